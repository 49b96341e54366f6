"""``GraphSAGE``: a GraphSAGE node classifier (mean aggregator) from Dorylus ``SAGEConv`` layers."""

from __future__ import annotations

import itertools

from torch import Tensor, nn
from typing_extensions import override

from lightning_dorylus.graph import GraphContext
from lightning_dorylus.models.base import NodeClassifier
from lightning_dorylus.nn import SAGEConv
from lightning_dorylus.nn.dropout import feature_dropout, row_dropout


class GraphSAGE(NodeClassifier):
    """``dropout -> SAGEConv(relu) -> ... -> dropout -> SAGEConv(logits)`` (PyG's ``GraphSAGE``, full-batch).

    Args:
        in_channels: Feature width.
        hidden_channels: Hidden width.
        out_channels: Number of classes.
        num_layers: Number of ``SAGEConv`` layers (``>= 1``).
        dropout: Dropout on every layer's input, applied on the owner before SC; masks keyed by global
            vertex id (see :mod:`lightning_dorylus.nn.dropout`).
        lr: Adam learning rate.
        weight_decay: Adam weight decay.
    """

    def __init__(
        self,
        in_channels: int,
        hidden_channels: int,
        out_channels: int,
        num_layers: int = 2,
        dropout: float = 0.5,
        lr: float = 0.01,
        weight_decay: float = 5e-4,
    ) -> None:
        super().__init__(lr=lr, weight_decay=weight_decay)
        if num_layers < 1:
            raise ValueError(f"num_layers={num_layers} must be >= 1")
        self.save_hyperparameters()
        widths = [in_channels] + [hidden_channels] * (num_layers - 1) + [out_channels]
        self.convs = nn.ModuleList(
            SAGEConv(w_in, w_out, activation="relu" if i < num_layers - 1 else "none")
            for i, (w_in, w_out) in enumerate(itertools.pairwise(widths))
        )
        self.dropout = dropout

    @override
    def forward(self, graph: GraphContext) -> Tensor:
        """Logits ``(n_local, out_channels)`` of this server's owned vertices."""
        h = feature_dropout(graph, self.dropout, self.training, self.dropout_key(0))  # only nonzeros hashed
        for i, conv in enumerate(self.convs):
            if i > 0:
                key = self.dropout_key(i)
                h = row_dropout(h, graph.partition.local_nodes, self.dropout, self.training, key)
            h = conv(h, graph)
        self.next_free_step()
        return h
