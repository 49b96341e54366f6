"""Checks of a user's module that turn a late, bare torch error into a named one before any weight moves.

* :func:`check_foreign_layers` (setup): a PyG message-passing layer outside a Dorylus layer. A graph
  server's ``batch.edge_index`` holds local ids whose sources include ghost vertices (``n_local ..
  n_local + n_ghost - 1``); their rows exist only inside Dorylus layers (``self.scatter``), so a PyG layer
  given ``(n_local, F)`` rows indexes past them (issue 32: a bare ``IndexError``), or, on one server,
  works and then fails with more. PyG layers *inside* a ``DorylusLayer`` (run on ``self.scatter``'s rows)
  are the user's own GA and are left alone.
* :func:`check_output_width` (before the first epoch): the model's last layer gives fewer class scores
  than the graph's labels need (issue 32: torch's bare "Target out of bounds" 24 s in). Its width is read
  without a forward pass where the last layer says it (:func:`output_width`: a Dorylus layer's
  ``output_width``, an ``nn.Linear``'s ``out_features``).
* :class:`LabelRangeCheck` (first training step), the fallback where the width cannot be read so (a last
  layer of another kind, or no partition to count labels on before the step): a classification loss
  (``F.cross_entropy``, ``F.nll_loss``) whose input has fewer class scores than the labels need.

The label count is the whole graph's (every server's ``y``, all-reduced), so every server raises the same
error at the same point and none is left waiting in a collective.
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


def output_width(module: nn.Module) -> tuple[str, int] | None:
    """``(name, width)`` of ``module``'s last layer (the last submodule, in registration order, that holds
    parameters; a Dorylus layer counts as one) when its output width is known without a forward pass: a
    Dorylus layer's ``output_width`` or an ``nn.Linear``'s ``out_features``. ``None`` otherwise (a last
    ``LayerNorm``, a user layer without ``output_width``): the first training step's loss checks then."""
    last: tuple[str, nn.Module] | None = None
    pending: list[tuple[str, nn.Module]] = list(module.named_children())
    while pending:
        name, child = pending.pop(0)
        nested = [] if isinstance(child, DorylusLayer) else list(child.named_children())
        if isinstance(child, DorylusLayer) or next(child.parameters(recurse=False), None) is not None:
            last = (name, child)
        pending[:0] = [(f"{name}.{sub}", grandchild) for sub, grandchild in nested]  # depth first, in order
    if last is None:
        return None
    name, layer = last
    width = layer.out_features if isinstance(layer, nn.Linear) else getattr(layer, "output_width", None)
    return (f"{type(module).__name__}.{name}", int(width)) if isinstance(width, int) else None


def label_range_error(source: str, width: int, num_classes: int) -> LabelRangeError:
    """The error for ``width`` class scores per vertex (given by ``source``) below ``num_classes`` labels."""
    return LabelRangeError(
        f"{source} got {width} class scores per vertex, but the graph's labels (batch.y on every graph "
        f"server) go up to {num_classes - 1}: the model needs {num_classes} outputs (build it with "
        "num_classes=datamodule.num_classes), else torch fails with 'Target out of bounds' or trains on "
        "wrong targets"
    )


def check_output_width(module: nn.Module, num_classes: int) -> bool:
    """Raises :class:`LabelRangeError` when ``module``'s last layer (:func:`output_width`) gives fewer than
    ``num_classes`` outputs; ``True`` when the width was known (checked), ``False`` when the first step's
    :class:`LabelRangeCheck` must check instead."""
    last = output_width(module)
    if last is None:
        return False
    name, width = last
    if num_classes and width < num_classes:
        raise label_range_error(f"{name} (the model's last layer)", width, num_classes)
    return True


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
                    raise label_range_error(func.__name__, width, self.num_classes)
        return func(*args, **kwargs)
