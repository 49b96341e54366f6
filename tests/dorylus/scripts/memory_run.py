"""Worker script of the memory guard: a graph server's peak resident memory while it trains.

    memory_run.py prepare <cache dir> <nodes> <avg degree> <features>    # partitions into 2
    memory_run.py train <partition dir> <features> <epochs> <out dir>     # one graph server (LOCAL_RANK)

``prepare`` writes ``<cache dir>/prepared.json`` (``{"partition_dir": ...}``).

``train`` resets the kernel's high-water mark of resident memory (``/proc/self/clear_refs``) once torch,
Lightning and the model are imported and built, trains ``<epochs>`` epochs of the 2-layer GCN with dropout,
and writes ``<out dir>/memory_rank{r}.json`` (a file per server: two servers' lines on one shared stdout can
run together): how far the server's peak rose above its resident size at the reset, and the
sizes the guard's budget is stated in (its vertices, ghost vertices, edges, feature width).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_dorylus import DorylusStrategy
from lightning_dorylus.data import DorylusDataModule
from lightning_dorylus.data.synthetic import powerlaw_graph
from lightning_dorylus.models import GCN

HIDDEN, CLASSES, INTERVAL_SIZE = 16, 8, 2048


def status_bytes(field: str) -> int:
    """One ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def prepare(cache_dir: str, nodes: int, avg_degree: float, features: int) -> None:
    data = powerlaw_graph(nodes, avg_degree, features, CLASSES, seed=0)
    datamodule = DorylusDataModule(data, num_parts=2, interval_size=INTERVAL_SIZE, cache_dir=cache_dir)
    datamodule.prepare_data()
    record = {"partition_dir": str(datamodule.resolved_partition_dir())}
    (Path(cache_dir) / "prepared.json").write_text(json.dumps(record))


class PeakAboveStart(pl.Callback):
    """Records the partition's sizes at the first step and the peak rise at the end of training."""

    def __init__(self, start_rss: int) -> None:
        self.start_rss = start_rss
        self.sizes: dict[str, int] = {}
        self.peak_rise = 0

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if not self.sizes:
            self.sizes = {"n_local": batch.n_local, "n_ghost": batch.n_ghost,
                          "edges": int(batch.edge_index.shape[1]), "features": int(batch.x.shape[1])}

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.peak_rise = status_bytes("VmHWM") - self.start_rss


def train(partition_dir: str, features: int, epochs: int, out: Path) -> None:
    torch.manual_seed(0)
    datamodule = DorylusDataModule(partition_dir)
    strategy = DorylusStrategy(executor="local", executor_options={"num_workers": 1})
    model = GCN(features, HIDDEN, CLASSES, num_layers=2, dropout=0.5)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS from here on
    peak = PeakAboveStart(status_bytes("VmRSS"))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, callbacks=[peak],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=datamodule)
    record = {"rank": trainer.global_rank, "peak_rise": peak.peak_rise, **peak.sizes}
    (out / f"memory_rank{trainer.global_rank}.json").write_text(json.dumps(record))


def main() -> None:
    mode = sys.argv[1]
    if mode == "prepare":
        prepare(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]))
    elif mode == "train":
        train(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
    else:
        raise SystemExit(f"mode {mode!r}: expected 'prepare' or 'train'")


if __name__ == "__main__":
    main()
