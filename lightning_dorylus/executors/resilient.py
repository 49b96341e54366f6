"""The fault layer every remote executor shares: planning, deadlines, retries, straggler relaunch, dedup.

A backend (``LocalPoolExecutor``: worker processes; ``LambdaExecutor``: AWS Lambda) only knows how to run
one *attempt* of one planned piece and how to abandon it. This layer owns everything else, so the local
pool and Lambda behave the same:

* **planning** — each request is cut by ``planning.plan_request`` into pieces that fit ``payload_limit``;
  their outputs are merged by ``planning.merge_outputs`` (one future per request, as before);
* **deadline** — an attempt running longer than ``deadline_s`` (counted from when it starts, not while it
  waits for a free worker) is abandoned (``_cancel``: the local pool kills the stuck worker) and retried;
* **retries** — ``RetryableError`` (429 throttling, a lost worker, a deadline) is retried
  after a jittered exponential backoff ("full jitter"), at most ``max_attempts`` launches per piece (throttled
  launches do not count; at most ``max_throttles`` of those); then the request fails with an
  ``ExecutorError`` naming the op, interval, attempts and the last error — training stops there;
* **outages** — a lost connection (kind ``"connection"``: the endpoint refuses, resets or cannot be reached)
  does not use up ``max_attempts``: it is retried with backoff (at most ``outage_backoff_max_s`` apart) until
  the piece has been unreachable for ``max(outage_s, deadline_s)`` seconds (default 120 s), so an endpoint
  restarted or a network blip of a minute costs that minute, not the run. The first connection failure of
  an outage and the recovery (with the requests retried) are logged as warnings, each retry at INFO; the
  messages name the op, interval and endpoint host, never credentials;
* **stragglers** — an attempt running past ``straggler_ratio`` x the moving median duration of its op is
  launched again; the first result wins and a late one is dropped (matched by request id and attempt) and
  counted in ``stats["duplicates_dropped"]``;
* a ``RemoteOpError`` (the handler raised) is not retried: the same input would raise again.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import random
import statistics
import threading
import time
from abc import abstractmethod
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor
from typing_extensions import override

from ..ops.handlers import request_header
from .base import ExecutorError, RetryableError, TensorOpExecutor, TensorOpRequest
from .planning import Piece, merge_outputs, plan_request

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FaultPolicy:
    """How long to wait and how often to try again.

    Args:
        deadline_s: seconds one attempt may run before it is abandoned and retried (``None``: no deadline —
            a hung executor then hangs training; not recommended).
        max_attempts: launches per piece (first try + retries + straggler relaunches), >= 1.
        max_throttles: 429 answers tolerated per piece before the request fails.
        backoff_base_s / backoff_max_s: retry ``k`` waits ``uniform(0, min(max, base * 2**k))``.
        straggler_ratio: relaunch an attempt running past this x the op's moving median duration (``None``:
            never). The paper relaunches Lambdas past a timeout ratio of the moving average.
        straggler_min_s: never call an attempt a straggler before this many seconds.
        straggler_samples: finished attempts of an op needed before its median is trusted.
        window: durations kept per op for the moving median.
        outage_s: seconds a piece whose attempts fail to connect (the endpoint down or unreachable) keeps
            being retried before its request fails; at least ``deadline_s`` (a piece is never given up on a
            connection failure before its deadline would have passed). Connection failures do not count
            towards ``max_attempts``. Keep the strategy's collective ``timeout`` above it: the other graph
            servers wait in a collective meanwhile.
        outage_backoff_max_s: the longest wait between two such retries (the backoff doubles from
            ``backoff_base_s`` up to this, jittered): how soon after the endpoint is back training resumes.
    """

    deadline_s: float | None = 300.0
    max_attempts: int = 3
    max_throttles: int = 20
    backoff_base_s: float = 0.05
    backoff_max_s: float = 2.0
    straggler_ratio: float | None = 4.0
    straggler_min_s: float = 0.2
    straggler_samples: int = 5
    window: int = 64
    outage_s: float = 120.0
    outage_backoff_max_s: float = 5.0

    def __post_init__(self) -> None:
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ValueError(f"deadline_s={self.deadline_s!r}: expected seconds > 0 or None")
        for name in ("max_attempts", "straggler_samples", "window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected an int >= 1")
        if isinstance(self.max_throttles, bool) or not isinstance(self.max_throttles, int) \
                or self.max_throttles < 0:
            raise ValueError(f"max_throttles={self.max_throttles!r}: expected an int >= 0")
        if self.straggler_ratio is not None and not self.straggler_ratio > 1:
            raise ValueError(f"straggler_ratio={self.straggler_ratio!r}: expected a ratio > 1 or None")
        if not self.outage_s >= 0:
            raise ValueError(f"outage_s={self.outage_s!r}: expected seconds >= 0 (0: fail at the first lost "
                             f"connection once deadline_s has passed)")
        for name in ("backoff_base_s", "backoff_max_s", "straggler_min_s", "outage_backoff_max_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected seconds >= 0")


POLICY_FIELDS = frozenset(FaultPolicy.__dataclass_fields__)


@dataclass(eq=False)
class Attempt:
    """One launch of one piece. ``(call.request_id, number)`` identifies it."""

    call: _Call
    number: int
    started: float | None = None
    finished: bool = False
    abandoned: bool = False  # passed its deadline; whatever it reports later is dropped
    relaunched: bool = False  # a straggler copy of it was launched
    backend: Any = None  # the backend's handle (e.g. which worker runs it)


@dataclass(eq=False)
class _Call:
    """One planned piece of a request and its attempts."""

    request_id: int
    request: TensorOpRequest
    piece: Piece
    future: Future
    attempts: list[Attempt] = field(default_factory=list)
    throttles: int = 0
    connection_failures: int = 0
    unreachable_since: float | None = None  # monotonic time of the first connection failure in a row
    cut: bool = False  # one of several pieces of its request
    running: bool = False
    done: bool = False
    last_error: BaseException | None = None

    @property
    def header(self) -> dict[str, Any]:
        r = self.request
        return request_header(r.op, r.attrs, r.interval)

    def describe(self) -> str:
        r, p = self.request, self.piece
        rows = f" rows {p.start}:{p.stop}" if self.cut else ""
        return f"op {r.op!r} (interval {r.interval}){rows} [request {self.request_id}]"


class ResilientExecutor(TensorOpExecutor):
    """Base of executors whose attempts can be lost, throttled, hang or straggle (see the module doc).

    Subclasses implement ``_start_backend``, ``_launch`` (start running an attempt; call
    ``_attempt_started`` when it really starts and ``_attempt_done`` exactly once when it ends),
    ``_cancel`` (abandon a running attempt) and ``_close_backend``.

    Args:
        policy: deadlines, retries and straggler relaunch.
        payload_limit: bytes per request/response after base64 (``None``: no limit, requests are not cut).
        max_rows: cut requests into pieces of at most this many rows (``None``: only the limit cuts).
    """

    name = "executor"

    def __init__(self, policy: FaultPolicy | None = None, payload_limit: int | None = None,
                 max_rows: int | None = None) -> None:
        if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int)
                                     or max_rows < 1):
            raise ValueError(f"max_rows={max_rows!r}: expected an int >= 1 or None")
        self.policy = policy or FaultPolicy()
        self.payload_limit = payload_limit
        self.max_rows = max_rows
        self._state_lock = threading.Lock()
        self._wake = threading.Condition(self._state_lock)
        self._active: dict[int, _Call] = {}
        self._retries: list[tuple[float, int, _Call]] = []  # (due, tiebreak, call) heap
        self._durations: dict[str, deque[float]] = {}
        self._ids = itertools.count()
        self._monitor: threading.Thread | None = None
        self._stopping = False
        self.stats: dict[str, int] = dict.fromkeys(
            ("requests", "pieces", "attempts", "retries", "throttled", "timeouts", "relaunched",
             "duplicates_dropped", "failed", "connection_retries"), 0)
        self._outage: _Outage | None = None  # the connection failures since the last success

    # ---- backend hooks -------------------------------------------------------------------------------------
    @abstractmethod
    def _launch(self, attempt: Attempt) -> None:
        """Start running ``attempt`` (asynchronously)."""

    @abstractmethod
    def _cancel(self, attempt: Attempt) -> None:
        """Abandon a running attempt that passed its deadline (best effort)."""

    def _start_monitor(self) -> None:
        with self._state_lock:
            if self._monitor is None:
                self._stopping = False
                self._monitor = threading.Thread(target=self._watch, name=f"dorylus-{self.name}-monitor",
                                                 daemon=True)
                self._monitor.start()

    def _stop_monitor(self, message: str) -> None:
        """Stop the monitor and fail every request still open (so nobody waits forever)."""
        with self._state_lock:
            self._stopping = True
            self._wake.notify_all()
            calls = list(self._active.values())
            self._active.clear()
            self._retries.clear()
            for call in calls:
                call.done = True
        for call in calls:
            self._resolve(call, error=ExecutorError(f"{message}: {call.describe()}"))
        if self._monitor is not None:
            self._monitor.join(5.0)
            self._monitor = None

    # ---- submit --------------------------------------------------------------------------------------------
    @override
    def submit(self, request: TensorOpRequest) -> Future[dict[str, Tensor]]:
        self.start()
        future: Future[dict[str, Tensor]] = Future()
        try:
            pieces = plan_request(request.op, request.numpy_inputs(), request.attrs, request.interval,
                                  self.payload_limit, self.max_rows)
        except Exception as err:
            future.set_exception(err)
            return future
        calls = []
        with self._state_lock:
            self.stats["requests"] += 1
            self.stats["pieces"] += len(pieces)
            for piece in pieces:
                call = _Call(next(self._ids), request, piece, future if len(pieces) == 1 else Future(),
                             cut=len(pieces) > 1)
                self._active[call.request_id] = call
                calls.append(call)
            self._wake.notify_all()  # the monitor sleeps while nothing is active
        if len(calls) > 1:
            _combine(request.op, [c.future for c in calls], future)
        for call in calls:
            self._launch_attempt(call)
        return future

    def _launch_attempt(self, call: _Call) -> None:
        with self._state_lock:
            if call.done:
                return
            attempt = Attempt(call, len(call.attempts))
            call.attempts.append(attempt)
            self.stats["attempts"] += 1
            stopping = self._stopping
        if stopping:
            self._attempt_done(attempt, error=ExecutorError(f"{type(self).__name__} is closed"))
            return
        try:
            self._launch(attempt)
        except Exception as err:
            self._attempt_done(attempt, error=err)

    # ---- called by backends --------------------------------------------------------------------------------
    def _attempt_started(self, attempt: Attempt) -> bool:
        """Mark ``attempt`` running; False if it is no longer needed (the backend then skips it)."""
        call = attempt.call
        with self._state_lock:
            if call.done or attempt.abandoned:
                attempt.finished = True
                return False
            attempt.started = time.monotonic()
            if not call.running:
                call.running = True
                if not call.future.set_running_or_notify_cancel():  # cancelled by its owner
                    call.done = True
                    self._active.pop(call.request_id, None)
                    return False
        return True

    def _attempt_done(self, attempt: Attempt, outputs: dict[str, Tensor] | None = None,
                      error: BaseException | None = None) -> None:
        """Report an attempt's outcome (exactly one of ``outputs``/``error``). Late duplicates are dropped."""
        call = attempt.call
        with self._state_lock:
            if attempt.finished:
                return
            attempt.finished = True
            if call.done:
                if outputs is not None:
                    self.stats["duplicates_dropped"] += 1
                return
            if outputs is not None:
                call.done = True
                self._active.pop(call.request_id, None)
                recovered, self._outage = self._outage, None
                if attempt.started is not None:
                    durations = self._durations.setdefault(call.request.op, deque(maxlen=self.policy.window))
                    durations.append(time.monotonic() - attempt.started)
            elif attempt.abandoned:
                return  # its deadline already counted as a failure
            elif isinstance(error, RetryableError):
                call.last_error = error
                if self._retry_or_fail_locked(call, error):
                    return  # retried (or a straggler copy still runs)
                error = self._final_error(call)
            else:
                call.done = True
                self._active.pop(call.request_id, None)
        if outputs is not None:
            if recovered is not None:
                recovered.log_recovery(type(self).__name__)
            self._resolve(call, outputs=outputs)
        else:
            self._resolve(call, error=error)

    # ---- internals -----------------------------------------------------------------------------------------
    def _retry_or_fail_locked(self, call: _Call, error: RetryableError) -> bool:
        """Schedule a retry (True) or mark the call failed (False). Holds the lock."""
        now = time.monotonic()
        if error.kind == "throttled":
            call.throttles += 1
            self.stats["throttled"] += 1
        if error.kind == "connection":
            call.connection_failures += 1
            if call.unreachable_since is None:
                call.unreachable_since = now
        else:
            call.unreachable_since = None
        if any(not a.finished and not a.abandoned for a in call.attempts):
            return True  # a straggler copy is still running; let it answer
        launches = len(call.attempts) - call.throttles - call.connection_failures
        if error.kind == "throttled":
            over = call.throttles > self.policy.max_throttles
        elif error.kind == "connection":
            assert call.unreachable_since is not None
            over = now - call.unreachable_since >= self._outage_window()
        else:
            over = launches >= self.policy.max_attempts
        if over or self._stopping:
            call.done = True
            self._active.pop(call.request_id, None)
            return False
        self.stats["retries"] += 1
        if error.kind == "connection":
            due = self._connection_retry_due_locked(call, error, now)
        else:
            cap = min(self.policy.backoff_max_s, self.policy.backoff_base_s * 2 ** (len(call.attempts) - 1))
            due = now + random.uniform(0, cap)
        heapq.heappush(self._retries, (due, call.request_id, call))
        self._wake.notify_all()
        return True

    def _outage_window(self) -> float:
        """Seconds a piece is retried while it cannot connect: ``outage_s``, never less than its deadline."""
        return max(self.policy.outage_s, self.policy.deadline_s or 0.0)

    def _connection_retry_due_locked(self, call: _Call, error: RetryableError, now: float) -> float:
        """When to retry a piece that could not connect (jittered backoff, the last try at the window's
        end); logs the outage's first failure as a warning and each retry at INFO. Holds the lock."""
        assert call.unreachable_since is not None
        self.stats["connection_retries"] += 1
        policy = self.policy
        cap = min(policy.outage_backoff_max_s, policy.backoff_base_s * 2 ** call.connection_failures)
        window = self._outage_window()
        due = min(now + random.uniform(0, cap), call.unreachable_since + window)
        if self._outage is None:
            self._outage = _Outage(now)
            log.warning("%s: connection lost: %s; retrying every request that meets it with backoff for up "
                        "to %.0f s (outage_s=%s, deadline_s=%s) before it fails", type(self).__name__, error,
                        window, self.policy.outage_s, self.policy.deadline_s)
        self._outage.retried(call.describe())
        log.info("%s: retrying %s in %.2f s (connection failure %d, unreachable for %.1f s of %.0f s)",
                 type(self).__name__, call.describe(), due - now, call.connection_failures,
                 now - call.unreachable_since, window)
        return due

    def _final_error(self, call: _Call) -> ExecutorError:
        launches = len(call.attempts) - call.throttles - call.connection_failures
        unreachable = ""
        if call.connection_failures:
            since = call.unreachable_since
            spent = f" over {time.monotonic() - since:.1f} s" if since is not None else ""
            unreachable = (f", {call.connection_failures} failed connection(s){spent} "
                           f"(outage_s={self.policy.outage_s})")
        return ExecutorError(
            f"{call.describe()} failed after {launches} attempt(s) and {call.throttles} throttled call(s)"
            f"{unreachable} (max_attempts={self.policy.max_attempts}, "
            f"max_throttles={self.policy.max_throttles}, deadline_s={self.policy.deadline_s}) on "
            f"{type(self).__name__}: {call.last_error}")

    def _resolve(self, call: _Call, outputs: dict[str, Tensor] | None = None,
                 error: BaseException | None = None) -> None:
        with self._state_lock:
            # A resolved call launches no more attempts; dropping them breaks the call <-> attempt cycle, so
            # the request's tensors are freed by reference counting as soon as their last user lets go
            # instead of at the next full garbage collection (which came every few epochs: +90 MiB per
            # epoch on a 200k-vertex graph server until it did).
            call.attempts = []
            if call.future.done():
                return
            if not call.running:
                call.running = True
                if not call.future.set_running_or_notify_cancel():
                    return
            if error is not None:
                self.stats["failed"] += 1
        if error is not None:
            call.future.set_exception(error)
        else:
            call.future.set_result(outputs)

    def _median(self, op: str) -> float | None:
        durations = self._durations.get(op)
        if not durations or len(durations) < self.policy.straggler_samples:
            return None
        return statistics.median(durations)

    def _check_attempts_locked(self, now: float, to_cancel: list[Attempt], to_launch: list[_Call],
                               failed: list[_Call]) -> None:
        """Deadlines and straggler relaunch of the active calls (holds the lock). A method of its own so
        that the monitor, waiting between checks, keeps no call (and its request's tensors) in its locals."""
        policy = self.policy
        for call in list(self._active.values()):
            live = [a for a in call.attempts if not a.finished and not a.abandoned]
            for a in live:
                if a.started is None:
                    continue
                ran = now - a.started
                if policy.deadline_s is not None and ran > policy.deadline_s:
                    a.abandoned = True
                    self.stats["timeouts"] += 1
                    to_cancel.append(a)
                    err = RetryableError(
                        f"attempt {a.number} got no result within deadline_s={policy.deadline_s} "
                        f"(ran {ran:.1f} s)", "deadline")
                    call.last_error = err
                    if not self._retry_or_fail_locked(call, err):
                        failed.append(call)
                    continue
                median = self._median(call.request.op) if policy.straggler_ratio else None
                if (median is not None and len(live) == 1 and not a.relaunched
                        and ran > max(policy.straggler_min_s, policy.straggler_ratio * median)
                        and len(call.attempts) - call.throttles < policy.max_attempts):
                    a.relaunched = True
                    self.stats["relaunched"] += 1
                    to_launch.append(call)

    def _watch(self) -> None:
        """Monitor thread: deadlines, straggler relaunch, due retries."""
        while True:
            to_cancel: list[Attempt] = []
            to_launch: list[_Call] = []
            failed: list[_Call] = []
            with self._state_lock:
                if self._stopping:
                    return
                now = time.monotonic()
                self._check_attempts_locked(now, to_cancel, to_launch, failed)
                while self._retries and self._retries[0][0] <= now:
                    to_launch.append(heapq.heappop(self._retries)[2])
                timeout = 0.05 if self._active else None
                if self._retries:
                    timeout = min(timeout or 0.05, max(0.0, self._retries[0][0] - now))
                if not (to_cancel or to_launch or failed):
                    self._wake.wait(timeout)
                    continue
            self._act(to_cancel, failed, to_launch)

    def _act(self, to_cancel: list[Attempt], failed: list[_Call], to_launch: list[_Call]) -> None:
        """The monitor's decisions, outside the lock (in a method: its loop variables end with it)."""
        for a in to_cancel:
            with contextlib.suppress(Exception):  # best effort: the retry goes ahead either way
                self._cancel(a)
        for call in failed:
            self._resolve(call, error=self._final_error(call))
        for call in to_launch:
            self._launch_attempt(call)


class _Outage:
    """The connection failures since the executor's last success: what was retried, for the recovery log."""

    SHOWN = 8  # requests named in the recovery line

    def __init__(self, since: float) -> None:
        self.since = since
        self.retries = 0
        self.requests: dict[str, None] = {}  # insertion-ordered set

    def retried(self, what: str) -> None:
        self.retries += 1
        self.requests.setdefault(what, None)

    def log_recovery(self, executor: str) -> None:
        names = list(self.requests)
        shown = ", ".join(names[: self.SHOWN]) + (f" and {len(names) - self.SHOWN} more"
                                                   if len(names) > self.SHOWN else "")
        log.warning("%s: connection back after %.1f s; %d connection retr%s of %d request piece(s): %s",
                    executor, time.monotonic() - self.since, self.retries,
                    "y" if self.retries == 1 else "ies", len(names), shown)


def _combine(op: str, parts: list[Future], out: Future) -> None:
    """Resolve ``out`` with the merged outputs of ``parts`` (or the first error) once all are done."""
    lock = threading.Lock()
    left = [len(parts)]

    def done(part: Future) -> None:
        with lock:
            if out.done():
                return
            if out.running() is False and not out.set_running_or_notify_cancel():
                return
            if part.exception() is not None:
                out.set_exception(part.exception())
                return
            left[0] -= 1
            if left[0]:
                return
            try:
                merged = merge_outputs(op, [p.result() for p in parts])
            except Exception as err:
                out.set_exception(err)
                return
        out.set_result(merged)

    for p in parts:
        p.add_done_callback(done)
