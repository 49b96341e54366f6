"""PyG's own GAT on a Planetoid graph: the reference the Dorylus ``GAT`` recipe is measured against.

``torch_geometric``'s ``examples/gat.py`` as published: ``F.dropout(x, 0.6) -> GATConv(F, 8, heads=8,
dropout=0.6) -> ELU -> F.dropout(0.6) -> GATConv(64, C, heads=1, concat=False, dropout=0.6)``, Adam (lr 0.005,
weight decay 5e-4), 200 full-graph epochs on row-normalised features, and the test accuracy of the first epoch
with the best validation accuracy (the protocol of the Dorylus recipe's ``ModelCheckpoint`` +
``trainer.test(ckpt_path="best")``). Dropout masks come from torch's generator, seeded per run; one thread, so
the figures do not depend on the machine's core count.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.data import Data
from torch_geometric.nn import GATConv
from torch_geometric.transforms import NormalizeFeatures

from lightning_dorylus.data import load_planetoid


class PyGGAT(nn.Module):
    """PyG's ``examples/gat.py`` model (Veličković et al.'s Planetoid GAT)."""

    def __init__(self, in_channels: int, out_channels: int, hidden: int = 8, heads: int = 8,
                 dropout: float = 0.6) -> None:
        super().__init__()
        self.dropout = dropout
        self.conv1 = GATConv(in_channels, hidden, heads=heads, dropout=dropout)
        self.conv2 = GATConv(hidden * heads, out_channels, heads=1, concat=False, dropout=dropout)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        x = F.dropout(x, p=self.dropout, training=self.training)
        x = F.elu(self.conv1(x, edge_index))
        x = F.dropout(x, p=self.dropout, training=self.training)
        return self.conv2(x, edge_index)


def planetoid(root: Path, name: str, processed_root: Path) -> Data:
    """The graph ``name`` from ``root/<name>/raw`` (never downloaded), features row-normalised."""
    return NormalizeFeatures()(load_planetoid(root, name, processed_root)[0])


def best_val_test_accuracy(data: Data, seed: int, epochs: int = 200) -> float:
    """Test accuracy of the first epoch with the best validation accuracy; ``torch.manual_seed(seed)`` draws
    the weights and the dropout masks."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        model = PyGGAT(data.num_features, int(data.y.max()) + 1)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.005, weight_decay=5e-4)
        best_val, test_at_best = -1.0, 0.0
        for _ in range(epochs):
            model.train()
            optimizer.zero_grad()
            out = model(data.x, data.edge_index)
            F.cross_entropy(out[data.train_mask], data.y[data.train_mask]).backward()
            optimizer.step()
            model.eval()
            with torch.no_grad():
                pred = model(data.x, data.edge_index).argmax(dim=-1)
            val, test = (
                float((pred[m] == data.y[m]).float().mean())
                for m in (data.val_mask, data.test_mask)
            )
            if val > best_val:
                best_val, test_at_best = val, test
        return test_at_best
    finally:
        torch.set_num_threads(threads)
