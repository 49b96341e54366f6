"""``with_pipeline_clipping``: the strategy's precision plugin is the named Bamboo plugin of the chosen
precision (Lightning's class of it with only the norm clipping replaced; no method assigned on an instance,
no class made at run time, the user's plugin untouched); a plugin Bamboo cannot clip through is refused."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

from lightning_bamboo import BambooStrategy
from lightning_bamboo._lightning import precision as bamboo_precision
from lightning_bamboo._lightning.precision import (
    BambooDoublePrecision,
    PipelineNormClipping,
    with_pipeline_clipping,
)


def test_keeps_class_and_settings_and_routes_norm_clipping() -> None:
    calls = []
    user = MixedPrecision("bf16-mixed", "cpu")
    plugin = with_pipeline_clipping(user, lambda optimizer, value: calls.append(value))
    assert isinstance(plugin, MixedPrecision) and isinstance(plugin, PipelineNormClipping)
    assert plugin.precision == "bf16-mixed" and plugin.device == "cpu"
    assert "clip_grad_by_norm" not in vars(user) and type(user) is MixedPrecision
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    plugin.clip_grad_by_norm(optimizer, 2)
    assert calls == [2.0]


def test_wrapping_twice_does_not_nest() -> None:
    first = with_pipeline_clipping(DoublePrecision(), lambda o, v: None)
    second = with_pipeline_clipping(first, lambda o, v: None)
    assert type(second) is type(first)
    assert type(second).__mro__.count(PipelineNormClipping) == 1


def test_refuses_a_non_precision_plugin() -> None:
    with pytest.raises(TypeError, match="precision_plugin must be a lightning Precision plugin, got str"):
        with_pipeline_clipping("64-true", lambda o, v: None)  # type: ignore[arg-type]


def test_strategy_holds_the_clipping_plugin() -> None:
    strategy = BambooStrategy(num_stages=2, precision_plugin=DoublePrecision())
    assert isinstance(strategy.precision_plugin, DoublePrecision)
    assert isinstance(strategy.precision_plugin, PipelineNormClipping)
    strategy.precision_plugin = Precision()  # what Lightning's connector does
    assert isinstance(strategy.precision_plugin, PipelineNormClipping)
    assert strategy.precision_plugin.pipeline_clip_by_norm == strategy.session.clip


@pytest.mark.parametrize(
    ("precision", "named", "extends"),
    [
        ("32-true", "BambooPrecision", Precision),
        ("64-true", "BambooDoublePrecision", DoublePrecision),
        ("bf16-true", "BambooHalfPrecision", HalfPrecision),
        ("bf16-mixed", "BambooMixedPrecision", MixedPrecision),
    ],
)
def test_trainer_precision_becomes_the_named_bamboo_plugin(
    precision: str, named: str, extends: type[Precision]
) -> None:
    """Lightning's connector builds its plugin and hands it to the strategy: the strategy holds the named
    class of that precision, a class of the package (never one made at run time)."""
    strategy = BambooStrategy(num_stages=2)
    Trainer(  # type: ignore[call-overload]
        strategy=strategy, precision=precision, accelerator="cpu", devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    plugin = strategy.precision_plugin
    assert type(plugin) is getattr(bamboo_precision, named) and type(plugin) in bamboo_precision.ACCEPTED
    assert isinstance(plugin, extends) and plugin.pipeline_clip_by_norm == strategy.session.clip
    assert getattr(plugin, "precision", precision) == precision


def test_a_bamboo_plugin_or_a_subclass_of_one_is_held_as_given() -> None:
    class Mine(BambooDoublePrecision):
        pass

    mine = Mine()
    strategy = BambooStrategy(num_stages=2, precision_plugin=mine)
    assert strategy.precision_plugin is mine
    assert mine.pipeline_clip_by_norm == strategy.session.clip


def test_a_plugin_bamboo_cannot_clip_through_is_refused_naming_the_accepted_ones() -> None:
    class Custom(Precision):
        pass

    match = (r"BambooPrecision, BambooDoublePrecision, BambooHalfPrecision, BambooMixedPrecision .* got "
             r".*Custom\. Use Trainer\(precision=")
    with pytest.raises(TypeError, match=match):
        BambooStrategy(num_stages=2, precision_plugin=Custom())
    with pytest.raises(RuntimeError, match=r"BambooDoublePrecision clips by the norm over a Bamboo pipeline"):
        BambooDoublePrecision().clip_grad_by_norm(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))]), 1.0)
