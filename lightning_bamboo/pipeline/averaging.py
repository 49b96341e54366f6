"""The end of a training step's pipeline work: the gradients averaged over the data-parallel pipelines (per
original stage, so any layout, fused or not, gives the same averages), tied copies summed over their uses,
and the pipeline's mean loss broadcast from its last position."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lbd_common import codec
from lightning_bamboo.layout.view import PipelineView
from lightning_bamboo.pipeline.ties import TiedGradient


class GradientAveraging:
    """Averages one member's gradients after its backwards (the engine calls it at the end of a step).

    ``stage_params[s]``: this member's parameters of original stage ``s``; each is all-reduced over the
    members holding ``s`` in every pipeline (``view.stage_groups[s]``), stages in increasing order on every
    member (no cycle between groups). ``tied``: the tied parameters' sums over their uses
    (:mod:`lightning_bamboo.pipeline.ties`), after the averages, in the same order on every member.
    """

    def __init__(
        self,
        view: PipelineView,
        stage_params: Mapping[int, Sequence[nn.Parameter]],
        tied: Sequence[TiedGradient] = (),
    ) -> None:
        missing = [s for s in stage_params if view.num_pipelines > 1 and s not in view.stage_groups]
        if missing:
            raise ValueError(f"stage_params names stages {missing} that have no stage group in the view")
        self.view = view
        self.stage_params = {s: list(params) for s, params in stage_params.items()}
        self.tied = list(tied)

    def __call__(self) -> None:
        count = self.view.num_pipelines
        if count > 1:
            for stage in sorted(self.stage_params):
                average_gradients(self.stage_params[stage], self.view.stage_groups[stage], count)
        for gradient in self.tied:
            gradient.reduce()


def mean_loss(losses: list[Tensor], view: PipelineView, device: torch.device) -> Tensor:
    """The mean of the last position's micro-batch losses, as a float64 scalar on every rank of the
    pipeline (broadcast from the last position)."""
    if view.is_last:
        loss = torch.stack([value.to(torch.float64) for value in losses]).mean().to(device)
    else:
        loss = torch.zeros((), dtype=torch.float64, device=device)
    if view.num_positions > 1:
        dist.broadcast(loss, src=view.last_rank, group=view.pipeline_group)
    return loss


def average_gradients(params: Sequence[nn.Parameter], group: Any, count: int) -> None:
    """Mean of ``params``' gradients over the ``count`` ranks of ``group`` (one flat all-reduce per dtype).

    Each flat buffer carries, behind the gradients, one has-gradient flag per parameter: a parameter that got
    no gradient on any rank keeps ``.grad = None`` (the optimizer skips it, as it would in one process; a
    zero gradient would still be decayed and stepped by AdamW), and one that got a gradient on some ranks
    only averages with zeros for the others (their samples did not use it).
    """
    trainable = [p for p in params if p.requires_grad]
    for bucket in codec.by_dtype(trainable):
        flags = torch.tensor([float(p.grad is not None) for p in bucket], dtype=bucket[0].dtype)
        parts = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket
        ]
        flat = torch.cat([*parts, flags.to(bucket[0].device)])
        dist.all_reduce(flat, group=group)
        flat /= count
        offset = 0
        for p, had_grad in zip(bucket, flat[-len(bucket) :].tolist(), strict=True):
            values = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            if had_grad == 0:
                p.grad = None
            elif p.grad is None:
                p.grad = values.clone()
            else:
                p.grad.copy_(values)
