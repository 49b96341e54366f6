"""What the signal and crash tests' workers add to ``scripts/train_elastic.py``: their PID for the test to
signal, a hold at a step boundary (so a signal lands at a known step), and a model whose loss raises on one
member (an error in user code, not a preemption)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch import Callback
from torch import Tensor

from lightning_bamboo.callbacks import BambooNotices
from tests.bamboo.pipe_mlp import PipeMLP
from tests.process import write_atomically

HOLD_S = 120.0


class SignalTarget(Callback):
    """Writes ``<out>/pid_member{m}`` at setup; with ``hold=(step, until)`` (or a list of them), at that step
    boundary (0: the end of Lightning's sanity check) writes ``<out>/reached{step}_member{m}`` and waits until
    ``until`` holds: ``"sigterm"`` = this member's SIGTERM notice is pending (BambooNotices saw the signal),
    ``"release"`` = ``<out>/release`` exists, ``"file"`` = ``<out>/release{step}`` exists."""

    def __init__(
        self, out: Path, member: int, hold: tuple[int, str] | list[tuple[int, str]] | None
    ) -> None:
        self.out, self.member = out, member
        self.holds = [hold] if isinstance(hold, tuple) else list(hold or [])

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        write_atomically(self.out / f"pid_member{self.member}", str(os.getpid()))

    def on_sanity_check_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Step 0: hold at the end of Lightning's sanity check."""
        self.on_train_batch_end(trainer, pl_module, None, None, 0)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        held = [h for h in self.holds if h[0] == trainer.global_step]
        if not held:
            return
        step, until = held[0]
        (self.out / f"reached{step}_member{self.member}").write_text("")
        notices = [c for c in trainer.callbacks if isinstance(c, BambooNotices)]
        deadline = time.monotonic() + HOLD_S
        while not self._released(until, notices, step):
            if time.monotonic() > deadline:
                raise TimeoutError(f"member {self.member} held at step {step} for {HOLD_S}s: no {until}")
            time.sleep(0.01)

    def _released(self, until: str, notices: list[BambooNotices], step: int) -> bool:
        if until == "sigterm":
            return any(n.watcher is not None and n.watcher.pending() is not None for n in notices)
        return (self.out / ("release" if until == "release" else f"release{step}")).exists()


class UserBugMLP(PipeMLP):
    """``PipeMLP`` whose loss (the user code Bamboo runs in the last stage) raises ``ValueError("user bug")``
    on member ``member`` at global step ``step``."""

    def __init__(self, member: int, step: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bug_member, self.bug_step = member, step

    def pipeline_loss(self, outputs: Tensor, batch: tuple[Tensor, Tensor]) -> Tensor:
        strategy = self.trainer.strategy
        if getattr(strategy, "member", None) == self.bug_member and self.trainer.global_step == self.bug_step:
            raise ValueError("user bug")
        return super().pipeline_loss(outputs, batch)
