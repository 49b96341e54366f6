"""``with_pipeline_clipping``: the strategy's precision plugin is the chosen plugin's class with only the norm
clipping replaced (no method assigned on an instance, the user's plugin untouched)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.plugins.precision import DoublePrecision, MixedPrecision, Precision

from lightning_bamboo import BambooStrategy
from lightning_bamboo.precision import PipelineNormClipping, with_pipeline_clipping


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
    assert strategy.precision_plugin.pipeline_clip_by_norm == strategy._clip_grad_by_global_norm
