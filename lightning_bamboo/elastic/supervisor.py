"""The supervisor of an elastic Bamboo job (the process side; the CLI is :mod:`lightning_bamboo.launch`).

The supervisor is not a training rank, so no preemption of a worker can take it down:

* it serves the job's store (a ``TCPStore`` on one machine; ``--store etcd://host:port`` uses an etcd
  server instead, for several machines),
* starts ``N`` workers (each in its own session, member ids ``0..N-1``, told where the store is through
  ``BAMBOO_*`` environment variables),
* watches them: a worker that exits non-zero (SIGKILL included) is lost; a worker whose heartbeat stops
  for ``--hang-timeout`` seconds (SIGSTOP, a deadlock) is SIGKILLed by PID and lost; a worker that
  announced its departure (a preemption notice, :mod:`lightning_bamboo.elastic.drain`) leaves: not a loss; a
  worker that exits with an error of the training code (:mod:`lightning_bamboo.elastic.crash`) stops the job
  (exit 1): a failover would only raise it again,
* and is the one place membership is decided: it writes generation ``g+1``'s ownership map
  (:func:`lightning_bamboo.elastic.ownership.failover`, or a checkpoint fallback when redundancy cannot cover
  the
  loss) into the store and prints the old and new maps. Workers form the new generation themselves.

It restarts nobody on its own. ``--replace K`` starts a replacement worker (a new member id)
``--replace-delay`` seconds after each loss (at most ``K``); :meth:`Supervisor.add_worker` starts one from
another thread at any time. A new worker registers once its model is built; the supervisor then proposes the
next map and the members adopt it after one committed step (:mod:`lightning_bamboo.elastic.join`); it prints
``[bamboo.launch] join members=[..] step=S generation=G wait_s=.. join_s=..`` when the first step at the new
size is committed. When the members of the current generation have all exited 0, remaining
spare workers are stopped by PID and the supervisor exits 0; if no pipeline can continue it stops all
workers by PID and exits 1. On SIGTERM it stops the workers at a step boundary (each writes the final
checkpoint when the strategy has one configured), SIGKILLs by PID whatever is left after
``--stop-timeout`` seconds, and exits 143.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from lightning_bamboo.elastic import commit as commit_protocol
from lightning_bamboo.elastic import crash
from lightning_bamboo.elastic import drain as departure
from lightning_bamboo.elastic import join as joining
from lightning_bamboo.elastic import store as ms
from lightning_bamboo.elastic.ownership import FallbackNeeded, OwnershipMap, failover, initial, rejoin


@dataclass
class _Worker:
    member: int
    proc: subprocess.Popen[bytes]
    last_beat: int = -1
    beat_seen_at: float = field(default_factory=time.monotonic)


class Supervisor:
    """Starts, watches and re-forms the workers of one job (see the module docstring)."""

    def __init__(
        self,
        command: list[str],
        nproc: int,
        store_url: str | None = None,
        hang_timeout: float = 5.0,
        settle: float = 0.3,
        replace: bool = False,
        log=print,
        replace_delay: float = 0.0,
        stop_timeout: float = 30.0,
    ) -> None:
        if nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {nproc}")
        if stop_timeout < 0:
            raise ValueError(f"--stop-timeout must be >= 0 seconds, got {stop_timeout}")
        if hang_timeout <= 0:
            raise ValueError(f"--hang-timeout must be > 0 seconds, got {hang_timeout}")
        if replace_delay < 0:
            raise ValueError(f"--replace-delay must be >= 0 seconds, got {replace_delay}")
        self.command = command
        self.nproc = nproc
        self.hang_timeout = hang_timeout
        self.settle = settle
        self.replace = replace
        self.replace_delay = replace_delay
        self.stop_timeout = stop_timeout
        self.log = log
        self.job = uuid.uuid4().hex[:12]
        if store_url is None:
            self._server = dist.TCPStore(
                "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
            )
            store_url = f"tcp://127.0.0.1:{self._server.port}"
        self.store_url = store_url
        self.store = ms.connect(store_url, self.job)
        self.workers: dict[int, _Worker] = {}
        self.next_member = 0
        self.finished: set[int] = set()
        self.lost: set[int] = set()
        self.departed: set[int] = set()
        self.events: list[dict[str, object]] = []
        self._pending_joins: list[int] = []
        self.start_time = time.monotonic()
        self._lock = threading.RLock()  # add_worker / kill may come from another thread while run() runs
        self._due: list[float] = []  # when the next replacements start
        self._added_at: dict[int, float] = {}
        self._proposal: tuple[int, OwnershipMap, float] | None = None  # (generation, next map, proposed at)
        self._join_watch: dict[str, object] | None = None
        self.joins: list[dict[str, object]] = []
        """One entry per completed join: members, step, generation, start_s, wait_s, join_s."""
        self.returncode: int | None = None
        self._stop_signal: int | None = None
        self._stopping = False
        self.error: dict[str, object] | None = None
        """The failure that stopped the job (:mod:`lightning_bamboo.elastic.crash`): member, type, message,
        traceback."""

    # ------------------------------------------------------------------ processes
    def start_worker(self, joining: bool = False) -> int:
        with self._lock:
            return self._start_worker(joining)

    def add_worker(self) -> int:
        """Start one more worker while the job runs; it joins at a step boundary once its model is built.

        Safe to call from another thread while :meth:`run` runs. Returns its member id.
        """
        with self._lock:
            member = self._start_worker(joining=True)
            self._pending_joins.append(member)
            self._added_at[member] = time.monotonic()
            return member

    def live_members(self) -> list[int]:
        """Member ids of the workers whose process is running."""
        with self._lock:
            return sorted(m for m, w in self.workers.items() if w.proc.poll() is None)

    def wait_formed(self, timeout: float = 300.0) -> None:
        """Block until all members formed generation 0 (for callers that run :meth:`run` in a thread)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.store.check(["gen0/map", "gen0/formed"]):
                owners = ms.read_map(self.store, 0)
                if int(self.store.add("gen0/formed", 0)) >= len(owners.members()):
                    return
            if self.returncode is not None:
                raise RuntimeError(f"the job ended (exit code {self.returncode}) before generation 0 formed")
            time.sleep(0.05)
        raise TimeoutError(f"generation 0 did not form in {timeout}s")

    def _start_worker(self, joining: bool = False) -> int:
        member = self.next_member
        self.next_member += 1
        env = {
            **os.environ,
            ms.ENV_JOINING: "1" if joining else "0",
            ms.ENV_STORE: self.store_url,
            ms.ENV_JOB: self.job,
            ms.ENV_MEMBER: str(member),
            ms.ENV_NPROC: str(self.nproc),
        }
        proc = subprocess.Popen(self.command, env=env, start_new_session=True)
        self.workers[member] = _Worker(member, proc)
        self.log(f"[bamboo.launch] started member {member} (pid {proc.pid})", flush=True)
        return member

    def kill(self, member: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one worker, by PID (the tests and the benchmark preempt workers this way)."""
        with self._lock:
            worker = self.workers[member]
            if worker.proc.poll() is None:
                os.kill(worker.proc.pid, sig)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Stop the job as SIGTERM to the supervisor does (see :meth:`run`). Safe from another thread."""
        self._stop_signal = signum

    def stop_all(self) -> None:
        for member in self.departed:  # a leaver ends its fit right after its drain: let it exit on its own
            worker = self.workers[member]
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(timeout=5)
        if not self._stopping:
            self._check()  # reports the leavers' exits (after a stop, every exit is expected)
        with self._lock:
            workers = list(self.workers.values())
        for worker in workers:
            if worker.proc.poll() is None:
                os.kill(worker.proc.pid, signal.SIGKILL)
                worker.proc.wait()

    # ------------------------------------------------------------------ watching
    def _check(self) -> set[int]:
        """Newly lost members: exited non-zero, or heartbeat silent for ``hang_timeout`` (then SIGKILLed)."""
        lost: set[int] = set()
        now = time.monotonic()
        with self._lock:
            workers = list(self.workers.items())
        for member, worker in workers:
            if member in self.departed and member not in self.finished and worker.proc.poll() is not None:
                self.finished.add(member)
                self.log(f"[bamboo.launch] member {member} left (exit {worker.proc.returncode})", flush=True)
            if member in self.lost or member in self.finished or member in self.departed:
                continue
            code = worker.proc.poll()
            if code is not None:
                if code == 0:
                    self.finished.add(member)
                else:
                    self.log(f"[bamboo.launch] member {member} exited with {code}", flush=True)
                    lost.add(member)
                continue
            key = f"hb/{member}"
            if self.store.check([f"done/{member}"]):
                continue  # training is over for it; it is writing its results and exiting
            if self.store.check([key]):
                beat = int(self.store.get(key).decode())  # add() stores the counter as text
                if beat != worker.last_beat:
                    worker.last_beat, worker.beat_seen_at = beat, now
                elif now - worker.beat_seen_at > self.hang_timeout:
                    self.log(
                        f"[bamboo.launch] member {member} silent for {now - worker.beat_seen_at:.1f}s: "
                        "killing it",
                        flush=True,
                    )
                    os.kill(worker.proc.pid, signal.SIGKILL)
                    worker.proc.wait()
                    lost.add(member)
            elif now - worker.beat_seen_at > max(self.hang_timeout, 300.0):  # never started beating
                self.log(f"[bamboo.launch] member {member} sent no heartbeat in 300s: killing it", flush=True)
                os.kill(worker.proc.pid, signal.SIGKILL)
                worker.proc.wait()
                lost.add(member)
        return lost

    def _failure_in_code(self, lost: set[int]) -> dict[str, object] | None:
        """The error a lost member recorded before exiting non-zero (:mod:`lightning_bamboo.elastic.crash`),
        when no
        member lost with it was killed by a signal (a preemption, or fenced for a silent heartbeat): an error
        of the training code, which a failover would only raise again. ``None``: fail over."""
        with self._lock:
            codes = {m: self.workers[m].proc.returncode for m in lost if m in self.workers}
        if any(code is None or code < 0 for code in codes.values()):
            return None
        for member in sorted(codes):
            failure = crash.recorded(self.store, member)
            if failure is not None:
                self.error = failure
                self.log(
                    f"[bamboo.launch] member {member} failed with {failure['type']}: {failure['message']} "
                    "(an error of the training code, not a preemption; its traceback is in the worker's "
                    "output): stopping the job",
                    flush=True,
                )
                return failure
        return None

    def _current(self) -> tuple[int, OwnershipMap | None]:
        generation = ms.current_generation(self.store)
        if generation < 0 or not self.store.check([f"gen{generation}/map"]):
            return generation, None
        return generation, ms.read_map(self.store, generation)

    def _publish(self, new: OwnershipMap, kind: str) -> None:
        self.store.set(f"gen{new.generation}/map", new.to_json())
        self.store.set(f"gen{new.generation}/kind", kind)
        self.store.set("gen", str(new.generation))

    def _departures(self) -> set[int]:
        """Members of the current generation announced as leaving (in it or in an earlier generation)."""
        generation, current = self._current()
        if current is None:
            return set()
        leaving: set[int] = set()
        # members announce in the generation they train in, which may have just been superseded by a loss
        for g in range(max(generation - 2, 0), generation + 1):
            leaving |= set(departure.announced(self.store, g))
        return (leaving & set(current.members())) - self.departed

    def _reform(
        self, lost: set[int], joined: list[int], leaving: frozenset[int] | set[int] = frozenset()
    ) -> bool:
        """Publish the next generation; ``False`` when the job cannot continue."""
        generation, old = self._current()
        if old is None:
            self.log("[bamboo.launch] a worker was lost before generation 0 formed", flush=True)
            return False
        proposed = set(self._proposal[1].members()) if self._proposal is not None else set()
        if lost and not leaving and not lost & (set(old.members()) | set(old.spares) | proposed):
            with self._lock:
                self._pending_joins = [m for m in self._pending_joins if m not in lost]
            return True  # a joiner died before it was placed anywhere: nothing to re-form
        gone = set(lost) | set(leaving)
        if gone:
            adopted = joining.close(self.store, generation)
            if adopted is not None and self._proposal is not None:
                # the members adopted the join before the loss: the failover applies to the joined layout
                old = self._publish_join(adopted)
            self._proposal = None
        kind = ("failover" if lost else "drain") if gone else "rejoin"
        try:
            new = failover(old, gone) if gone else old
            if joined:
                new = rejoin(new, joined)
        except FallbackNeeded as err:
            survivors = sorted(m for m in old.members() + list(old.spares) if m not in gone) + joined
            if not survivors:
                self.log(f"[bamboo.launch] {err}\nno worker left", flush=True)
                return False
            new = fallback_map(old, survivors)
            kind = "fallback"
        left = f" left {sorted(leaving)}" if leaving else ""
        self.log(
            f"[bamboo.launch] {kind}: lost {sorted(lost)}{left} joined {joined}\n{old.format()}\n->\n"
            f"{new.format()}",
            flush=True,
        )
        self.events.append(
            {
                "t_s": time.monotonic() - self.start_time,
                "kind": kind,
                "lost": sorted(lost),
                "left": sorted(leaving),
                "joined": joined,
                "old": old.to_json(),
                "new": new.to_json(),
            }
        )
        self._publish(new, kind)
        return True

    def run(self, replacements: int = 0, poll: float = 0.02) -> int:
        """Start the workers and supervise until the job ends; returns the exit code (also ``returncode``).

        Run on the main thread, it handles SIGTERM (what ``docker stop``, Kubernetes and schedulers send):
        the workers stop at a step boundary (the final checkpoint is written when the strategy has
        ``checkpoint_every_n_steps``), whatever is left after ``stop_timeout`` seconds is SIGKILLed by PID,
        and the exit code is 143 (128 + SIGTERM). :meth:`stop` does the same from another thread.
        """
        self.returncode = None
        handler = None
        if threading.current_thread() is threading.main_thread():
            handler = signal.signal(signal.SIGTERM, lambda signum, _frame: self.stop(signum))
        try:
            self.returncode = self._run(replacements, poll)
        finally:
            if handler is not None:
                signal.signal(signal.SIGTERM, handler)
            if self.returncode is None:
                self.returncode = 1
        return self.returncode

    def _stop_job(self, reason: str, code: int, poll: float) -> int:
        """Stop every worker at a step boundary: publish a ``stop`` generation (each member leaves ``fit`` at
        its next boundary, all at the same committed step, after writing the final checkpoint when one is
        configured), wait up to ``stop_timeout`` seconds, SIGKILL by PID whatever is left."""
        self._stopping = True
        generation, current = self._current()
        members = set(current.members()) if current is not None else set()
        if current is not None:
            following = OwnershipMap(generation + 1, current.num_stages, current.pipelines, current.spares)
            self._publish(following, "stop")
        self.log(
            f"[bamboo.launch] {reason}: stopping the workers at the next step boundary "
            f"(at most {self.stop_timeout:g}s)",
            flush=True,
        )
        with self._lock:
            workers = list(self.workers.values())
        for worker in workers:  # not training (a spare, a joiner not yet placed): nothing to finish
            if worker.member not in members and worker.proc.poll() is None:
                os.kill(worker.proc.pid, signal.SIGKILL)
                worker.proc.wait()
        deadline = time.monotonic() + self.stop_timeout
        while time.monotonic() < deadline and any(w.proc.poll() is None for w in workers):
            time.sleep(poll)
        killed = sorted(w.member for w in workers if w.proc.poll() is None)
        for worker in workers:
            if worker.proc.poll() is None:
                os.kill(worker.proc.pid, signal.SIGKILL)
                worker.proc.wait()
        late = f"; members {killed} did not stop in {self.stop_timeout:g}s: killed" if killed else ""
        self.log(f"[bamboo.launch] job stopped ({reason}){late}; exit code {code}", flush=True)
        return code

    def _run(self, replacements: int, poll: float) -> int:
        self.store.set("gen", "0")
        for _ in range(self.nproc):
            self.start_worker()
        budget = replacements
        try:
            while True:
                if self._stop_signal is not None:
                    name = signal.Signals(self._stop_signal).name
                    return self._stop_job(f"{name} received", 128 + self._stop_signal, poll)
                lost = self._check()
                leaving = self._departures()  # announced together, at one step boundary: no settling
                if lost or leaving:
                    if lost:
                        time.sleep(self.settle)  # losses that arrive together are handled together
                        self.lost |= lost
                        lost |= self._check()
                        self.lost |= lost
                        leaving |= self._departures()
                    failure = self._failure_in_code(lost)
                    if failure is not None:
                        return self._stop_job(f"member {failure['member']} failed", 1, poll)
                    self.departed |= leaving
                    joined: list[int] = []
                    if not self._reform(lost, joined, leaving):
                        return 1
                    if self.replace and budget != 0:
                        for _ in lost | leaving:
                            if budget == 0:
                                break
                            self._due.append(time.monotonic() + self.replace_delay)
                            budget -= 1
                while self._due and self._due[0] <= time.monotonic():
                    self._due.pop(0)
                    self.add_worker()
                self._advance_joins()
                _, current = self._current()
                if current is not None and current.members() and set(current.members()) <= self.finished:
                    return 0
                with self._lock:
                    procs = [w.proc for w in self.workers.values()]
                if all(proc.poll() is not None for proc in procs):
                    # a member that exited 0 after this iteration's _check() is finished, not a failure
                    self._check()
                    return 0 if current is not None and set(current.members()) <= self.finished else 1
                time.sleep(poll)
        finally:
            self.stop_all()
            (
                Path(os.environ["BAMBOO_EVENTS"]).write_text(json.dumps(self.events, indent=1))
                if os.environ.get("BAMBOO_EVENTS")
                else None
            )

    def _advance_joins(self) -> None:
        """Propose a map with the registered joiners, publish it once adopted, report the join's cost."""
        generation, current = self._current()
        if current is None:
            return
        self._watch_join()
        if self._proposal is None:
            with self._lock:
                pending = [
                    m
                    for m in self._pending_joins
                    if m not in current.members() and m not in self.lost and joining.registered(self.store, m)
                ]
            if not pending:
                return
            proposal = rejoin(current, pending)
            if proposal.pipelines == current.pipelines:
                return  # not enough new workers to change the layout yet: they wait
            joining.propose(self.store, generation, proposal)
            self._proposal = (generation, proposal, time.monotonic())
            return
        proposed_in, _, _ = self._proposal
        step = joining.adopted_step(self.store, proposed_in)
        if step is not None and self.store.check([f"g{proposed_in}/outcome/{step}"]):
            self._publish_join(step)

    def _publish_join(self, step: int) -> OwnershipMap:
        """Publish the adopted proposal as the next generation (the members form it after ``step``)."""
        assert self._proposal is not None
        generation, proposal, proposed_at = self._proposal
        old = ms.read_map(self.store, generation)
        joined = sorted(set(proposal.members()) - set(old.members()))
        self.log(
            f"[bamboo.launch] rejoin after step {step}: joined {joined}\n{old.format()}\n->\n"
            f"{proposal.format()}",
            flush=True,
        )
        self.events.append(
            {
                "t_s": time.monotonic() - self.start_time,
                "kind": "rejoin",
                "lost": [],
                "joined": joined,
                "old": old.to_json(),
                "new": proposal.to_json(),
            }
        )
        self._publish(proposal, "rejoin")
        with self._lock:
            self._pending_joins = [m for m in self._pending_joins if m not in joined]
        self._proposal = None
        now = time.monotonic()
        self._join_watch = {
            "members": joined,
            "step": step + 1,
            "generation": proposal.generation,
            "start_s": max((proposed_at - self._added_at.get(m, proposed_at) for m in joined), default=0.0),
            "proposed_at": proposed_at,
            "wait_s": now - proposed_at,
        }
        return proposal

    def _watch_join(self) -> None:
        """The join is complete when the first step at the new size commits: print its cost."""
        watch = self._join_watch
        if watch is None:
            return
        generation, step = watch["generation"], watch["step"]
        if ms.current_generation(self.store) != generation:
            self._join_watch = None  # a failover came first: no step ran at the joined size
            return
        key = f"g{generation}/outcome/{step}"
        if not self.store.check([key]) or ms.get_str(self.store, key) == commit_protocol.ABORT:
            return
        join_s = time.monotonic() - float(watch.pop("proposed_at"))  # type: ignore[arg-type]
        entry = {**watch, "join_s": join_s}
        self.joins.append(entry)
        self._join_watch = None
        self.log(
            f"[bamboo.launch] join members={entry['members']} step={step} generation={generation} "
            f"wait_s={entry['wait_s']:.3f} join_s={join_s:.3f} start_s={entry['start_s']:.2f}",
            flush=True,
        )


def fallback_map(old: OwnershipMap, survivors: list[int]) -> OwnershipMap:
    """One layout over the survivors after a loss redundancy cannot cover (they reload a checkpoint).

    As many full pipelines as fit; with fewer survivors than stages, one pipeline whose members own
    consecutive runs of stages (a member runs its run fused).
    """
    members = sorted(survivors)
    if len(members) >= old.num_stages:
        fresh = initial(old.num_stages, members)
        return OwnershipMap(old.generation + 1, old.num_stages, fresh.pipelines, fresh.spares)
    owners: dict[int, int] = {}
    for stage in range(old.num_stages):
        owners[stage] = members[stage * len(members) // old.num_stages]
    return OwnershipMap(old.generation + 1, old.num_stages, {0: owners}, ())
