"""What the runtime's parts need of Lightning, as callables the strategy passes: the parts (membership,
fallback, joins) never hold the strategy, and none of them has to import another to name this type."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer

if TYPE_CHECKING:
    import lightning.pytorch as pl


@dataclass(frozen=True)
class LightningSide:
    """What the runtime's parts need of Lightning, as callables the strategy passes (never the strategy)."""

    module: Callable[[], pl.LightningModule]
    optimizer: Callable[[], Optimizer]
    schedulers: Callable[[], list[Any]]
    device: Callable[[], torch.device]
    ranks_changed: Callable[[], None]  # Lightning's rank-zero-only parts follow this member's rank
