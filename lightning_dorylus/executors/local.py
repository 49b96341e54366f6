"""The "local" executor: a pool of worker processes running the Lambda handler code.

Each worker is ``python -S -m lightning_dorylus.executors.worker`` started inside a handler bundle (the
files a Lambda zip holds; see ``lightning_dorylus.ops.bundle``), talking wire payloads over its
stdin/stdout pipes. So this executor crosses a real process and serialization boundary with the same
bytes part 2 sends to AWS Lambda, and never pickles anything.

Flow: ``submit`` encodes the request (zero-copy frames over the tensors' memory) and puts it on one
queue; one dispatcher thread per worker takes the next request, streams it into its worker, reads the
reply into a fresh buffer and resolves the future with tensors viewing that buffer (no copy). Deadlines,
retries and straggler relaunch are ``ResilientExecutor``'s, shared with the Lambda executor: a worker that
dies or hangs is replaced and its request retried, up to ``max_attempts``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import queue
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import weakref
from typing import Any

from typing_extensions import override

from .. import wire
from ..ops import bundle, registry
from .base import ExecutorError, RemoteOpError, RetryableError, to_tensors
from .resilient import POLICY_FIELDS, Attempt, FaultPolicy, ResilientExecutor
from .worker import read_message, write_message

log = logging.getLogger(__name__)

_THREAD_ENV_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS",
                    "VECLIB_MAXIMUM_THREADS")


def describe_exit(returncode: int | None) -> str:
    """``-9`` -> ``"exit code -9 (SIGKILL)"``."""
    if returncode is None:
        return "no exit code (still running)"
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"exit code {returncode} ({signal.Signals(-returncode).name})"
    return f"exit code {returncode}"


_POST_KILL_GRACE_S = 5.0  # how long close() waits for dispatchers once their workers are gone
PIPE_SIZE = 1 << 20  # intervals are MBs: fewer, larger pipe transfers (Linux F_SETPIPE_SZ; else the default)


def _grow_pipe(fd: int) -> None:
    if hasattr(fcntl, "F_SETPIPE_SZ"):
        with contextlib.suppress(OSError):  # above /proc/sys/fs/pipe-max-size: keep the default
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE)


class _Worker:
    """One worker process and its pipes; used by exactly one dispatcher thread."""

    def __init__(self, index: int, cmd: list[str], cwd: str, env: dict[str, str], startup_timeout: float):
        self.index = index
        self.current: Any = None  # the attempt it is running (read by the deadline monitor)
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     bufsize=0)
        for pipe in (self.proc.stdin, self.proc.stdout):
            _grow_pipe(pipe.fileno())  # type: ignore[union-attr]
        self._await_hello(startup_timeout)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _await_hello(self, timeout: float) -> None:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            ready = bool(sel.select(timeout))
        hello: dict[str, Any] = {}
        try:
            if ready and (message := read_message(self.proc.stdout)) is not None:  # type: ignore[arg-type]
                hello = wire.decode(message)[0]
        except (OSError, EOFError, ValueError):
            pass
        if hello.get("ready"):
            return
        if hello.get("error"):
            self.kill()
            raise ExecutorError(f"worker {self.index} (pid {self.pid}) failed to start: {hello['error']}")
        if not ready:
            self.kill()
            raise ExecutorError(f"worker {self.index} (pid {self.pid}) did not report ready within "
                                f"{timeout} s (startup_timeout); it was killed")
        code = self.exit_code(timeout=5.0)
        self.kill()
        raise ExecutorError(f"worker {self.index} (pid {self.pid}) failed to start: {describe_exit(code)}; "
                            f"see its stderr above")

    def call(self, frames: list[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Send one request and wait for its reply. Raises OSError/EOFError if the worker died."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        write_message(self.proc.stdin, frames)  # type: ignore[arg-type]
        reply = read_message(self.proc.stdout)  # type: ignore[arg-type]
        if reply is None:
            raise EOFError("worker closed its output")
        return wire.decode(reply)

    def exit_code(self, timeout: float = 5.0) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float) -> None:
        """Close stdin (the worker exits on EOF), then kill if it does not exit within ``timeout``."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # type: ignore[union-attr]
        if self.exit_code(timeout) is None:
            self.kill()
        with contextlib.suppress(OSError):
            self.proc.stdout.close()  # type: ignore[union-attr]

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()


def _kill_all(workers: list[_Worker]) -> None:
    for w in workers:
        if w.proc.poll() is None:
            w.kill()


class LocalPoolExecutor(ResilientExecutor):
    """Run ops in a pool of local worker processes, over the Lambda wire format.

    Deadlines, retries and straggler relaunch come from ``ResilientExecutor`` (the same code as the Lambda
    executor): a worker stuck past ``deadline_s`` is killed and its request retried on a fresh worker; a
    worker found dead (also one that died while idle) is replaced and the request retried; anything the
    dispatcher itself hits (``MemoryError`` reading a reply, ``RecursionError``) fails that request, not the
    dispatcher thread.

    Args:
        num_workers: worker processes (>= 1); requests are spread over them as they free up.
        threads_per_worker: BLAS/OpenMP threads in each worker (sets ``OMP_NUM_THREADS`` etc.); 1 keeps
            ``num_workers`` workers from oversubscribing the graph server's cores.
        startup_timeout: seconds a worker may take to import numpy and report ready.
        close_timeout: seconds ``close`` waits for in-flight ops before killing workers.
        respawn: start a new worker when one dies (with ``False`` the pool breaks instead).
        deadline_s, max_attempts, straggler_ratio, ...: the ``FaultPolicy`` fields (``FaultPolicy`` docs).
        max_rows: cut each request into pieces of at most this many rows (``None``: never cut; a local pipe
            has no payload limit).
    """

    name = "local"

    def __init__(self, num_workers: int = 2, threads_per_worker: int = 1, startup_timeout: float = 60.0,
                 close_timeout: float = 10.0, respawn: bool = True, max_rows: int | None = None,
                 **policy: Any) -> None:
        for name, value in (("num_workers", num_workers), ("threads_per_worker", threads_per_worker)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected an int >= 1")
        unknown = sorted(set(policy) - POLICY_FIELDS)
        if unknown:
            raise TypeError(f"LocalPoolExecutor got unknown option(s) {unknown}; it takes num_workers, "
                            f"threads_per_worker, startup_timeout, close_timeout, respawn, max_rows and "
                            f"{sorted(POLICY_FIELDS)}")
        super().__init__(FaultPolicy(**policy), payload_limit=None, max_rows=max_rows)
        self.num_workers = num_workers
        self.threads_per_worker = threads_per_worker
        self.startup_timeout = startup_timeout
        self.close_timeout = close_timeout
        self.respawn = respawn
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        self._workers: list[_Worker] = []
        self._threads: list[threading.Thread] = []
        self._queue: queue.SimpleQueue[Attempt | None] = queue.SimpleQueue()
        self._bundle_dir: str | None = None
        self._broken: BaseException | None = None
        self._finalizer: weakref.finalize | None = None
        self.respawns = 0
        self.requests_per_worker = [0] * num_workers  # answered requests (ok or op error), for tracing

    @property
    def worker_pids(self) -> list[int]:
        """PIDs of the current workers (changes when a worker is respawned)."""
        return [w.pid for w in self._workers]

    @override
    def start(self) -> None:
        with self._lock:
            if self._closed:
                raise ExecutorError("LocalPoolExecutor is closed")
            if self._started:
                return
            self._bundle_dir = tempfile.mkdtemp(prefix="dorylus-bundle-")
            self._finalizer = weakref.finalize(self, _cleanup, self._workers, self._bundle_dir)
            try:
                # user op modules ship by name: those that registered ops in this process so far
                bundle.write_bundle(os.path.join(self._bundle_dir, "code"), registry.op_modules())
                bundle.link_numpy(os.path.join(self._bundle_dir, "site"))
                for i in range(self.num_workers):
                    self._workers.append(self._spawn(i))
            except BaseException:
                self._finalizer()
                self._workers.clear()
                raise
            for i in range(self.num_workers):
                t = threading.Thread(target=self._dispatch, args=(i,), name=f"dorylus-dispatch-{i}",
                                     daemon=True)
                t.start()
                self._threads.append(t)
            self._start_monitor()
            self._started = True

    def _spawn(self, index: int) -> _Worker:
        env = dict(os.environ)
        env.update({var: str(self.threads_per_worker) for var in _THREAD_ENV_VARS})
        assert self._bundle_dir is not None
        # -S: no site-packages; the import path is the bundle (cwd) and a directory holding only numpy.
        env["PYTHONPATH"] = os.path.join(self._bundle_dir, "site")
        cmd = [sys.executable, "-S", "-m", "lightning_dorylus.executors.worker"]
        return _Worker(index, cmd, os.path.join(self._bundle_dir, "code"), env, self.startup_timeout)

    @override
    def _launch(self, attempt: Attempt) -> None:
        self._queue.put(attempt)
        if self._closed:  # raced with close(): make sure nobody waits forever
            self._fail_queued("LocalPoolExecutor closed before the op ran")

    @override
    def _cancel(self, attempt: Attempt) -> None:
        worker = attempt.backend
        if isinstance(worker, _Worker) and worker.current is attempt:
            worker.kill()  # unblocks its dispatcher (EOF), which replaces the worker

    def _dispatch(self, index: int) -> None:
        while (attempt := self._queue.get()) is not None:
            try:
                self._run(index, attempt)
            except Exception as err:  # MemoryError, RecursionError, ...: fail this request, keep serving
                worker = self._workers[index]
                worker.current = None
                self._attempt_done(attempt, error=ExecutorError(
                    f"dispatcher of worker {index} (pid {worker.pid}) failed running "
                    f"{attempt.call.describe()}: {type(err).__name__}: {err}"))
                if not self._closed:
                    self._replace(index, worker)  # its pipe is mid-message: start clean
            del attempt  # not kept (with its request's tensors) while this dispatcher waits for the next

    def _run(self, index: int, attempt: Attempt) -> None:
        call = attempt.call
        if self._broken is not None:
            self._attempt_done(attempt, error=ExecutorError(
                f"{call.describe()} not run: the pool is broken: {self._broken}"))
            return
        worker = self._workers[index]
        if worker.proc.poll() is not None and not self._closed:  # died while idle: replace it first
            self._replace(index, worker)
            worker = self._workers[index]
            if self._broken is not None:
                self._attempt_done(attempt, error=ExecutorError(
                    f"{call.describe()} not run: the pool is broken: {self._broken}"))
                return
        if not self._attempt_started(attempt):
            return
        attempt.backend, worker.current = worker, attempt
        _, frames = wire.encode_frames(call.header, call.piece.inputs)
        try:
            header, arrays = worker.call(frames)
        except (OSError, EOFError, ValueError) as err:
            worker.current = None
            code = describe_exit(worker.exit_code())
            if self._closed:
                self._attempt_done(attempt, error=ExecutorError(
                    f"LocalPoolExecutor closed while {call.describe()} was running in worker {index} "
                    f"(pid {worker.pid}, stopped with {code})"))
                return
            self._replace(index, worker)  # first, so later requests find a live worker
            self._attempt_done(attempt, error=RetryableError(
                f"worker {index} (pid {worker.pid}) died with {code} while running {call.describe()} "
                f"(attempt {attempt.number}): {type(err).__name__}: {err}", "lost"))
            return
        worker.current = None
        self.requests_per_worker[index] += 1
        if header.get("ok"):
            self._attempt_done(attempt, outputs=to_tensors(arrays))
        else:
            self._attempt_done(attempt, error=RemoteOpError(
                f"{call.describe()} failed in worker {index} (pid {worker.pid}): "
                f"{header.get('error_type')}: {header.get('message')}", str(header.get("error_type"))))

    def _replace(self, index: int, dead: _Worker) -> None:
        dead.kill()
        if self._closed or not self.respawn:
            if not self._closed:
                self._broken = ExecutorError(f"worker {index} died and respawn=False")
            return
        try:
            self._workers[index] = self._spawn(index)
            self.respawns += 1
            if self.respawns == 1:  # once: later ones are only counted (respawns, metric executor_recoveries)
                log.warning("local executor: worker %d (pid %s) died; a new worker replaced it and its "
                            "requests are retried (results unchanged). Further recoveries are counted in "
                            "executor.respawns and the logged metric 'executor_recoveries'", index, dead.pid)
        except Exception as err:
            self._broken = err

    def _fail_queued(self, message: str) -> None:
        """Fail every attempt still waiting in the queue (stop sentinels are put back)."""
        sentinels = 0
        while True:
            try:
                attempt = self._queue.get_nowait()
            except queue.Empty:
                break
            if attempt is None:
                sentinels += 1
                continue
            self._attempt_done(attempt, error=ExecutorError(f"{message}: {attempt.call.describe()}"))
        for _ in range(sentinels):
            self._queue.put(None)

    @override
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._fail_queued("LocalPoolExecutor closed before the op ran")
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:  # let in-flight ops finish, up to close_timeout
            t.join(self.close_timeout)
        for w in list(self._workers):
            w.stop(self.close_timeout if not any(t.is_alive() for t in self._threads) else 0.0)
        for t in self._threads:  # a stopped worker unblocks its dispatcher, which fails its future
            t.join(max(self.close_timeout, _POST_KILL_GRACE_S))
        self._fail_queued("LocalPoolExecutor closed before the op ran")
        self._stop_monitor("LocalPoolExecutor closed before the op finished")
        if self._finalizer is not None:
            self._finalizer()

    def __repr__(self) -> str:
        return (f"LocalPoolExecutor(num_workers={self.num_workers}, "
                f"threads_per_worker={self.threads_per_worker}, pids={self.worker_pids})")


def _cleanup(workers: list[_Worker], bundle_dir: str) -> None:
    """Kill leftover workers and remove the bundle (also runs at garbage collection / exit)."""
    _kill_all(workers)
    shutil.rmtree(bundle_dir, ignore_errors=True)
