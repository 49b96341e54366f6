"""Worker script: Cora node classification with ``DorylusStrategy`` on N graph servers, several seeds.

One job (Lightning's popen launcher starts the other graph servers), seeds trained one after another. Per
seed: ``max_epochs`` epochs (one full-graph step each), validation every epoch, a ``ModelCheckpoint`` of
the best val accuracy, and ``trainer.test(ckpt_path="best")`` — test accuracy at the best validation epoch,
the model selection of PyG's ``examples/gcn.py`` and ``examples/gat.py``. Rank 0 writes ``cora.json``.

Usage: python cora_run.py OUT_DIR PLANETOID_ROOT --model gcn|gat [--seeds 5] [--servers 2] [--epochs 200]
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch
import torch_geometric.transforms as T
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dorylus import GAT, GCN, DorylusStrategy
from lightning_dorylus.data import DorylusDataModule
from lightning_dorylus.data.planetoid import load_planetoid


def make_model(name: str, num_features: int, num_classes: int) -> LightningModule:
    """PyG's published Cora configurations."""
    if name == "gcn":
        return GCN(num_features, 16, num_classes, dropout=0.5, lr=0.01, weight_decay=5e-4)
    if name == "gat":
        return GAT(
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
    args = parser.parse_args()
    torch.set_num_threads(1)

    dataset = load_planetoid(args.planetoid_root, "Cora", processed_root=args.out / "processed")
    data = T.NormalizeFeatures()(dataset[0])
    datamodule = DorylusDataModule(data, partitioner="metis", cache_dir=args.out / "partitions")
    results = []
    for seed in range(args.seeds):
        seed_everything(seed, verbose=False)
        model = make_model(args.model, datamodule.num_features, datamodule.num_classes)
        best = ModelCheckpoint(
            dirpath=args.out / f"ckpt_{seed}",
            monitor="val_acc",
            mode="max",
            save_top_k=1,
            save_weights_only=True,
        )
        strategy = DorylusStrategy(executor=args.executor, timeout=datetime.timedelta(seconds=120))
        trainer = Trainer(  # a Trainer and a strategy per seed; the process group is created once
            accelerator="cpu",
            devices=args.servers,
            strategy=strategy,
            max_epochs=args.epochs,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=[best],
        )
        start = time.perf_counter()
        trainer.fit(model, datamodule=datamodule)
        fit_s = time.perf_counter() - start
        metrics = trainer.test(
            model, datamodule=datamodule, ckpt_path="best", weights_only=True, verbose=False
        )
        results.append(
            {
                "seed": seed,
                "test_acc": metrics[0]["test_acc"],
                "best_val_acc": float(best.best_model_score),
                "fit_s": fit_s,
            }
        )
    if trainer.global_rank == 0:
        accs = [r["test_acc"] for r in results]
        summary = {
            "model": args.model,
            "servers": args.servers,
            "runs": results,
            "mean_test_acc": sum(accs) / len(accs),
        }
        (args.out / "cora.json").write_text(json.dumps(summary, indent=2))
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
