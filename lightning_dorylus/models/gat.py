"""``GAT``: Veličković et al.'s two-layer GAT for node classification, from Dorylus ``GATConv`` layers."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor
from typing_extensions import override

from lightning_dorylus.graph import GraphContext
from lightning_dorylus.models.base import NodeClassifier, check_widths
from lightning_dorylus.nn import GATConv
from lightning_dorylus.nn.dropout import RowSource, row_dropout


class GAT(NodeClassifier):
    """``dropout -> GATConv(heads, concat) -> ELU -> dropout -> GATConv(out_heads, mean)`` (PyG's ``gat.py``).

    Args:
        in_channels: Feature width.
        hidden_channels: Width per head of the hidden layer (8 for Cora).
        out_channels: Number of classes.
        heads: Heads of the hidden layer (8 for Cora).
        out_heads: Heads of the output layer, averaged (1 for Cora).
        dropout: Dropout on features and on attention coefficients (0.6 for Cora).
        lr: Adam learning rate.
        weight_decay: Adam weight decay.
    """

    def __init__(
        self,
        in_channels: int,
        hidden_channels: int,
        out_channels: int,
        heads: int = 8,
        out_heads: int = 1,
        dropout: float = 0.6,
        lr: float = 0.005,
        weight_decay: float = 5e-4,
    ) -> None:
        super().__init__(lr=lr, weight_decay=weight_decay)
        check_widths(
            in_channels=in_channels, hidden_channels=hidden_channels, out_channels=out_channels, heads=heads,
            out_heads=out_heads,
        )
        self.save_hyperparameters()
        self.conv1 = GATConv(in_channels, hidden_channels, heads=heads, concat=True, dropout=dropout)
        self.conv2 = GATConv(
            hidden_channels * heads, out_channels, heads=out_heads, concat=False, dropout=dropout
        )
        self.dropout = dropout

    @override
    def forward(self, graph: GraphContext) -> Tensor:
        """Logits ``(n_local, out_channels)`` of this server's owned vertices."""
        # features' dropout (only nonzeros hashed); per interval as the requests go out in the pipeline
        # engine; the next step's key lets it send those requests early (staleness >= 1)
        key, next_key = self.dropout_key(0), self.next_step_dropout_key(0)
        source = RowSource(graph, self.dropout, self.training, key, next_key)
        x = source if self.conv1.takes_row_source else source.full()
        h = F.elu(self.conv1(x, graph, dropout_key=self.dropout_key(1)))  # (n_local, heads * hidden)
        h = row_dropout(h, graph.partition.local_nodes, self.dropout, self.training, self.dropout_key(2))
        out = self.conv2(h, graph, dropout_key=self.dropout_key(3))  # (n_local, out_channels)
        self.next_free_step()
        return out
