"""Worker script of ``tests/dorylus/test_model_checks.py``: one rank of a 2-server fit that must fail before
any update with a named error; writes ``error_rank<R>.json`` (``{"type": ..., "message": ...}``) into the
working folder and exits 0 (a file per rank: two ranks' lines on one shared stdout can run together).

Usage: python model_checks_run.py pyg|too_few
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

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
        record = {"type": type(err).__name__, "message": str(err)}
        Path(f"error_rank{trainer.global_rank}.json").write_text(json.dumps(record))
        return
    raise AssertionError(f"case {case!r} trained without the named error")


if __name__ == "__main__":
    main()
