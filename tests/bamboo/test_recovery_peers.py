"""``recovery="peers"``: no replica, no redundant forwards; a lost stage is restored peer to peer from the
same stage of another data-parallel pipeline (``runtime/reshard.py`` takes each missing layer, with its
optimizer state, from the lowest member holding it), its pipeline's survivor runs it fused, and the step is
replayed.

Float64 ``WithDropout`` runs of ``scripts/train_elastic.py`` (dropout keyed by step, layer and global
micro-batch), a worker SIGKILLed in step 2's forward: the final parameters and Adam state equal the
uninterrupted run's (to rounding: a fused position sums in another order).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from tests.bamboo.test_elastic import TOL, launched, run_elastic
from tests.bamboo.test_keyed_rng import elastic_finals

PEERS = ("--variant", "dropout", "--recovery", "peers")


def _run(out: Path, nproc: int, stages: int, fault: str = "") -> tuple[dict[str, Tensor], str]:
    """``nproc / stages`` pipelines of 2 micro-batches each, the global batch 2 samples per micro-batch."""
    batch = ("--batch-size", str(2 * 2 * nproc // stages))
    log = run_elastic(out, nproc=nproc, stages=stages, fault=fault, extra_args=(*PEERS, *batch))
    return elastic_finals(out), log


def _assert_close(got: dict[str, Tensor], reference: dict[str, Tensor]) -> None:
    assert set(got) == set(reference)
    for key, value in reference.items():
        torch.testing.assert_close(got[key], value, **TOL, msg=lambda m, k=key: f"{k}: {m}")


@pytest.fixture(scope="module")
def three_stages_two_pipelines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tensor]:
    return _run(tmp_path_factory.mktemp("peers-3x2"), nproc=6, stages=3)[0]


@pytest.fixture(scope="module")
def two_stages_three_pipelines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tensor]:
    return _run(tmp_path_factory.mktemp("peers-2x3"), nproc=6, stages=2)[0]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(("lost", "grid"), [
    ("0", [[1, 1, 2], [3, 4, 5]]), ("1", [[0, 0, 2], [3, 4, 5]]), ("2", [[0, 1, 1], [3, 4, 5]]),
    ("0+1", [[2, 2, 2], [3, 4, 5]]),  # two adjacent positions: the survivor runs all three stages
], ids=["first", "middle", "last", "two-adjacent"])
def test_a_stage_lost_in_each_position_of_three_is_restored_from_the_peer_pipeline(
    tmp_path: Path, three_stages_two_pipelines: dict[str, Tensor], lost: str, grid: list[list[int]]
) -> None:
    """3 stages x 2 pipelines, no replica anywhere: member ``lost`` (stage ``lost`` of pipeline 0) dies; its
    layers and Adam state come from member ``lost + 3`` (the same stage of pipeline 1) to the neighbour that
    runs them fused, and that pipeline runs fewer of the global micro-batches (``microbatch_shares``). Two
    adjacent members lost together leave one survivor running the whole body. Equal to the uninterrupted
    run."""
    got, log = _run(tmp_path, nproc=6, stages=3, fault=f"{lost}:2:forward")
    record = launched(tmp_path)
    assert record.summary() == [("failover", [int(m) for m in lost.split("+")])], log[-3000:]
    assert record.grids() == [grid]
    _assert_close(got, three_stages_two_pipelines)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(("fault", "lost", "grid"), [
    ("2:2:forward", [2], [[0, 1], [3, 3], [4, 5]]),  # the first position of pipeline 1
    ("3:2:forward", [3], [[0, 1], [2, 2], [4, 5]]),  # the last position of pipeline 1
    ("1+4:2:forward", [1, 4], [[0, 0], [2, 3], [5, 5]]),  # two pipelines lose a worker at once
], ids=["first", "last", "two-pipelines-at-once"])
def test_losses_in_two_stages_by_three_pipelines_are_restored_from_peers(
    tmp_path: Path, two_stages_three_pipelines: dict[str, Tensor], fault: str, lost: list[int],
    grid: list[list[int]],
) -> None:
    """2 stages x 3 pipelines: a stage lost in each position, and two pipelines each losing a worker in the
    same step (every lost stage still has a holder in a third pipeline). Equal to the uninterrupted run."""
    got, log = _run(tmp_path, nproc=6, stages=2, fault=fault)
    record = launched(tmp_path)
    assert record.summary() == [("failover", lost)], log[-3000:]
    assert record.grids() == [grid]
    _assert_close(got, two_stages_three_pipelines)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_pipeline_that_lost_two_positions_is_rebalanced_over_its_survivors(
    tmp_path: Path, three_stages_two_pipelines: dict[str, Tensor]
) -> None:
    """4 stages x 2 pipelines: members 0 and 1 (stages 0 and 1 of pipeline 0) die together. Fusing would
    leave member 2 running stages 0-2 and member 3 stage 3 (3 + 1); the failover rebalances the pipeline
    over its survivors instead (2 + 2, Oobleck's templates at the grain of stages): member 2 takes stages 0-1
    from pipeline 1's members 4 and 5 and gives its own stage 2 to member 3, peer to peer. The same
    ``WithDropout`` body, global batch and keyed masks as the 3 x 2 run: equal to that uninterrupted run."""
    got, log = _run(tmp_path, nproc=8, stages=4, fault="0+1:2:forward")
    record = launched(tmp_path)
    assert record.summary() == [("failover", [0, 1])], log[-3000:]
    assert record.grids() == [[[2, 2, 3, 3], [4, 5, 6, 7]]]
    _assert_close(got, three_stages_two_pipelines)
