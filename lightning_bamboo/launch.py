"""``python -m lightning_bamboo.launch --nproc N script.py args``: the supervisor of an elastic Bamboo job.

The supervisor is not a training rank, so no preemption of a worker can take it down:

* it serves the job's store (a ``TCPStore`` on one machine; ``--store etcd://host:port`` uses an etcd
  server instead, for several machines),
* starts ``N`` workers (each in its own session, member ids ``0..N-1``, told where the store is through
  ``BAMBOO_*`` environment variables),
* watches them: a worker that exits non-zero (SIGKILL included) is lost; a worker whose heartbeat stops
  for ``--hang-timeout`` seconds (SIGSTOP, a deadlock) is SIGKILLed by PID and lost,
* and is the one place membership is decided: it writes generation ``g+1``'s ownership map
  (:func:`lightning_bamboo.ownership.failover`, or a checkpoint fallback when redundancy cannot cover the
  loss) into the store and prints the old and new maps. Workers form the new generation themselves.

It restarts nobody on its own. ``--replace`` starts a replacement worker (a new member id) after each loss,
which joins at a step boundary. When the members of the current generation have all exited 0, remaining
spare workers are stopped by PID and the supervisor exits 0; if no pipeline can continue it stops all
workers by PID and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from lightning_bamboo import membership as ms
from lightning_bamboo.ownership import FallbackNeeded, OwnershipMap, failover, initial, rejoin


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
    ) -> None:
        if nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {nproc}")
        if hang_timeout <= 0:
            raise ValueError(f"--hang-timeout must be > 0 seconds, got {hang_timeout}")
        self.command = command
        self.nproc = nproc
        self.hang_timeout = hang_timeout
        self.settle = settle
        self.replace = replace
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
        self.events: list[dict[str, object]] = []
        self._pending_joins: list[int] = []
        self.start_time = time.monotonic()

    # ------------------------------------------------------------------ processes
    def start_worker(self, joining: bool = False) -> int:
        member = self.next_member
        self.next_member += 1
        env = {
            **os.environ,
            ms.ENV_STORE: self.store_url,
            ms.ENV_JOB: self.job,
            ms.ENV_MEMBER: str(member),
            ms.ENV_NPROC: str(self.nproc),
        }
        if joining:
            env["BAMBOO_JOINING"] = "1"
        proc = subprocess.Popen(self.command, env=env, start_new_session=True)
        self.workers[member] = _Worker(member, proc)
        self.log(f"[bamboo.launch] started member {member} (pid {proc.pid})", flush=True)
        return member

    def kill(self, member: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one worker, by PID (the tests and the benchmark preempt workers this way)."""
        worker = self.workers[member]
        if worker.proc.poll() is None:
            os.kill(worker.proc.pid, sig)

    def stop_all(self) -> None:
        for worker in self.workers.values():
            if worker.proc.poll() is None:
                os.kill(worker.proc.pid, signal.SIGKILL)
                worker.proc.wait()

    # ------------------------------------------------------------------ watching
    def _check(self) -> set[int]:
        """Newly lost members: exited non-zero, or heartbeat silent for ``hang_timeout`` (then SIGKILLed)."""
        lost: set[int] = set()
        now = time.monotonic()
        for member, worker in self.workers.items():
            if member in self.lost or member in self.finished:
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

    def _current(self) -> tuple[int, OwnershipMap | None]:
        generation = ms.current_generation(self.store)
        if generation < 0 or not self.store.check([f"gen{generation}/map"]):
            return generation, None
        return generation, ms.read_map(self.store, generation)

    def _publish(self, new: OwnershipMap, kind: str) -> None:
        self.store.set(f"gen{new.generation}/map", new.to_json())
        self.store.set(f"gen{new.generation}/kind", kind)
        self.store.set("gen", str(new.generation))

    def _reform(self, lost: set[int], joined: list[int]) -> bool:
        """Publish the next generation; ``False`` when the job cannot continue."""
        _, old = self._current()
        if old is None:
            self.log("[bamboo.launch] a worker was lost before generation 0 formed", flush=True)
            return False
        kind = "failover" if lost else "rejoin"
        try:
            new = failover(old, lost) if lost else old
            if joined:
                new = rejoin(new, joined)
        except FallbackNeeded as err:
            survivors = sorted(m for m in old.members() + list(old.spares) if m not in lost) + joined
            if not survivors:
                self.log(f"[bamboo.launch] {err}\nno worker left", flush=True)
                return False
            new = fallback_map(old, survivors)
            kind = "fallback"
        self.log(
            f"[bamboo.launch] {kind}: lost {sorted(lost)} joined {joined}\n{old.format()}\n->\n"
            f"{new.format()}",
            flush=True,
        )
        self.events.append(
            {
                "t_s": time.monotonic() - self.start_time,
                "kind": kind,
                "lost": sorted(lost),
                "joined": joined,
                "old": old.to_json(),
                "new": new.to_json(),
            }
        )
        self._publish(new, kind)
        return True

    def run(self, replacements: int = 0, poll: float = 0.02) -> int:
        """Start the workers and supervise until the job ends; returns the exit code."""
        self.store.set("gen", "0")
        for _ in range(self.nproc):
            self.start_worker()
        budget = replacements
        try:
            while True:
                lost = self._check()
                if lost:
                    time.sleep(self.settle)  # losses that arrive together are handled together
                    self.lost |= lost
                    lost |= self._check()
                    self.lost |= lost
                    joined: list[int] = []
                    if not self._reform(lost, joined):
                        return 1
                    if self.replace and budget != 0:
                        for _ in lost:
                            self._pending_joins.append(self.start_worker(joining=True))
                            budget -= 1
                for member in self._ready_joins():
                    if not self._reform(set(), [member]):
                        return 1
                _, current = self._current()
                if current is not None and current.members() and set(current.members()) <= self.finished:
                    return 0
                if all(w.proc.poll() is not None for w in self.workers.values()):
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

    def _ready_joins(self) -> list[int]:
        """Joiners that registered in the store (``join/{member}``), taken one at a time."""
        ready = [m for m in self._pending_joins if self.store.check([f"join/{m}"])]
        for member in ready[:1]:
            self._pending_joins.remove(member)
        return ready[:1]


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_bamboo.launch", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--nproc", type=int, required=True, help="workers to start")
    parser.add_argument(
        "--store",
        default=None,
        help="etcd://host:port to keep the job's state in etcd (default: a TCPStore here)",
    )
    parser.add_argument(
        "--hang-timeout",
        type=float,
        default=5.0,
        help="seconds without a heartbeat after which a worker is killed and lost",
    )
    parser.add_argument(
        "--replace",
        type=int,
        default=0,
        help="start up to this many replacement workers, one after each loss (-1: no limit)",
    )
    parser.add_argument("-m", dest="module", action="store_true", help="the script is a module (python -m)")
    parser.add_argument("script", help="the training script (or module, with -m)")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = [sys.executable, *(["-m"] if args.module else []), args.script, *args.args]
    supervisor = Supervisor(
        command,
        args.nproc,
        args.store,
        args.hang_timeout,
        replace=args.replace != 0,
    )
    return supervisor.run(replacements=args.replace)


if __name__ == "__main__":
    sys.exit(main())
