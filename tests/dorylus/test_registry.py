"""``import lightning_dorylus`` registers the Dorylus strategies with Lightning, once."""

from __future__ import annotations

import importlib

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry

import lightning_dorylus
from lightning_dorylus import DorylusStrategy


@pytest.mark.parametrize(
    ("name", "init_params"),
    [("dorylus", {"executor": "local"}), ("dorylus_inline", {"executor": "inline"})],
)
def test_registered(name: str, init_params: dict) -> None:
    assert name in StrategyRegistry
    entry = StrategyRegistry[name]
    assert entry["strategy"] is DorylusStrategy
    assert entry["init_params"] == init_params
    strategy = StrategyRegistry.get(name)
    assert isinstance(strategy, DorylusStrategy)
    assert strategy.options.executor == init_params["executor"]


def test_trainer_resolves_strategy_name() -> None:
    trainer = Trainer(strategy="dorylus", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, DorylusStrategy)
    assert trainer.strategy.options.executor == "local"
    assert trainer.world_size == 2


def test_double_import_and_registration_are_harmless() -> None:
    importlib.reload(lightning_dorylus)
    DorylusStrategy.register_strategies(StrategyRegistry)
    assert list(StrategyRegistry.available_strategies()).count("dorylus") == 1
    assert isinstance(StrategyRegistry.get("dorylus"), lightning_dorylus.DorylusStrategy)
