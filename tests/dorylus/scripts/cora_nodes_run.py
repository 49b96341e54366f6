"""Worker script: GCN on Cora, float64, with ``DorylusStrategy`` on graph servers spread over ``--nodes``
machines; records per-epoch losses, final weights and where each rank ran.

Started by ``tests/dorylus/test_multihost.py`` either by torchrun, once per host (a network namespace:
``torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d ...``; Lightning sees
``TorchElasticEnvironment``),
or as the one-host reference, all ranks on loopback (``tests.process.run_ranks``, ``--nodes 1``).
``--work`` is this host's own folder (its "local disk"): PyG's processed Cora and the partition cache, which
each host's local rank 0 builds for itself (``prepare_data`` runs once per node). Cora is PyG's public
split with ``NormalizeFeatures``, cast to float64; dropout 0.5 (masks are keyed by global vertex ids, so
they do not depend on where a server runs); tensor ops on the inline executor.

Every rank writes ``OUT/rank<r>.json`` (its node rank, ``MASTER_ADDR``, and its network namespace,
``/proc/self/ns/net``) and ``OUT/weights_rank<r>.safetensors``; rank 0 writes ``OUT/result.json`` with
the per-epoch global train losses and validation accuracies.

Usage: python cora_nodes_run.py OUT PLANETOID_ROOT --work DIR [--nodes 2] [--devices 1] [--epochs 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import torch
import torch_geometric.transforms as T
from lightning.pytorch import Trainer, seed_everything
from safetensors.torch import save_file

from lightning_dorylus import GCN, DorylusStrategy
from lightning_dorylus.data import DorylusDataModule
from lightning_dorylus.data.planetoid import load_planetoid
from tests.dorylus.scripts.exact_run import Recorder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("planetoid_root", type=Path)
    parser.add_argument("--work", type=Path, required=True, help="this host's folder for its caches")
    parser.add_argument("--nodes", type=int, default=2, help="Trainer(num_nodes=...)")
    parser.add_argument("--devices", type=int, default=1, help="graph servers per node")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)

    dataset = load_planetoid(args.planetoid_root, "Cora", processed_root=args.work / "processed")
    data = T.NormalizeFeatures()(dataset[0])
    data.x = data.x.double()
    datamodule = DorylusDataModule(data, partitioner="metis", cache_dir=args.work / "partitions")
    seed_everything(0, verbose=False)
    model = GCN(datamodule.num_features, 16, datamodule.num_classes, dropout=0.5, lr=0.01,
                weight_decay=5e-4).double()
    recorder = Recorder()
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.nodes,
        strategy=DorylusStrategy(executor="inline", timeout=datetime.timedelta(seconds=120)),
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[recorder],
    )
    trainer.fit(model, datamodule=datamodule)

    rank = trainer.global_rank
    where = {
        "rank": rank,
        "node_rank": trainer.node_rank,
        "world_size": trainer.world_size,
        "environment": type(trainer.strategy.cluster_environment).__name__,
        "master_addr": os.environ.get("MASTER_ADDR"),
        "netns": os.readlink("/proc/self/ns/net"),  # "net:[<inode>]"
    }
    (args.out / f"rank{rank}.json").write_text(json.dumps(where))
    weights = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(args.out / f"weights_rank{rank}.safetensors"))
    if rank == 0:
        result = {"losses": recorder.losses, "val_acc": recorder.val_acc}
        (args.out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
