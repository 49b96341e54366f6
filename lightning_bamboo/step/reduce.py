"""``self.log(..., sync_dist=True)`` under Bamboo: a mean over the samples, not over the ranks.

Every rank of a pipeline logs its pipeline's value (the loss is broadcast from the last position), and a
pipeline has as many ranks as positions: 2 before a failover fuses two stages, 1 after. Lightning's mean over
the ranks would weight a pipeline by its rank count, so a logged value would move when a worker is lost
although the model did not. Here each rank's value is weighted by its pipeline's share of the global batch's
micro-batches divided by the pipeline's rank count: the weights sum to 1, and a value every rank of a pipeline
logs counts once per pipeline, in proportion to that pipeline's samples. For a training loss that is the
global batch's mean loss (as one process logs it); for validation and test, which every pipeline runs on the
same batch, the value itself. Other reductions (``"sum"``, ``"max"``, ...) are Lightning's over every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

MEANS = ("mean", "avg")


def is_mean(reduce_op: Any) -> bool:
    """``reduce_op`` asks for a mean (Lightning's ``"mean"``/``"avg"`` spelling, or ``ReduceOp.AVG``)."""
    if isinstance(reduce_op, str):
        return reduce_op.lower() in MEANS
    return reduce_op is not None and reduce_op == dist.ReduceOp.AVG


def sample_weighted_mean(tensor: Tensor, weight: float, group: Any = None) -> Tensor:
    """The all-reduced sum of ``tensor * weight`` (in place, as Lightning's reduce works), in float64 for the
    products and back in ``tensor``'s dtype (an integer tensor becomes float, as Lightning's mean does)."""
    weighted = tensor.detach().to(torch.float64) * weight
    dist.all_reduce(weighted, group=group)
    if not torch.is_floating_point(tensor):
        return weighted.to(torch.get_default_dtype())
    tensor.copy_(weighted.to(tensor.dtype))
    return tensor
