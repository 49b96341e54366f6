"""What each graph server's training loss is, so that the SUM of the servers' weight gradients is the
full-graph gradient (``DorylusStrategy(loss_reduction=...)``; the class docstring of
:class:`~lightning_dorylus.strategy.DorylusStrategy` says why the weight goes on the loss).

``"mean"``: a mean over this partition's train vertices, weighted by the server's share of the train
vertices before backward (:func:`train_share`); ``"sum"``: already a share of a global mean or sum (no
weighting). The module may say which (``dorylus_loss_reduction``: :func:`resolve_loss_reduction`).
"""

from __future__ import annotations

from typing import Any

from lightning_dorylus.data.partition import GraphPartition
from lightning_dorylus.options import LOSS_REDUCTIONS, LossReduction


def resolve_loss_reduction(module: Any, chosen: LossReduction | None) -> LossReduction:
    """The strategy's ``loss_reduction`` (``chosen``), else the module's ``dorylus_loss_reduction``, else
    ``"mean"``; a module attribute outside ``"mean"``/``"sum"`` or one that contradicts ``chosen`` raises."""
    declared = getattr(module, "dorylus_loss_reduction", None)
    name = type(module).__name__
    if declared is not None and declared not in LOSS_REDUCTIONS:
        raise ValueError(f"{name}.dorylus_loss_reduction={declared!r}: expected 'mean' or 'sum'")
    if chosen is not None and declared is not None and chosen != declared:
        raise ValueError(
            f"DorylusStrategy(loss_reduction={chosen!r}) but {name}.dorylus_loss_reduction={declared!r}: "
            f"the module says what its loss is; drop the strategy argument, or set the module's attribute"
        )
    return chosen or declared or "mean"


def train_share(batch: GraphPartition, rank: int) -> float:
    """``n_train_local / num_train_global``: the weight of graph server ``rank``'s local-mean loss."""
    n_train = int(batch.train_mask.sum())
    if n_train == 0 and batch.num_train_global > 0:
        raise ValueError(
            f"graph server {rank} owns no train vertex, so a mean over its train vertices is "
            "0 / 0 (NaN, and NaN ghost gradients for every server) with loss_reduction='mean': compute "
            "the loss as F.cross_entropy(out[mask], y[mask], reduction='sum') / batch.num_train_global "
            "and set loss_reduction='sum' (as NodeClassifier), or partition so that every server has some"
        )
    return n_train / batch.num_train_global if batch.num_train_global else 1.0
