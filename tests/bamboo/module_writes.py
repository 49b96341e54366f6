"""A callback of the Bamboo worker scripts: does anything write into the user's module during training?"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


class ModuleWrites(Callback):
    """Record, from train start to train end, which object the module's body is and which names its
    ``__dict__`` holds, at every batch's start and end (validation batches too); written at train end to
    ``where(trainer)`` as ``[[hook, batch_idx, id(body), sorted keys], ...]``."""

    def __init__(self, where: Callable[[Trainer], Path]) -> None:
        self.where = where
        self.seen: list[list[Any]] = []

    def _record(self, hook: str, pl_module: LightningModule, batch_idx: int = -1) -> None:
        self.seen.append([hook, batch_idx, id(pl_module.pipeline), sorted(pl_module.__dict__)])

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._record("on_train_start", pl_module)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._record("on_train_batch_start", pl_module, batch_idx)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._record("on_train_batch_end", pl_module, batch_idx)

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        self._record("on_validation_batch_end", pl_module, batch_idx)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._record("on_train_end", pl_module)
        self.where(trainer).write_text(json.dumps(self.seen))


def assert_no_writes(seen: list[list[Any]], where: str) -> tuple[int, list[str]]:
    """Every record names the same body object and the same ``__dict__`` keys as the first (train start);
    returns those."""
    _, _, body, names = seen[0]
    assert "pipeline_loss" in names and "pipeline_inputs" in names, where  # wrapped once, at setup
    for hook, batch_idx, other, others in seen:
        at = f"{where} {hook} batch {batch_idx}"
        assert other == body, f"{at}: the module's body was replaced"
        assert others == names, f"{at}: __dict__ changed: {sorted(set(others) ^ set(names))}"
    return body, names
