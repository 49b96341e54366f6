"""Multi-label node classification (ogbn-proteins / PPI style) with Dorylus: ``y`` of shape ``(N, C)``.

    python docs/examples/multilabel.py --devices 2     # 2 graph servers (devices 1: strategy="auto")

The targets are 0/1 per vertex and label (an int64 ``(N, C)`` tensor, as ogbn-proteins gives them), the
splits are index tensors (as OGB's ``get_idx_split()`` gives them), and the edges carry weights (as
ogbn-proteins' edge features would after reducing them to one number). ``GCN`` sees the multi-label ``y``
and trains with BCE-with-logits (PyG's ``BCEWithLogitsLoss()``); validation logs the micro-F1 of
``logits > 0`` as ``val_f1`` (PyG's ``examples/ppi.py`` metric), summed over graph servers exactly.
"""

from __future__ import annotations

import argparse

import torch
from lightning.pytorch import Trainer, seed_everything
from torch_geometric.data import Data
from torch_geometric.utils import to_undirected

from lightning_dorylus import GCN, DorylusStrategy
from lightning_dorylus.data import DorylusDataModule


def make_graph(num_nodes: int = 800, num_labels: int = 8, num_features: int = 16, seed: int = 0) -> Data:
    """Communities whose members share most of their labels; features a noisy view of the labels; weighted
    edges (heavier inside a community). Seeded: every graph server re-runs this script and must build the
    same graph."""
    gen = torch.Generator().manual_seed(seed)
    community = torch.randint(0, 10, (num_nodes,), generator=gen)
    profile = torch.rand(10, num_labels, generator=gen) < 0.35  # the labels a community tends to have
    flip = torch.rand(num_nodes, num_labels, generator=gen) < 0.1
    y = (profile[community] ^ flip).long()  # (N, C) int64 0/1, as ogbn-proteins
    mixing = torch.randn(num_labels, num_features, generator=gen)
    x = y.float() @ mixing + 2.0 * torch.randn(num_nodes, num_features, generator=gen)
    src = torch.randint(0, num_nodes, (8 * num_nodes,), generator=gen)
    by_community = torch.sort(community, stable=True).indices  # members of community c: a contiguous run
    size = torch.bincount(community, minlength=10)
    start = torch.cumsum(size, 0) - size
    pick = (torch.rand(src.numel(), generator=gen) * size[community[src]]).long()
    dst = by_community[start[community[src]] + pick]  # a random member of the source's community
    noise = torch.rand(src.numel(), generator=gen) < 0.3
    dst[noise] = torch.randint(0, num_nodes, (int(noise.sum()),), generator=gen)
    keep = src != dst
    edge_index = to_undirected(torch.stack([src[keep], dst[keep]]), num_nodes=num_nodes)
    edge_weight = torch.where(community[edge_index[0]] == community[edge_index[1]], 1.0, 0.2)
    order = torch.randperm(num_nodes, generator=gen)
    split = {"train": order[: num_nodes // 2], "valid": order[num_nodes // 2 : 3 * num_nodes // 4],
             "test": order[3 * num_nodes // 4 :]}  # index tensors, as OGB's get_idx_split()
    return Data(x=x, edge_index=edge_index, edge_weight=edge_weight, y=y, train_mask=split["train"],
                val_mask=split["valid"], test_mask=split["test"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=100)
    args = parser.parse_args()
    seed_everything(0, verbose=False)
    datamodule = DorylusDataModule(make_graph(), partitioner="metis")   # index masks -> bool masks
    model = GCN(datamodule.num_features, 32, datamodule.num_classes,   # num_classes = C = 8 outputs
                dropout=0.0, lr=0.01, weight_decay=0.0)                 # loss: BCE-with-logits
    trainer = Trainer(accelerator="cpu", devices=args.devices, max_epochs=args.epochs, logger=False,
                      strategy=DorylusStrategy(executor="inline") if args.devices > 1 else "auto",
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=datamodule)
    metrics = dict(trainer.callback_metrics)  # the last epoch's train_loss (BCE) and val_f1 (micro-F1)
    [test] = trainer.test(model, datamodule=datamodule, verbose=False)
    if trainer.global_rank == 0:
        print(f"train_loss={float(metrics['train_loss']):.6f} val_f1={float(metrics['val_f1']):.6f} "
              f"test_f1={test['test_f1']:.6f}")


if __name__ == "__main__":
    main()
