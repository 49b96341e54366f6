"""Catches torch's own dropout (``F.dropout``, ``nn.Dropout``) in a user model trained on several servers.

``F.dropout`` draws its mask from the process's torch generator, so with N graph servers each server draws
masks for its own rows from its own stream: the run trains a different model than ``strategy="auto"`` (and
than any other number of servers), silently. Dorylus's dropout
(:func:`lightning_dorylus.nn.dropout.row_dropout`) hashes global vertex ids instead, so every partitioning
draws the single-process masks.

:class:`TorchDropoutCheck` is a ``TorchFunctionMode`` the strategy holds around the first training step of a
fit only (a model that calls ``F.dropout`` does so in every step, and later steps then pay nothing); it warns
once, with the fix, and changes no result.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from torch.overrides import TorchFunctionMode

#: torch's dropout functions (``nn.Dropout*`` modules call them); the value names the "training" keyword.
TORCH_DROPOUTS: dict[Any, str] = {
    F.dropout: "training", F.dropout1d: "training", F.dropout2d: "training", F.dropout3d: "training",
    F.alpha_dropout: "training", F.feature_alpha_dropout: "training", torch.dropout: "train",
}

FIX = (
    "use lightning_dorylus.nn.dropout.row_dropout(x, graph.partition.local_nodes, p, self.training, key) "
    "with key = lightning_dorylus.nn.dropout.dropout_key(seed, self.current_epoch, self.global_step, site) "
    "(seed: torch.initial_seed() when the model is built; site: 0, 1, ... per dropout call), whose masks "
    "depend on global vertex ids only (docs/dorylus-own-model.md, 'Dropout'); GCN/GAT/GraphSAGE do this "
    "already"
)


def torch_dropout_message(name: str, world_size: int) -> str:
    """The warning for ``name`` (e.g. ``"dropout"``) called in training mode on ``world_size`` servers."""
    return (
        f"torch.nn.functional.{name} (or an nn.Dropout module) ran in training mode under DorylusStrategy "
        f"with {world_size} graph servers: each server draws its masks from its own torch generator, so this "
        f"run trains a different model than strategy='auto' (or any other number of servers). To get the "
        f"single-process masks, {FIX}."
    )


class TorchDropoutCheck(TorchFunctionMode):
    """Warns (once per instance) when a torch dropout runs in training with ``p > 0``; changes nothing."""

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self.world_size = world_size
        self.caught: str | None = None  # the first dropout function seen

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        flag = TORCH_DROPOUTS.get(func)
        if flag is not None and self.caught is None and _active(func, flag, args, kwargs):
            self.caught = getattr(func, "__name__", str(func))
            rank_zero_warn(torch_dropout_message(self.caught, self.world_size), category=UserWarning)
        return func(*args, **kwargs)


def _active(func: Any, flag: str, args: tuple, kwargs: dict) -> bool:
    """Whether this call drops anything: ``p > 0`` and training (F.dropout's defaults: 0.5, True)."""
    p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
    training = kwargs.get(flag, args[2] if len(args) > 2 else func is not torch.dropout)
    return bool(training) and float(p) > 0.0
