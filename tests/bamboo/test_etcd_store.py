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

from lightning_bamboo.protocol import etcd_watch
from lightning_bamboo.protocol import store as ms
from lightning_bamboo.protocol.etcd_store import EtcdStore
from lightning_bamboo.protocol.etcd_watch import PutWatch

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


class CountedRequests:
    """Counts the etcd requests ``store`` sends: single reads and transactions."""

    def __init__(self, store: EtcdStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.gets = self.txns = 0
        client = store._client
        get, transaction = client.get, client.transaction

        def counted_get(*args, **kwargs):
            self.gets += 1
            return get(*args, **kwargs)

        def counted_transaction(*args, **kwargs):
            self.txns += 1
            return transaction(*args, **kwargs)

        monkeypatch.setattr(client, "get", counted_get)
        monkeypatch.setattr(client, "transaction", counted_transaction)


def test_a_tick_reads_what_the_last_one_read_in_one_request(
    store: EtcdStore, etcd_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent's tick reads a dozen keys: after the first tick, each tick fetches them in one transaction,
    at the tick's start (another process's write before it is seen), absent keys included."""
    other = EtcdStore(*etcd_endpoint.split(":"), prefix=store._prefix)  # type: ignore[arg-type]
    for key in ("a", "b"):
        store.set(key, f"{key}0")
    counted = CountedRequests(store, monkeypatch)

    def one_tick() -> tuple:
        with ms.one_pass(store):
            return store.read("a"), ms.read_if_set(store, "b"), store.check(["c"]), store.add("n", 0)

    assert one_tick() == (b"a0", b"b0", False, 0)
    assert (counted.gets, counted.txns) == (4, 0)
    other.set("b", "b1")
    other.set("c", "c1")
    other.add("n", 5)
    assert one_tick() == (b"a0", b"b1", True, 5)
    assert (counted.gets, counted.txns) == (4, 1)


def test_a_tick_reads_live_after_its_first_read_and_after_its_own_write(
    store: EtcdStore, etcd_endpoint: str
) -> None:
    """Within a tick, only the first read of a key is the prefetched one: a loop waiting in the tick for a
    change sees it, and a key the tick writes (set, add, compare_set, delete) reads as written."""
    other = EtcdStore(*etcd_endpoint.split(":"), prefix=store._prefix)  # type: ignore[arg-type]
    for key in ("a", "b", "c", "d", "e"):
        store.set(key, "0")
    with ms.one_pass(store):
        for key in ("a", "b", "c", "d", "e"):
            store.read(key)
    with ms.one_pass(store):
        assert store.read("a") == b"0"
        other.set("a", "1")
        assert store.read("a") == b"1"
        store.set("b", "2")
        assert store.read("b") == b"2"
        assert store.add("c", 3) == 3
        assert store.read("c") == b"3"
        store.compare_set("d", "0", "4")
        assert store.read("d") == b"4"
        store.delete_key("e")
        assert store.read("e") is None


def test_a_tick_serves_only_the_thread_that_opened_it(store: EtcdStore, etcd_endpoint: str) -> None:
    """The agent's other threads (its lease renewals) share the store object: they read live."""
    other = EtcdStore(*etcd_endpoint.split(":"), prefix=store._prefix)  # type: ignore[arg-type]
    store.set("a", "0")
    with ms.one_pass(store):
        store.read("a")
    with ms.one_pass(store):
        other.set("a", "1")
        seen: list[bytes | None] = []
        thread = threading.Thread(target=lambda: seen.append(store.read("a")))
        thread.start()
        thread.join()
        assert seen == [b"1"]
        assert store.read("a") == b"0"  # this thread's prefetch, taken when the tick began


def test_read_many_reads_more_keys_than_one_transaction_takes(store: EtcdStore) -> None:
    keys = [f"k{i}" for i in range(250)]
    for i, key in enumerate(keys[::2]):
        store.set(key, str(i))
    values = store.read_many(keys)
    assert values == {key: (str(i // 2).encode() if i % 2 == 0 else None) for i, key in enumerate(keys)}


def test_a_vote_reads_the_keys_it_is_given_in_its_transaction(store: EtcdStore) -> None:
    store.set("outcome", "commit")
    assert store.vote_and_read("prep/1", "m0", ["outcome", "gen"]) == (1, {"outcome": b"commit", "gen": None})
    assert store.vote_and_read("prep/1", "m1", []) == (2, {})


def test_the_boundary_reads_the_generation_only_after_a_put_of_it(
    store: EtcdStore, etcd_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member asks at every step boundary whether a newer generation exists: it reads ``gen`` once, then
    not again until the watch reports a put of it (or the re-read interval passed), and a put is seen."""
    other = EtcdStore(*etcd_endpoint.split(":"), prefix=store._prefix)  # type: ignore[arg-type]
    store.set("gen", "3")
    generations = ms.GenerationWatch(store)
    counted = CountedRequests(store, monkeypatch)
    try:
        assert not generations.newer_than(3)
        assert not generations.newer_than(3)
        assert counted.gets == 1  # the second look read nothing
        other.set("gen", "4")
        deadline = time.monotonic() + etcd_watch.REREAD_S + 1.0
        while not generations.newer_than(3):
            assert time.monotonic() < deadline, "the put of gen was never seen"
            time.sleep(0.01)
        assert counted.gets <= 3  # read after the put, not at every look
    finally:
        generations.close()
    local = dist.HashStore()
    local.set("gen", "1")
    assert ms.GenerationWatch(local).newer_than(0)  # a local store is read every time


def test_the_committing_member_asks_for_a_join_only_when_one_is_proposed(store: EtcdStore) -> None:
    """The vote reads the join proposal's key: while it is absent the member that commits does not look for a
    proposal (a round trip every member's outcome waited for); once it is there, it does."""
    from lightning_bamboo.protocol.commit import COMMIT, COMMIT_JOIN, StepCommit

    asked: list[int] = []

    def claim(step: int) -> bool:
        asked.append(step)
        return True

    commit = StepCommit(store, 0, 1)
    assert commit.prepare_and_wait(1, claim, proposal_key="gen0/join") == COMMIT
    store.set("gen0/join", "{}")
    assert commit.prepare_and_wait(2, claim, proposal_key="gen0/join") == COMMIT_JOIN
    assert asked == [2]
    assert commit.prepare_and_wait(3, claim) == COMMIT_JOIN  # no key given: asked every time
    assert asked == [2, 3]


def test_settling_a_cut_step_sleeps_on_the_watch_and_reads_once_per_wake(store: EtcdStore) -> None:
    """A member settling a step a loss cut (:func:`~lightning_bamboo.runtime.collective_commit.settle`) waits
    for a survivor's late report on the watch stream, one read of every key per wake: polling every member's
    key every 10 ms would be a burst of requests on etcd at the moment the failover needs it."""
    from lightning_bamboo.layout.ownership import failover, initial
    from lightning_bamboo.protocol.commit import COMMIT
    from lightning_bamboo.runtime.collective_commit import report_applied, settle

    zero = initial(2, [0, 1, 2, 3])
    for owners in (zero, failover(zero, [1])):
        store.set(f"gen{owners.generation}/map", owners.to_json())
        store.set("gen", str(owners.generation))
    report_applied(store, 0, 0, 5)
    report_applied(store, 0, 2, 5)
    reads = []
    read_many = store.read_many
    store.read_many = lambda keys: reads.append(keys) or read_many(keys)  # type: ignore[method-assign]
    late = threading.Timer(0.5, report_applied, (store, 0, 3, 6))  # member 3 applied the step
    late.start()
    began = time.monotonic()
    assert settle(store, 0, [0, 1, 2, 3], 5, wait_s=20.0) == COMMIT
    assert time.monotonic() - began >= 0.45
    assert 2 <= len(reads) <= 4, len(reads)
    late.join()


def test_waiting_for_a_peers_key_sleeps_on_the_watch_and_reads_once_per_wake(store: EtcdStore) -> None:
    """Forming waits for keys its peers write (:func:`~lightning_bamboo.protocol.store.wait_for_key`): on etcd
    it sleeps on the watch of the key and the generation, one read of both per wake, and ends at the
    key's put, or at a later generation's (the peer was lost)."""
    store.set("gen", "3")
    reads = []
    read_many = store.read_many
    store.read_many = lambda keys: reads.append(keys) or read_many(keys)  # type: ignore[method-assign]
    late = threading.Timer(0.5, store.set, ("g3/holds/1", "[2]"))
    late.start()
    began = time.monotonic()
    assert ms.wait_for_key(store, "g3/holds/1", 3) == b"[2]"
    assert time.monotonic() - began >= 0.45
    assert 2 <= len(reads) <= 4, len(reads)
    late.join()
    superseding = threading.Timer(0.3, store.set, ("gen", "4"))
    superseding.start()
    with pytest.raises(ms.GenerationSuperseded, match="generation 3 was superseded while waiting for 'g3/h"):
        ms.wait_for_key(store, "g3/holds/2", 3)
    superseding.join()


def test_a_read_on_a_dropped_connection_is_sent_once_more(
    store: EtcdStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd closing a kept-alive connection while the client idled fails the next request without an answer;
    a read (``read``, ``read_many``: they change nothing) is sent once more, a second failure is raised."""
    import etcd3gw.exceptions

    store.set("dropped", "1")
    client = store._client
    real_post = client.post
    failures = [0]

    def drops_once(*args: object, **kwargs: object) -> object:
        failures[0] += 1
        if failures[0] == 1:
            raise etcd3gw.exceptions.ConnectionFailedError("Remote end closed connection without response")
        return real_post(*args, **kwargs)

    monkeypatch.setattr(client, "post", drops_once)  # every request of the client goes through post
    assert store.read("dropped") == b"1" and failures[0] == 2
    failures[0] = 0
    assert store.read_many(["dropped", "absent"]) == {"dropped": b"1", "absent": None} and failures[0] == 2

    def always(*args: object, **kwargs: object) -> object:
        raise etcd3gw.exceptions.ConnectionFailedError("down")

    monkeypatch.setattr(client, "post", always)
    with pytest.raises(etcd3gw.exceptions.ConnectionFailedError):
        store.read("dropped")
