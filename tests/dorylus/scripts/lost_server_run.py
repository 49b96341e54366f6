"""Worker script: 2 graph servers train the float64 GCN with a checkpoint every epoch; one can be killed.

Launched by ``tests/dorylus/test_lost_server.py``, one process per graph server started together. With
``--kill-rank R --kill-epoch E`` rank R SIGKILLs itself at the start of epoch E (a lost machine); a survivor
records the exception that ends its fit in ``error_rank{r}.json`` (written atomically). ``--resume`` resumes
from ``OUT/ckpt/last.ckpt``. Every rank that finishes writes ``weights_rank{r}.safetensors``.

Usage: python lost_server_run.py OUT --epochs 4 [--kill-rank 1 --kill-epoch 2] [--resume]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import save_file

from lightning_dorylus import DorylusStrategy
from lightning_dorylus.data import partition_graph
from tests.dorylus.scripts.exact_run import INTERVAL_SIZE, loader, make_graph, make_model


class KillAt(Callback):
    """SIGKILLs this process at the start of epoch ``epoch`` if it is graph server ``rank``."""

    def __init__(self, rank: int | None, epoch: int | None) -> None:
        self.rank, self.epoch = rank, epoch

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.global_rank == self.rank and trainer.current_epoch == self.epoch:
            os.kill(os.getpid(), signal.SIGKILL)


class RecordError(Callback):
    """Writes the exception that ends the fit (Lightning calls ``on_exception`` before its teardown)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        record = {"type": type(exception).__name__, "message": str(exception),
                  "lost": getattr(exception, "lost", None),
                  "collective": getattr(exception, "collective", None),
                  "cause": type(exception.__cause__).__name__ if exception.__cause__ else None}
        path = self.out / f"error_rank{trainer.global_rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.rename(path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--kill-rank", type=int, default=None)
    parser.add_argument("--kill-epoch", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    partitions = partition_graph(make_graph(), 2, partitioner="metis", interval_size=INTERVAL_SIZE)
    strategy = DorylusStrategy(executor="inline", timeout=datetime.timedelta(seconds=180))
    checkpoints = ModelCheckpoint(dirpath=args.out / "ckpt", save_last=True, every_n_epochs=1)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=args.epochs, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=args.out, limit_val_batches=0,
        callbacks=[checkpoints, KillAt(args.kill_rank, args.kill_epoch), RecordError(args.out)],
    )
    model = make_model("gcn")
    part = partitions[trainer.global_rank]
    trainer.fit(model, train_dataloaders=loader(part),
                ckpt_path=str(args.out / "ckpt" / "last.ckpt") if args.resume else None)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(args.out / f"weights_rank{trainer.global_rank}.safetensors"))


if __name__ == "__main__":
    main()
