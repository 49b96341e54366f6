"""Issue 7's "bugs found by trying it": each case failed before its fix (2 processes, float64).

Each runs ``scripts/train_pipe.py`` under ``strategy="auto"`` (one process) and under Bamboo (2 stages), and
checks every parameter, optimizer state, buffer and replica after every step against the reference, as
``test_strategy.py`` does. The runs are batched with test_strategy.py's (``pipe_runs.py``); the refused
partial batch, which must fail its launch, runs on its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.bamboo.launch import run_script, snapshot
from tests.bamboo.pipe_runs import STEPS, bamboo_args
from tests.bamboo.test_strategy import assert_matches_reference

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.fixture
def matches(pipe_references: dict[str, Path], pipe_bamboo_2: dict[str, Path]):
    """Asserts that case ``name`` (pipe_runs.CASES) on 2 stages equals its single-process reference."""

    def check(name: str) -> None:
        assert_matches_reference(pipe_bamboo_2[name], pipe_references[name], 2, 1, True)

    return check


def test_accumulate_grad_batches(matches) -> None:
    """accumulate_grad_batches=2: Lightning scales the loss by 1/2; the pipeline's gradients must be too."""
    matches("accumulate")


def test_replica_takes_the_successors_hyperparameters(matches) -> None:
    """Per-layer learning rates (and a scheduler): the replica of stage 1 steps with stage 1's groups."""
    matches("per-layer-lr")


def test_param_group_of_the_head_by_index(matches) -> None:
    """``self.pipeline[-1]`` in configure_optimizers is the head on every stage (stage 0's own last layer
    trained with the head's learning rate before); Nesterov momentum on the replica too."""
    matches("head-lr")


def test_stage_output_with_strides(matches) -> None:
    """Stage 0's output is a column-major view (as x.transpose leaves it): its gradient's receive buffer
    was allocated with the same strides and gloo refused it ("input tensor has to be contiguous")."""
    matches("strided")


def test_parameter_without_gradient_is_not_stepped_on_the_replica(matches) -> None:
    """Adam with weight decay skips a parameter whose .grad is None; so must the replica's optimizer."""
    matches("unused")


def test_inplace_first_layer_of_the_successor(matches) -> None:
    """Stage 1 starts with LeakyReLU(inplace=True): FR must not write into stage 0's output being sent."""
    matches("inplace")


def test_random_augmentation_pairs_stage0_inputs_with_their_labels(matches) -> None:
    """The dataset draws noise per process: the last stage must use stage 0's batch, not its own."""
    matches("rank-noise")


def test_partial_last_batch_that_microbatches_divide(matches) -> None:
    """4 + 4 + 4 + 2 samples, 2 micro-batches: the short last batch splits evenly and trains exactly."""
    matches("partial-last-batch")


def test_partial_last_batch_is_refused_before_training(tmp_path: Path) -> None:
    """4 + 4 + 4 + 1 samples, 2 micro-batches: a clear error before the first step, not at the epoch's end."""
    with pytest.raises(AssertionError) as failure:
        args = bamboo_args(2, 1, "sgd", ["--extra-samples", "1"])
        run_script("train_pipe.py", ["--out", str(tmp_path / "bamboo"), *args], timeout=180, nprocs=2)
    message = str(failure.value)
    assert "drop_last=False leaves a last batch of 1 samples" in message.replace("\n", " "), message[-3000:]
    assert "num_microbatches (2)" in message
    assert not list((tmp_path / "bamboo").glob("step*_rank*.safetensors")), "a step ran before the error"


def test_buffers_and_frozen_parameters_reach_the_replica(pipe_bamboo_2: dict[str, Path]) -> None:
    """Each rank draws its own frozen parameter and buffers (no common seed): the replica must hold the
    successor's, before the first step and after every step (BatchNorm running stats included)."""
    run = pipe_bamboo_2["per-rank-state"]
    for step in range(1, STEPS + 1):
        ranks = [snapshot(run, step, rank) for rank in range(2)]
        for rank, got in enumerate(ranks):
            twin = ranks[(rank + 1) % 2]
            replica = [k for k in got if k.startswith("replica")]
            assert rank == 1 or any(k.startswith("replica_buf/") for k in replica)  # stage 1 has buffers
            for key in replica:
                torch.testing.assert_close(got[key], twin["own" + key[len("replica") :]], rtol=0, atol=0)
            fr = {k: v for k, v in got.items() if k.startswith("fr/")}
            for key, value in fr.items():  # so the replica's forwards are the successor's, bit for bit
                torch.testing.assert_close(value, twin["fwd/" + key[3:]], rtol=0, atol=0)
