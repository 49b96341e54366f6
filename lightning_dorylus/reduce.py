"""The all-reduce behind ``DorylusStrategy.reduce`` (``self.log(..., sync_dist=True)``, global sums).

Lightning's ``_sync_ddp`` puts a ``barrier`` before every all-reduce. The all-reduce already waits for every
rank, so the barrier only adds a round trip; a graph server logs a few metrics per epoch, each a point where
both servers wait for each other, so the extra round trips are a measurable share of a small graph's epoch.
Same semantics otherwise: in place, ``"mean"``/``"avg"`` as a sum divided by the world size on gloo.

``reduce(t, "sum")`` passes ``"sum"`` as the *group* (Lightning's signature is ``reduce(tensor, group,
reduce_op)``); under ``strategy="auto"`` that is a silent no-op and with torch's collectives it fails as
"Process group sum is not initialized", so the mistake shows only with more servers. A string group is
refused here, on any number of servers, with the call to write instead.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.types import ReduceOp
from torch import Tensor


def all_reduce(tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
    """Reduce ``tensor`` in place over ``group`` (world by default) and return it."""
    check_group(group)
    group = dist.group.WORLD if group is None else group
    divide = False
    if reduce_op is None:
        op = dist.ReduceOp.SUM
    elif isinstance(reduce_op, str):
        name = "avg" if reduce_op.lower() == "mean" else reduce_op.lower()
        if name == "avg" and dist.get_backend(group) == "gloo":  # gloo has no AVG
            op, divide = dist.ReduceOp.SUM, True
        elif hasattr(dist.ReduceOp, name.upper()):
            op = getattr(dist.ReduceOp, name.upper())
        else:
            expected = "'sum', 'mean', 'avg', 'max', 'min' or a torch.distributed.ReduceOp"
            raise ValueError(f"reduce_op={reduce_op!r}: expected {expected}")
    else:
        op = reduce_op
    dist.all_reduce(tensor, op=op, group=group)
    if not divide:
        return tensor
    world_size = dist.get_world_size(group)
    if not torch.is_floating_point(tensor):
        return tensor.copy_(tensor / world_size)
    return tensor.div_(world_size)


def check_group(group: Any) -> None:
    """Refuses a string where a process group belongs (``reduce(t, "sum")``), naming the keyword call."""
    if isinstance(group, str):
        raise TypeError(
            f"reduce(tensor, {group!r}): the second positional argument of reduce is the process group, not "
            f"the reduction; write reduce(tensor, reduce_op={group!r})"
        )
