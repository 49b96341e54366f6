"""A killed executor worker leaves a trace (issue 32: it was recovered with none): one warning the first time,
and the count in the metric ``executor_recoveries`` that the strategy logs every step; the run still trains
exactly what an undisturbed run trains. One graph server in this process, the local pool of one worker."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything

from lightning_dorylus import DorylusStrategy
from lightning_dorylus.data import partition_graph
from tests.dorylus.scripts.exact_run import INTERVAL_SIZE, NUM_CLASSES, NUM_FEATURES, loader, make_graph
from tests.dorylus.scripts.user_module_run import UserGCN


class KillWorker(Callback):
    """SIGKILLs the pool's worker at the start of the given epochs (the next request finds it dead)."""

    def __init__(self, epochs: tuple[int, ...]) -> None:
        self.epochs = epochs
        self.seen: list[float] = []

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.current_epoch in self.epochs:
            os.kill(trainer.strategy.executor.worker_pids[0], signal.SIGKILL)  # type: ignore[union-attr]

    def on_train_batch_end(self, trainer: Trainer, *args: object) -> None:
        self.seen.append(float(trainer.callback_metrics["executor_recoveries"]))


def _fit(tmp_path: Path, kill: tuple[int, ...]) -> tuple[dict[str, torch.Tensor], list[float]]:
    seed_everything(0, verbose=False)
    model = UserGCN(NUM_FEATURES, 8, NUM_CLASSES, optimizer="sgd", lr=0.1, dropout=0.0).double()
    [part] = partition_graph(make_graph(), 1, interval_size=INTERVAL_SIZE)
    killer = KillWorker(kill)
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=4, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                      limit_val_batches=0, default_root_dir=tmp_path, callbacks=[killer],
                      strategy=DorylusStrategy(executor="local", executor_options={"num_workers": 1}))
    try:
        trainer.fit(model, loader(part))
    finally:  # a 1-process group was created in this (pytest) process
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, killer.seen


def test_killed_workers_are_counted_warned_once_and_change_nothing(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    undisturbed, counts = _fit(tmp_path / "calm", kill=())
    assert counts == [0.0] * 4
    with caplog.at_level(logging.WARNING, logger="lightning_dorylus.executors.local"):
        killed, counts = _fit(tmp_path / "killed", kill=(1, 2))
    assert counts == [0.0, 1.0, 2.0, 2.0]  # the metric after each epoch's step
    warned = [r for r in caplog.records if r.name == "lightning_dorylus.executors.local"]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING  # the first recovery only
    for key, value in undisturbed.items():
        assert torch.equal(killed[key], value), key  # recovered bit-exactly
