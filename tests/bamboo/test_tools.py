"""Lightning's tools around training under Bamboo: ``Tuner.lr_find`` and the hyper-parameter message it
changes at run time, and ``StochasticWeightAveraging`` (refused at setup)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from lightning_bamboo.pipeline.replica import (
    ReplicaSync,
    decode_hyperparameters,
    encode_hyperparameters,
    follow_schema,
    hyperparameter_schema,
)
from tests.bamboo.launch import run_script


@pytest.mark.multiprocess
@pytest.mark.slow
def test_lr_find_suggests_what_auto_suggests(tmp_path: Path) -> None:
    """lr_find's scheduler adds ``initial_lr`` to the stage optimizer only; the replica follows (it was a
    gloo abort, ``304 vs 296``). The suggestion, the losses, the parameters after a fit with the suggested
    learning rate equal the single process at float64, and each replica equals its successor's stage."""
    auto, bamboo = tmp_path / "auto", tmp_path / "bamboo"
    run_script("train_tools.py", ["--out", str(auto), "--strategy", "auto", "--tool", "lr-find"], timeout=200)
    run_script("train_tools.py", ["--out", str(bamboo), "--tool", "lr-find"], timeout=300, nprocs=2)
    reference = json.loads((auto / "rank0.json").read_text())
    assert reference["suggestion"] is not None
    for rank in (0, 1):
        result = json.loads((bamboo / f"rank{rank}.json").read_text())
        assert result["suggestion"] == reference["suggestion"]
        assert result["lr"] == reference["suggestion"]  # the Tuner set it on the module on every rank
        torch.testing.assert_close(
            torch.tensor(result["loss"]), torch.tensor(reference["loss"]), rtol=1e-13, atol=1e-13
        )
    expected = load_file(str(auto / "rank0.safetensors"))
    stages = [load_file(str(bamboo / f"rank{rank}.safetensors")) for rank in (0, 1)]
    own = {k: v for stage in stages for k, v in stage.items() if k.startswith("own/")}
    assert own.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(own[key], value, rtol=1e-12, atol=1e-12, msg=key)
    for rank in (0, 1):  # the replica on rank r is stage (r + 1) % 2, bit for bit
        successor = stages[(rank + 1) % 2]
        replicas = {
            k.removeprefix("replica/"): v for k, v in stages[rank].items() if k.startswith("replica/")
        }
        assert replicas
        for name, value in replicas.items():
            assert torch.equal(value, successor[f"own/{name}"]), name


@pytest.mark.multiprocess
@pytest.mark.slow
def test_stochastic_weight_averaging_is_refused_at_setup(tmp_path: Path) -> None:
    run_script("train_tools.py", ["--out", str(tmp_path), "--tool", "swa"], timeout=300, nprocs=2)
    for rank in (0, 1):
        message = (tmp_path / f"error_rank{rank}.txt").read_text()
        assert "StochasticWeightAveraging" in message and "before BambooStrategy splits" in message


def _sgd(*groups_lr: float) -> torch.optim.SGD:
    params = [nn.Parameter(torch.zeros(2)) for _ in groups_lr]
    return torch.optim.SGD([{"params": [p], "lr": lr} for p, lr in zip(params, groups_lr)], momentum=0.9)


def test_replica_optimizer_follows_keys_gained_at_run_time() -> None:
    """A scheduler built later (lr_find's) adds ``initial_lr``; the replica gains it and its value."""
    stage, replica = _sgd(0.1, 0.2), _sgd(0.1, 0.2)
    torch.optim.lr_scheduler.LinearLR(stage, start_factor=0.5)
    stage.param_groups[1]["betas_like"] = (0.9, 0.99)  # a tuple setting a callback adds
    stage.param_groups[0]["lr_tensor"] = torch.tensor(0.25, dtype=torch.float64)
    del stage.param_groups[1]["dampening"]  # and one it drops
    follow_schema(replica, json.loads(json.dumps(hyperparameter_schema(stage))))
    decode_hyperparameters(replica, encode_hyperparameters(stage))
    for ours, theirs in zip(replica.param_groups, stage.param_groups):
        assert ours.keys() == theirs.keys()
        for key in theirs:
            if key != "params":
                assert type(ours[key]) is type(theirs[key]) and str(ours[key]) == str(theirs[key]), key


def test_malformed_hyperparameter_messages_raise_readable_errors() -> None:
    with pytest.raises(RuntimeError, match=r"optimizer has 2 param groups but the replica's has 1"):
        follow_schema(_sgd(0.1), hyperparameter_schema(_sgd(0.1, 0.2)))
    with pytest.raises(RuntimeError, match=r"has 3 hyper-parameter values but the replica's has \d+"):
        decode_hyperparameters(_sgd(0.1), [0.1, 0.2, 0.3])
    stage, replica = nn.Linear(2, 2), nn.Linear(2, 2)
    sync = ReplicaSync(stage, replica, _sgd(0.1), SimpleNamespace(successor_rank=1), torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"malformed replica header from rank 1"):
        sync._check_header(torch.tensor([1.0, 2.0, 3.0, 0.0], dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"gradients of 5 trainable parameters but the replica has 2"):
        sync._check_header(torch.tensor([7301.0, 5.0, 3.0, 0.0], dtype=torch.float64))


class _Loopback(ReplicaSync):
    """A rank whose predecessor and successor are itself: every send lands in the matching receive (in
    order), with gloo's rule that a message may not be longer than its receive buffer."""

    def _post(self, outgoing: list[torch.Tensor], incoming: list[torch.Tensor], tag: object) -> list:
        assert len(outgoing) == len(incoming), (len(outgoing), len(incoming))
        for sent, received in zip(outgoing, incoming):
            assert sent.numel() == received.numel() and sent.dtype == received.dtype, "size mismatch (abort)"
            received.copy_(sent)
        return []


def test_replica_follows_an_optimizer_changed_between_steps() -> None:
    """The stage optimizer gains a scheduler (``initial_lr``) after the first step, a tensor learning rate
    and a new key later, and loses a key: every message fits its receive, and the replica keeps stepping
    exactly as the stage does."""
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)).double()
    replica = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)).double()
    replica.load_state_dict(stage.state_dict())
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)
    replica_optimizer = torch.optim.SGD(replica.parameters(), lr=0.5, momentum=0.9)  # lr comes from the stage
    groups = SimpleNamespace(successor_rank=0, predecessor_rank=0)
    sync = _Loopback(stage, replica, replica_optimizer, groups, torch.device("cpu"))
    scheduler = None
    for step in range(6):
        if step == 1:
            scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)  # adds initial_lr
        if step == 3:
            optimizer.param_groups[0]["custom"] = 2.0
            optimizer.param_groups[0]["lr"] = torch.tensor(0.05, dtype=torch.float64)
        if step == 4:
            del optimizer.param_groups[0]["custom"]
        stage(torch.randn(4, 3, dtype=torch.float64)).pow(2).mean().backward()
        optimizer.step()
        sync.step(optimizer)
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        sync.flush()
        for ours, theirs in zip(sync.replica.parameters(), stage.parameters()):
            assert torch.equal(ours, theirs), step
    # one message behind the keys at most: the replica has every key the stage had at its last message
    assert set(sync.optimizer.param_groups[0]) == set(optimizer.param_groups[0])
    assert "initial_lr" in sync.optimizer.param_groups[0] and "custom" not in sync.optimizer.param_groups[0]
