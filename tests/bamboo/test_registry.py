"""``import lightning_bamboo`` registers ``"bamboo"`` with Lightning, once."""

from __future__ import annotations

import importlib

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry

import lightning_bamboo
from lightning_bamboo import BambooStrategy


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
