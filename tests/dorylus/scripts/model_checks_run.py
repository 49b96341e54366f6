"""Worker script of ``tests/dorylus/test_model_checks.py``: one rank of a 2-server fit that must fail before
any update with a named error; writes ``error_rank<R>.json`` (``{"type": ..., "message": ...}``) into the
working folder and exits 0 (a file per rank: two ranks' lines on one shared stdout can run together).

Cases: ``pyg`` (refused at setup), ``too_few`` (a plain DataLoader: the first step's loss names the error)
and ``too_few_early`` (a ``PartitionLoader``: the last layer's width is checked before the first epoch). The
record also holds how many training epochs had started.

Usage: python model_checks_run.py pyg|too_few|too_few_early
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer

from lightning_dorylus import DorylusStrategy
from lightning_dorylus.data import PartitionLoader, partition_graph
from lightning_dorylus.model_checks import LabelRangeError
from tests.dorylus.scripts.exact_run import INTERVAL_SIZE, NUM_CLASSES, NUM_FEATURES, loader, make_graph
from tests.dorylus.scripts.user_module_run import UserGCN
from tests.dorylus.test_model_checks import PygGCN


class EpochStarts(Callback):
    """Counts the training epochs that started."""

    def __init__(self) -> None:
        self.started = 0

    def on_train_epoch_start(self, trainer: Trainer, pl_module: object) -> None:
        self.started += 1


def main() -> None:
    case = sys.argv[1]
    torch.set_num_threads(1)
    parts = partition_graph(make_graph(), 2, interval_size=INTERVAL_SIZE)
    pyg = case == "pyg"
    model = PygGCN(NUM_FEATURES, 8, NUM_CLASSES) if pyg else UserGCN(NUM_FEATURES, 8, NUM_CLASSES - 1)
    model = model.double()  # make_graph's features are float64
    trainer = Trainer(accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                      limit_val_batches=0, callbacks=[starts := EpochStarts()],
                      strategy=DorylusStrategy(executor="inline", timeout=datetime.timedelta(seconds=60)))
    try:
        part = parts[trainer.global_rank]
        trainer.fit(model, PartitionLoader(part) if case == "too_few_early" else loader(part))
    except (TypeError, LabelRangeError) as err:
        assert trainer.global_step == 0
        record = {"type": type(err).__name__, "message": str(err), "epochs_started": starts.started}
        Path(f"error_rank{trainer.global_rank}.json").write_text(json.dumps(record))
        return
    raise AssertionError(f"case {case!r} trained without the named error")


if __name__ == "__main__":
    main()
