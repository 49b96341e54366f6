"""BambooStrategy end to end: real multi-process runs checked against single-process training.

Each case runs ``scripts/train_pipe.py`` twice: once with ``strategy="auto"`` on one process (the same
``PipeMLP`` class, the union of the pipelines' batches per step) and once with ``strategy="bamboo"``. After
every step, EVERY parameter and optimizer state of every stage, and of every replica, must equal the
reference; so must the returned and the logged loss. The runs are batched (``pipe_runs.py``: all references
in one process, all 2-process runs in one launch, all 4-process ones in another), each case checked here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.bamboo.launch import snapshot
from tests.bamboo.module_writes import assert_no_writes
from tests.bamboo.pipe_runs import STEPS, bamboo_args, run_batch

# float64 model: the only differences are summation orders (micro-batches, all-reduce)
TOL = {"rtol": 1e-10, "atol": 1e-12}


def _close(actual: torch.Tensor, expected: torch.Tensor, where: str) -> None:
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda message: f"{where}: {message}")


def assert_matches_reference(run: Path, ref: Path, stages: int, pipelines: int, redundancy: bool) -> None:
    world = stages * pipelines
    for step in range(1, STEPS + 1):
        expected = snapshot(ref, step, 0)
        covered: set[str] = set()
        pipeline_losses = []
        for rank in range(world):
            got = snapshot(run, step, rank)
            own = [k for k in got if k.startswith("own")]
            replica = [k for k in got if k.startswith("replica")]
            assert own, f"rank {rank} wrote no parameters"
            assert bool(replica) == redundancy, f"rank {rank}: replica present={bool(replica)}"
            for key in own:
                _close(got[key], expected[key], f"step {step} rank {rank} {key}")
                covered.add(key)
            for key in replica:  # the replica of stage s+1 equals stage s+1 of the reference
                _close(got[key], expected["own" + key[len("replica") :]], f"step {step} rank {rank} {key}")
            # the logged loss relates to the returned one as in the reference (both / accumulate_grad_batches)
            torch.testing.assert_close(got["logged"] / got["loss"], expected["logged"] / expected["loss"])
            lrs = [k for k in got if k.startswith("lr/")]
            assert lrs, f"rank {rank} wrote no learning rates"
            for key in lrs:  # every parameter's learning rate (per-layer param groups, schedulers)
                torch.testing.assert_close(got[key], expected[key])
            if rank % stages == 0:
                pipeline_losses.append(got["loss"])
            else:  # every stage of a pipeline reports the pipeline's loss
                torch.testing.assert_close(got["loss"], pipeline_losses[-1])
        if redundancy:  # eager forward redundancy: rank s's FR outputs are exactly stage s+1's F outputs
            for rank in range(world):
                fr = {k: v for k, v in snapshot(run, step, rank).items() if k.startswith("fr/")}
                successor = (rank // stages) * stages + (rank % stages + 1) % stages
                fwd = {k: v for k, v in snapshot(run, step, successor).items() if k.startswith("fwd/")}
                assert len(fr) == len(fwd) > 0
                for mb in range(len(fr)):
                    torch.testing.assert_close(fr[f"fr/{mb}"], fwd[f"fwd/{mb}"], rtol=0, atol=0)
        # every parameter of the model lives on some stage
        assert covered == {k for k in expected if k.startswith("own")}
        # equal-size pipeline batches: the mean of the pipeline means is the reference's batch mean
        torch.testing.assert_close(torch.stack(pipeline_losses).mean(0), expected["loss"], **TOL)


CASES = [  # name in pipe_runs.CASES, stages, pipelines, redundancy
    pytest.param("2stages-redundant-sgd", 2, 1, True, id="2stages-redundant-sgd"),
    pytest.param("2stages-plain-adam", 2, 1, False, id="2stages-plain-adam"),
    pytest.param("4stages-redundant-adam", 4, 1, True, id="4stages-redundant-adam"),
    pytest.param("4stages-plain-sgd", 4, 1, False, id="4stages-plain-sgd"),
    pytest.param("2stages-x-2pipelines-redundant-adam", 2, 2, True, id="2stages-x-2pipelines-redundant-adam"),
]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(("case", "stages", "pipelines", "redundancy"), CASES)
def test_bamboo_matches_single_process(
    request: pytest.FixtureRequest, pipe_references: dict[str, Path], case: str, stages: int, pipelines: int,
    redundancy: bool,
) -> None:
    runs = request.getfixturevalue(f"pipe_bamboo_{stages * pipelines}")
    assert_matches_reference(runs[case], pipe_references[case], stages, pipelines, redundancy)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_global_norm_clipping_cpu_replica_and_validation(
    pipe_references: dict[str, Path], pipe_bamboo_2: dict[str, Path]
) -> None:
    """Clipping by the norm over all stages; replica in host memory; validation loss from the last stage."""
    ref, run = pipe_references["clip-cpu-replica-validate"], pipe_bamboo_2["clip-cpu-replica-validate"]
    assert_matches_reference(run, ref, 2, 1, True)
    expected = json.loads((ref / "validate.json").read_text())[0]["val_loss"]
    got = json.loads((run / "validate.json").read_text())[0]["val_loss"]
    assert got == pytest.approx(expected, rel=1e-10)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_no_step_writes_into_the_users_module(pipe_bamboo_2: dict[str, Path]) -> None:
    """The strategy's seam is installed once at setup: from train start to train end (every training and
    validation batch, replayed steps included) the module's body is one object and its ``__dict__`` holds the
    same names, on every rank of every case (validation, accumulation, a replica in host memory, ties)."""
    for case, run in pipe_bamboo_2.items():
        for rank in range(2):
            seen = json.loads((run / f"module_rank{rank}.json").read_text())
            assert [hook for hook, *_ in seen].count("on_train_batch_end") >= STEPS, (case, rank)
            body, names = assert_no_writes(seen, f"{case} rank {rank}")
            after, after_body = json.loads((run / f"module_after_fit_rank{rank}.json").read_text())
            assert set(names) - set(after) == {"pipeline_inputs", "pipeline_loss"}, (case, rank)
            assert set(after) <= set(names) and after_body == body, (case, rank)  # the body keeps the stage


@pytest.mark.multiprocess
@pytest.mark.slow
def test_bf16_mixed_precision(pipe_references: dict[str, Path], pipe_bamboo_2: dict[str, Path]) -> None:
    """Autocast around every stage forward: close to single-process bf16-mixed, replicas still bit-exact."""
    ref, run = pipe_references["bf16-mixed"], pipe_bamboo_2["bf16-mixed"]
    for step in range(1, STEPS + 1):
        expected = snapshot(ref, step, 0)
        ranks = [snapshot(run, step, rank) for rank in range(2)]
        for rank, got in enumerate(ranks):
            # bf16 rounds per micro-batch here and per batch in the reference
            torch.testing.assert_close(got["loss"], expected["loss"], rtol=1e-4, atol=1e-6)
            for key in (k for k in got if k.startswith("own")):
                torch.testing.assert_close(got[key], expected[key], rtol=0.05, atol=5e-3)
            for key in (k for k in got if k.startswith("replica")):
                twin = ranks[(rank + 1) % 2]["own" + key[len("replica") :]]
                torch.testing.assert_close(got[key], twin, rtol=0, atol=0)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_forward_redundancy_switched_off_and_on_trains_exactly_as_always_on(tmp_path: Path) -> None:
    """``set_forward_redundancy`` (what AdvisorProbe alternates to measure the step without redundancy):
    2 ranks, float64, Adam; FR off at steps 2 and 4, on at 1 and 3, against FR on at every step, in one
    launch. Every parameter, optimizer state, replica (still stepped and exchanged) and loss is bit-equal;
    FR steps produce the successor's forwards exactly, the others none."""
    steps = 4
    base = [*bamboo_args(2, 1, "adam", []), "--steps", str(steps)]  # the later --steps wins
    runs = run_batch(tmp_path, {"always": base, "alternating": [*base, "--fr-off-steps", "2", "4"]},
                     timeout=300, nprocs=2)
    for step in range(1, steps + 1):
        for rank in range(2):
            always = snapshot(runs["always"], step, rank)
            alternating = snapshot(runs["alternating"], step, rank)
            state = sorted(k for k in always if not k.startswith("fr/"))
            assert any(k.startswith("replica/") for k in state)
            assert any(k.startswith("own_opt/") for k in state)
            assert sorted(k for k in alternating if not k.startswith("fr/")) == state
            for key in state:
                torch.testing.assert_close(alternating[key], always[key], rtol=0, atol=0,
                                           msg=lambda m, s=step, r=rank, k=key: f"step {s} rank {r} {k}: {m}")
            fr = {k: v for k, v in alternating.items() if k.startswith("fr/")}
            if step % 2 == 0:
                assert not fr, f"step {step} rank {rank} ran FR with it switched off"
            else:
                successor = snapshot(runs["alternating"], step, (rank + 1) % 2)
                assert len(fr) == 2
                for mb in range(2):
                    torch.testing.assert_close(fr[f"fr/{mb}"], successor[f"fwd/{mb}"], rtol=0, atol=0)
