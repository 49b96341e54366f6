"""Lightning's checkpoint hooks for one member's stages: what the strategy saves and loads when Lightning
calls ``save_checkpoint``/``load_checkpoint`` (``ckpt_path``, ``ModelCheckpoint``).

Saving writes a sharded folder (one file per member, :mod:`lightning_bamboo.checkpoint.sharded`). Loading
reads a Bamboo folder (any stage and pipeline count) or an ordinary Lightning ``.ckpt`` file
(``torch.load(weights_only=True)``), whose whole model and optimizer state are split into this member's
stages and replica by parameter name. :class:`StageCheckpoints` remembers what was read, so the replica
(the successor's stage, in the same checkpoint) is loaded from it rather than transferred.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.optim import Optimizer

from lightning_bamboo.checkpoint import sharded as ckpt
from lightning_bamboo.pipeline.ties import aliases

if TYPE_CHECKING:  # the runtime floor is above this one: only its types are named here
    from lightning_bamboo.runtime.formation import Formation
    from lightning_bamboo.runtime.generation import Generation


class StageCheckpoints:
    """The strategy's checkpoint part: its stages (and replica) to and from Lightning checkpoints."""

    def __init__(self, formation: Formation, gen: Generation) -> None:
        self.formation, self.gen = formation, gen
        self.path: Path | None = None  # a Bamboo checkpoint folder being loaded
        self.whole: dict[str, Any] | None = None  # an ordinary .ckpt's whole model being loaded
        self.group_names: list[list[str]] | None = None  # the whole model's param groups, before the split

    def _tied(self) -> dict[str, str]:
        return aliases(self.formation.ties, self.formation.body_attr)

    def save(self, checkpoint: dict[str, Any], filepath: Any, is_global_zero: bool,
             barrier: Callable[[], None]) -> None:
        """Write a sharded checkpoint folder atomically (a temporary folder, then a rename). Pipeline 0's
        members write their param groups' names; one file per member, named by its first stage (a member
        holding several stages after a failover lists all their parameters in it)."""
        stage = self.gen.stage_index if self.gen.pipeline_index == 0 else None
        if self.formation.ties:
            checkpoint[ckpt.TIED_KEY] = self._tied()
        ckpt.save_sharded(checkpoint, filepath, is_global_zero, barrier, stage=stage)

    def load(self, checkpoint_path: Any, module: nn.Module, optimizers: list[Optimizer]) -> dict[str, Any]:
        """This member's stages (and their optimizer state) and the trainer state; nothing is unpickled."""
        path = Path(checkpoint_path)
        self.path = self.whole = None
        if path.is_file():
            checkpoint, self.whole = ckpt.load_lightning_checkpoint(
                path, module, optimizers, self.group_names, self._tied()
            )
            return checkpoint
        if not path.is_dir():
            raise FileNotFoundError(
                f"checkpoint_path {str(path)!r} does not exist (expected a BambooStrategy checkpoint folder "
                "or an ordinary Lightning .ckpt file)"
            )
        self.path = path
        return ckpt.load_sharded(checkpoint_path, module, optimizers)

    def load_model(self, module: nn.Module | None, checkpoint: dict[str, Any], strict: bool) -> None:
        """The stages' weights Lightning hands back from :meth:`load`, then the replica's (same read)."""
        assert module is not None, "the strategy has no LightningModule attached"
        module.load_state_dict(checkpoint["state_dict"], strict=strict)
        self._load_replica(None)

    def load_optimizers(
        self, module: nn.Module | None, optimizers: list[Optimizer], checkpoint: dict[str, Any]
    ) -> None:
        """The stages' optimizer state (keyed by parameter name), then the replica's from the same read."""
        assert module is not None, "the strategy has no LightningModule attached"
        for optimizer, state in zip(optimizers, checkpoint["optimizer_states"]):
            ckpt.load_named_optimizer_state(module, optimizer, state)
        if self.gen.replica_optimizer is not None:
            self._load_replica(self.gen.replica_optimizer)

    def _load_replica(self, optimizer: Optimizer | None) -> None:
        """The replica's layers (``optimizer``: and its optimizer state) from the checkpoint just read."""
        replica, attr = self.gen.replica, self.formation.body_attr
        if replica is not None and self.path is not None:
            ckpt.load_replica(self.path, replica, attr, optimizer)
        if replica is not None and self.whole is not None:
            ckpt.load_replica_from_memory(self.whole, replica, attr, optimizer)
