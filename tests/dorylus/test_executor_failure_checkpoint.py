"""An executor that gives up stops training with its own error, and Lightning's checkpoint of the last
finished epoch resumes to exactly the uninterrupted run (issue: "bounded retries, then training stops with a
clear error and Lightning's normal checkpointing still works")."""

from __future__ import annotations

import datetime
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dorylus import DorylusStrategy
from lightning_dorylus.data import partition_graph
from lightning_dorylus.executors import ExecutorError, InlineExecutor, TensorOpRequest
from tests.dorylus.scripts.exact_run import INTERVAL_SIZE, loader, make_graph, make_model

EPOCHS = 4
pytestmark = pytest.mark.timeout(300)


class GiveUpAtEpoch(Callback):
    """From the start of ``epoch`` on, every request fails the way a resilient executor reports giving up
    (retries exhausted): an ``ExecutorError`` raised from the request's future."""

    def __init__(self, executor: InlineExecutor, epoch: int) -> None:
        self.epoch = epoch
        submit = executor.submit

        def failing_submit(request: TensorOpRequest) -> Future:
            if not self.failing:
                return submit(request)
            future: Future = Future()
            where = f"op {request.op!r} (interval {request.interval})"
            future.set_exception(ExecutorError(f"{where} failed after 3 attempt(s): no result in time"))
            return future

        self.failing = False
        executor.submit = failing_submit  # type: ignore[method-assign]

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.failing = trainer.current_epoch >= self.epoch


def _fit(
    strategy: DorylusStrategy, model: LightningModule, root: Path, callbacks=(), ckpt_path=None
) -> Trainer:
    part = partition_graph(make_graph(), 1, partitioner="metis", interval_size=INTERVAL_SIZE)[0]
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_epochs=EPOCHS, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root,
        callbacks=[ModelCheckpoint(dirpath=root / "ckpt", save_top_k=-1, every_n_epochs=1), *callbacks],
    )
    try:
        trainer.fit(model, train_dataloaders=loader(part), ckpt_path=ckpt_path)
    finally:  # a 1-process group lives in this (pytest) process; leave nothing behind
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return trainer


def test_executor_giving_up_leaves_a_checkpoint_that_resumes_exactly(tmp_path: Path) -> None:
    timeout = datetime.timedelta(seconds=30)
    reference = make_model("gcn")
    _fit(DorylusStrategy(executor="inline", timeout=timeout), reference, tmp_path / "ref")

    executor = InlineExecutor()
    give_up = GiveUpAtEpoch(executor, epoch=2)
    model = make_model("gcn")
    strategy = DorylusStrategy(executor=executor, timeout=timeout)
    with pytest.raises(ExecutorError, match=r"op .apply_vertex.forward. \(interval 0\) failed after 3"):
        _fit(strategy, model, tmp_path / "run", callbacks=[give_up])
    saved = sorted(p.name for p in (tmp_path / "run" / "ckpt").iterdir())
    assert saved == ["epoch=0-step=1.ckpt", "epoch=1-step=2.ckpt"]  # whole epochs only, nothing half-written
    torch.load(tmp_path / "run" / "ckpt" / saved[-1], weights_only=True)  # loads without unpickling code

    resumed = make_model("gcn")
    _fit(DorylusStrategy(executor="inline", timeout=timeout), resumed, tmp_path / "resume",
         ckpt_path=tmp_path / "run" / "ckpt" / saved[-1])
    for (name, a), b in zip(resumed.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0, msg=name)
