"""A user's own LightningModule on Dorylus layers, trained on N graph servers exactly as under ``"auto"``.

    python docs/examples/own_gcn.py --devices 2 --out run/      # 2 graph servers (devices 1: strategy="auto")

What makes it exact (docs/dorylus-own-model.md): the loss is the usual mean over this partition's train
vertices and ``DorylusStrategy`` scales each server's loss by its share of the train vertices before backward
(``loss_reduction="mean"``, the default); dropout masks hash global vertex ids (``row_dropout``), not torch's
generator; ``trainer.predict`` returns the whole graph in global vertex order on every rank.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import Tensor
from torch_geometric.data import Data
from torch_geometric.utils import to_undirected

from lightning_dorylus import DorylusStrategy
from lightning_dorylus.data import DorylusDataModule, GraphPartition
from lightning_dorylus.graph import GraphCache
from lightning_dorylus.nn import GCNConv
from lightning_dorylus.nn.dropout import dropout_key, row_dropout


class UserGCN(LightningModule):
    """Two Dorylus ``GCNConv`` layers, PyG-style dropout, a local-mean cross-entropy."""

    def __init__(self, in_channels: int, hidden_channels: int, num_classes: int, dropout: float = 0.5,
                 lr: float = 0.01, optimizer: str = "adam") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.conv1 = GCNConv(in_channels, hidden_channels, activation="relu")
        self.conv2 = GCNConv(hidden_channels, num_classes, activation="none")
        self.graphs = GraphCache()  # per partition: normalised adjacency, intervals (built once)
        self.dropout_seed = torch.initial_seed()  # equal on every server after seed_everything

    def dropout(self, h: Tensor, batch: GraphPartition, site: int) -> Tensor:
        """``F.dropout`` whose mask hashes (seed, epoch, step, site, global vertex id): any number of graph
        servers draws the single-process masks."""
        key = dropout_key(self.dropout_seed, self.current_epoch, self.global_step, site)
        return row_dropout(h, batch.local_nodes, self.hparams.dropout, self.training, key)

    def forward(self, batch: GraphPartition) -> Tensor:
        graph = self.graphs.context(batch)
        h = self.conv1(self.dropout(batch.x, batch, site=0), graph)
        return self.conv2(self.dropout(h, batch, site=1), graph)  # (n_local, num_classes)

    def training_step(self, batch: GraphPartition, batch_idx: int) -> Tensor:
        mask = batch.train_mask
        loss = F.cross_entropy(self(batch)[mask], batch.y[mask])  # mean over THIS partition's train vertices
        # logged: the whole graph's mean loss = Σ over servers of loss * this server's share of train vertices
        share = int(mask.sum()) / batch.num_train_global  # 1 under strategy="auto"
        self.log("train_loss", loss.detach() * share, reduce_fx="sum", sync_dist=True, batch_size=1)
        return loss

    def predict_step(self, batch: GraphPartition, batch_idx: int) -> Tensor:
        return self(batch).softmax(dim=-1)  # (n_local, C); the strategy returns (num_nodes, C), global order

    def validation_step(self, batch: GraphPartition, batch_idx: int) -> None:
        correct = (self(batch).argmax(dim=-1) == batch.y)[batch.val_mask].sum()
        counts = torch.stack([correct, batch.val_mask.sum()]).double()  # this partition's (correct, count)
        counts = self.trainer.strategy.reduce(counts, reduce_op="sum")  # the whole graph's; by keyword
        self.log("val_acc", counts[0] / counts[1], batch_size=1)  # already global: no sync_dist

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def make_graph(num_nodes: int = 600, num_classes: int = 4, num_features: int = 16, seed: int = 0) -> Data:
    """A stochastic block model with noisy class-centroid features. Seeded: every graph server re-runs this
    script and must build the same graph."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, num_classes, (num_nodes,), generator=gen)
    src, dst = torch.randint(0, num_nodes, (2, 8 * num_nodes), generator=gen)
    keep = (y[src] == y[dst]) | (torch.rand(src.numel(), generator=gen) < 0.2)  # mostly within a block
    edge_index = to_undirected(torch.stack([src[keep], dst[keep]]), num_nodes=num_nodes)
    edge_index = edge_index[:, edge_index[0] != edge_index[1]]
    centroids = torch.randn(num_classes, num_features, generator=gen)
    x = centroids[y] + torch.randn(num_nodes, num_features, generator=gen)
    split = torch.rand(num_nodes, generator=gen)
    return Data(x=x, edge_index=edge_index, y=y, train_mask=split < 0.4,
                val_mask=(split >= 0.4) & (split < 0.7), test_mask=split >= 0.7)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2, help="graph servers (1: strategy='auto')")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("own_gcn_run"))
    args = parser.parse_args()
    seed_everything(0)
    datamodule = DorylusDataModule(make_graph(), cache_dir=args.out / "cache")
    model = UserGCN(datamodule.num_features, 16, datamodule.num_classes)
    trainer = Trainer(accelerator="cpu", devices=args.devices, max_epochs=args.epochs, logger=False,
                      strategy=DorylusStrategy(executor="local") if args.devices > 1 else "auto",
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=datamodule)
    loss = float(trainer.callback_metrics["train_loss"])  # the last epoch's whole-graph mean
    val_acc = float(trainer.callback_metrics["val_acc"])  # the last epoch's whole-graph accuracy
    [probs] = trainer.predict(model, datamodule=datamodule)  # (num_nodes, C) on every rank
    if trainer.global_rank == 0:
        torch.save(probs, args.out / "probs.pt")
        print(f"train_loss={loss:.4f} val_acc={val_acc:.6f} predictions={tuple(probs.shape)}")


if __name__ == "__main__":
    main()
