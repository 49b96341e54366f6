"""Worker script: Cora node classification with ``DorylusStrategy`` on N graph servers, several seeds.

One job (the test starts every graph server, ``tests.process.run_ranks``; run alone, Lightning's popen
launcher starts the others), seeds trained one after another. Per
seed: ``max_epochs`` epochs (one full-graph step each) and, every epoch, one evaluation forward that gives
the global validation AND test accuracy; the test accuracy of the best validation epoch is kept in memory
(:class:`BestValidation`) — the model selection of PyG's ``examples/gcn.py`` and ``examples/gat.py``
(``if val_acc > best_val_acc: test_acc = tmp_test_acc``), without writing a checkpoint per improvement or a
second evaluation pass. Rank 0 writes ``cora.json``.

Usage: python cora_staleness_run.py OUT_DIR PLANETOID_ROOT --model gcn|gat [--seeds 5] [--servers 2]
       [--epochs 200] [--staleness none,0,1]   (one config after another; cora.json holds each config's runs)
       [--stale-reads freshest|oldest]   (DorylusStrategy(stale_reads=...) of the staleness >= 1 configs)
       [--seeds-of 0=1]   (a config trained on fewer seeds than --seeds: seeds 0..N-1)
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch
import torch_geometric.transforms as T
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import Tensor
from typing_extensions import override

from lightning_dorylus import GAT, GCN, DorylusStrategy
from lightning_dorylus.data import DorylusDataModule, GraphPartition
from lightning_dorylus.data.planetoid import load_planetoid


class _ValAndTest:
    """Mixin: validation logs ``val_acc`` and ``test_acc`` from the same forward pass."""

    @override
    def validation_step(self, batch: GraphPartition, batch_idx: int) -> Tensor:
        accs = self.accuracies(batch, {"val_acc": batch.val_mask, "test_acc": batch.test_mask})
        return accs["val_acc"]


class CoraGCN(_ValAndTest, GCN):
    """``GCN`` whose validation also reports test accuracy."""


class CoraGAT(_ValAndTest, GAT):
    """``GAT`` whose validation also reports test accuracy."""


class BestValidation(Callback):
    """Keeps the test accuracy of the first epoch with the highest validation accuracy (in memory)."""

    def __init__(self) -> None:
        self.best_val_acc = -1.0
        self.test_acc = float("nan")
        self.best_epoch = -1
        self.val_curve: list[float] = []

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        val_acc = float(trainer.callback_metrics["val_acc"])
        self.val_curve.append(val_acc)
        if val_acc > self.best_val_acc:  # every rank sees the same all-reduced value
            self.best_val_acc = val_acc
            self.test_acc = float(trainer.callback_metrics["test_acc"])
            self.best_epoch = trainer.current_epoch


class StaleReads(Callback):
    """Keeps the stale exchange's counters at the end of training (before teardown drops the runtime)."""

    def __init__(self, strategy: DorylusStrategy) -> None:
        self.strategy = strategy
        self.stats: dict = {}

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        runtime = self.strategy.runtime
        exchange = runtime.stale_exchange if runtime is not None else None
        if exchange is not None:
            ages = {str(age): n for age, n in sorted(exchange.ages.items())}
            self.stats = {"reads": exchange.reads, "waits": exchange.waits, "ages": ages}


def make_model(name: str, num_features: int, num_classes: int) -> LightningModule:
    """PyG's published Cora configurations."""
    if name == "gcn":
        return CoraGCN(num_features, 16, num_classes, dropout=0.5, lr=0.01, weight_decay=5e-4)
    if name == "gat":
        return CoraGAT(
            num_features, 8, num_classes, heads=8, out_heads=1, dropout=0.6, lr=0.005, weight_decay=5e-4
        )
    raise ValueError(f"--model {name!r}: expected 'gcn' or 'gat'")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("planetoid_root", type=Path)
    parser.add_argument("--model", default="gcn")
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--executor", default="inline")
    parser.add_argument(
        "--staleness", default="none", help="comma-separated: 'none' (synchronous) and/or ints, e.g. none,0,1"
    )
    parser.add_argument(
        "--stale-reads", default="freshest", choices=["freshest", "oldest"],
        help="DorylusStrategy(stale_reads=...) of the staleness >= 1 configs",
    )
    parser.add_argument(
        "--seeds-of", action="append", default=[], metavar="CONFIG=N",
        help="train config CONFIG (e.g. '0') on seeds 0..N-1 instead of --seeds; repeatable",
    )
    args = parser.parse_args()
    stalenesses = [None if s == "none" else int(s) for s in args.staleness.split(",")]
    seeds_of = {name: int(n) for name, n in (item.split("=", 1) for item in args.seeds_of)}
    torch.set_num_threads(1)

    dataset = load_planetoid(args.planetoid_root, "Cora", processed_root=args.out / "processed")
    data = T.NormalizeFeatures()(dataset[0])  # once, before partitioning: never recomputed per epoch
    datamodule = DorylusDataModule(data, partitioner="metis", cache_dir=args.out / "partitions")
    configs: dict[str, list[dict]] = {}
    runs = [
        (staleness, seed)
        for staleness in stalenesses
        for seed in range(seeds_of.get("none" if staleness is None else str(staleness), args.seeds))
    ]
    for staleness, seed in runs:
        results = configs.setdefault("none" if staleness is None else str(staleness), [])
        seed_everything(seed, verbose=False)
        model = make_model(args.model, datamodule.num_features, datamodule.num_classes)
        best = BestValidation()
        strategy = DorylusStrategy(
            executor=args.executor,
            timeout=datetime.timedelta(seconds=120),
            staleness=staleness,
            stale_reads=args.stale_reads if staleness else "freshest",
        )
        stale = StaleReads(strategy)
        trainer = Trainer(  # a Trainer and a strategy per seed; the process group is created once
            accelerator="cpu",
            devices=args.servers,
            strategy=strategy,
            max_epochs=args.epochs,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=[best, stale],
        )
        start = time.perf_counter()
        trainer.fit(model, datamodule=datamodule)
        fit_s = time.perf_counter() - start
        results.append(
            {
                "seed": seed,
                "test_acc": best.test_acc,
                "best_val_acc": best.best_val_acc,
                "best_epoch": best.best_epoch,
                "fit_s": fit_s,
                "val_curve": best.val_curve,
                "stale_reads": stale.stats,  # rank 0's: reads, waits, ages (epochs -> reads)
            }
        )
    if trainer.global_rank == 0:
        summaries = {}
        for name, runs in configs.items():
            accs = [r["test_acc"] for r in runs]
            curve = [sum(c) / len(c) for c in zip(*(r["val_curve"] for r in runs))]
            summaries[name] = {"runs": runs, "mean_test_acc": sum(accs) / len(accs), "mean_val_curve": curve}
        first = summaries[next(iter(summaries))]
        summary = {
            "model": args.model,
            "servers": args.servers,
            "runs": first["runs"],
            "mean_test_acc": first["mean_test_acc"],
            "configs": summaries,
        }
        (args.out / "cora.json").write_text(json.dumps(summary, indent=2))
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
