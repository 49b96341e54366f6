"""The workers one machine runs for an elastic Bamboo job: start them, watch them, stop them by PID.

Used by the one-machine :class:`~lightning_bamboo.control.supervisor.Supervisor` and by each machine's agent
(:mod:`lightning_bamboo.control.agent`); neither decides membership here (that is
:class:`~lightning_bamboo.control.coordinator.Coordinator`'s job). A worker that exits non-zero (SIGKILL
included) is lost; a worker whose heartbeat (``hb/{member}`` in the store) stops for ``hang_timeout`` seconds
(SIGSTOP, a deadlock) is SIGKILLed by PID and lost. Workers are forked from a preload server that has imported
torch and Lightning once (:mod:`lbd_common.preload`) unless ``preload=False`` or
``BAMBOO_PRELOAD=0``; each is exactly what ``python train.py`` would be, in its own session.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch.distributed as dist

from lbd_common.preload import PreloadedProcess, Preloader
from lightning_bamboo.control import machines as mc
from lightning_bamboo.protocol import nccl_env
from lightning_bamboo.protocol import store as ms

PRELOAD_ENV = "BAMBOO_PRELOAD"
"""``BAMBOO_PRELOAD=0``: start every worker as a fresh interpreter (as ``--no-preload`` does)."""


@dataclass
class _Worker:
    member: int
    proc: subprocess.Popen[bytes] | PreloadedProcess
    local_rank: int = 0
    last_beat: int = -1
    beat_seen_at: float = field(default_factory=time.monotonic)


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS tells it, else all cores)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def thread_env(workers_on_machine: int) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for each worker: this machine's cores shared among its workers (at least 1), as
    Lightning's own launchers and torchrun set it; nothing when the user set it.

    Why: left alone, torch starts one intra-op thread per core in every worker, and K workers on one machine
    oversubscribe it K-fold. Measured: the GPT recipe, 2 workers on 2 cores, a step of 75 ms with stalls of
    0.3-1.2 s, against 20 ms without stalls at one thread each (docs/bamboo-advise.md).
    """
    if os.environ.get("OMP_NUM_THREADS", "").strip():
        return {}
    return {"OMP_NUM_THREADS": str(max(1, available_cores() // max(1, workers_on_machine)))}


class LocalWorkers:
    """The worker processes of this machine, by member id (each in its own session); ``workers_on_machine``
    of them at a time share its cores (:func:`thread_env`). ``preload``: fork them from a preload server
    (started with the environment the workers get, less their own variables, so that they qualify)
    unless ``BAMBOO_PRELOAD=0``."""

    def __init__(
        self,
        command: list[str],
        store: dist.Store,
        hang_timeout: float,
        log=print,
        workers_on_machine: int = 1,
        preload: bool = True,
        backend: str | None = None,
    ) -> None:
        self.command = command
        self.store = store
        self.hang_timeout = hang_timeout
        self.log = log
        self.threads = thread_env(workers_on_machine)
        # NCCL workers survive a lost peer only with these (protocol/nccl_env.py); the preload server too
        self.nccl = nccl_env.for_workers(backend or nccl_env.workers_backend())
        self.preloader: Preloader | None = None
        if preload and os.environ.get(PRELOAD_ENV, "1") != "0":
            self.preloader = Preloader({**os.environ, **self.threads, **self.nccl}, log)
        self.workers: dict[int, _Worker] = {}
        self.hung: list[int] = []
        """Members SIGKILLed for a silent heartbeat, in order (the supervisor's record of the job)."""
        self.lost: set[int] = set()
        """Members whose process exited non-zero or was killed for a silent heartbeat."""
        self.finished: set[int] = set()
        """Members whose process exited 0."""
        self._reported: set[int] = set()
        self.lock = threading.RLock()  # kill / start may come from another thread

    def start(self, member: int, env: Mapping[str, str]) -> int:
        """Start the worker ``member`` with ``env`` added to this process's environment; returns its local
        rank (``BAMBOO_LOCAL_RANK``: the lowest no running worker of this machine has, its device index)."""
        with self.lock:
            taken = {w.local_rank for w in self.workers.values() if w.proc.poll() is None}
            local_rank = min(set(range(len(taken) + 1)) - taken)
            env = {**os.environ, **self.threads, **self.nccl, **env, ms.ENV_LOCAL_RANK: str(local_rank)}
            if self.preloader is not None:
                proc = self.preloader.start(self.command, env)
            else:
                proc = subprocess.Popen(self.command, env=env, start_new_session=True)
            self.workers[member] = _Worker(member, proc, local_rank)
        threads = f" with OMP_NUM_THREADS={self.threads['OMP_NUM_THREADS']}" if self.threads else ""
        self.log(f"[bamboo.launch] started member {member} (pid {proc.pid}){threads}", flush=True)
        return local_rank

    def kill(self, member: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one worker, by PID (the tests and the benchmark preempt workers this way)."""
        with self.lock:
            worker = self.workers[member]
            if worker.proc.poll() is None:
                os.kill(worker.proc.pid, sig)

    def live_members(self) -> list[int]:
        """Member ids of the workers whose process is running."""
        with self.lock:
            return sorted(m for m, w in self.workers.items() if w.proc.poll() is None)

    def all_exited(self) -> bool:
        with self.lock:
            return all(w.proc.poll() is not None for w in self.workers.values())

    def exits(self) -> dict[int, int | None]:
        """Each worker's exit code by member (negative: killed by that signal; ``None``: still running)."""
        with self.lock:
            return {m: w.proc.poll() for m, w in sorted(self.workers.items())}

    def returncode(self, member: int) -> int | None:
        with self.lock:
            worker = self.workers.get(member)
        return None if worker is None else worker.proc.returncode

    def kill_all(self, members: set[int] | None = None) -> list[int]:
        """SIGKILL (by PID) and reap every running worker (or those of ``members``); returns the killed."""
        with self.lock:
            workers = [w for m, w in self.workers.items() if members is None or m in members]
        killed = []
        for worker in workers:
            if worker.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.proc.pid, signal.SIGKILL)
                worker.proc.wait()
                killed.append(worker.member)
        return killed

    def finish(self, grace: float = 5.0) -> list[int]:
        """The job is over: let the workers whose training is over (``done/{member}``: a member that left,
        writing its results) exit on their own for up to ``grace`` seconds, then SIGKILL (by PID) what is left
        (spares, joiners never placed); returns the killed."""
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            finishing = [m for m in self.live_members() if self.store.check([f"done/{m}"])]
            if not finishing:
                break
            time.sleep(0.05)
        return self.kill_all()

    def report(self, store: dist.Store, machine: int) -> set[int]:
        """Look at the workers (:meth:`check`) and append every exit not reported yet to the job's report log
        (:func:`~lightning_bamboo.control.machines.report`), where the coordinator reads it; returns the
        members newly lost. Called by the agent every pass, and by its coordinator after waiting for losses
        that arrive together (so that those of this machine are among them)."""
        newly = self._check()
        self.lost |= newly
        for member in sorted((self.lost | self.finished) - self._reported):
            code = self.returncode(member)
            mc.report(store, machine, member, 0 if code is None else code)
            self._reported.add(member)
        return newly

    def _check(self) -> set[int]:
        """Newly lost members: exited non-zero, or heartbeat silent for ``hang_timeout`` (then SIGKILLed).

        Members that exited 0 are added to :attr:`finished`; members already in :attr:`lost` or
        :attr:`finished` are not looked at again.
        """
        newly: set[int] = set()
        now = time.monotonic()
        with self.lock:
            workers = list(self.workers.items())
        for member, worker in workers:
            if member in self.lost or member in self.finished:
                continue
            code = worker.proc.poll()
            if code is not None:
                if code == 0:
                    self.finished.add(member)
                else:
                    self.log(f"[bamboo.launch] member {member} exited with {code}", flush=True)
                    newly.add(member)
                continue
            key = f"hb/{member}"
            if self.store.check([f"done/{member}"]):
                continue  # training is over for it; it is writing its results and exiting
            value = ms.read_if_set(self.store, key)
            if value is not None:
                beat = int(value.decode())  # the worker writes its count as text
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
                    self.hung.append(member)
                    newly.add(member)
            elif now - worker.beat_seen_at > max(self.hang_timeout, 300.0):  # never started beating
                self.log(f"[bamboo.launch] member {member} sent no heartbeat in 300s: killing it", flush=True)
                os.kill(worker.proc.pid, signal.SIGKILL)
                worker.proc.wait()
                self.hung.append(member)
                newly.add(member)
        return newly


def worker_env(store_url: str, job: str, member: int, nproc: int, joining: bool) -> dict[str, str]:
    """What a worker is told through its environment (read back by
    :class:`~lightning_bamboo.protocol.store.WorkerEnv`; :meth:`LocalWorkers.start` adds the local rank)."""
    return {
        ms.ENV_JOINING: "1" if joining else "0",
        ms.ENV_STORE: store_url,
        ms.ENV_JOB: job,
        ms.ENV_MEMBER: str(member),
        ms.ENV_NPROC: str(nproc),
    }
