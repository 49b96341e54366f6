"""``trainer.predict`` through the pipeline, the full-forward helper for callbacks, and the refusal of a
stage's partial forward outside the pipeline.

The multi-process tests run ``scripts/predict_pipe.py`` (``TinyLM``, float64: train 2 steps, generate 4
tokens greedily in a callback, then predict 12 samples) under ``strategy="auto"`` and under Bamboo with 2
stages, and 2 stages x 2 pipelines; every rank's predictions and generated sample must equal auto's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_bamboo._lightning.seam import StageBody
from lightning_bamboo.contract import pipeline_execution, sub_sequential
from lightning_bamboo.pipeline.microbatch import join_microbatches, split_microbatches
from tests.bamboo.launch import run_script
from tests.bamboo.tiny_lm import TinyLM, make_tokens

TOL = {"rtol": 1e-10, "atol": 1e-12}
GUARD = (
    r"TinyLM.pipeline holds only this process's stage of the pipeline body under BambooStrategy \(layers "
    r"{layers} of 6\); calling it outside the pipeline schedule \(directly or through the module's forward\) "
    r"would run part of the model. To run the whole body from a callback call "
    r"trainer.strategy.full_forward\(inputs\) on every rank of the pipeline"
)


def _run(out: Path, strategy: str, stages: int, pipelines: int) -> Path:
    args = ["--out", str(out), "--strategy", strategy, "--stages", str(stages), "--pipelines", str(pipelines)]
    nprocs = stages * pipelines if strategy == "bamboo" else None
    run_script("predict_pipe.py", args, timeout=420, nprocs=nprocs)
    return out


@pytest.fixture(scope="module")
def predict_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("predict")
    return {
        "auto-p1": _run(root / "auto-p1", "auto", 1, 1),
        "auto-p2": _run(root / "auto-p2", "auto", 1, 2),
        "bamboo-2": _run(root / "bamboo-2", "bamboo", 2, 1),
        "bamboo-2x2": _run(root / "bamboo-2x2", "bamboo", 2, 2),
    }


def _check_against_auto(run: Path, ref: Path, stages: int, pipelines: int) -> None:
    expected = load_file(str(ref / "predict_rank0.safetensors"))
    assert expected["ids"].tolist() == list(range(12))
    sample = load_file(str(ref / "sample_rank0.safetensors"))
    assert json.loads((ref / "sample_rank0.json").read_text()) == {"pipeline": None, "forward": None}
    for rank in range(stages * pipelines):
        got = load_file(str(run / f"predict_rank{rank}.safetensors"))
        pipeline = rank // stages
        # each pipeline predicts its shard (Lightning's unrepeated sampler: samples p, p + P, ...), and
        # every stage of the pipeline returns the same predictions
        assert got["ids"].tolist() == list(range(pipeline, 12, pipelines)), f"rank {rank}"
        torch.testing.assert_close(got["logits"], expected["logits"][got["ids"]], **TOL)
        generated = load_file(str(run / f"sample_rank{rank}.safetensors"))
        assert generated["tokens"].tolist() == sample["tokens"].tolist(), f"rank {rank}"
        torch.testing.assert_close(generated["logits"], sample["logits"], **TOL)
        errors = json.loads((run / f"sample_rank{rank}.json").read_text())
        layers = "0-2" if rank % stages == 0 else "3-5"
        for call in ("pipeline", "forward"):
            assert errors[call] is not None, f"rank {rank}: pl_module {call} ran one stage silently"
            assert re.match(GUARD.format(layers=layers), errors[call]), errors[call]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_predict_and_generation_match_auto_2_stages(predict_runs: dict[str, Path]) -> None:
    _check_against_auto(predict_runs["bamboo-2"], predict_runs["auto-p1"], stages=2, pipelines=1)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_predict_and_generation_match_auto_2_stages_x_2_pipelines(predict_runs: dict[str, Path]) -> None:
    _check_against_auto(predict_runs["bamboo-2x2"], predict_runs["auto-p2"], stages=2, pipelines=2)


# ---------------------------------------------------------------------------------------- single process
def test_guarded_stage_runs_only_inside_the_engine() -> None:
    model = TinyLM()
    stage = sub_sequential(model.pipeline, range(0, 3))
    ids = make_tokens(2)[0]
    hidden = stage(ids)  # standalone (benchmarks, tests): not guarded
    stage.outside_call_error = "use full_forward"
    with pytest.raises(RuntimeError, match="use full_forward"):
        stage(ids)
    with pytest.raises(RuntimeError, match="use full_forward"):
        stage[0:2](ids)  # a slice of the stage is never run by the engine either
    with pipeline_execution(stage):
        torch.testing.assert_close(stage(ids), hidden)
    with pytest.raises(RuntimeError, match="use full_forward"):
        stage(ids)


def test_predict_replay_gives_outputs_for_the_batch_input_only() -> None:
    model = TinyLM()
    body = model.pipeline
    seam = StageBody("TinyLM", "pipeline", dict(enumerate(body)), len(body))
    seam.attach(model)
    ids, targets, index = make_tokens(4)
    batch = (ids, targets, index)
    outputs = torch.randn(4, 5, 16, dtype=torch.float64)
    with seam.predicting(model.pipeline_inputs(batch), outputs):
        assert model.predict_step(batch, 0) is outputs
        assert model.predict_step((ids.clone(), targets, index), 0) is outputs  # equal values
        assert list(model.parameters()) == list(body.parameters())
        with pytest.raises(ValueError, match=r"TinyLM.predict_step called the pipeline body on something "
                           r"other than pipeline_inputs\(batch\)"):
            model(ids[:2])
    assert model.pipeline is seam
    torch.testing.assert_close(model(ids), body(ids))  # outside the replay: the layers' own forward


def test_join_is_the_inverse_of_split() -> None:
    batch = {"x": torch.arange(12).reshape(6, 2), "pair": (torch.arange(6), torch.ones(6, 3))}
    joined = join_microbatches(split_microbatches(batch, 3))
    assert torch.equal(joined["x"], batch["x"]) and torch.equal(joined["pair"][1], batch["pair"][1])
    with pytest.raises(ValueError, match="scalars"):
        join_microbatches([torch.tensor(1.0), torch.tensor(2.0)])


def test_full_forward_off_bamboo_runs_the_body() -> None:
    from lightning.pytorch import Trainer

    from lightning_bamboo.strategy import full_forward

    model = TinyLM()
    model.trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    ids = make_tokens(2)[0]
    out = full_forward(model, ids)
    assert not out.requires_grad
    torch.testing.assert_close(out, model.pipeline(ids))
