"""BatchNorm and other running buffers across pipelines, end to end (float64, ``WithBatchNorm``: BatchNorm1d
in and out of a residual block, BatchNorm2d, dropout; 2 stages x 2 pipelines x 2 micro-batches).

* ``batch_norm="broadcast"`` (DDP's rule): after every step both pipelines hold the same buffers, pipeline 0's
  (its micro-batches' updates), and the consolidated checkpoint holds them too.
* ``batch_norm="deferred"``: the running statistics are the global batch's (the first layer's after the
  first step equal ``strategy="auto"``'s on the whole batch: its input does not depend on how later layers
  normalize), equal across pipelines, and a stage lost under each recovery mode (rank 0 among them), a whole
  pipeline lost and a pipeline joining again all end equal to the uninterrupted run; the ``sync_dist=True``
  training loss logged after the failover of rank 0 is the uninterrupted run's.

Each launch carries several assertions; the supervisor's record says what happened to the job.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import Tensor

from lightning_bamboo import consolidate_checkpoint
from tests.bamboo.launch_record import NAME, Record, record_env
from tests.bamboo.test_elastic import SCRIPT, STEPS, TOL, launched, run_elastic
from tests.process import launch_env, run_process

BN = ("--variant", "batchnorm", "--record-buffers", "--validate", "3")
DEFERRED = (*BN, "--batch-norm", "deferred")
REJOIN = Path(__file__).parent / "scripts" / "train_rejoin.py"
REJOIN_STEPS = 7


def _buffers(out: Path, who: str, step: int) -> dict[str, Tensor]:
    return load_file(str(out / "buffers" / f"{who}_step{step}.safetensors"))


def _finals(out: Path) -> dict[str, dict[str, Tensor]]:
    """Every finished member's final file, by member."""
    finals = {p.stem.removeprefix("final_"): load_file(str(p)) for p in sorted(out.glob("final_member*"))}
    assert finals, f"no member finished: {sorted(p.name for p in out.iterdir())}"
    return finals


def _assert_each_equal(finals: dict[str, dict[str, Tensor]], reference: dict[str, dict[str, Tensor]]) -> None:
    """Every member's every tensor (parameters, optimizer state, buffers, logged losses) equals the same
    name's in the reference run (whichever member held it there); every reference name is covered."""
    merged = {k: v for state in reference.values() for k, v in state.items()}
    covered: set[str] = set()
    for member, state in finals.items():
        for key, value in state.items():
            torch.testing.assert_close(value, merged[key], **TOL,
                                       msg=lambda m, k=key, w=member: f"{w} {k}: {m}")
            covered.add(key)
    assert covered == set(merged), f"not covered: {sorted(set(merged) - covered)}"


def _assert_pipelines_agree(out: Path, steps: int) -> None:
    """Members 0 and 2 (stage 0 of each pipeline), 1 and 3 (stage 1): bit-equal buffers after every step."""
    for step in range(1, steps + 1):
        for a, b in ((0, 2), (1, 3)):
            x, y = _buffers(out, f"member{a}", step), _buffers(out, f"member{b}", step)
            x.pop("logged/train_loss", None), y.pop("logged/train_loss", None)
            assert x and set(x) == set(y)
            differ = [k for k in x if not torch.equal(x[k], y[k])]
            assert not differ, f"step {step}: members {a} and {b} differ in {differ}"


@pytest.fixture(scope="module")
def deferred(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted deferred run, 2 x 2."""
    out = tmp_path_factory.mktemp("deferred-2x2")
    run_elastic(out, nproc=4, stages=2, extra_args=DEFERRED)
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_broadcast_rule_one_model_across_pipelines_and_in_the_checkpoint(tmp_path: Path) -> None:
    """DDP's rule: every buffer bit-equal across the pipelines after every step, updated by pipeline 0's 2
    micro-batches per step, and the consolidated checkpoint's buffers are those. The BatchNorm warning counts
    the pipelines' split."""
    ckpt = tmp_path / "ckpt"
    log = run_elastic(tmp_path, nproc=4, stages=2, extra_args=(*BN, "--save-ckpt", str(ckpt)))
    assert "the global batch is split into 4 micro-batches (num_microbatches=2 x 2 pipelines)" in log
    _assert_pipelines_agree(tmp_path, STEPS)
    last = {**_buffers(tmp_path, "member0", STEPS), **_buffers(tmp_path, "member1", STEPS)}
    last.pop("logged/train_loss")
    assert int(last["pipeline.1.num_batches_tracked"]) == 2 * STEPS
    merged = consolidate_checkpoint(ckpt)
    for key, value in last.items():
        assert torch.equal(merged[key], value), key
    finals = _finals(tmp_path)
    val = [state["val_losses"] for state in finals.values()]
    assert all(torch.equal(v, val[0]) for v in val)  # every member logged the same validation
    for state in finals.values():  # a metric on full_forward's outputs in validation_step: the same model
        torch.testing.assert_close(state["val_full_mse"], state["val_losses"], rtol=1e-12, atol=0)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_deferred_statistics_are_the_global_batchs(tmp_path: Path, deferred: Path) -> None:
    """Equal across pipelines after every step, one update per step; after the first step the first
    BatchNorm's statistics equal one process's on the whole batch (``strategy="auto"``, same samples)."""
    _assert_pipelines_agree(deferred, STEPS)
    assert int(_buffers(deferred, "member0", STEPS)["pipeline.1.num_batches_tracked"]) == STEPS
    cmd = [sys.executable, str(SCRIPT), "--strategy", "auto", "--out", str(tmp_path), "--stages", "2",
           "--steps", str(STEPS), "--variant", "batchnorm", "--record-buffers"]  # the same samples per step
    run_process(cmd, timeout=300, env=launch_env())
    one = _buffers(tmp_path, "reference", 1)
    ours = _buffers(deferred, "member0", 1)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        key = f"pipeline.1.{name}"
        torch.testing.assert_close(ours[key], one[key], rtol=1e-12, atol=1e-14, msg=key)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(("recovery", "fault", "grid"), [
    ("replica", "0:4:forward", [[1, 1], [2, 3]]),  # rank 0 lost in training: its pipeline is one rank after
    ("replica+forward", "1:2:forward", [[0, 0], [2, 3]]),
    ("peers", "1:2:forward", [[0, 0], [2, 3]]),
], ids=["replica-rank0", "replica+forward", "peers"])
def test_a_stage_lost_keeps_the_uninterrupted_model(
    tmp_path: Path, deferred: Path, recovery: str, fault: str, grid: list[list[int]]
) -> None:
    """A worker of pipeline 0 SIGKILLed mid-step: parameters, optimizer state, buffers and the logged
    validation losses of every member equal the uninterrupted run's, and so does the ``sync_dist=True``
    training loss logged after every step (weighted by samples, not by the pipelines' rank counts)."""
    run_elastic(tmp_path, nproc=4, stages=2, fault=fault, extra_args=(*DEFERRED, "--recovery", recovery))
    record = launched(tmp_path)
    assert record.grids() == [grid]
    _assert_each_equal(_finals(tmp_path), _finals(deferred))
    for step in range(1, STEPS + 1):
        for member in (2, 3):  # the pipeline that kept both ranks
            who = f"member{member}"
            got, want = _buffers(tmp_path, who, step), _buffers(deferred, who, step)
            for key, value in want.items():
                torch.testing.assert_close(got[key], value, **TOL,
                                           msg=lambda m, k=key, s=step: f"step {s} {k}: {m}")


def _rejoin_run(out: Path, launch: tuple[str, ...] = (), script: tuple[str, ...] = (),
                fault: str = "") -> dict[str, dict[str, Tensor]]:
    cmd = [sys.executable, "-m", "lightning_bamboo.launch", "--nproc", "4", *launch]
    cmd += [str(REJOIN), "--out", str(out), "--stages", "2", "--steps", str(REJOIN_STEPS), "--batchnorm"]
    cmd += script
    run_process(cmd, timeout=400, env=record_env(out, fault))
    finals = _finals(out)
    assert all(int(state.pop("global_step")) == REJOIN_STEPS for state in finals.values())
    return finals


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_whole_pipeline_lost_and_joined_again_keeps_the_uninterrupted_statistics(tmp_path: Path) -> None:
    """Both members of pipeline 1 SIGKILLed in step 1 (pipeline 0 runs all 4 global micro-batches alone),
    two replacements form pipeline 1 again after step 4: the deferred running statistics (and everything
    else) equal the uninterrupted 2 x 2 run's, which no per-pipeline rule could give."""
    reference = _rejoin_run(tmp_path / "uninterrupted")
    got = _rejoin_run(tmp_path / "lost", ("--replace", "2"), ("--hold-at", "4"), fault="2+3:1:forward")
    record = Record.read(tmp_path / "lost" / NAME)
    assert record.history() == [("failover", [2, 3], []), ("rejoin", [], [4, 5])]
    assert any(k.startswith("own_buffer/") and "running_var" in k for s in got.values() for k in s)
    _assert_each_equal(got, reference)
