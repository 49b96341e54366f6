"""Sharded checkpoints: merge into a single-process model, resume exactly, never half-written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from lightning_bamboo import consolidate_checkpoint
from lightning_bamboo._lightning import private as _private
from lightning_bamboo.checkpoint import sharded as ckpt
from tests.bamboo.launch import run_script, snapshot
from tests.bamboo.pipe_mlp import PipeMLP


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_stage_checkpoint_merges_and_resumes(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    common = ["--strategy", "bamboo", "--devices", "2", "--stages", "2", "--optimizer", "adam"]
    callback_dir = tmp_path / "callback"
    run = [
        *common,
        "--out",
        str(tmp_path / "run"),
        "--save-ckpt",
        str(path),
        "--checkpoint-dir",
        str(callback_dir),
    ]
    resume = tmp_path / "resume"
    resumed = [*common, "--out", str(resume), "--resume", str(path), "--steps", "4", "--max-epochs", "2"]
    # one launch, two Trainers: train 3 steps and save; then a fresh model + strategy resumes from the files
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps({"save": run, "resume": resumed}))
    proc = run_script("train_pipe.py", ["--cases", str(cases)], timeout=300, nprocs=2)
    # ranks started by an outside launcher (run_ranks: LOCAL_RANK set, as torchrun does): the same runtime on
    # fixed ranks, which says once at start that surviving a lost worker needs Bamboo's launcher
    assert proc.stdout.count("a lost worker ends the job. Surviving it needs Bamboo's launcher") == 1, (
        proc.stdout[-3000:]
    )
    assert (path / ckpt.META_FILE).exists()
    assert not path.with_name(path.name + ".partial").exists()
    # ModelCheckpoint (paths broadcast without pickle): the 2 lowest train losses of 3 steps are kept, + last
    kept = sorted(p.name for p in callback_dir.iterdir())
    assert kept == ["epoch=0-step=2.ckpt", "epoch=0-step=3.ckpt", "last.ckpt"]

    # all stages merged load into the single-process module, equal to what the stages held
    model = PipeMLP()
    model.load_state_dict(consolidate_checkpoint(path))
    trained = {**snapshot(tmp_path / "run", 3, 0), **snapshot(tmp_path / "run", 3, 1)}
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), trained[f"own/{name}"], rtol=0, atol=0)

    # resuming restores every stage, its optimizer state AND its replica (with optimizer state) exactly
    for rank in range(2):
        saved, loaded = snapshot(tmp_path / "run", 3, rank), _load(resume / f"start_rank{rank}.safetensors")
        keys = {k for k in saved if k.startswith(("own", "replica"))}
        assert keys == set(loaded) and any(k.startswith("replica_opt/") for k in keys)
        for key in keys:
            torch.testing.assert_close(loaded[key], saved[key], rtol=0, atol=0, msg=key)
    # and training goes on with each replica equal to its successor stage
    after = [snapshot(resume, 4, rank) for rank in range(2)]
    for rank in range(2):
        successor = after[(rank + 1) % 2]
        for key, value in after[rank].items():
            if key.startswith("replica"):
                twin = "own" + key[len("replica") :]
                torch.testing.assert_close(value, successor[twin], rtol=0, atol=0, msg=key)


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def test_failed_save_leaves_previous_checkpoint_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One process, no process group: a crash while writing must not touch the checkpoint under the name."""
    model = PipeMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    checkpoint = _one_step_checkpoint(model, optimizer)
    path = tmp_path / "model.ckpt"
    ckpt.save_sharded(checkpoint, path, is_global_zero=True, barrier=lambda: None)
    before = consolidate_checkpoint(path)

    def crash(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save", crash)  # the shard write of the rank's tensors
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    with pytest.raises(CheckpointException, match="disk full"):
        ckpt.save_sharded({**checkpoint, "state_dict": model.state_dict()}, path, True, lambda: None)
    monkeypatch.undo()
    after = consolidate_checkpoint(path)
    assert before.keys() == after.keys()
    for key in before:
        torch.testing.assert_close(after[key], before[key], rtol=0, atol=0)
    meta = torch.load(path / ckpt.META_FILE, weights_only=True)
    assert meta["global_step"] == 1


def test_named_optimizer_state_round_trip() -> None:
    model = PipeMLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model.pipeline(torch.randn(2, 8, dtype=torch.float64)).sum().backward()
    optimizer.step()
    named = ckpt.named_optimizer_state(model, optimizer)
    assert set(named["state"]) == {n for n, _ in model.named_parameters()}
    fresh = torch.optim.Adam(model.parameters(), lr=0.5)
    ckpt.load_named_optimizer_state(model, fresh, named)
    assert fresh.param_groups[0]["lr"] == 0.1
    for p in model.parameters():
        torch.testing.assert_close(fresh.state[p]["exp_avg"], optimizer.state[p]["exp_avg"], rtol=0, atol=0)


def _one_step_checkpoint(model: PipeMLP, optimizer: torch.optim.Optimizer) -> dict:
    """One optimizer step of ``model``, then the checkpoint dict the strategy would save (one process)."""
    model.pipeline(torch.randn(2, 8, dtype=torch.float64)).sum().backward()
    optimizer.step()
    return {
        "state_dict": model.state_dict(),
        "optimizer_states": [ckpt.named_optimizer_state(model, optimizer)],
        "global_step": 1,
    }


def _saved(tmp_path: Path, model: PipeMLP) -> tuple[Path, torch.optim.Optimizer]:
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    path = tmp_path / "model.ckpt"
    ckpt.save_sharded(_one_step_checkpoint(model, optimizer), path, is_global_zero=True, barrier=lambda: None)
    return path, optimizer


def test_loading_never_unpickles_and_is_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shards are safetensors (headers are JSON) and meta.pt loads with weights_only=True: with every pickle
    entry point raising, the model and optimizer state come back bit-exact."""
    import pickle

    model = PipeMLP()
    path, optimizer = _saved(tmp_path, model)
    assert not (path / ".metadata").exists() and list(path.glob("*.safetensors"))

    def unpickle(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a checkpoint load unpickled something")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, unpickle)
    merged = consolidate_checkpoint(path)
    fresh = PipeMLP()
    loaded = ckpt.load_sharded(path, fresh, [torch.optim.Adam(fresh.parameters(), lr=0.5)])
    monkeypatch.undo()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(merged[key], value, rtol=0, atol=0)
        torch.testing.assert_close(loaded["state_dict"][key], value, rtol=0, atol=0)
    names = {id(p): n for n, p in model.named_parameters()}
    for p, values in optimizer.state.items():
        for key, value in values.items():
            torch.testing.assert_close(loaded["optimizer_states"][0]["state"][names[id(p)]][key], value)
    assert loaded["global_step"] == 1


def test_tied_weights_are_saved_once_per_name(tmp_path: Path) -> None:
    """safetensors refuses aliased tensors: a weight shared by two modules (tied embeddings) is still saved,
    under both names, equal."""
    model = PipeMLP()
    model.pipeline[2].weight = model.pipeline[0].weight  # two 8 x 8 layers share one weight
    path, _ = _saved(tmp_path, model)
    assert set(model.state_dict()) >= {"pipeline.0.weight", "pipeline.2.weight"}
    merged = consolidate_checkpoint(path)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(merged[key], value, rtol=0, atol=0)


def test_a_checkpoint_of_the_pickled_format_is_refused(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    old = tmp_path / "old.ckpt"
    _private.save_single_process({"model/w": torch.ones(2)}, dcp.FileSystemWriter(str(old)))
    with pytest.raises(ValueError, match=r"older format .* not loaded, since loading it would unpickle"):
        consolidate_checkpoint(old)
    with pytest.raises(FileNotFoundError, match="is not a BambooStrategy checkpoint directory"):
        consolidate_checkpoint(tmp_path)
