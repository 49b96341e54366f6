"""Every ``DorylusStrategy`` argument is in the recipes' strategy configs with its default, so a user
overrides any of them from the command line without Hydra's ``+`` (``strategy.staleness=1``)."""

from __future__ import annotations

import inspect
from datetime import timedelta
from pathlib import Path

import hydra
import pytest
from omegaconf import OmegaConf

from lightning_dorylus import DorylusStrategy
from recipes.compose import compose_recipe
from recipes.paths import CONFIG_DIR
from recipes.train import build_strategy

#: Values a recipe sets on purpose instead of the constructor's default.
RECIPE_CHOICES = {
    "dorylus": {"timeout": timedelta(seconds=120)},  # a dead server fails the job in 2 min, not 30
    "dorylus_lambda": {"executor": "lambda", "timeout": timedelta(seconds=300)},
}
#: The experiment that composes each strategy config.
EXPERIMENT = {"dorylus": "dorylus_gcn_cora", "dorylus_lambda": "dorylus_gcn_cora_lambda"}


def dorylus_strategy_configs() -> list[str]:
    """The strategy configs that build a DorylusStrategy (their own ``_target_`` or their defaults')."""
    names = []
    for path in sorted((CONFIG_DIR / "strategy").glob("*.yaml")):
        raw = OmegaConf.load(path)
        if raw.get("_target_") == "lightning_dorylus.DorylusStrategy" or "dorylus" in raw.get("defaults", []):
            names.append(path.stem)
    return names


def test_every_dorylus_strategy_config_has_an_experiment() -> None:
    assert sorted(dorylus_strategy_configs()) == sorted(EXPERIMENT)


@pytest.mark.parametrize("name", sorted(EXPERIMENT))
def test_strategy_config_lists_every_constructor_argument_with_its_default(name: str, tmp_path: Path) -> None:
    params = {k: p for k, p in inspect.signature(DorylusStrategy.__init__).parameters.items() if k != "self"}
    cfg = compose_recipe(EXPERIMENT[name], tmp_path).strategy
    assert cfg._target_ == "lightning_dorylus.DorylusStrategy"
    listed = set(cfg) - {"_target_"}
    assert listed == set(params), (f"strategy/{name}.yaml: missing {sorted(set(params) - listed)}, "
                                   f"not arguments {sorted(listed - set(params))}")
    choices = RECIPE_CHOICES[name]
    for key, param in params.items():
        node = cfg[key]
        value = hydra.utils.instantiate(node) if OmegaConf.is_dict(node) and "_target_" in node else node
        if key == "executor_options" and name == "dorylus_lambda":
            continue  # the Lambda function's options, documented in the file
        expected = choices.get(key, param.default)
        assert value == expected, f"strategy/{name}.yaml: {key}={value!r}, expected {expected!r}"


@pytest.mark.parametrize("name", sorted(EXPERIMENT))
def test_every_option_is_overridden_without_plus(name: str, tmp_path: Path) -> None:
    overrides = ["strategy.staleness=1", "strategy.stale_reads=oldest", "strategy.intervals=4",
                 "strategy.max_in_flight=8", "strategy.loss_reduction=sum", "strategy.mmap_threshold=null",
                 "strategy.num_threads=1", "strategy.start_method=spawn"]
    strategy = build_strategy(compose_recipe(EXPERIMENT[name], tmp_path, overrides).strategy)
    assert isinstance(strategy, DorylusStrategy)
    options = strategy.options
    assert options.staleness == 1
    assert options.num_threads == 1
    assert options.start_method == "spawn" and strategy._start_method == "spawn"  # DDPStrategy's launcher
    assert options.stale_reads == "oldest"
    assert (options.intervals, options.max_in_flight) == (4, 8)
    assert options.loss_reduction == "sum" and options.mmap_threshold is None
