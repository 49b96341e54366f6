"""Worker script: a 2-graph-server ``fit`` whose input is wrong in one way; every rank records the error.

Launched by ``tests/dorylus/test_cache_integrity.py`` (both ranks started together,
``tests.process.run_ranks``). Cases:

* ``split``: every process re-runs ``T.RandomNodeSplit`` with its own random state (as an unseeded split
  does when the processes' random states differ) -> the graphs differ per process.
* ``num_parts``: ``DorylusDataModule(num_parts=3)`` on ``devices=2``.
* ``same``: the same graph everywhere (control: trains one epoch).

Usage: python graph_check_run.py OUT_DIR CACHE_DIR CASE
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch
import torch_geometric.transforms as T
from lightning.pytorch import Trainer

from lightning_dorylus import GCN, DorylusStrategy
from lightning_dorylus.data import DorylusDataModule
from lightning_dorylus.data.synthetic import powerlaw_graph


def main(out_dir: Path, cache_dir: Path, case: str) -> None:
    torch.set_num_threads(1)
    graph = powerlaw_graph(300, 6, 5, 3, seed=0)
    num_parts = 3 if case == "num_parts" else None
    if case == "split":
        torch.seed()  # this process's own random state, as when nothing seeds it
        graph = T.RandomNodeSplit(num_val=30, num_test=60)(graph)
    datamodule = DorylusDataModule(graph, num_parts=num_parts, partitioner="bfs", interval_size=64,
                                   cache_dir=cache_dir)
    model = GCN(datamodule.num_features, 8, datamodule.num_classes)
    strategy = DorylusStrategy(executor="inline", timeout=datetime.timedelta(seconds=60))
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0)
    result: dict[str, object] = {}
    try:
        trainer.fit(model, datamodule)
        result["global_step"] = trainer.global_step
    except ValueError as err:
        result["error"] = str(err)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
