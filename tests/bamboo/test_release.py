"""How a failed generation is released on NCCL (``lightning_bamboo/runtime/release.py``), in one process over
a real ``TCPStore`` and a one-rank ``nccl-like`` group: the watcher thread aborts every backend when a
failover generation is published or when an attempt outlives its deadline, the group is then gone from
torch's world (never destroyed), and a planned change destroys it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_bamboo.protocol import crash
from lightning_bamboo.protocol import store as ms
from lightning_bamboo.runtime import nccl_like
from lightning_bamboo.runtime.release import AbortBackends


@pytest.fixture
def job() -> Iterator[tuple[ms.WorkerEnv, dist.Store]]:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    env = ms.WorkerEnv(f"tcp://127.0.0.1:{server.port}", "releasejob", member=0, nproc=1)
    store = ms.connect(env.store_url, env.job)
    store.set("gen", "0")
    yield env, store
    if dist.is_initialized():
        dist.destroy_process_group()


def formed(release: AbortBackends, store: dist.Store, generation: int) -> None:
    release.before_init()
    dist.init_process_group(nccl_like.NAME, store=dist.PrefixStore(f"gen{generation}", store), rank=0,
                            world_size=1)
    dist.all_reduce(torch.ones(1))
    release.formed(generation)


def wait_until(condition: object, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def cpu() -> torch.device:
    return torch.device("cpu")


def test_a_failover_generation_makes_the_watcher_abort_every_backend(
    job: tuple[ms.WorkerEnv, dist.Store],
) -> None:
    env, store = job
    release = AbortBackends(env, cpu, deadline=None)
    try:
        formed(release, store, 0)
        store.set("gen1/kind", "rejoin")
        store.set("gen", "1")
        time.sleep(0.3)
        assert dist.is_initialized()  # a join is a planned change: left to the step boundary
        store.set("gen2/kind", "failover")
        store.set("gen", "2")
        assert wait_until(lambda: not dist.is_initialized())  # aborted by the watcher, not destroyed
        release.end(failed=True)  # the main thread's release: nothing left to do, no destroy
        formed(release, store, 2)
        release.end(failed=False)  # a planned change destroys
        assert not dist.is_initialized()
    finally:
        release.stop()


def test_an_attempt_past_its_deadline_is_aborted(job: tuple[ms.WorkerEnv, dist.Store]) -> None:
    env, store = job
    release = AbortBackends(env, cpu, deadline=0.3)
    try:
        formed(release, store, 0)
        with release.attempt():
            assert wait_until(lambda: not dist.is_initialized())
        assert release.pg_timeout(timedelta(seconds=5)) == timedelta(seconds=10)
    finally:
        release.stop()


def test_an_attempt_counts_its_deadline_from_the_generation_it_formed(
    job: tuple[ms.WorkerEnv, dist.Store],
) -> None:
    """A step that went through a failover (its attempt began on the old generation) has its whole deadline
    on the new one: a loss that took long to detect does not make the new generation abort at once."""
    env, store = job
    release = AbortBackends(env, cpu, deadline=1.0)
    try:
        formed(release, store, 0)
        with release.attempt():
            time.sleep(0.8)
            release.end(failed=False)
            formed(release, store, 1)  # 0.8 s into the attempt: its deadline counts from here
            time.sleep(0.6)
            assert dist.is_initialized()  # 1.4 s into the attempt, 0.6 s into generation 1
            assert wait_until(lambda: not dist.is_initialized())  # and it still ends a stalled one
    finally:
        release.stop()


def test_a_wait_for_a_lost_peers_key_ends_when_the_next_generation_is_published(
    job: tuple[ms.WorkerEnv, dist.Store],
) -> None:
    """Forming waits for keys its peers write (the layers each holds); a peer lost before writing would make
    a blocking ``get`` wait for the store's timeout (60 s) holding the connection. The wait returns the value
    once written, and raises a communication error as soon as a later generation is published."""
    _, store = job
    store.set("g0/holds/1", "[1]")
    assert ms.wait_for_key(store, "g0/holds/1", 0) == b"[1]"
    threading.Timer(0.3, lambda: store.set("gen", "1")).start()
    # not the store's timeout (DistStoreError after 60 s): the superseding generation, named
    with pytest.raises(ms.GenerationSuperseded, match=r"generation 0 was superseded while waiting for 'g0"):
        ms.wait_for_key(store, "g0/holds/2", 0)
    assert crash.is_communication_error(ms.GenerationSuperseded("x"))
