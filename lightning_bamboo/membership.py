"""The store an elastic Bamboo job keeps its membership in, and what workers read and write there.

The store lives outside every training process (a ``TCPStore`` served by the launcher for one machine, an
etcd server for several; see :mod:`lightning_bamboo.launch` and :mod:`lightning_bamboo.etcd_store`), so
losing any rank, rank 0 included, loses nothing of it. Keys (all under the job's prefix):

* ``gen``: the current generation number; ``gen{g}/map``: its :class:`OwnershipMap` as JSON (written by
  the launcher, which is the only one to decide membership); ``gen{g}/formed``: members that formed it.
* ``hb/{member}``: a heartbeat counter, bumped by a thread of every worker (a hung process stops bumping).
* ``g{g}/prep/{step}`` and ``g{g}/outcome/{step}``: the two-phase commit of a training step
  (:class:`StepCommit`).
* ``config/num_stages``: the pipeline length the workers were started with (the launcher needs it).
* ``join/{member}``, ``gen{g}/join``, ``gen{g}/next``, ``gen{g}/progress``: a worker joining the running job
  (:mod:`lightning_bamboo.joining`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlparse

import torch.distributed as dist

from lightning_bamboo.ownership import OwnershipMap

ENV_STORE = "BAMBOO_STORE"
"""``tcp://host:port`` (the launcher's TCPStore) or ``etcd://host:port`` (an etcd v3 HTTP endpoint)."""
ENV_JOB = "BAMBOO_JOB"
ENV_MEMBER = "BAMBOO_MEMBER"
ENV_NPROC = "BAMBOO_NPROC"
ENV_HEARTBEAT = "BAMBOO_HEARTBEAT_S"
ENV_JOINING = "BAMBOO_JOINING"
"""``1`` for a worker the launcher started while the job runs (it joins instead of forming gen 0)."""

COMMIT = "commit"
COMMIT_JOIN = "commit+join"
"""The step commits and the members adopt the join proposal after it (:mod:`lightning_bamboo.joining`)."""
ABORT = "abort"


def connect(url: str, job: str, timeout: float = 60.0) -> dist.Store:
    """A client of the job's store: ``tcp://host:port`` or ``etcd://host:port``, under the job's prefix."""
    parsed = urlparse(url)
    if parsed.scheme == "tcp":
        if parsed.hostname is None or parsed.port is None:
            raise ValueError(f"{ENV_STORE} must look like tcp://host:port, got {url!r}")
        base: dist.Store = dist.TCPStore(
            parsed.hostname, parsed.port, is_master=False, timeout=timedelta(seconds=timeout)
        )
    elif parsed.scheme == "etcd":
        from lightning_bamboo.etcd_store import EtcdStore

        if parsed.hostname is None or parsed.port is None:
            raise ValueError(f"{ENV_STORE} must look like etcd://host:port, got {url!r}")
        # its own key prefix, not a PrefixStore: a PrefixStore keeps only the C++ side of a Python store
        return EtcdStore(parsed.hostname, parsed.port, timeout=timeout, prefix=f"/bamboo/{job}/")
    else:
        raise ValueError(f"{ENV_STORE} must start with tcp:// or etcd://, got {url!r}")
    return dist.PrefixStore(f"bamboo/{job}", base)


def get_str(store: dist.Store, key: str) -> str:
    return store.get(key).decode()


def current_generation(store: dist.Store) -> int:
    return int(get_str(store, "gen")) if store.check(["gen"]) else -1


def read_map(store: dist.Store, generation: int) -> OwnershipMap:
    return OwnershipMap.from_json(store.get(f"gen{generation}/map"))


@dataclass
class WorkerEnv:
    """What the launcher tells a worker through its environment."""

    store_url: str
    job: str
    member: int
    nproc: int
    joining: bool = False

    @classmethod
    def from_env(cls) -> WorkerEnv | None:
        """``None`` when the process was not started by ``python -m lightning_bamboo.launch``."""
        if ENV_STORE not in os.environ:
            return None
        missing = [key for key in (ENV_JOB, ENV_MEMBER, ENV_NPROC) if key not in os.environ]
        if missing:
            raise RuntimeError(
                f"{ENV_STORE} is set but {', '.join(missing)} not: start workers with "
                "python -m lightning_bamboo.launch"
            )
        return cls(
            os.environ[ENV_STORE],
            os.environ[ENV_JOB],
            int(os.environ[ENV_MEMBER]),
            int(os.environ[ENV_NPROC]),
            os.environ.get(ENV_JOINING) == "1",
        )


class Heartbeat:
    """A daemon thread bumping ``hb/{member}`` every ``interval`` seconds on its own store connection.

    A SIGSTOPped (or otherwise frozen) process stops bumping; the launcher notices after its hang timeout.
    """

    def __init__(self, env: WorkerEnv, interval: float) -> None:
        self._store = connect(env.store_url, env.job)
        self._key = f"hb/{env.member}"
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bamboo-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._store.add(self._key, 1)
            except Exception:  # the launcher is gone: the job is over, nothing to report to
                return
            self._stop.wait(self._interval)

    def stop(self) -> None:
        self._stop.set()


def store_barrier(
    store: dist.Store, key: str, count: int, timeout: float | None = None, poll: float = 0.01
) -> None:
    """Count this process in at ``key`` and wait until ``count`` processes have (``timeout`` seconds at most;
    ``None``: no bound).

    Raises:
        TimeoutError: naming the key, how many arrived and the timeout.
    """
    store.add(key, 1)
    deadline = None if timeout is None else time.monotonic() + timeout
    while (arrived := int(store.add(key, 0))) < count:
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(
                f"Bamboo: {arrived} of {count} workers reached {key!r} within timeout={timeout:.0f}s"
            )
        time.sleep(poll)


def outcome_key(generation: int, step: int) -> str:
    return f"g{generation}/outcome/{step}"


def decide(store: dist.Store, generation: int, step: int, proposal: str) -> str:
    """Write ``proposal`` as the outcome of ``step`` in ``generation`` unless one exists; return the one that
    holds. Anyone may call it (the supervisor settles a step with ``abort`` before acting on a join claimed
    at it, :func:`lightning_bamboo.joining.close`): the first writer wins."""
    return store.compare_set(outcome_key(generation, step), "", proposal).decode()


class StepCommit:
    """The commit point of a training step, decided once in the store for all members of a generation.

    Every member *prepares* (its replica holds the successor's gradients of the step) by bumping
    ``g{g}/prep/{step}``; the one that brings it to the member count writes ``commit`` into the outcome
    key, and a member that sees the generation end first writes ``abort`` there. ``compare_set`` makes the
    first writer win, so every member, and every survivor after a failure, reads the same outcome.

    What holds (``tests/bamboo/test_commit.py``, threads over a ``HashStore`` and a ``TCPStore``): one
    outcome per (generation, step), whoever races to write it; ``commit`` only once every member prepared,
    so a member lost before preparing aborts the step everywhere and one lost after preparing is rolled
    forward; a member that was waiting leaves only with an outcome (``abort`` once the generation ends).
    The store is the only thing it reads: no clock but the polling interval, no environment.
    """

    def __init__(self, store: dist.Store, generation: int, size: int) -> None:
        self.store = store
        self.generation = generation
        self.size = size

    def _outcome_key(self, step: int) -> str:
        return outcome_key(self.generation, step)

    def decide(self, step: int, proposal: str) -> str:
        """Write ``proposal`` unless an outcome exists; return the outcome that holds."""
        return decide(self.store, self.generation, step, proposal)

    def prepare_and_wait(self, step: int, claim_join: Callable[[int], bool] | None = None) -> str:
        """Mark this member prepared and wait for the outcome (``abort`` if the generation ends first).

        ``claim_join(step)``: called by the member that commits; ``True`` when it adopted a join proposal
        after this step (the outcome is then ``commit+join``).
        """
        if self.store.add(f"g{self.generation}/prep/{step}", 1) == self.size:
            joins = claim_join is not None and claim_join(step)
            return self.decide(step, COMMIT_JOIN if joins else COMMIT)
        key = self._outcome_key(step)
        polls = 0
        while True:
            if self.store.check([key]):
                return get_str(self.store, key)
            polls += 1
            if polls % 20 == 0 and current_generation(self.store) != self.generation:
                return self.decide(step, ABORT)
            time.sleep(0.0005 if polls < 200 else 0.005)
