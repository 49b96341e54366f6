"""What a member loads from a checkpoint Lightning hands the strategy (``ckpt_path``): a Bamboo checkpoint
folder (any stage and pipeline count) or an ordinary Lightning ``.ckpt`` file (``torch.load(weights_only=
True)``), whose whole model and optimizer state are split into this member's stages and replica by
parameter name. Lightning loads the stages through the strategy's hooks; :class:`CheckpointLoad` remembers
what was read so the replica (the successor's stage, in the same checkpoint) is loaded from it rather than
transferred.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn
from torch.optim import Optimizer

from lightning_bamboo.checkpoint import sharded as ckpt


class CheckpointLoad:
    """The checkpoint being loaded into this member (see the module docstring)."""

    def __init__(self) -> None:
        self.path: Path | None = None  # a Bamboo checkpoint folder
        self.whole: dict[str, Any] | None = None  # an ordinary .ckpt's whole model
        self.group_names: list[list[str]] | None = None  # the whole model's param groups, before the split

    def load(self, checkpoint_path: Any, module: nn.Module, optimizers: list[Optimizer],
             tied: dict[str, str]) -> dict[str, Any]:
        """This member's stages (and their optimizer state) and the trainer state; nothing is unpickled."""
        path = Path(checkpoint_path)
        self.path = self.whole = None
        if path.is_file():
            checkpoint, self.whole = ckpt.load_lightning_checkpoint(
                path, module, optimizers, self.group_names, tied
            )
            return checkpoint
        if not path.is_dir():
            raise FileNotFoundError(
                f"checkpoint_path {str(path)!r} does not exist (expected a BambooStrategy checkpoint folder "
                "or an ordinary Lightning .ckpt file)"
            )
        self.path = path
        return ckpt.load_sharded(checkpoint_path, module, optimizers)

    def load_replica(self, replica: nn.Module | None, attr: str, optimizer: Optimizer | None) -> None:
        """The replica's layers (``optimizer``: and its optimizer state) from the checkpoint just read."""
        if replica is not None and self.path is not None:
            ckpt.load_replica(self.path, replica, attr, optimizer)
        if replica is not None and self.whole is not None:
            ckpt.load_replica_from_memory(self.whole, replica, attr, optimizer)
