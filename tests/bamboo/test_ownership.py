"""The ownership map of an elastic Bamboo job: failover, rejoin and fallback as pure functions, as grids."""

from __future__ import annotations

import pytest

from lightning_bamboo.elastic.ownership import FallbackNeeded, OwnershipMap, failover, initial, rejoin
from lightning_bamboo.elastic.supervisor import fallback_map


def grid(owners: OwnershipMap) -> str:
    return owners.format()


def test_initial_fills_pipelines_in_order() -> None:
    assert grid(initial(2, range(5))) == (
        "gen 0  stage0  stage1\npipe0  m0      m1\npipe1  m2      m3\nspares m4"
    )


def test_failover_predecessor_runs_the_lost_stage_fused() -> None:
    assert grid(failover(initial(3, range(3)), [1])) == (
        "gen 1  stage0  stage1  stage2\npipe0  m0      m0      m2"
    )


def test_failover_last_stage_goes_to_its_replica_holder() -> None:
    owners = failover(initial(3, range(3)), [2])
    assert grid(owners) == "gen 1  stage0  stage1  stage2\npipe0  m0      m1      m1"
    assert owners.replica_stages_of(0) == [1, 2] and owners.replica_stages_of(1) == [0]


def test_failover_first_stage_keeps_runs_contiguous() -> None:
    # stage 0's replica is on the last position; the second position takes the stage (layers sent to it)
    assert (
        grid(failover(initial(3, range(3)), [0]))
        == "gen 1  stage0  stage1  stage2\npipe0  m1      m1      m2"
    )
    assert grid(failover(initial(2, range(2)), [0])) == "gen 1  stage0  stage1\npipe0  m1      m1"


def test_failover_in_one_pipeline_of_two_and_then_the_whole_pipeline() -> None:
    once = failover(initial(2, range(4)), [3])
    assert grid(once) == "gen 1  stage0  stage1\npipe0  m0      m1\npipe1  m2      m2"
    assert grid(failover(once, [2])) == "gen 2  stage0  stage1\npipe0  m0      m1"


def test_adjacent_losses_drop_the_pipeline_or_need_the_checkpoint() -> None:
    two = initial(3, range(6))
    assert (
        grid(failover(two, [0, 1])) == "gen 1  stage0  stage1  stage2\npipe1  m3      m4      m5\nspares m2"
    )
    with pytest.raises(FallbackNeeded, match=r"losing members \[0, 1\] leaves no pipeline"):
        failover(initial(3, range(3)), [0, 1])


def test_rejoin_splits_fused_stages_then_adds_pipelines() -> None:
    shortened = failover(initial(3, range(3)), [1])
    assert grid(rejoin(shortened, [7])) == "gen 2  stage0  stage1  stage2\npipe0  m0      m7      m2"
    assert grid(rejoin(shortened, [7, 8, 9, 10])) == (
        "gen 2  stage0  stage1  stage2\npipe0  m0      m7      m2\npipe1  m8      m9      m10"
    )

    # no more pipelines than the job's global micro-batches (each runs at least one): the rest wait as spares
    capped = rejoin(shortened, [7, 8, 9, 10], max_pipelines=1)
    assert capped.pipelines == {0: {0: 0, 1: 7, 2: 2}} and capped.spares == (8, 9, 10)


def test_fallback_map_with_fewer_members_than_stages() -> None:
    assert (
        grid(fallback_map(initial(3, range(3)), [2]))
        == "gen 1  stage0  stage1  stage2\npipe0  m2      m2      m2"
    )


def test_map_round_trips_and_rejects_split_runs() -> None:
    owners = rejoin(failover(initial(2, range(4)), [3]), [5])
    assert OwnershipMap.from_json(owners.to_json()) == owners
    with pytest.raises(ValueError, match="not adjacent"):
        OwnershipMap(0, 3, {0: {0: 1, 1: 2, 2: 1}})
