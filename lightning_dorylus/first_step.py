"""The checks a fit runs once: before its first epoch where they can, else around its first training step.

Each turns a late, bare torch error or a silent mistake into a named one on every graph server at the same
point (:mod:`lightning_dorylus.model_checks`, :mod:`lightning_dorylus.dropout_check`):

* before the first epoch, the model's output width against the graph's labels, where both are known without
  a step (:func:`~lightning_dorylus.model_checks.check_output_width`);
* around the first training step, the same check on the loss's inputs where the width was not known
  (:class:`~lightning_dorylus.model_checks.LabelRangeCheck`), and a warning for a torch dropout on several
  servers (:class:`~lightning_dorylus.dropout_check.TorchDropoutCheck`).

A model that calls ``F.dropout`` or has too few outputs does so on every step, so one step is enough; later
steps run with nothing around them.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule

from lightning_dorylus._lightning import distributed_is_initialized
from lightning_dorylus.data.partition import GraphPartition
from lightning_dorylus.dropout_check import TorchDropoutCheck
from lightning_dorylus.model_checks import LabelRangeCheck, check_output_width, num_labels


class FirstStepChecks:
    """One fit's one-shot checks (a new instance per ``setup``): :meth:`before_fit` before the first epoch,
    :meth:`around_step` around each training step (checks on the first only)."""

    def __init__(self, world_size: int, device: torch.device) -> None:
        self.world_size, self.device = world_size, device
        self._step_pending = True  # the first training step has not run
        self._width_checked = False  # the output width was checked before the first epoch

    def before_fit(self, module: LightningModule, partition: GraphPartition | None) -> None:
        """The output width against the whole graph's labels, where every server has its partition at hand
        (else the first step checks); every server takes part in the all-reduce either way."""
        count = torch.tensor([num_labels(partition.y) if partition is not None else 0, partition is None],
                             device=self.device)
        self._all_reduce_max(count)  # [labels, some server without a partition]
        if not count[1]:
            self._width_checked = check_output_width(module, int(count[0]))

    def around_step(self, batch: Any) -> AbstractContextManager[Any]:
        """What wraps this training step: the first step's checks, nothing on later ones."""
        checks = ExitStack()
        if not self._step_pending:
            return checks
        self._step_pending = False
        if not self._width_checked:  # the output width was unknown before the step
            count = torch.tensor(num_labels(getattr(batch, "y", None)), device=self.device)
            self._all_reduce_max(count)  # every server checks against the whole graph's count
            checks.enter_context(LabelRangeCheck(int(count)))
        if self.world_size > 1:
            checks.enter_context(TorchDropoutCheck(self.world_size))
        return checks

    def _all_reduce_max(self, tensor: torch.Tensor) -> None:
        if self.world_size > 1 and distributed_is_initialized():
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)


def training_partition(trainer: Any) -> GraphPartition | None:
    """This server's partition before the first step, where it is at hand: a ``DorylusDataModule``'s, or
    that of the train loader it gives (``PartitionLoader``); a user's own loader is not iterated."""
    for holder in (getattr(trainer, "datamodule", None), getattr(trainer, "train_dataloader", None)):
        partition = getattr(holder, "partition", None)
        if isinstance(partition, GraphPartition):
            return partition
    return None
