"""The two-phase step's gradient clipping plan equals Lightning's clipping (one process, no group)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.utilities.enums import GradClipAlgorithmType

from lightning_bamboo.step.clipping import apply_clipping, plan_clipping


def _grads(scale: float) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(4, 3, dtype=torch.float64) * scale, torch.randn(3, dtype=torch.float64) * scale]


@pytest.mark.parametrize("scale", [10.0, 1e-3])  # clips / leaves alone
def test_norm_plan_matches_clip_grad_norm(scale: float) -> None:
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in _grads(scale)]
    for p, g in zip(params, _grads(scale)):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    grads = _grads(scale)
    plan = plan_clipping([grads], 1.0, GradClipAlgorithmType.NORM, None, torch.device("cpu"))
    apply_clipping(plan, grads)
    for p, g in zip(params, grads):
        torch.testing.assert_close(g, p.grad, rtol=1e-14, atol=0)


def test_value_plan_clamps_like_clip_grad_value() -> None:
    expected = _grads(1.0)
    grads = _grads(1.0)
    apply_clipping(plan_clipping([grads], 0.5, "value", None, torch.device("cpu")), [*grads, None])
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e.clamp(-0.5, 0.5), rtol=0, atol=0)


def test_no_clip_value_means_no_plan_and_a_bad_algorithm_is_named() -> None:
    assert plan_clipping([_grads(1.0)], None, "norm", None, torch.device("cpu")) is None
    assert plan_clipping([_grads(1.0)], 0, "norm", None, torch.device("cpu")) is None
    with pytest.raises(ValueError, match="gradient_clip_algorithm must be 'norm' or 'value', got 'max'"):
        plan_clipping([_grads(1.0)], 1.0, "max", None, torch.device("cpu"))


def test_the_norm_adds_the_stages_sums_in_stage_order() -> None:
    """A member holding both stages (after a failover) gets the coefficient two members get: each stage's
    squares summed on their own, then the stages' sums added (their all-reduce), not one running sum over
    both stages, which rounds 1 + 2**-54 + ... (1024 terms) to 1 where the stages' sums give 1 + 2**-44."""
    stage0 = [torch.ones(1, dtype=torch.float64)]
    stage1 = [torch.full((1,), 2.0**-27, dtype=torch.float64) for _ in range(1024)]
    two_members = torch.tensor(1.0, dtype=torch.float64) + torch.tensor(2.0**-44, dtype=torch.float64)
    running = torch.tensor(1.0, dtype=torch.float64)
    for grad in stage1:
        running += grad.pow(2).sum()
    assert running != two_members  # the test would not tell the two orders apart otherwise
    plan = plan_clipping([stage0, stage1], 1e-3, "norm", None, torch.device("cpu"))
    assert plan is not None and plan.coef is not None
    assert plan.coef.item() == torch.clamp(1e-3 / (two_members.sqrt() + 1e-6), max=1.0).item()
    assert plan.coef.item() != torch.clamp(1e-3 / (running.sqrt() + 1e-6), max=1.0).item()
