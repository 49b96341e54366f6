"""Checkpoints that travel between ``strategy="auto"`` and Bamboo: auto -> Bamboo -> auto, exact (float64)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_bamboo import consolidate_checkpoint
from lightning_bamboo.checkpoint import sharded as ckpt
from tests.bamboo.launch import run_script, snapshot
from tests.bamboo.pipe_mlp import PipeMLP
from tests.bamboo.pipe_variants import Tied

ADAM = ["--optimizer", "adam"]


def _positional_by_name(state: dict, names: list[str]) -> dict[str, torch.Tensor]:
    """``own_opt/<name>/<key>`` of a whole-model ``Optimizer.state_dict()`` (one group, module order)."""
    return {f"own_opt/{names[i]}/{k}": v for i, values in state["state"].items() for k, v in values.items()}


def _assert_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], prefix: str) -> None:
    keys = {k for k in expected if k.startswith(prefix)}
    assert keys and keys == {k for k in actual if k.startswith(prefix)}, prefix
    for key in keys:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=0, msg=key)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_auto_to_bamboo_to_auto_keeps_weights_optimizer_and_step(tmp_path: Path) -> None:
    first, second = tmp_path / "auto.ckpt", tmp_path / "bamboo.ckpt"
    # 1. one process trains 3 steps (Adam) and saves an ordinary .ckpt file
    run_script("train_pipe.py", ["--strategy", "auto", *ADAM, "--out", str(tmp_path / "a"), "--save-ckpt",
                                 str(first)], timeout=200)
    # 2. Bamboo (2 stages) resumes from the file, trains a 4th step and saves its folder
    resumed = tmp_path / "b"
    run_script(
        "train_pipe.py",
        ["--strategy", "bamboo", "--devices", "2", "--stages", "2", *ADAM, "--out", str(resumed),
         "--resume", str(first), "--steps", "4", "--max-epochs", "2", "--save-ckpt", str(second)],
        timeout=300, nprocs=2,
    )
    saved = snapshot(tmp_path / "a", 3, 0)
    starts = [load_file(str(resumed / f"start_rank{rank}.safetensors")) for rank in (0, 1)]
    whole = {k: v for start in starts for k, v in start.items() if k.startswith("own")}
    _assert_equal(whole, saved, "own/")  # every stage's weights, as saved by the single process
    _assert_equal(whole, saved, "own_opt/")  # and its Adam state (positional in the file, by name here)
    for rank in (0, 1):  # each replica, with its optimizer state, is its successor's stage as saved
        replica = {"own" + k[len("replica") :]: v for k, v in starts[rank].items() if k.startswith("replica")}
        successor = {k: v for k, v in starts[(rank + 1) % 2].items() if k.startswith("own")}
        _assert_equal(replica, successor, "own/")
        _assert_equal(replica, successor, "own_opt/")

    # 2b. the same file loads into 3 stages (the stage count is free): every stage and replica as saved
    three = tmp_path / "b3"
    run_script(
        "train_pipe.py",
        ["--strategy", "bamboo", "--devices", "3", "--stages", "3", *ADAM, "--out", str(three),
         "--resume", str(first), "--steps", "4", "--max-epochs", "2"],
        timeout=300, nprocs=3,
    )
    starts3 = [load_file(str(three / f"start_rank{rank}.safetensors")) for rank in range(3)]
    _assert_equal({k: v for start in starts3 for k, v in start.items() if k.startswith("own")}, saved, "own")
    for start in starts3:
        replica = {"own" + k[len("replica") :]: v for k, v in start.items() if k.startswith("replica")}
        _assert_equal(replica, {k: v for k, v in saved.items() if k in replica}, "own")

    # 3. the converter writes an ordinary .ckpt: weights, optimizer state, loop state of step 4
    third = tmp_path / "converted.ckpt"
    consolidate_checkpoint(second, output=third)
    converted = torch.load(third, weights_only=True)
    trained = {k: v for rank in (0, 1) for k, v in snapshot(resumed, 4, rank).items() if k.startswith("own")}
    meta = torch.load(second / ckpt.META_FILE, weights_only=True)
    assert converted["global_step"] == 4 and converted["epoch"] == meta["epoch"]
    # the data position is Bamboo's loader's; the one-process run's plain DataLoader has none to load
    assert meta["loops"]["fit_loop"]["state_dict"].pop("combined_loader")[0]["batches"] == 1
    assert converted["loops"] == meta["loops"]
    _assert_equal({f"own/{k}": v for k, v in converted["state_dict"].items()}, trained, "own/")
    names = [name for name, _ in PipeMLP().named_parameters()]
    (optimizer,) = converted["optimizer_states"]
    assert optimizer["param_groups"][0]["params"] == list(range(len(names)))
    _assert_equal(_positional_by_name(optimizer, names), trained, "own_opt/")
    model = PipeMLP.load_from_checkpoint(third)
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), trained[f"own/{name}"]), name

    # 4. one process resumes from the converted file at global step 4
    back = tmp_path / "c"
    run_script("train_pipe.py", ["--strategy", "auto", *ADAM, "--out", str(back), "--resume", str(third),
                                 "--steps", "5", "--max-epochs", "3"], timeout=200)
    start = load_file(str(back / "start_rank0.safetensors"))
    _assert_equal(start, trained, "own/")
    _assert_equal(start, trained, "own_opt/")
    assert (back / "step5_rank0.safetensors").exists()  # the step counter went on from 4


def test_optimizer_state_names_and_positions_round_trip() -> None:
    """Positional (one process) -> by name (stages) -> positional, with two param groups."""
    model = PipeMLP()
    layers = list(model.pipeline.children())
    groups = [{"params": list(layers[0].parameters())}, {"params": list(layers[2].parameters()), "lr": 0.2}]
    optimizer = torch.optim.Adam(groups, lr=0.1)
    model.pipeline(torch.randn(2, 8, dtype=torch.float64)).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    group_names = [["pipeline.0.weight", "pipeline.0.bias"], ["pipeline.2.weight", "pipeline.2.bias"]]
    named = ckpt.named_from_positional(state, group_names)
    assert named["param_groups"][1]["lr"] == 0.2
    assert set(named["state"]) == {n for g in group_names for n in g}
    back = ckpt.positional_from_named(named, group_names)
    assert back["param_groups"] == state["param_groups"]
    for index, values in state["state"].items():
        for key, value in values.items():
            assert torch.equal(back["state"][index][key], value)
    match = r"param groups of \[2, 2\] parameters but configure_optimizers builds groups of \[4\]"
    with pytest.raises(ValueError, match=match):
        ckpt.named_from_positional(state, [[n for g in group_names for n in g]])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_tied_weights_travel_between_auto_and_any_stage_count(tmp_path: Path) -> None:
    """``pipe_variants.Tied`` (layers 0 and 4 share one weight): the single-process optimizer holds the
    weight once, under its first name; each Bamboo stage holding a use holds a copy with its own state.
    auto -> Bamboo (1 stage: one member holds both uses, one optimizer entry) -> Bamboo (2 stages: the
    second use's copy takes its state from the first's name; same 16 samples in batches of 2, so the saved
    data position fits) -> ordinary .ckpt -> auto, exact."""
    tied = ["--variant", "tied", *ADAM]
    first, one, two, converted = (tmp_path / n for n in ("auto.ckpt", "one", "two", "converted.ckpt"))
    run_script("train_pipe.py", ["--strategy", "auto", *tied, "--out", str(tmp_path / "a"),
                                 "--save-ckpt", str(first)], timeout=200)
    run_script("train_pipe.py", ["--strategy", "bamboo", "--devices", "1", "--stages", "1", "--no-redundancy",
                                 *tied, "--out", str(tmp_path / "b"), "--resume", str(first), "--steps", "4",
                                 "--max-epochs", "2", "--save-ckpt", str(one)], timeout=300, nprocs=1)
    saved = snapshot(tmp_path / "a", 3, 0)
    assert torch.equal(saved["own/pipeline.0.weight"], saved["own/pipeline.4.weight"])
    _assert_equal(load_file(str(tmp_path / "b" / "start_rank0.safetensors")), saved, "own")
    assert torch.load(one / ckpt.META_FILE, weights_only=True)[ckpt.TIED_KEY] == {
        "pipeline.4.weight": "pipeline.0.weight"
    }
    run_script("train_pipe.py", ["--strategy", "bamboo", "--devices", "2", "--stages", "2", *tied, "--out",
                                 str(tmp_path / "c"), "--resume", str(one), "--steps", "8", "--batch-size",
                                 "2", "--max-epochs", "3", "--save-ckpt", str(two)], timeout=300, nprocs=2)
    after_one = snapshot(tmp_path / "b", 4, 0)
    starts = [load_file(str(tmp_path / "c" / f"start_rank{rank}.safetensors")) for rank in (0, 1)]
    resumed = {k: v for start in starts for k, v in start.items() if k.startswith("own")}
    _assert_equal(resumed, after_one, "own")

    consolidate_checkpoint(two, output=converted)
    model = Tied.load_from_checkpoint(converted)
    assert model.pipeline[4].weight is model.pipeline[0].weight
    trained = {k: v for rank in (0, 1) for k, v in snapshot(tmp_path / "c", 8, rank).items()}
    assert torch.equal(trained["own/pipeline.0.weight"], trained["own/pipeline.4.weight"])
    (optimizer,) = torch.load(converted, weights_only=True)["optimizer_states"]
    assert optimizer["param_groups"][0]["params"] == list(range(len(list(model.parameters()))))
    run_script("train_pipe.py", ["--strategy", "auto", *tied, "--out", str(tmp_path / "d"), "--resume",
                                 str(converted), "--steps", "9", "--max-epochs", "4"], timeout=200)
    back = load_file(str(tmp_path / "d" / "start_rank0.safetensors"))
    _assert_equal(back, {k: v for k, v in trained.items() if k.startswith("own")}, "own")
