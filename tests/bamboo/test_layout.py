"""Stage layout as data: cost-balanced partition, rank mapping, micro-batch checks."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from lightning_bamboo.layout.plan import (
    StageLayout,
    estimate_layer_costs,
    partition_by_cost,
    validate_microbatches,
)
from lightning_bamboo.layout.view import view_of


def brute_force_best(costs: list[float], num_stages: int) -> float:
    """Smallest largest-stage cost over every contiguous split into non-empty stages."""
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), num_stages - 1):
        bounds = [0, *cuts, len(costs)]
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


def check_partition(stages: list[range], num_layers: int, num_stages: int) -> None:
    assert len(stages) == num_stages
    assert all(len(stage) > 0 and stage.step == 1 for stage in stages)
    assert [i for stage in stages for i in stage] == list(range(num_layers))


@pytest.mark.parametrize("seed", range(40))
def test_partition_by_cost_is_optimal(seed):
    rng = random.Random(seed)
    num_layers = rng.randint(1, 8)
    num_stages = rng.randint(1, num_layers)
    costs = [rng.choice([0.0, 1.0, 2.0, 3.0, 5.0, 8.0, 13.0]) + rng.random() for _ in range(num_layers)]
    stages = partition_by_cost(costs, num_stages)
    check_partition(stages, num_layers, num_stages)
    worst = max(sum(costs[i] for i in stage) for stage in stages)
    assert worst == pytest.approx(brute_force_best(costs, num_stages))


def test_partition_by_cost_is_not_split_by_count():
    # Splitting 6 layers by count gives [0-2] (cost 6) and [3-5] (cost 3); cutting after layer 0 gives 5.
    assert partition_by_cost([4, 1, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 6)]
    # Every split that isolates the 10 costs 10; ties give the later stages the layers.
    assert partition_by_cost([10, 1, 1, 1, 1, 1, 1], 3) == [range(0, 1), range(1, 2), range(2, 7)]
    assert partition_by_cost([1, 2, 3], 3) == [range(0, 1), range(1, 2), range(2, 3)]


@pytest.mark.parametrize(
    ("costs", "num_stages", "message"),
    [
        (
            [1, 1, 1, 1],
            5,
            r"num_stages \(5\) is greater than the number of layers in the pipeline body \(4\)",
        ),
        ([], 1, "costs is empty: the pipeline body has no layers to partition"),
        ([1, -1], 1, "layer costs must be finite and >= 0, got -1.0 for layer 1"),
        ([1, float("nan")], 1, "layer costs must be finite and >= 0, got nan for layer 1"),
        ([1, float("inf")], 1, "layer costs must be finite and >= 0, got inf for layer 1"),
        ([1, 1], 0, "num_stages must be an integer >= 1, got 0"),
    ],
)
def test_partition_by_cost_rejects_bad_input(costs, num_stages, message):
    with pytest.raises(ValueError, match=message):
        partition_by_cost(costs, num_stages)


def test_estimate_layer_costs_without_input_counts_parameters():
    layers = [torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2, bias=False)]
    assert estimate_layer_costs(layers) == [4 * 3 + 3 + 1.0, 1.0, 3 * 2 + 1.0]


def test_estimate_layer_costs_times_layers_in_sequence():
    torch.manual_seed(0)
    # Shapes change from layer to layer, so this only runs if each layer is fed the previous layer's output.
    layers = [
        torch.nn.Linear(8, 768),
        torch.nn.Linear(768, 768),
        torch.nn.Identity(),
        torch.nn.Linear(768, 4),
    ]
    costs = estimate_layer_costs(layers, torch.randn(256, 8), repeats=3)
    assert len(costs) == 4
    assert all(c > 0 for c in costs)
    assert costs[1] > costs[2]  # a 768x768 matmul on 256 rows takes longer than returning the input


def test_estimate_layer_costs_rejects_bad_repeats():
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        estimate_layer_costs([torch.nn.Identity()], torch.zeros(1), repeats=0)


def test_stage_layout_rank_mapping():
    """Ranks come from the layout's generation-0 ownership data through the engine's view (one model)."""
    layout = StageLayout.plan([1.0, 1.0, 4.0, 1.0, 1.0, 1.0], world_size=6, num_stages=3)
    assert (layout.num_stages, layout.num_pipelines, layout.world_size, layout.num_layers) == (3, 2, 6, 6)
    grid = layout.generation_zero()
    assert grid == {0: {0: 0, 1: 1, 2: 2}, 1: {0: 3, 1: 4, 2: 5}}
    views = [view_of(grid, r, lambda m: m) for r in range(6)]
    assert [v.position for v in views] == [0, 1, 2, 0, 1, 2]
    assert [v.pipeline for v in views] == [0, 0, 0, 1, 1, 1]
    assert views[4].ranks == (3, 4, 5) and views[4].own_stages == (1,)
    assert [grid[p][1] for p in grid] == [1, 4]  # stage 1's group
    assert [layout.successor(s) for s in range(3)] == [1, 2, 0]
    assert [layout.predecessor(s) for s in range(3)] == [2, 0, 1]
    check_partition(list(layout.stage_layers), 6, 3)


def test_stage_layout_describe():
    layout = StageLayout(num_stages=2, num_pipelines=2, stage_layers=(range(0, 2), range(2, 4)))
    table = layout.describe(layer_names=["embed", "block0", "block1", "head"], costs=[1.0, 2.0, 3.0, 4.0])
    assert table.splitlines() == [
        "stage  ranks  layers               cost   replica-of",
        "0      0,2    0-1 (embed..block0)  30.0%  1",
        "1      1,3    2-3 (block1..head)   70.0%  0",
    ]
    assert "replica-of" in StageLayout(1, 1, (range(0, 1),)).describe()
    with pytest.raises(ValueError, match="costs has 2 entries, the layout has 4 layers"):
        layout.describe(costs=[1.0, 2.0])


@pytest.mark.parametrize(
    ("costs", "world_size", "num_stages", "message"),
    [
        ([1, 1, 1, 1], 6, 4, r"world_size \(6\) is not a multiple of num_stages \(4\)"),
        (
            [1, 1, 1, 1],
            5,
            5,
            r"num_stages \(5\) is greater than the number of layers in the pipeline body \(4\)",
        ),
        ([1, 1], 2, 0, "num_stages must be an integer >= 1, got 0"),
        ([1, 1], 0, 1, "world_size must be an integer >= 1, got 0"),
    ],
)
def test_stage_layout_plan_rejects_bad_values(costs, world_size, num_stages, message):
    with pytest.raises(ValueError, match=message):
        StageLayout.plan(costs, world_size, num_stages)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_stages": 2, "num_pipelines": 1, "stage_layers": (range(0, 2),)}, "stage_layers has 1 entries"),
        (
            {"num_stages": 2, "num_pipelines": 1, "stage_layers": (range(0, 2), range(3, 4))},
            "expected to start at layer 2",
        ),
        (
            {"num_stages": 1, "num_pipelines": 0, "stage_layers": (range(0, 2),)},
            "num_pipelines must be >= 1, got 0",
        ),
        ({"num_stages": 1, "num_pipelines": 1, "stage_layers": (range(0, 0),)}, "stage 0 has layers range"),
    ],
)
def test_stage_layout_rejects_bad_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StageLayout(**kwargs)


def test_stage_layout_rejects_out_of_range_lookups():
    layout = StageLayout(num_stages=2, num_pipelines=2, stage_layers=(range(0, 1), range(1, 2)))
    with pytest.raises(ValueError, match=r"stage 2 is outside 0..1"):
        layout.successor(2)
    with pytest.raises(KeyError, match=r"member 4 owns no stage"):
        view_of(layout.generation_zero(), 4, lambda m: m)


def test_validate_microbatches():
    assert validate_microbatches(8, 4) == 2
    assert validate_microbatches(5, 1) == 5
    with pytest.raises(
        ValueError, match=r"batch size \(10\) is not divisible by num_microbatches \(4\): 10 % 4 = 2"
    ):
        validate_microbatches(10, 4)
    with pytest.raises(ValueError, match="num_microbatches must be an integer >= 1, got 0"):
        validate_microbatches(8, 0)
