"""Checks of a user's module that turn a late, bare torch error into a named one before any weight moves.

* :func:`check_foreign_layers` (setup): a PyG message-passing layer outside a Dorylus layer. A graph
  server's ``batch.edge_index`` holds local ids whose sources include ghost vertices (``n_local ..
  n_local + n_ghost - 1``); their rows exist only inside Dorylus layers (``self.scatter``), so a PyG layer
  given ``(n_local, F)`` rows indexes past them (issue 32: a bare ``IndexError``), or, on one server,
  works and then fails with more. PyG layers *inside* a ``DorylusLayer`` (run on ``self.scatter``'s rows)
  are the user's own GA and are left alone.
* :class:`LabelRangeCheck` (first training step): a classification loss (``F.cross_entropy``,
  ``F.nll_loss``) whose input has fewer class scores than the graph's labels need (issue 32: torch's bare
  "Target out of bounds" 24 s in). The label count is the whole graph's (every server's ``batch.y``,
  all-reduced once before the step), so every server raises the same error at the same call and none is
  left waiting in a collective.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_dorylus.nn import DorylusLayer

CLASSIFICATION_LOSSES = (F.cross_entropy, F.nll_loss)


class LabelRangeError(ValueError):
    """The model has fewer outputs than the graph has classes."""


def check_foreign_layers(module: nn.Module) -> None:
    """Raises ``TypeError`` naming the first PyG ``MessagePassing`` layer of ``module`` that is not inside a
    ``DorylusLayer``, and what to use instead."""
    try:
        from torch_geometric.nn import MessagePassing
    except ImportError:  # pragma: no cover - PyG comes with the package's models
        return
    pending: list[tuple[str, nn.Module]] = list(module.named_children())
    while pending:
        name, child = pending.pop(0)
        if isinstance(child, DorylusLayer):
            continue  # its own GA: it may run PyG code on self.scatter's local + ghost rows
        if isinstance(child, MessagePassing):
            raise TypeError(
                f"{type(module).__name__}.{name} ({type(child).__module__}.{type(child).__name__}) is a PyG "
                "message-passing layer outside a Dorylus layer: under DorylusStrategy a graph server's "
                "batch.edge_index has ghost vertices as sources (local ids n_local and up), whose rows exist "
                "only inside Dorylus layers, so it would index past its input or aggregate the wrong rows. "
                "Use a Dorylus layer (lightning_dorylus.nn.GCNConv, GATConv, SAGEConv), or call it inside a "
                "DorylusLayer of your own on self.scatter(x, graph)'s rows (docs/dorylus-own-model.md, 'Your "
                "own layer')"
            )
        pending.extend((f"{name}.{sub}", grandchild) for sub, grandchild in child.named_children())


def num_labels(y: Tensor | None) -> int:
    """``max(y) + 1`` over the labelled vertices (``-1``: none) of an integer label tensor, else 0."""
    if y is None or y.is_floating_point() or y.numel() == 0:
        return 0
    return int(y.max().clamp(min=-1)) + 1


class LabelRangeCheck(TorchFunctionMode):
    """Raises :class:`LabelRangeError` when a classification loss gets fewer class scores than
    ``num_classes`` (the graph's ``max(y) + 1``); changes nothing otherwise."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.num_classes = num_classes

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in CLASSIFICATION_LOSSES and self.num_classes:
            scores = kwargs.get("input", args[0] if args else None)
            if isinstance(scores, Tensor) and scores.dim() >= 1:
                width = scores.shape[1] if scores.dim() > 1 else scores.shape[0]
                if width < self.num_classes:
                    raise LabelRangeError(
                        f"{func.__name__} got {width} class scores per vertex, but the graph's labels "
                        f"(batch.y on every graph server) go up to {self.num_classes - 1}: the model needs "
                        f"{self.num_classes} outputs (build it with num_classes=datamodule.num_classes), "
                        "else torch fails with 'Target out of bounds' or trains on wrong targets"
                    )
        return func(*args, **kwargs)
