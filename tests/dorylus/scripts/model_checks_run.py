"""Worker script of ``tests/dorylus/test_model_checks.py``: one rank of a 2-server fit that must fail before
any update with a named error; prints ``model_checks_run: rank R: <type>: <message>`` and exits 0.

Usage: python model_checks_run.py pyg|too_few
"""

from __future__ import annotations

import datetime
import sys

import torch
from lightning.pytorch import Trainer

from lightning_dorylus import DorylusStrategy
from lightning_dorylus.data import partition_graph
from lightning_dorylus.model_checks import LabelRangeError
from tests.dorylus.scripts.exact_run import INTERVAL_SIZE, NUM_CLASSES, NUM_FEATURES, loader, make_graph
from tests.dorylus.scripts.user_module_run import UserGCN
from tests.dorylus.test_model_checks import PygGCN


def main() -> None:
    case = sys.argv[1]
    torch.set_num_threads(1)
    parts = partition_graph(make_graph(), 2, interval_size=INTERVAL_SIZE)
    pyg = case == "pyg"
    model = PygGCN(NUM_FEATURES, 8, NUM_CLASSES) if pyg else UserGCN(NUM_FEATURES, 8, NUM_CLASSES - 1)
    model = model.double()  # make_graph's features are float64
    trainer = Trainer(accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                      limit_val_batches=0,
                      strategy=DorylusStrategy(executor="inline", timeout=datetime.timedelta(seconds=60)))
    try:
        trainer.fit(model, loader(parts[trainer.global_rank]))
    except (TypeError, LabelRangeError) as err:
        assert trainer.global_step == 0
        print(f"model_checks_run: rank {trainer.global_rank}: {type(err).__name__}: {err}", flush=True)
        return
    raise AssertionError(f"case {case!r} trained without the named error")


if __name__ == "__main__":
    main()
