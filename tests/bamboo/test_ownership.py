"""The ownership map of an elastic Bamboo job: failover, rejoin and fallback as pure functions, as grids."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from lightning_bamboo.layout.ownership import (
    FallbackNeeded,
    OwnershipMap,
    failover,
    fallback,
    initial,
    rebalanced,
    rejoin,
)


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


def test_a_pipeline_that_lost_two_positions_is_rebalanced_over_its_survivors() -> None:
    """Oobleck's templates at the grain of stages: 4 stages whose first two positions are lost run 2 + 2 on
    the survivors (fusing would give 3 + 1); 6 stages that lost three run 2 + 2 + 2 (fusing: 4 + 1 + 1)."""
    four = failover(initial(4, range(8)), [0, 1], replicas=False)
    assert [four.pipelines[0][s] for s in range(4)] == [2, 2, 3, 3]
    assert four.shapes() == [(2, 2), (4, 1)]
    six = failover(initial(6, range(12)), [1, 2, 3], replicas=False)
    assert [six.pipelines[0][s] for s in range(6)] == [0, 0, 4, 4, 5, 5]


def test_a_fused_pipeline_already_as_short_as_it_can_be_is_left_as_fused() -> None:
    """One loss in a pipeline of one stage per member: fusing already gives the shortest widest position, so
    the replica holder's promotion stands (no layer moves); the same for two non-adjacent losses."""
    assert [failover(initial(4, range(4)), [1]).pipelines[0][s] for s in range(4)] == [0, 0, 2, 3]
    assert [failover(initial(4, range(4)), [1, 3]).pipelines[0][s] for s in range(4)] == [0, 0, 2, 2]


def test_rebalancing_keeps_the_most_stages_in_place() -> None:
    """5 stages on 2 survivors (at most 3 each): 3 + 2 keeps four stages where they are, 2 + 3 three."""
    assert rebalanced({0: 7, 1: 7, 2: 7, 3: 7, 4: 9}) == {0: 7, 1: 7, 2: 7, 3: 9, 4: 9}


def test_rebalancing_is_the_best_cut_of_every_small_pipeline() -> None:
    """Against every cut, on random pipelines: the runs keep the members' order, none is wider than
    ``ceil(stages / members)`` (or the map was that already and is unchanged), and no cut of that width
    keeps more stages in place."""
    rng = random.Random(0)
    for _ in range(300):
        stages = rng.randint(2, 9)
        members = rng.randint(1, stages)
        sizes = [1] * members
        for _ in range(stages - members):
            sizes[rng.randrange(members)] += 1
        ids = rng.sample(range(20), members)
        owners = {s: m for s, m in enumerate(m for m, n in zip(ids, sizes) for _ in range(n))}
        width = math.ceil(stages / members)
        got = rebalanced(owners)
        if max(sizes) <= width:
            assert got == owners
            continue
        runs = [list(g) for _, g in itertools.groupby(got[s] for s in range(stages))]
        assert [r[0] for r in runs] == ids and max(map(len, runs)) <= width
        best = 0
        for cuts in itertools.combinations(range(1, stages), members - 1):
            bounds = [0, *cuts, stages]
            if max(b - a for a, b in itertools.pairwise(bounds)) > width:
                continue
            best = max(best, sum(owners[s] == ids[i] for i, (a, b) in enumerate(itertools.pairwise(bounds))
                                 for s in range(a, b)))
        assert sum(got[s] == owners[s] for s in range(stages)) == best, owners


def test_rejoin_splits_fused_stages_then_adds_pipelines() -> None:
    shortened = failover(initial(3, range(3)), [1])
    assert grid(rejoin(shortened, [7])) == "gen 2  stage0  stage1  stage2\npipe0  m0      m7      m2"
    assert grid(rejoin(shortened, [7, 8, 9, 10])) == (
        "gen 2  stage0  stage1  stage2\npipe0  m0      m7      m2\npipe1  m8      m9      m10"
    )

    # no more pipelines than the job's global micro-batches (each runs at least one): the rest wait as spares
    capped = rejoin(shortened, [7, 8, 9, 10], max_pipelines=1)
    assert capped.pipelines == {0: {0: 0, 1: 7, 2: 2}} and capped.spares == (8, 9, 10)


def test_fallback_with_fewer_members_than_stages() -> None:
    assert (
        grid(fallback(initial(3, range(3)), [2]))
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
