"""The two-phase commit of a training step (``elastic.commit.StepCommit``), one thread per member over one
store.

No process group and no training: each member is a thread with its own connection to the job's store (an
in-process ``HashStore``, or the launcher's ``TCPStore`` through ``elastic.store.connect``), and a member is
lost between two store operations by a store that raises for it from then on (what everyone else sees of a
SIGKILL). The supervisor's side is the real ``Coordinator._reform`` where it matters. Every wait is
bounded: a member still waiting after ``TIMEOUT`` seconds fails the test (the generation is then bumped so
that the thread ends).
"""

from __future__ import annotations

import contextlib
import functools
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar

import pytest
import torch.distributed as dist

from lightning_bamboo.control.coordinator import Coordinator
from lightning_bamboo.layout.ownership import initial, rejoin
from lightning_bamboo.protocol import join as joining
from lightning_bamboo.protocol import store as ms
from lightning_bamboo.protocol.commit import ABORT, COMMIT, COMMIT_JOIN, StepCommit
from lightning_bamboo.protocol.etcd_store import EtcdStore
from tests.bamboo.served_store import ServedStore, serve_store

TIMEOUT = 20.0
"""Seconds a member (or a wait of the test) may take before the test fails instead of hanging."""

STEP = 5
T = TypeVar("T")


class MemberLost(Exception):
    """Raised by a lost member's store: the member does nothing more."""


@dataclass
class Lose:
    """Lose the member just ``when`` ("before"/"after") its first ``op`` on a key containing ``key``."""

    when: str
    op: str
    key: str


class MemberStore(dist.Store):
    """One member's connection to the job's store; the member is lost at ``lose``.

    ``decided`` collects what every ``compare_set`` on an outcome key returned (all of them, every member).
    """

    def __init__(self, base: dist.Store, lose: Lose | None = None, decided: list[str] | None = None) -> None:
        super().__init__()
        self._base = base
        self._lose = lose
        self._decided = decided
        self.lost = False

    def _do(self, op: str, key: str, call: Callable[[], T]) -> T:
        lose = self._lose
        when = lose.when if lose is not None and lose.op == op and lose.key in key else None
        if self.lost or when == "before":
            self.lost = True
            raise MemberLost(f"lost before {op} {key}")
        value = call()
        if when == "after":
            self.lost = True
            raise MemberLost(f"lost after {op} {key}")
        return value

    def set(self, key: str, value: str) -> None:  # type: ignore[override]
        self._do("set", key, lambda: self._base.set(key, value))

    def get(self, key: str) -> bytes:  # type: ignore[override]
        return self._do("get", key, lambda: self._base.get(key))

    def add(self, key: str, amount: int) -> int:  # type: ignore[override]
        return self._do("add", key, lambda: self._base.add(key, amount))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:  # type: ignore[override]
        value = self._do("compare_set", key, lambda: self._base.compare_set(key, expected, desired))
        if self._decided is not None and "/outcome/" in key:
            self._decided.append(value.decode())
        return value

    def check(self, keys: list[str]) -> bool:  # type: ignore[override]
        return self._do("check", ",".join(keys), lambda: self._base.check(keys))


class VotingMemberStore(MemberStore):
    """A member's connection to an etcd store: it prepares with a vote (lost as at the ``add`` it replaces)
    and sleeps on the store's watch between its reads."""

    def read(self, key: str) -> bytes | None:
        return self._do("check", key, lambda: self._base.read(key))

    def read_many(self, keys: list[str]) -> dict[str, bytes | None]:
        return self._do("check", ",".join(keys), lambda: self._base.read_many(keys))

    def vote(self, key: str, voter: str) -> int:
        return self._do("add", key, lambda: self._base.vote(key, voter))

    def vote_and_read(self, key: str, voter: str, reads: list[str]) -> tuple[int, dict[str, bytes | None]]:
        return self._do("add", key, lambda: self._base.vote_and_read(key, voter, reads))

    def watching(self, keys: list[str]) -> contextlib.AbstractContextManager[Callable[[float], bool]]:
        return self._base.watching(keys)


@dataclass
class Member:
    name: str
    thread: threading.Thread
    outcome: str | None = None
    error: BaseException | None = None
    lost: bool = False


@dataclass
class Job:
    """One job's store as its members and the test see it; ``connect(name)``: member ``name``'s connection."""

    connect: Callable[[str], dist.Store]
    store: dist.Store
    kind: str = "tcp"
    decided: list[str] = field(default_factory=list)
    connections: dict[str, dist.Store] = field(default_factory=dict)

    def member_store(self, name: str, lose: Lose | None = None) -> MemberStore:
        if name not in self.connections:
            self.connections[name] = self.connect(name)
        kind = VotingMemberStore if isinstance(self.connections[name], ms.RoundTripStore) else MemberStore
        return kind(self.connections[name], lose, self.decided)

    def prepare(
        self,
        name: str,
        generation: int,
        size: int,
        lose: Lose | None = None,
        step: int = STEP,
        claim_join: Callable[[dist.Store, int], bool] | None = None,
    ) -> Member:
        """A member preparing ``step`` in its own thread (``claim_join(store, step)``: as the strategy's)."""
        store = self.member_store(name, lose)
        claim = None if claim_join is None else (lambda s: claim_join(store, s))
        return start(name, lambda: StepCommit(store, generation, size).prepare_and_wait(step, claim))

    def bump(self, generation: int) -> None:
        """What the supervisor's publication of the next generation looks like to the members."""
        self.store.set("gen", str(generation + 1))

    def outcome(self, generation: int, step: int = STEP) -> str:
        return ms.get_str(self.store, f"g{generation}/outcome/{step}")

    def prepared(self, generation: int, step: int = STEP) -> int:
        key = f"g{generation}/prep/{step}"
        if isinstance(self.store, EtcdStore):  # one key per vote
            return len(self.store._client.get_prefix(self.store._key(key + "/")))
        return int(self.store.add(key, 0))


def start(name: str, call: Callable[[], str]) -> Member:
    member = Member(name, threading.Thread(target=lambda: None))

    def body() -> None:
        try:
            member.outcome = call()
        except MemberLost:
            member.lost = True
        except BaseException as err:  # reported by finish()
            member.error = err

    member.thread = threading.Thread(target=body, name=f"member-{name}", daemon=True)
    member.thread.start()
    return member


def finish(job: Job, members: list[Member], release_generation: int) -> dict[str, str | None]:
    """Join the members (bounded); their outcomes by name, ``None`` for a lost one."""
    deadline = time.monotonic() + TIMEOUT
    for member in members:
        member.thread.join(max(deadline - time.monotonic(), 0.0))
    waiting = [m.name for m in members if m.thread.is_alive()]
    if waiting:
        job.bump(release_generation + 100)  # let them end: they abort on a generation change
        pytest.fail(f"members {waiting} still waiting for the step's outcome after {TIMEOUT}s")
    for member in members:
        if member.error is not None:
            raise AssertionError(f"member {member.name} raised") from member.error
    return {m.name: None if m.lost else m.outcome for m in members}


def wait_until(what: str, predicate: Callable[[], bool]) -> None:
    """Poll ``predicate`` until it holds; fail the test (never hang) after ``TIMEOUT`` seconds."""
    deadline = time.monotonic() + TIMEOUT
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {TIMEOUT}s")
        time.sleep(0.001)


@pytest.fixture(scope="module")
def tcp_clients() -> Iterator[Callable[[str], dist.Store]]:
    """A ``TCPStore`` served here, and one client per member name (``elastic.store.connect``) kept for the
    module, as a worker keeps one for its life: on this machine every ~25th connection to a ``TCPStore``
    waits 5 s in torch's connect back-off, so connecting anew for every test and round would be slow."""
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=TIMEOUT)
    )
    url = f"tcp://127.0.0.1:{server.port}"
    clients: dict[str, dist.Store] = {}

    def client(name: str) -> dist.Store:
        if name not in clients:
            clients[name] = ms.connect(url, "commit-tests", timeout=TIMEOUT)
        return clients[name]

    yield client
    clients.clear()  # then the server goes with this frame


@pytest.fixture(params=["hash", "tcp", pytest.param("etcd", marks=pytest.mark.services)])
def job(request: pytest.FixtureRequest, tcp_clients: Callable[[str], dist.Store]) -> Job:
    """Generation 0 of a job, in a ``HashStore``, in a ``TCPStore`` served here (one client per member), or in
    an etcd server (``scripts/services.sh``'s; one ``EtcdStore`` per member: votes and watches)."""
    if request.param == "hash":
        shared = dist.HashStore()
        shared.set("gen", "0")
        return Job(lambda name: shared, shared, "hash")
    if request.param == "etcd":
        endpoint = request.getfixturevalue("etcd_endpoint")
        job_name = f"commit-{uuid.uuid4().hex[:8]}"
        client = ms.connect(f"etcd://{endpoint}", job_name, timeout=TIMEOUT)
        client.set("gen", "0")
        return Job(lambda name: ms.connect(f"etcd://{endpoint}", job_name, timeout=TIMEOUT), client, "etcd")
    prefix = f"job-{uuid.uuid4().hex[:8]}"  # the module's clients, a job of this test's own
    client = dist.PrefixStore(prefix, tcp_clients("test"))
    client.set("gen", "0")
    return Job(lambda name: dist.PrefixStore(prefix, tcp_clients(name)), client)


# ---------------------------------------------------------------------------------------------- commit
@pytest.mark.parametrize("size", [1, 2, 4])
def test_every_member_prepared_all_read_commit(job: Job, size: int) -> None:
    members = [job.prepare(str(i), 0, size) for i in range(size)]
    assert finish(job, members, 0) == {str(i): COMMIT for i in range(size)}
    assert job.outcome(0) == COMMIT and job.prepared(0) == size
    assert job.decided == [COMMIT]  # decided once, by the last to prepare


def test_steps_and_generations_have_their_own_outcome(job: Job) -> None:
    """Step 6 of generation 0 and step 5 of generation 1 are new decisions, not step 5's of generation 0."""
    for generation, step in [(0, 5), (0, 6), (1, 5)]:
        job.store.set("gen", str(generation))
        members = [job.prepare(str(i), generation, 2, step=step) for i in range(2)]
        assert finish(job, members, generation) == {"0": COMMIT, "1": COMMIT}
    assert job.decided == [COMMIT] * 3


# ---------------------------------------------------------------------------------------------- abort
def test_generation_ends_before_all_prepared_all_abort(job: Job) -> None:
    """Three of four prepared, the supervisor publishes the next generation: the three read ``abort``; the
    fourth, preparing late in the old generation, completes the count but cannot overturn it."""
    early = [job.prepare(str(i), 0, 4) for i in range(3)]
    wait_until("three members prepared", lambda: job.prepared(0) == 3)
    job.bump(0)
    assert finish(job, early, 0) == {"0": ABORT, "1": ABORT, "2": ABORT}
    late = job.prepare("3", 0, 4)
    assert finish(job, [late], 0) == {"3": ABORT}
    assert job.prepared(0) == 4 and job.outcome(0) == ABORT
    assert set(job.decided) == {ABORT}  # nobody committed, not even the one completing the count


def test_member_that_failed_decides_abort_nobody_commits(job: Job) -> None:
    """A member whose step raised (a lost peer) decides ``abort`` once the generation ended (the strategy's
    ``commit.decide(step, ABORT)``); every other member reads it."""
    waiting = [job.prepare(str(i), 0, 3) for i in range(2)]
    wait_until("two members prepared", lambda: job.prepared(0) == 2)
    job.bump(0)
    assert StepCommit(job.member_store("2"), 0, 3).decide(STEP, ABORT) == ABORT
    assert finish(job, waiting, 0) == {"0": ABORT, "1": ABORT}
    assert set(job.decided) == {ABORT}


def test_replay_on_next_generation_commits(job: Job) -> None:
    """An aborted step is replayed on the next generation, under keys of its own."""
    waiting = job.prepare("0", 0, 2)
    wait_until("member 0 prepared", lambda: job.prepared(0) == 1)
    job.bump(0)
    assert finish(job, [waiting], 0) == {"0": ABORT}
    replay = [job.prepare(str(i), 1, 2) for i in range(2)]
    assert finish(job, replay, 1) == {"0": COMMIT, "1": COMMIT}
    assert job.outcome(0) == ABORT and job.outcome(1) == COMMIT


# ---------------------------------------------------------------------------------------------- a member lost
def test_lost_before_prepare_survivors_abort(job: Job) -> None:
    lost = job.prepare("lost", 0, 3, lose=Lose("before", "add", "/prep/"))
    survivors = [job.prepare(str(i), 0, 3) for i in range(2)]
    wait_until("the survivors prepared", lambda: job.prepared(0) == 2)
    lost.thread.join(TIMEOUT)
    job.bump(0)  # the supervisor saw the loss
    assert finish(job, [lost, *survivors], 0) == {"lost": None, "0": ABORT, "1": ABORT}
    assert job.outcome(0) == ABORT


def test_lost_after_prepare_survivors_roll_forward(job: Job) -> None:
    """Prepared means its gradients are in its replica holder: the step commits without it, and the
    supervisor's publication afterwards does not change the outcome."""
    lost = job.prepare("lost", 0, 3, lose=Lose("after", "add", "/prep/"))
    assert finish(job, [lost], 0) == {"lost": None}
    survivors = [job.prepare(str(i), 0, 3) for i in range(2)]
    assert finish(job, survivors, 0) == {"0": COMMIT, "1": COMMIT}
    job.bump(0)
    # a survivor whose step raised afterwards asks to abort: the commit holds, it rolls forward
    assert StepCommit(job.member_store("0"), 0, 3).decide(STEP, ABORT) == COMMIT


def test_last_to_prepare_lost_before_deciding_survivors_abort(job: Job) -> None:
    """Everyone prepared but the member completing the count died before writing ``commit``: nobody wrote an
    outcome, so the survivors abort when the generation ends (and replay the step)."""
    survivors = [job.prepare(str(i), 0, 3) for i in range(2)]
    wait_until("the survivors prepared", lambda: job.prepared(0) == 2)
    lost = job.prepare("lost", 0, 3, lose=Lose("after", "add", "/prep/"))
    lost.thread.join(TIMEOUT)
    assert job.prepared(0) == 3
    job.bump(0)
    assert finish(job, [lost, *survivors], 0) == {"lost": None, "0": ABORT, "1": ABORT}


def test_lost_after_reading_the_outcome_survivors_commit(job: Job) -> None:
    """The last to prepare decides ``commit`` and is lost: waiting members read ``commit`` even when the
    generation ends before they look."""
    survivors = [job.prepare(str(i), 0, 3) for i in range(2)]
    wait_until("the survivors prepared", lambda: job.prepared(0) == 2)
    lost = job.prepare("lost", 0, 3, lose=Lose("after", "compare_set", "/outcome/"))
    lost.thread.join(TIMEOUT)
    job.bump(0)
    assert finish(job, [lost, *survivors], 0) == {"lost": None, "0": COMMIT, "1": COMMIT}


# ---------------------------------------------------------------------------------------------- join claims
def propose_join(job: Job, generation: int) -> None:
    joining.propose(job.store, generation, initial(2, range(4)))


def test_join_claimed_by_the_committing_member(job: Job) -> None:
    propose_join(job, 0)
    claims: list[int] = []

    def claim(store: dist.Store, step: int) -> bool:
        claims.append(step)
        return joining.claim(store, 0, step)

    members = [job.prepare(str(i), 0, 2, claim_join=claim) for i in range(2)]
    assert finish(job, members, 0) == {"0": COMMIT_JOIN, "1": COMMIT_JOIN}
    assert claims == [STEP]  # only the member completing the count claims
    assert joining.adopted_step(job.store, 0) == STEP


def test_join_after_a_failover_was_decided_is_a_plain_commit(job: Job) -> None:
    propose_join(job, 0)
    assert joining.close(job.store, 0) is None  # the supervisor decided a failover first
    members = [job.prepare(str(i), 0, 2, claim_join=claim_in_generation_0) for i in range(2)]
    assert finish(job, members, 0) == {"0": COMMIT, "1": COMMIT}
    assert joining.adopted_step(job.store, 0) is None


@dataclass
class Decider:
    """The launcher's decision side (a ``Coordinator``) over the job's store, served here."""

    coordinator: Coordinator
    served: ServedStore

    def job(self) -> Job:
        return Job(lambda name: self.served.client(timeout=TIMEOUT), self.coordinator.store)


@pytest.fixture
def decider() -> Iterator[Decider]:
    """The launcher's decision side (its store, ``_reform``) over generation 0 = members 0 and 1 in one
    pipeline of two stages, with members 2 and 3 proposed to join as a second pipeline; no worker starts."""
    served = serve_store()
    sup = Coordinator(served.client(), log=lambda *args, **kwargs: None)
    sup.store.set("gen", "0")
    current = initial(2, range(2))
    sup._publish(current, "initial")
    proposal = rejoin(current, [2, 3])
    joining.propose(sup.store, 0, proposal)
    sup._proposal = (0, proposal, time.monotonic())
    yield Decider(sup, served)


def claim_in_generation_0(store: dist.Store, step: int) -> bool:
    return joining.claim(store, 0, step)


def test_claimer_lost_before_deciding_the_supervisor_drops_the_join(decider: Decider) -> None:
    """The member completing the count claims the join and dies before writing ``commit+join``: the members
    abort the step, so the supervisor must not publish the joined layout as adopted after it."""
    job, supervisor = decider.job(), decider.coordinator
    survivor = job.prepare("0", 0, 2, claim_join=claim_in_generation_0)
    wait_until("member 0 prepared", lambda: job.prepared(0) == 1)
    lost = job.prepare(
        "1", 0, 2, lose=Lose("after", "compare_set", "/next"), claim_join=claim_in_generation_0
    )
    lost.thread.join(TIMEOUT)
    assert joining.adopted_step(job.store, 0) == STEP
    assert supervisor._reform({1}, [])
    assert finish(job, [lost, survivor], 0) == {"1": None, "0": ABORT}
    assert [e["kind"] for e in supervisor.events] == ["failover"]  # not "rejoin" after an aborted step
    new = ms.read_map(job.store, ms.current_generation(job.store))
    assert new.generation == 1 and new.members() == [0]


def test_loss_after_a_committed_join_applies_to_the_joined_layout(decider: Decider) -> None:
    """The members read ``commit+join``, then one is lost: the supervisor publishes the joined layout
    (adopted after the step) and the failover from it."""
    job, supervisor = decider.job(), decider.coordinator
    members = [job.prepare(str(i), 0, 2, claim_join=claim_in_generation_0) for i in range(2)]
    assert finish(job, members, 0) == {"0": COMMIT_JOIN, "1": COMMIT_JOIN}
    assert supervisor._reform({1}, [])
    assert [e["kind"] for e in supervisor.events] == ["rejoin", "failover"]
    new = ms.read_map(job.store, ms.current_generation(job.store))
    assert new.generation == 2 and 1 not in new.members() and {2, 3} <= set(new.members())


# ---------------------------------------------------------------------------------------------- races
def prepared(job: Job, generation: int, count: int) -> bool:
    return job.prepared(generation) == count


def race_last_prepare_with_abort(job: Job, generation: int, delay: float) -> list[Member]:
    """The last member prepares while the supervisor publishes the next generation and asks to abort the
    step; both are released together, and the one with a negative/positive ``delay`` sleeps that long."""
    go = threading.Barrier(2, timeout=TIMEOUT)

    def last() -> str:
        store = job.member_store("last")
        go.wait()
        time.sleep(max(delay, 0.0))
        return StepCommit(store, generation, 4).prepare_and_wait(STEP)

    def supervisor() -> str:
        store = job.member_store("supervisor")
        go.wait()
        time.sleep(max(-delay, 0.0))
        job.bump(generation)
        return StepCommit(store, generation, 4).decide(STEP, ABORT)

    return [start("last", last), start("abort", supervisor)]


def test_one_outcome_when_the_generation_ends_during_the_last_prepare(job: Job) -> None:
    """A member lost after preparing; the last member prepares while the supervisor publishes the next
    generation and a member asks to abort. Whatever wins, every member reads the same outcome, it was
    decided once, and it is ``commit`` only if every member prepared."""
    rng = random.Random(17)
    rounds = 200 if job.kind == "hash" else 100
    seen: list[str] = []
    for generation in range(rounds):
        job.store.set("gen", str(generation))
        job.decided.clear()
        lost = job.prepare("lost", generation, 4, lose=Lose("after", "add", "/prep/"))
        waiting = [job.prepare(str(i), generation, 4) for i in range(2)]
        wait_until("three members prepared", functools.partial(prepared, job, generation, 3))
        racers = race_last_prepare_with_abort(job, generation, rng.uniform(-0.0005, 0.0005))
        outcomes = finish(job, [lost, *waiting, *racers], generation)
        stored = job.outcome(generation)
        assert outcomes == {"lost": None, "0": stored, "1": stored, "last": stored, "abort": stored}
        assert set(job.decided) == {stored}, f"round {generation}: decisions {job.decided}"
        assert stored == ABORT or job.prepared(generation) == 4
        seen.append(stored)
    assert len(seen) == rounds


def test_join_claim_and_failover_agree_when_they_race(job: Job) -> None:
    """The member completing the count claims the join, then stalls (descheduled) before writing
    ``commit+join``, while the supervisor decides a failover. Either the step committed with the join and
    the supervisor applies the failover to the joined layout, or it aborted and the supervisor drops the
    join: ``joining.close`` and the members agree, every round."""
    rng = random.Random(18)
    rounds = 60 if job.kind == "hash" else 30
    for generation in range(rounds):
        job.store.set("gen", str(generation))
        job.decided.clear()
        propose_join(job, generation)
        stall = rng.uniform(0.0, 0.03)

        def claim(store: dist.Store, step: int, g: int = generation, stall: float = stall) -> bool:
            claimed = joining.claim(store, g, step)
            time.sleep(stall)
            return claimed

        waiting = job.prepare("0", generation, 2, claim_join=claim)
        wait_until("member 0 prepared", functools.partial(prepared, job, generation, 1))
        adopted: list[int | None] = []

        def supervisor(g: int = generation, adopted: list[int | None] = adopted) -> str:
            adopted.append(joining.close(job.member_store("supervisor"), g))
            job.bump(g)
            return "published"

        last = job.prepare("1", generation, 2, claim_join=claim)
        sup = start("supervisor", supervisor)
        outcomes = finish(job, [waiting, last, sup], generation)
        stored = job.outcome(generation)
        assert outcomes == {"0": stored, "1": stored, "supervisor": "published"}
        assert set(job.decided) == {stored}
        assert (adopted == [STEP]) == (stored == COMMIT_JOIN), f"round {generation}: {adopted} {stored}"
        assert stored in (COMMIT, COMMIT_JOIN, ABORT)


def test_store_barrier_meets_and_names_what_is_missing() -> None:
    store = dist.HashStore()
    threads = [threading.Thread(target=ms.store_barrier, args=(store, "meet", 3, 20.0)) for _ in range(2)]
    for thread in threads:
        thread.start()
    ms.store_barrier(store, "meet", 3, 20.0)
    for thread in threads:
        thread.join(timeout=20)
        assert not thread.is_alive()
    with pytest.raises(TimeoutError, match=r"Bamboo: 1 of 2 workers reached 'alone' within timeout=0s"):
        ms.store_barrier(store, "alone", 2, timeout=0.05)
