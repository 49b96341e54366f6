"""Worker script: Cora GCN (float64, dropout 0) on N graph servers with the "lambda" or "local" executor.

Launched by ``tests/dorylus/test_lambda_e2e.py``, one process per graph server started together
(``tests.process.run_ranks``; run alone, Lightning's popen launcher starts the others by re-running it).
With ``--executor lambda`` every tensor op goes through boto3 to the Lambda
endpoint in ``DORYLUS_TEST_LAMBDA_ENDPOINT`` (the local endpoint running the deploy zip) and pieces that do
not fit 6 MB through the S3 endpoint in ``DORYLUS_TEST_S3_ENDPOINT``. Rank 0 writes ``result.json``
(per-epoch global train losses, val accuracies and the executor's counters).

Usage: python lambda_cora_run.py OUT_DIR PLANETOID_ROOT --executor lambda|local|lambda,local [--servers 2]
       [--epochs 3]
With several executors, each trains in turn in this one launch (a strategy and a model per executor; the
imports and the process group paid once) and writes ``OUT_DIR/<executor>/result.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import torch
import torch_geometric.transforms as T
from lightning.pytorch import seed_everything

from lightning_dorylus import GCN, DorylusStrategy
from lightning_dorylus.data import partition_graph
from lightning_dorylus.data.planetoid import load_planetoid
from tests.dorylus.scripts.exact_run import train


def executor_options(name: str) -> dict:
    if name == "local":
        return {"num_workers": 1}
    return {
        "function_name": "dorylus-cora-e2e",
        "region": "us-east-1",
        "endpoint_url": os.environ["DORYLUS_TEST_LAMBDA_ENDPOINT"],
        "s3_bucket": os.environ["DORYLUS_TEST_S3_BUCKET"],
        "s3_endpoint_url": os.environ["DORYLUS_TEST_S3_ENDPOINT"],
        "max_concurrency": 2,
        "deadline_s": 120.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("planetoid_root", type=Path)
    parser.add_argument("--executor", default="lambda", help="lambda, local, or both comma-separated")
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)

    dataset = load_planetoid(args.planetoid_root, "Cora", processed_root=args.out / "processed")
    data = T.NormalizeFeatures()(dataset[0])
    data.x = data.x.double()
    partitions = partition_graph(data, args.servers, partitioner="metis")
    executors = args.executor.split(",")
    for name in executors:
        out = args.out if len(executors) == 1 else args.out / name
        out.mkdir(parents=True, exist_ok=True)
        run(name, partitions, int(data.y.max()) + 1, data.num_features, args, out)


def run(executor: str, partitions: list, num_classes: int, num_features: int, args, out: Path) -> None:
    """Trains the GCN with ``executor``; rank 0 writes ``out/result.json``."""
    strategy = DorylusStrategy(executor=executor, executor_options=executor_options(executor),
                               timeout=datetime.timedelta(seconds=300))
    seed_everything(0, verbose=False)
    model = GCN(num_features, 16, num_classes, dropout=0.0, lr=0.01, weight_decay=5e-4).double()
    stats: dict = {}
    model.on_train_end = lambda: stats.update(getattr(strategy.executor, "stats", {}))  # before teardown
    trainer, recorder = train(model, partitions, args.epochs, strategy, devices=args.servers)
    if trainer.global_rank == 0:
        result = {"losses": recorder.losses, "val_acc": recorder.val_acc, "stats": stats}
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
