"""The supervisor of an elastic Bamboo job (the process side; the CLI is :mod:`lightning_bamboo.launch`).

The supervisor is not a training rank, so no preemption of a worker can take it down:

* it serves the job's store (a ``TCPStore`` on one machine; ``--store etcd://host:port`` uses an etcd
  server instead, for several machines),
* starts ``N`` workers (each in its own session, member ids ``0..N-1``, told where the store is through
  ``BAMBOO_*`` environment variables),
* watches them: a worker that exits non-zero (SIGKILL included) is lost; a worker whose heartbeat stops
  for ``--hang-timeout`` seconds (SIGSTOP, a deadlock) is SIGKILLed by PID and lost; a worker that
  announced its departure (a preemption notice, :mod:`lightning_bamboo.control.drain`) leaves: not a loss; a
  worker that exits with an error of the training code (:mod:`lightning_bamboo.control.crash`) stops the job
  (exit 1): a failover would only raise it again,
* and is the one place membership is decided: it is the job's
  :class:`~lightning_bamboo.control.coordinator.Coordinator`, which writes generation ``g+1``'s ownership map
  (:func:`lightning_bamboo.layout.ownership.failover`, or a checkpoint fallback when redundancy cannot cover
  the loss) into the store and prints the old and new maps. Workers form the new generation themselves.

The processes are :class:`~lightning_bamboo.control.workers.LocalWorkers`; on several machines each machine's
agent runs those and one elected agent the coordinator (:mod:`lightning_bamboo.control.agent`).

It restarts nobody on its own. ``--replace K`` starts a replacement worker (a new member id)
``--replace-delay`` seconds after each loss (at most ``K``); :meth:`Supervisor.add_worker` starts one from
another thread at any time. A new worker registers once its model is built; the supervisor then proposes the
next map and the members adopt it after one committed step (:mod:`lightning_bamboo.control.join`); it prints
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
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from lightning_bamboo.control import store as ms
from lightning_bamboo.control.coordinator import Coordinator, fallback_map
from lightning_bamboo.control.workers import LocalWorkers, _Worker, worker_env

__all__ = ["Supervisor", "_Worker", "fallback_map"]


class Supervisor(Coordinator):
    """Starts, watches and re-forms the workers of one job on one machine (see the module docstring)."""

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
        preload: bool = True,
        backend: str | None = None,
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
        self.job = uuid.uuid4().hex[:12]
        if store_url is None:
            self._server = dist.TCPStore(
                "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
            )
            store_url = f"tcp://127.0.0.1:{self._server.port}"
        self.store_url = store_url
        super().__init__(ms.connect(store_url, self.job), log)
        self.local = LocalWorkers(command, self.store, hang_timeout, log, workers_on_machine=nproc,
                                  preload=preload, backend=backend)
        self.next_member = 0
        self._due: list[float] = []  # when the next replacements start
        self.returncode: int | None = None
        self._stop_signal: int | None = None
        self._stopping = False
        self.stopped: dict[str, object] | None = None
        """How the job was stopped (:meth:`_stop_job`): reason, exit code, members killed late."""

    @property
    def workers(self) -> dict[int, _Worker]:
        return self.local.workers

    def exit_codes(self, members: set[int]) -> dict[int, int | None]:
        return {m: self.local.returncode(m) for m in members if m in self.workers}

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
        return self.local.live_members()

    def wait_formed(self, timeout: float = 300.0) -> None:
        """Block until all members formed generation 0 (for callers that run :meth:`run` in a thread)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if first_formed(self.store):
                return
            if self.returncode is not None:
                raise RuntimeError(f"the job ended (exit code {self.returncode}) before generation 0 formed")
            time.sleep(0.05)
        raise TimeoutError(f"generation 0 did not form in {timeout}s")

    def _start_worker(self, joining: bool = False) -> int:
        member = self.next_member
        self.next_member += 1
        self.local.start(member, worker_env(self.store_url, self.job, member, self.nproc, joining))
        return member

    def kill(self, member: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one worker, by PID (the tests and the benchmark preempt workers this way)."""
        self.local.kill(member, sig)

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
        self.local.kill_all()

    # ------------------------------------------------------------------ watching
    def _check(self) -> set[int]:
        """Newly lost members: exited non-zero, or heartbeat silent for ``hang_timeout`` (then SIGKILLed)."""
        return self.local.check(self.lost, self.finished, self.departed)

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
            self._recorded()
        return self.returncode

    # ------------------------------------------------------------------ the record of the job
    def record(self) -> dict[str, object]:
        """What happened to the job so far, as JSON data (the ``BAMBOO_EVENTS`` file, docs/bamboo-elastic.md):
        ``changes`` (every generation change: kind, lost, left, joined, old and new map), ``joins`` (completed
        joins with their cost), ``hung`` (members killed for a silent heartbeat), ``error`` (the error of the
        training code that stopped the job), ``stop`` (reason, exit code, members killed for not stopping in
        time: ``None`` until they are gone), ``exits`` (each worker's exit code, negative for a signal,
        ``None`` while it runs), ``returncode`` (``None`` while the job runs), ``pids`` (each worker's
        PID, from when the workers started), ``store`` and ``job`` (where the job's store is: a watcher
        reads :func:`first_formed` there)."""
        with self._lock:
            return {
                "changes": list(self.events),
                "joins": list(self.joins),
                "hung": list(self.local.hung),
                "error": self.error,
                "stop": self.stopped,
                "exits": {str(m): code for m, code in self.local.exits().items()},
                "returncode": self.returncode,
                "pids": {str(m): w.proc.pid for m, w in sorted(self.workers.items())},
                "store": self.store_url,
                "job": self.job,
            }

    def _recorded(self) -> None:
        """Write :meth:`record` to ``BAMBOO_EVENTS`` when set, whole (a reader never sees half a file)."""
        path = os.environ.get("BAMBOO_EVENTS")
        if not path:
            return
        target = Path(path)
        partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(self.record(), indent=1))
        partial.replace(target)

    def _stop_job(self, reason: str, code: int, poll: float) -> int:
        """Stop every worker at a step boundary: publish a ``stop`` generation (each member leaves ``fit`` at
        its next boundary, all at the same committed step, after writing the final checkpoint when one is
        configured), wait up to ``stop_timeout`` seconds, SIGKILL by PID whatever is left."""
        self._stopping = True
        members = self._stop_generation()
        self.stopped = {"reason": reason, "code": code, "killed": None}
        self._recorded()
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
        self.stopped = {"reason": reason, "code": code, "killed": killed}
        self._recorded()
        self.log(f"[bamboo.launch] job stopped ({reason}){late}; exit code {code}", flush=True)
        return code

    def _run(self, replacements: int, poll: float) -> int:
        self.store.set("gen", "0")
        for _ in range(self.nproc):
            self.start_worker()
        self._recorded()  # the workers' PIDs
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
                if self._job_done():
                    return 0
                if self.local.all_exited():
                    # a member that exited 0 after this iteration's _check() is finished, not a failure
                    self._check()
                    return 0 if self._job_done() else 1
                time.sleep(poll)
        finally:
            self.stop_all()


def first_formed(store: dist.Store) -> bool:
    """Whether every member of generation 0 has formed it (its process group is up: training runs)."""
    if not store.check(["gen0/map", "gen0/formed"]):
        return False
    return int(store.add("gen0/formed", 0)) >= len(ms.read_map(store, 0).members())
