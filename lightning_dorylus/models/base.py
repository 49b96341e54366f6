"""``NodeClassifier``: the LightningModule side shared by Dorylus's GCN and GAT.

``training_step`` receives this graph server's :class:`GraphPartition` (the whole graph under
``strategy="auto"``) and returns ``Σ_local CE / num_train_global``: the sum of these losses over graph
servers is the full-graph mean loss, so after the strategy SUM-all-reduces weight gradients every replica
holds exactly the single-process full-graph gradient. Metrics are global too: sums of correct predictions
and counts are reduced over graph servers before dividing.

Multi-label targets (``y`` of shape ``(N, C)``, 0/1 or in ``[0, 1]``, as ogbn-proteins' 112 labels or PPI's
121) are recognised from the partition (``batch.multi_label``) and trained with BCE-with-logits, the loss
of PyG's ``examples/ppi.py`` and ogbn-proteins examples (``BCEWithLogitsLoss()``: the mean over train
vertices and labels); the model needs ``C`` outputs. Validation and test then log the micro-F1 of
``logits > 0`` (PyG's ``ppi.py``: ``f1_score(y, out > 0, average="micro")``) as ``val_f1`` /
``test_f1``, from true/false positive and false negative counts summed over graph servers (exact, unlike an
average of per-server F1s); ``predict`` gives the 0/1 predictions ``(N, C)``. Example::

    from lightning.pytorch import Trainer
    from torch_geometric.data import Data
    from lightning_dorylus import GCN, DorylusStrategy
    from lightning_dorylus.data import DorylusDataModule

    data = Data(x=x, edge_index=edge_index, y=labels_0_1,  # labels_0_1: (N, C)
                train_mask=train_idx, val_mask=val_idx)    # bool masks or index tensors
    datamodule = DorylusDataModule(data)
    model = GCN(datamodule.num_features, 64, datamodule.num_classes)  # num_classes = C
    trainer = Trainer(strategy=DorylusStrategy(), devices=2, max_epochs=100)
    trainer.fit(model, datamodule)  # logs train_loss (BCE), val_f1

ROC-AUC (ogbn-proteins' official metric) needs every vertex's scores in one place: take
``trainer.predict`` of the logits in your own ``predict_step`` and score them on rank 0.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_dorylus.data.partition import GraphPartition
from lightning_dorylus.data.validation import is_integer
from lightning_dorylus.graph import GraphCache, GraphContext
from lightning_dorylus.nn.dropout import dropout_key


def check_widths(**widths: int) -> None:
    """Raises naming the first width that is not an integer >= 1 (a 0-wide layer fails late, in an op)."""
    for name, value in widths.items():
        if not is_integer(value) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1")


def check_dropout(dropout: float) -> None:
    """Raises unless ``0 <= dropout < 1`` (as ``GATConv``; ``F.dropout`` would scale by ``1 / (1 - p)``)."""
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout={dropout!r} must be in [0, 1)")


class NodeClassifier(LightningModule):
    """Full-graph node classification on a :class:`GraphPartition`; subclasses define ``forward``.

    Args:
        lr: Adam learning rate.
        weight_decay: Adam weight decay (L2 on all parameters, as PyG's examples).
    """

    #: Read by ``DorylusStrategy``: the training loss is ``Σ_local CE / num_train_global``, a share of the
    #: global mean, so the servers' gradients are summed unweighted (a local-mean loss would be ``"mean"``).
    dorylus_loss_reduction: ClassVar[str] = "sum"

    def __init__(self, lr: float, weight_decay: float) -> None:
        super().__init__()
        self.lr, self.weight_decay = lr, weight_decay
        self._graphs = GraphCache()
        # Dropout masks hash (this seed, epoch, step, site, global id): graph servers seeded alike by
        # ``seed_everything`` agree on it; checkpoints carry it, so a resumed run draws the same masks.
        self.dropout_seed = torch.initial_seed()
        self._free_steps = 0  # training forwards outside a Trainer (each gets new masks)

    def graph(self, batch: Any) -> GraphContext:
        """The cached :class:`GraphContext` of ``batch``; rejects anything that is not a partition."""
        if not isinstance(batch, GraphPartition):
            raise TypeError(
                f"{type(self).__name__} expects a GraphPartition batch (use lightning_dorylus.data."
                f"DorylusDataModule), got {type(batch).__name__}"
            )
        in_channels = self.hparams.get("in_channels")
        if is_integer(in_channels) and batch.x.size(1) != in_channels:
            raise ValueError(
                f"{type(self).__name__}(in_channels={in_channels}) but the partition's features x have "
                f"{batch.x.size(1)} columns: build the model with in_channels=datamodule.num_features"
            )
        weight = next(self.parameters(), None)
        if weight is not None and weight.is_floating_point() and batch.x.dtype != weight.dtype:
            raise TypeError(
                f"the partition's features x are {batch.x.dtype} but {type(self).__name__}'s parameters are "
                f"{weight.dtype}: make them agree, e.g. model.double() (or Trainer(precision='64-true')) "
                "for float64 features, or data.x = data.x.float() before partitioning"
            )
        if batch.x.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            raise TypeError(
                "CPU autocast is on (Trainer(precision='bf16-mixed' or '16-mixed')): the graph server's "
                "sparse aggregation has no bfloat16 kernel; use precision='32-true' or '64-true'"
            )
        dtype = batch.x.dtype
        if dtype == torch.bfloat16 or (dtype == torch.float16 and batch.x.device.type == "cpu"):
            raise TypeError(
                f"the partition's features x are {dtype}: tensor ops cross to the executors as numpy arrays "
                "(no bfloat16) and the graph server's sparse aggregation has no CPU float16 kernel; use "
                "float32 or float64 features and parameters"
            )
        return self._graphs.context(batch)

    def dropout_key(self, site: int) -> int:
        """Key of dropout site ``site`` (0, 1, ... in forward order) for this training step.

        Folds the seed, the epoch, the global step and the site; without a Trainer, a counter of training
        forwards stands in for the step. Masks then depend on global vertex/edge ids only (see
        :mod:`lightning_dorylus.nn.dropout`), so every partitioning draws the single-process masks.
        """
        if self._trainer is None:
            return dropout_key(self.dropout_seed, -1, self._free_steps, site)
        return dropout_key(self.dropout_seed, self.current_epoch, self.global_step, site)

    def next_step_dropout_key(self, site: int) -> int | None:
        """Key of site ``site`` in the NEXT training step, assuming one step per epoch (Dorylus: one
        partition per graph server); ``None`` outside training or a Trainer, and in the last epoch. Lets the
        pipeline engine make the next epoch's first-layer input early; a wrong guess only costs the early
        work."""
        if self._trainer is None or not self.training:
            return None
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and 0 <= max_epochs <= self.current_epoch + 1:
            return None
        return dropout_key(self.dropout_seed, self.current_epoch + 1, self.global_step + 1, site)

    def next_free_step(self) -> None:
        """Advance the step counter used outside a Trainer (called once per training forward)."""
        if self._trainer is None and self.training:
            self._free_steps += 1

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["dorylus_dropout_seed"] = self.dropout_seed

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.dropout_seed = int(checkpoint.get("dorylus_dropout_seed", self.dropout_seed))

    def _global_sum(self, value: Tensor) -> Tensor:
        """Sum over graph servers (identity in a single process)."""
        return self.trainer.strategy.reduce(value, reduce_op="sum")

    @override
    def training_step(self, batch: GraphPartition, batch_idx: int) -> Tensor:
        graph = self.graph(batch)
        if batch.num_train_global == 0:  # the loss would be 0 / 0 = NaN on every server
            raise ValueError(
                "train_mask selects no vertex in the whole graph (num_train_global == 0): give data a "
                "train_mask with at least one True entry"
            )
        logits = self(graph)  # (n_local, num_classes)
        mask = batch.train_mask
        if batch.multi_label:  # BCEWithLogitsLoss(): the mean over train vertices and labels
            target = self._multi_label_target(batch, logits)[mask]
            loss = F.binary_cross_entropy_with_logits(logits[mask], target, reduction="sum")
            loss = loss / (batch.num_train_global * target.size(1))
        else:
            loss = F.cross_entropy(logits[mask], batch.y[mask], reduction="sum") / batch.num_train_global
        self.log("train_loss", self._global_sum(loss.detach()), prog_bar=True, batch_size=1)
        return loss

    def _multi_label_target(self, batch: GraphPartition, logits: Tensor) -> Tensor:
        """``batch.y`` in the logits' dtype, after checking there is one output per label."""
        if logits.dim() != 2 or logits.size(1) != batch.y.size(1):
            raise ValueError(
                f"{type(self).__name__} gives {tuple(logits.shape[1:])} outputs per vertex but y holds "
                f"{batch.y.size(1)} multi-label targets per vertex: build the model with "
                f"out_channels={batch.y.size(1)} (datamodule.num_classes)"
            )
        return batch.y.to(logits.dtype)

    def micro_f1s(self, batch: GraphPartition, masks: dict[str, Tensor]) -> dict[str, Tensor]:
        """Global micro-F1 of ``logits > 0`` against multi-label ``y`` per named vertex mask, logged under
        its name, from one forward pass: ``2 TP / (2 TP + FP + FN)``, the counts summed over graph servers
        in one all-reduce (PyG's ``examples/ppi.py`` metric; 0 where the mask selects no vertex)."""
        logits = self(self.graph(batch))
        target = self._multi_label_target(batch, logits) > 0.5
        pred = logits > 0
        rows = []
        for m in masks.values():
            p, t = pred[m], target[m]
            rows.append(torch.stack([(p & t).sum(), (p & ~t).sum(), (~p & t).sum()]))
        counts = self._global_sum(torch.stack(rows).to(logits.dtype))  # (len(masks), 3)
        scores = {}
        for name, (tp, fp, fn) in zip(masks, counts.unbind()):
            scores[name] = 2 * tp / (2 * tp + fp + fn).clamp_min(1)
            self.log(name, scores[name], prog_bar=True, batch_size=1, sync_dist=True, reduce_fx="max")
        return scores

    def accuracies(self, batch: GraphPartition, masks: dict[str, Tensor]) -> dict[str, Tensor]:
        """Global accuracy of each named vertex mask, logged under its name, from ONE forward pass.

        Every mask's (correct, total) counts travel in one all-reduce over graph servers.
        """
        logits = self(self.graph(batch))
        pred = logits.argmax(dim=-1)
        hits = pred == batch.y
        counts = torch.stack([torch.stack([hits[m].sum(), m.sum()]) for m in masks.values()])
        counts = self._global_sum(counts.to(logits.dtype))  # (len(masks), 2)
        accs = {}
        empty = [name for name, total in zip(masks, counts[:, 1].tolist()) if total == 0]
        if empty:  # 0 correct of 0: logged as 0, which must not pass for a measured accuracy
            rank_zero_warn(
                f"{empty}: the mask selects no vertex in the whole graph, so the accuracy is logged as 0.0 "
                "(give data a non-empty mask, or skip the loop, e.g. Trainer(limit_val_batches=0))",
                category=UserWarning,
            )
        for name, (correct, total) in zip(masks, counts.unbind()):
            accs[name] = correct / total.clamp_min(1)
            # already global and equal on every server: MAX over identical values is that value, and tells
            # Lightning the epoch metric is synced (no sync_dist hint); a no-op in one process
            self.log(name, accs[name], prog_bar=True, batch_size=1, sync_dist=True, reduce_fx="max")
        return accs

    @override
    def validation_step(self, batch: GraphPartition, batch_idx: int) -> Tensor:
        if batch.multi_label:
            return self.micro_f1s(batch, {"val_f1": batch.val_mask})["val_f1"]
        return self.accuracies(batch, {"val_acc": batch.val_mask})["val_acc"]

    @override
    def test_step(self, batch: GraphPartition, batch_idx: int) -> Tensor:
        if batch.multi_label:
            return self.micro_f1s(batch, {"test_f1": batch.test_mask})["test_f1"]
        return self.accuracies(batch, {"test_acc": batch.test_mask})["test_acc"]

    @override
    def predict_step(self, batch: GraphPartition, batch_idx: int) -> Tensor:
        """Class predictions ``(n_local,)`` of this server's vertices, in ``batch.local_nodes`` order
        (``DorylusStrategy`` gathers them into ``(num_global_nodes,)``, global order, on every rank);
        multi-label: the 0/1 predictions ``logits > 0``, ``(n_local, C)`` int64."""
        logits = self(self.graph(batch))
        if batch.multi_label:
            return (logits > 0).long()
        return logits.argmax(dim=-1)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
