"""``import lightning_bamboo`` registers ``"bamboo"`` with Lightning, once."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry

import lightning_bamboo
from lightning_bamboo import BambooStrategy
from tests.process import launch_env


def test_bamboo_is_registered() -> None:
    assert "bamboo" in StrategyRegistry
    assert StrategyRegistry["bamboo"]["strategy"] is BambooStrategy


def test_importing_twice_does_not_raise() -> None:
    importlib.reload(lightning_bamboo)
    importlib.import_module("lightning_bamboo")
    assert "bamboo" in StrategyRegistry


@pytest.mark.parametrize(("name", "init_params"), [("bamboo", {})])
def test_trainer_resolves_bamboo(name: str, init_params: dict) -> None:
    assert StrategyRegistry[name]["init_params"] == init_params
    trainer = Trainer(strategy=name, accelerator="cpu", devices=2, logger=False, enable_checkpointing=False)
    strategy = trainer.strategy
    assert isinstance(strategy, BambooStrategy)
    assert strategy.num_stages == 2
    assert strategy.world_size == 2
    # one pipeline: every stage reads the same (only) shard
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}


def test_the_supervisor_imports_no_lightning(tmp_path: Path) -> None:
    """``python -m lightning_bamboo.launch`` (the supervisor, not a training rank) does not import Lightning:
    it starts its workers ~5 CPU-seconds sooner. A plain ``import lightning_bamboo`` still registers."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "lightning_bamboo.launch", "--help"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=launch_env(),
    )
    assert out.returncode == 0 and "--nproc" in out.stdout, out.stderr[-2000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if "|" in line]
    assert "torch.distributed" in imported
    assert not [name for name in imported if name.split(".")[0] == "lightning"]
