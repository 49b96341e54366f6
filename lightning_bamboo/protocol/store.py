"""The store an elastic Bamboo job keeps its membership in, and what workers read and write there.

The store lives outside every training process (a ``TCPStore`` served by the launcher for one machine, an
etcd server for several; see :mod:`lightning_bamboo.control.supervisor` and
:mod:`lightning_bamboo.protocol.etcd_store`), so losing any rank, rank 0 included, loses nothing of it. Keys
(all under the job's prefix):

* ``gen``: the current generation number; ``gen{g}/map``: its :class:`OwnershipMap` as JSON (written by
  the launcher, which is the only one to decide membership); ``gen{g}/formed``: members that formed it.
* ``hb/{member}``: a heartbeat counter, written by a thread of every worker (a hung process stops writing).
* ``g{g}/prep/{step}`` and ``g{g}/outcome/{step}``: the two-phase commit of a training step
  (:class:`lightning_bamboo.protocol.commit.StepCommit`); across machines the step commits by all-reduce and
  ``g{g}/applied/{member}`` (steps a member applied when it left the generation) settles a step a loss cut
  (:mod:`lightning_bamboo.runtime.collective_commit`).
* ``config/num_stages``: the pipeline length the workers were started with (the launcher needs it).
* ``config/global_microbatches``: :data:`GLOBAL_MICROBATCHES`.
* ``config/replicas``: :data:`REPLICAS`.
* ``join/{member}``, ``gen{g}/join``, ``gen{g}/next``, ``gen{g}/progress``: a worker joining the running job
  (:mod:`lightning_bamboo.protocol.join`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol, runtime_checkable
from urllib.parse import urlparse

import torch.distributed as dist

from lightning_bamboo.layout.ownership import OwnershipMap

GLOBAL_MICROBATCHES = "config/global_microbatches"
"""The job's count of global micro-batches per step (``num_microbatches`` x the pipelines of generation 0),
written by the members forming generation 0 and fixed for the whole job, so the split of a global batch
never depends on the pipelines alive (a joiner reads it; the coordinator forms no more pipelines than it)."""
REPLICAS = "config/replicas"
"""``1`` when the members hold their successor's replica (``recovery="replica"`` or ``"replica+forward"``),
``0`` under ``recovery="peers"``; written when generation 0 forms. The coordinator's placement report reads
it: which losses a job can cover depends on it (:func:`lightning_bamboo.control.machines.fallback_risks`)."""
ENV_STORE = "BAMBOO_STORE"
"""``tcp://host:port`` (the launcher's TCPStore) or ``etcd://host:port`` (an etcd v3 HTTP endpoint)."""
ENV_JOB = "BAMBOO_JOB"
ENV_MEMBER = "BAMBOO_MEMBER"
ENV_NPROC = "BAMBOO_NPROC"
ENV_HEARTBEAT = "BAMBOO_HEARTBEAT_S"
ENV_JOINING = "BAMBOO_JOINING"
"""``1`` for a worker the launcher started while the job runs (it joins instead of forming gen 0)."""
ENV_LOCAL_RANK = "BAMBOO_LOCAL_RANK"
"""The worker's index among the running workers of its machine (its device: ``cuda:<local rank>``)."""
ENV_ONE_MACHINE_COMMIT = "BAMBOO_ONE_MACHINE_COMMIT"
"""``collective``: a job on one machine commits its steps by all-reduce as a job across machines does, instead
of through its TCPStore. A measurement switch (``benchmarks/bamboo_ft_cost.py --one-machine-commit``): on one
machine the store's commit measured faster (docs/bamboo-elastic-reference.md, "The two-phase step")."""


def connect(url: str, job: str, timeout: float = 60.0, request_timeout: float = 30.0) -> dist.Store:
    """A client of the job's store: ``tcp://host:port`` or ``etcd://host:port``, under the job's prefix.

    ``timeout``: seconds a ``get``/``wait`` waits for a key; ``request_timeout``: seconds one request to an
    etcd server may take."""
    parsed = urlparse(url)
    if parsed.scheme == "tcp":
        if parsed.hostname is None or parsed.port is None:
            raise ValueError(f"{ENV_STORE} must look like tcp://host:port, got {url!r}")
        base: dist.Store = dist.TCPStore(
            parsed.hostname, parsed.port, is_master=False, timeout=timedelta(seconds=timeout)
        )
    elif parsed.scheme == "etcd":
        from lightning_bamboo.protocol.etcd_store import EtcdStore

        if parsed.hostname is None or parsed.port is None:
            raise ValueError(f"{ENV_STORE} must look like etcd://host:port, got {url!r}")
        # its own key prefix, not a PrefixStore: a PrefixStore keeps only the C++ side of a Python store
        return EtcdStore(
            parsed.hostname,
            parsed.port,
            timeout=timeout,
            prefix=f"/bamboo/{job}/",
            request_timeout=request_timeout,
        )
    else:
        raise ValueError(f"{ENV_STORE} must start with tcp:// or etcd://, got {url!r}")
    return dist.PrefixStore(f"bamboo/{job}", base)


def get_str(store: dist.Store, key: str) -> str:
    return store.get(key).decode()


@runtime_checkable
class RoundTripStore(Protocol):
    """A store across machines (:class:`~lightning_bamboo.protocol.etcd_store.EtcdStore`) where every request
    is a network round trip, and what it offers so that the per-step paths poll nothing: a key :meth:`read`
    in one request (several keys: :meth:`read_many`), a step's preparation as one :meth:`vote_and_read` each
    (the outcome and the generation read with it), and sleeps :meth:`watching` keys, woken when one of them
    is written."""

    def read(self, key: str) -> bytes | None: ...

    def read_many(self, keys: list[str]) -> dict[str, bytes | None]: ...

    def vote(self, key: str, voter: str) -> int: ...

    def vote_and_read(
        self, key: str, voter: str, reads: list[str]
    ) -> tuple[int, dict[str, bytes | None]]: ...

    def watching(self, keys: list[str]) -> contextlib.AbstractContextManager[Callable[[float], bool]]: ...


def one_pass(store: dist.Store) -> contextlib.AbstractContextManager[None]:
    """A block of a polling loop that reads many keys: on etcd, the keys the previous pass read are fetched
    in one transaction (:meth:`~lightning_bamboo.protocol.etcd_store.EtcdStore.tick`); a local store reads as
    before (each read is a local round trip there)."""
    tick = getattr(store, "tick", None)
    return tick() if callable(tick) else contextlib.nullcontext()


def read_if_set(store: dist.Store, key: str) -> bytes | None:
    """``key``'s value, ``None`` while it is not set: one read on a :class:`RoundTripStore`."""
    if isinstance(store, RoundTripStore):
        return store.read(key)
    return store.get(key) if store.check([key]) else None


def current_generation(store: dist.Store) -> int:
    value = read_if_set(store, "gen")
    return int(value) if value is not None else -1


class GenerationSuperseded(ConnectionError):
    """A member waited for a key that a peer of ``generation`` was to write, and the launcher published a
    later generation first: the peer was lost (a communication failure; the newest generation forms)."""


def wait_for_key(store: dist.Store, key: str, generation: int, poll: float = 0.01) -> bytes:
    """``key``'s value once a peer of ``generation`` has set it. A blocking ``get`` would wait for the
    store's timeout (60 s) when that peer was lost, and hold the store's connection all the while (a
    watcher thread sharing it could not write); this returns or raises :class:`GenerationSuperseded` as soon
    as a generation after ``generation`` is published. On a :class:`RoundTripStore` it sleeps on the watch
    of ``key`` and ``gen`` and reads both in one request per wake; other stores are polled every ``poll``
    seconds."""
    keys = [key, "gen"]
    watched = isinstance(store, RoundTripStore)
    with store.watching(keys) if watched else contextlib.nullcontext() as sleep:  # type: ignore[attr-defined]
        while True:
            values = store.read_many(keys) if watched else {k: read_if_set(store, k) for k in keys}
            if values[key] is not None:
                return values[key]  # type: ignore[return-value]
            if values["gen"] is not None and int(values["gen"]) > generation:
                raise GenerationSuperseded(
                    f"Bamboo: generation {generation} was superseded while waiting for {key!r} (a peer was "
                    "lost)"
                )
            if sleep is not None:
                sleep(60.0)  # woken by a put of either key, else after the watch's re-read interval
            else:
                time.sleep(poll)


class GenerationWatch:
    """Whether the job's generation is newer than a member's, read only when it may have changed.

    A member asks at every step boundary (a generation published without a failure seen here, e.g. a drain,
    is formed there). On a :class:`RoundTripStore` that read was one of a step's few round trips, so the
    member keeps a watch on ``gen`` for its whole life and reads the key only after a put of it, or when its
    last read is older than the watch's re-read interval (a broken stream is not trusted for longer). A put
    after the read is counted by the watch, so no generation is missed, only seen at most that much later,
    as if the boundary had read a moment earlier. Other stores are read every time (a local round trip)."""

    def __init__(self, store: dist.Store) -> None:
        self._gen = WatchedKey(store, "gen")

    def newer_than(self, generation: int) -> bool:
        value = self._gen.read()
        return (int(value) if value is not None else -1) > generation

    def close(self) -> None:
        self._gen.close()


class WatchedKey:
    """A key's value, read again only when it may have changed: on a :class:`RoundTripStore`, after a put of
    it that the watch stream saw, or when the last read is older than the watch's re-read interval (a broken
    stream is not trusted for longer); on other stores, at every :meth:`read` (a local round trip). A put
    after a read is counted by the watch, so no write is missed, only seen at most that much later."""

    def __init__(self, store: dist.Store, key: str) -> None:
        from lightning_bamboo.protocol.etcd_watch import REREAD_S

        self._store, self._key = store, key
        self._reread_s = REREAD_S
        self._stack = contextlib.ExitStack()
        self._puts = (
            self._stack.enter_context(store.watching([key])) if isinstance(store, RoundTripStore) else None
        )
        self._known: bytes | None = None
        self._read_at = -float("inf")

    def read(self) -> bytes | None:
        now = time.monotonic()
        if self._puts is None or self._puts(0.0) or now - self._read_at >= self._reread_s:
            self._read_at = now
            self._known = read_if_set(self._store, self._key)
        return self._known

    def close(self) -> None:
        self._stack.close()


def report_lost_peer(store: dist.Store, generation: int) -> None:
    """A worker of ``generation`` lost a peer (a connection reset or closed): the multi-machine coordinator
    then probes the machines' agents at once instead of waiting for a lease to expire
    (:class:`lightning_bamboo.control.machines.Liveness`)."""
    store.add(f"gen{generation}/lost_peer", 1)


def lost_peer_reports(store: dist.Store, generation: int) -> int:
    """How many lost-peer reports ``generation`` has (a read only: agents ask at every tick)."""
    value = read_if_set(store, f"gen{generation}/lost_peer")
    return int(value) if value is not None else 0


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
    local_rank: int = 0

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
            int(os.environ.get(ENV_LOCAL_RANK, "0")),
        )


def default_heartbeat(store: dist.Store) -> float:
    """Seconds between a worker's heartbeats when the strategy was given none: 0.25 on one machine's store (a
    local round trip), 1.0 on a :class:`RoundTripStore` (a request over the network to etcd; still five
    beats in the launcher's default ``--hang-timeout`` of 5 s)."""
    return 1.0 if isinstance(store, RoundTripStore) else 0.25


class Heartbeat:
    """A daemon thread bumping ``hb/{member}`` every ``interval`` seconds on its own store connection.

    A SIGSTOPped (or otherwise frozen) process stops bumping; the launcher notices after its hang timeout
    (it only looks for a change of the value). Each beat is one write of this thread's own count: ``add``
    is a read and a compare-and-swap on etcd, two round trips, and six members beating every 0.25 s made
    about a third of a failure-free job's requests there (``docs/bamboo-elastic-reference.md``, "Detection").
    """

    def __init__(self, env: WorkerEnv, interval: float) -> None:
        self._store = connect(env.store_url, env.job)
        self._key = f"hb/{env.member}"
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bamboo-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        beats = 0
        while not self._stop.is_set():
            beats += 1
            try:
                self._store.set(self._key, str(beats))
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
