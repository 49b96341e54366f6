"""Gradient clipping for elastic Bamboo's two-phase step: agreed before the commit, applied after it.

Lightning clips inside ``optimizer_step``, which elastic Bamboo runs only after the step is committed; from
then on no collective may run (a peer lost after the commit must not stop the survivors from applying the
step). So the global norm over all stages is reduced *before* the commit, and the same plan then clips every
member's own stages and every replica (a replica must clip exactly as the stage it mirrors does, or a takeover
would not continue the same trajectory).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

NORM = "norm"
VALUE = "value"


@dataclass(frozen=True)
class ClipPlan:
    """What to do to every gradient of the step: scale by ``coef`` (norm) or clamp to ``±value``."""

    algorithm: str
    value: float
    coef: Tensor | None = None


def plan_clipping(
    stage_grads: Sequence[Iterable[Tensor | None]],
    clip_val: float | None,
    algorithm: Any,
    pipeline_group: Any | None,
    device: torch.device,
) -> ClipPlan | None:
    """The step's clipping (collective over ``pipeline_group`` for the norm), or ``None`` without clipping.

    The squared norm is summed per stage (each stage's gradients in order, from zero), the pipeline's members
    all-reduce the vector of per-stage sums (every entry has one contributor, the rest add exact zeros) and
    every member adds the entries in stage order. So the total is the same bits on any layout: a member
    holding several stages after a failover forms what one member per stage forms (a plain running sum over
    its stages would associate them differently, and a last-bit change of the clipping coefficient sets the
    pipeline off its uninterrupted trajectory).

    Args:
        stage_grads: per stage of the pipeline (index: the original stage), this member's own gradients of
            that stage that count in the norm (not its replica's: those are its successor's own); empty for a
            stage another member holds.
        clip_val: ``Trainer(gradient_clip_val=...)``.
        algorithm: ``Trainer(gradient_clip_algorithm=...)`` (``"norm"``, the default, or ``"value"``).
        pipeline_group: the members of this pipeline; ``None``: nothing to reduce (one member runs the whole
            pipeline) -- pass ``dist.group.WORLD`` for the default group.
        device: where the norm is reduced (the rank's device: NCCL reduces on the GPU).
    """
    if not clip_val:
        return None
    kind = str(getattr(algorithm, "value", algorithm) or NORM)
    if kind == VALUE:
        return ClipPlan(VALUE, float(clip_val))
    if kind != NORM:
        raise ValueError(f"gradient_clip_algorithm must be 'norm' or 'value', got {algorithm!r}")
    per_stage = torch.zeros(len(stage_grads), dtype=torch.float64, device=device)
    for stage, grads in enumerate(stage_grads):
        squares = torch.zeros((), dtype=torch.float64, device=device)
        for grad in grads:
            if grad is not None:
                squares += grad.detach().to(torch.float64).pow(2).sum()
        per_stage[stage] = squares
    if pipeline_group is not None:
        dist.all_reduce(per_stage, group=pipeline_group)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for squares in per_stage:
        total = total + squares
    coef = torch.clamp(float(clip_val) / (total.sqrt() + 1e-6), max=1.0)
    return ClipPlan(NORM, float(clip_val), coef)


def apply_clipping(plan: ClipPlan | None, grads: Iterable[Tensor | None]) -> None:
    """Clip ``grads`` in place by ``plan`` (no communication)."""
    if plan is None:
        return
    for grad in grads:
        if grad is None:
            continue
        if plan.algorithm == VALUE:
            grad.clamp_(-plan.value, plan.value)
        else:
            assert plan.coef is not None
            grad.mul_(plan.coef.to(device=grad.device, dtype=grad.dtype))
