"""The etcd store's operations against a real etcd server (``scripts/services.sh``'s): ``compare_set`` as
``TCPStore`` answers it, votes that concurrent members count exactly once each, and waits woken by the
process's watch stream (or, with the stream gone, by their own reads)."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_bamboo.control import etcd_watch
from lightning_bamboo.control import store as ms
from lightning_bamboo.control.etcd_store import EtcdStore
from lightning_bamboo.control.etcd_watch import PutWatch

pytestmark = pytest.mark.services


@pytest.fixture
def store(etcd_endpoint: str) -> EtcdStore:
    connected = ms.connect(f"etcd://{etcd_endpoint}", f"store-{uuid.uuid4().hex[:8]}", timeout=20.0)
    assert isinstance(connected, EtcdStore)
    return connected


def put_later(store: dist.Store, key: str, seconds: float) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), store.set(key, "v")), daemon=True)
    thread.start()
    return thread


def test_compare_set_answers_as_tcp_store_does(store: EtcdStore) -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    cases = [  # (key, expected, desired): absent/present keys, matching or not, empty expected
        ("a", "", "1"),
        ("a", "", "2"),
        ("a", "1", "3"),
        ("a", "9", "4"),
        ("b", "x", "5"),
        ("b", "", "6"),
    ]
    stores = {"etcd": store, "tcp": server}
    answers = {name: [s.compare_set(*case) for case in cases] for name, s in stores.items()}
    assert answers["etcd"] == answers["tcp"] == [b"1", b"1", b"3", b"3", b"x", b"6"]
    assert (store.get("a"), store.get("b")) == (server.get("a"), server.get("b"))


def test_concurrent_votes_are_counted_once_each(store: EtcdStore) -> None:
    """Eight members vote at once: the counts they read are 1..8, so exactly one of them saw everyone (the
    member that commits a step); a vote repeated (a retried request) does not count twice."""
    counts: list[int] = []
    start = threading.Barrier(8)

    def member(name: str) -> None:
        start.wait()
        counts.append(store.vote("prep/1", name))

    threads = [threading.Thread(target=member, args=(f"m{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(counts) == list(range(1, 9))
    assert store.vote("prep/1", "m3") == 8


def test_a_put_wakes_the_waiter_through_the_watch_stream(
    store: EtcdStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the waiter's own re-reads 60 s apart, only the stream can wake it within the 20 s wait."""
    monkeypatch.setattr(etcd_watch, "REREAD_S", 60.0)
    writer = put_later(store, "late", 0.3)
    store.wait(["late"], timedelta(seconds=20))
    assert store.get("late") == b"v"
    writer.join()


def test_two_threads_waiting_on_one_key_both_wake_on_its_put(
    store: EtcdStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's main thread (a step's outcome or the generation) and its cutter (the generation) share the
    process's stream: one put wakes both, not only the first to look."""
    monkeypatch.setattr(etcd_watch, "REREAD_S", 60.0)
    woke: list[str] = []

    def waiter(name: str) -> None:
        with store.watching(["gen"]) as sleep:
            while store.read("gen") is None:
                sleep(60.0)
        woke.append(name)

    threads = [threading.Thread(target=waiter, args=(name,), daemon=True) for name in ("main", "cutter")]
    for thread in threads:
        thread.start()
    put_later(store, "gen", 0.3).join()
    for thread in threads:
        thread.join(timeout=10)  # far less than the 60 s a waiter not woken would sleep
    assert sorted(woke) == ["cutter", "main"]


def test_a_waiter_without_the_stream_still_sees_the_put(
    store: EtcdStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream that cannot connect (etcd's watch endpoint gone): the waiter's re-reads find the key."""
    monkeypatch.setattr(etcd_watch, "REREAD_S", 0.2)
    store._puts = PutWatch("http://127.0.0.1:1/v3/watch", b"/nowhere/")
    writer = put_later(store, "late", 0.3)
    store.wait(["late"], timedelta(seconds=20))
    writer.join()


def test_a_wait_for_a_key_never_put_times_out_naming_it(store: EtcdStore) -> None:
    with pytest.raises(TimeoutError, match=r"keys \['never'\] not set within 0.3s"):
        store.wait(["never"], timedelta(seconds=0.3))
