"""The commit by all-reduce across machines (:mod:`lightning_bamboo.runtime.collective_commit`): a step cut by
a loss is settled from what the survivors applied, the first outcome written holds, and a member's prepare
commits through one all-reduce, or hands a step with a join proposal to the store's commit. The commit on
etcd is exercised end to end, with a member killed after the all-reduce, in
``test_elastic.py::test_failover_through_etcd``."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from lightning_bamboo.layout.ownership import OwnershipMap, failover, initial
from lightning_bamboo.protocol import crash
from lightning_bamboo.protocol import join as joining
from lightning_bamboo.protocol import store as ms
from lightning_bamboo.protocol.commit import ABORT, COMMIT, decide, outcome_key
from lightning_bamboo.runtime.collective_commit import CollectiveCommit, report_applied, settle

MEMBERS = [0, 1, 2, 3]  # 2 stages x 2 pipelines, generation 0


def publish(store: dist.Store, owners: OwnershipMap) -> None:
    store.set(f"gen{owners.generation}/map", owners.to_json())
    store.set("gen", str(owners.generation))


@pytest.fixture
def store() -> dist.Store:
    """Generation 0 of four members, and generation 1 after member 1 was lost."""
    hashed = dist.HashStore()
    zero = initial(2, MEMBERS)
    publish(hashed, zero)
    publish(hashed, failover(zero, [1]))
    return hashed


def test_a_step_a_survivor_applied_commits(store: dist.Store) -> None:
    """Member 2 completed the all-reduce of step 5 and applied it (6 steps); the others did not: the step is
    rolled forward everywhere."""
    for member, steps in ((0, 5), (2, 6), (3, 5)):
        report_applied(store, 0, member, steps)
    assert settle(store, 0, MEMBERS, 5, wait_s=5.0) == COMMIT
    assert ms.get_str(store, outcome_key(0, 5)) == COMMIT


def test_a_step_no_survivor_applied_aborts_even_if_the_lost_member_did(store: dist.Store) -> None:
    """The lost member 1 may have applied step 5 before it died: no survivor did, so it is aborted (its
    stages come back from a replica or peer at step 5's start) and replayed."""
    for member in (0, 2, 3):
        report_applied(store, 0, member, 5)
    report_applied(store, 0, 1, 6)  # what a lost member wrote is not read: it is not in the job
    assert settle(store, 0, MEMBERS, 5, wait_s=5.0) == ABORT


def test_settling_waits_for_every_survivors_report(store: dist.Store) -> None:
    """Member 3 reports late that it applied the step (it was still on its way to the next step's error):
    the settlement waits for it instead of aborting a step a survivor applied."""
    for member in (0, 2):
        report_applied(store, 0, member, 5)
    late = threading.Timer(0.3, report_applied, (store, 0, 3, 6))
    late.start()
    began = time.monotonic()
    assert settle(store, 0, MEMBERS, 5, wait_s=10.0) == COMMIT
    assert time.monotonic() - began >= 0.25
    late.join()


def test_the_first_outcome_written_holds(store: dist.Store) -> None:
    """Rank 0's background record of ``commit`` (it applied the step, then was lost) came first: a survivor
    that would propose ``abort`` follows it (every member had prepared, so rolling forward is valid)."""
    assert decide(store, 0, 5, COMMIT) == COMMIT
    for member in (0, 2, 3):
        report_applied(store, 0, member, 5)
    assert settle(store, 0, MEMBERS, 5, wait_s=5.0) == COMMIT


def test_a_member_lost_while_settling_is_not_waited_for(store: dist.Store) -> None:
    """Member 3 is lost before it reports: generation 2 drops it, and the settlement decides with 0 and 2."""
    for member in (0, 2):
        report_applied(store, 0, member, 5)
    later = failover(ms.read_map(store, 1), [3])
    threading.Timer(0.2, publish, (store, later)).start()
    assert settle(store, 0, MEMBERS, 5, wait_s=10.0) == ABORT


def test_a_member_whose_error_stopped_the_job_is_not_waited_for(store: dist.Store) -> None:
    for member in (0, 2):
        report_applied(store, 0, member, 5)
    crash.record(store, 3, RuntimeError("a bug in training_step"))
    began = time.monotonic()
    assert settle(store, 0, MEMBERS, 5, wait_s=10.0) == ABORT
    assert time.monotonic() - began < 5.0


def test_a_silent_survivor_is_named_and_the_others_decide(
    store: dist.Store, caplog: pytest.LogCaptureFixture
) -> None:
    for member in (0, 2):
        report_applied(store, 0, member, 6)
    with caplog.at_level(logging.WARNING):
        assert settle(store, 0, MEMBERS, 5, wait_s=0.2) == COMMIT
    assert "without the reports of members [3]" in caplog.text


@contextlib.contextmanager
def one_process_group() -> Iterator[dist.Store]:
    """A gloo world of this process alone (the all-reduce's arithmetic; its cut is tested end to end)."""
    hashed = dist.HashStore()
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", hashed), rank=0, world_size=1)
    try:
        yield hashed
    finally:
        dist.destroy_process_group()


def test_a_prepared_step_commits_and_rank_zero_records_it() -> None:
    with one_process_group() as store:
        commit = CollectiveCommit(store, lambda: store, lambda: torch.device("cpu"))
        assert commit.prepare_and_wait(0, 7, rank=0) == COMMIT
        deadline = time.monotonic() + 10
        while not store.check([outcome_key(0, 7)]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ms.get_str(store, outcome_key(0, 7)) == COMMIT
        commit.close()


def test_close_writes_every_pending_record_and_ends_the_recorder() -> None:
    """The steps committed just before ``fit`` ends are in the timeline once ``close`` returns, and the
    recorder thread is gone (it does not linger into the user's code after ``fit``)."""
    with one_process_group() as store:
        commit = CollectiveCommit(store, lambda: store, lambda: torch.device("cpu"))
        for step in range(20):
            assert commit.prepare_and_wait(0, step, rank=0) == COMMIT
        commit.close()
        assert all(ms.get_str(store, outcome_key(0, step)) == COMMIT for step in range(20))
        assert "bamboo-commit-record" not in [thread.name for thread in threading.enumerate()]


def test_a_join_proposal_hands_the_step_to_the_stores_commit() -> None:
    """A member that saw generation 0's join proposal makes the all-reduce say so: the step is not
    committed here (the store's commit claims the join), and nothing is recorded for it."""
    with one_process_group() as store:
        commit = CollectiveCommit(store, lambda: store, lambda: torch.device("cpu"))
        joining.propose(store, 0, initial(2, MEMBERS))
        assert commit.prepare_and_wait(0, 3, rank=0) is None
        assert not store.check([outcome_key(0, 3)])
        assert commit.prepare_and_wait(1, 3, rank=1) == COMMIT  # generation 1 has no proposal
        commit.close()
