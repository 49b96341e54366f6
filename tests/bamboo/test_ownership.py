"""The ownership map of an elastic Bamboo job: failover, rejoin and fallback as pure functions, as grids."""

from __future__ import annotations

import pytest

from lightning_bamboo.control.supervisor import fallback_map
from lightning_bamboo.layout.ownership import FallbackNeeded, OwnershipMap, failover, initial, rejoin


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


def test_adjacent_losses_are_covered_by_a_peer_pipeline_or_drop_the_pipeline() -> None:
    """Two consecutive positions lost: no replica covers them, but pipeline 1 owns the same stages, so the
    survivor runs all three (their layers come peer to peer); when a stage it lost is lost in every pipeline,
    the pipeline is dropped; with one pipeline, the checkpoint."""
    two = initial(3, range(6))
    header, full = "gen 1  stage0  stage1  stage2", "pipe1  m3      m4      m5"
    assert grid(failover(two, [0, 1])) == f"{header}\npipe0  m2      m2      m2\n{full}"
    assert grid(failover(two, [1, 2])) == f"{header}\npipe0  m0      m0      m0\n{full}"
    # stage 1 is lost in both pipelines: pipeline 0 (stages 0-1 lost) has no holder of it, pipeline 1's
    # replica holder m3 covers it
    assert grid(failover(two, [0, 1, 4])) == (
        "gen 1  stage0  stage1  stage2\npipe1  m3      m3      m5\nspares m2")
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


def test_the_engines_view_is_a_function_of_the_map() -> None:
    """What the engine reads (``view_of``): positions, not stages, after a failover fuses two stages; the
    original stages each position runs; ranks in the generation's member order; one name, one meaning."""
    from lightning_bamboo.layout.plan import StageLayout
    from lightning_bamboo.layout.view import PipelineView, view_of

    owners = failover(initial(3, range(6)), [4])  # pipeline 1: m3 runs stages 0 and 1, m5 stage 2
    groups = {0: "pipe0", 1: "pipe1"}
    view = view_of(owners.pipelines, 3, owners.rank_of, groups, {0: "s0", 1: "s1", 2: "s2"})
    assert (view.position, view.num_positions, view.ranks, view.stages) == (0, 2, (3, 4), ((0, 1), (2,)))
    assert (view.own_stages, view.pipeline, view.num_pipelines) == ((0, 1), 1, 2)
    assert view.pipeline_group == "pipe1" and view.stage_groups[2] == "s2"
    assert (view.is_first, view.is_last, view.predecessor_rank, view.successor_rank) == (True, False, 4, 4)
    assert view.rank_of_position(1) == 4 and view.last_rank == 4
    assert owners.positions(1) == [(3, [0, 1]), (5, [2])]  # the map's own positions: the same function
    assert not hasattr(view, "num_stages") and not hasattr(view, "layout")  # no second meaning
    first = view_of(owners.pipelines, 0, owners.rank_of)
    assert (first.position, first.num_positions, first.pipeline) == (0, 3, 0)
    assert first.stages == ((0,), (1,), (2,))
    # a fixed layout's generation 0 (BambooGroups.create) is the same function of the same data
    layout = StageLayout.plan([1.0] * 6, world_size=6, num_stages=3)
    grid0 = layout.generation_zero()
    assert grid0 == initial(3, range(6)).pipelines
    assert view_of(grid0, 4, lambda m: m).ranks == (3, 4, 5)
    with pytest.raises(ValueError, match=r"position 2 of a pipeline with ranks \(0, 1\)"):
        PipelineView(position=2, ranks=(0, 1), stages=((0,), (1,)))
    with pytest.raises(KeyError, match="member 4 owns no stage"):
        view_of(owners.pipelines, 4, owners.rank_of)
