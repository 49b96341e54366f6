"""``StackedConvClassifier``: ``dropout -> conv(relu) -> ... -> dropout -> conv(logits)``, one layer class.

GCN and GraphSAGE differ only in their layer class; the stack, the dropout placement (on the owner before SC,
so ghosts see the same values) and the global-id dropout keys live here once.
"""

from __future__ import annotations

import itertools
from typing import ClassVar

from torch import Tensor, nn
from typing_extensions import override

from lightning_dorylus.data.validation import is_integer
from lightning_dorylus.graph import GraphContext
from lightning_dorylus.models.base import NodeClassifier, check_dropout, check_widths
from lightning_dorylus.nn import DorylusLayer
from lightning_dorylus.nn.dropout import RowSource, row_dropout


class StackedConvClassifier(NodeClassifier):
    """A stack of ``num_layers`` ``conv_class`` layers; subclasses set ``conv_class`` and document themselves.

    Args:
        in_channels: Feature width.
        hidden_channels: Hidden width.
        out_channels: Number of classes.
        num_layers: Number of layers (``>= 1``).
        dropout: Dropout on every layer's input, applied on the owner before SC so ghosts see the same values;
            masks are keyed by global vertex id (see :mod:`lightning_dorylus.nn.dropout`).
        lr: Adam learning rate.
        weight_decay: Adam weight decay.
    """

    conv_class: ClassVar[type[DorylusLayer]]

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
        check_widths(in_channels=in_channels, hidden_channels=hidden_channels, out_channels=out_channels)
        if not is_integer(num_layers) or num_layers < 1:
            raise ValueError(f"num_layers={num_layers!r} must be >= 1 (an integer)")
        check_dropout(dropout)
        self.save_hyperparameters()
        widths = [in_channels] + [hidden_channels] * (num_layers - 1) + [out_channels]
        self.convs = nn.ModuleList(
            self.conv_class(w_in, w_out, activation="relu" if i < num_layers - 1 else "none")  # type: ignore[call-arg]
            for i, (w_in, w_out) in enumerate(itertools.pairwise(widths))
        )
        self.dropout = dropout

    @override
    def forward(self, graph: GraphContext) -> Tensor:
        """Logits ``(n_local, out_channels)`` of this server's owned vertices."""
        key, next_key = self.dropout_key(0), self.next_step_dropout_key(0)
        h: Tensor | RowSource = RowSource(graph, self.dropout, self.training, key, next_key)
        for i, conv in enumerate(self.convs):
            if i > 0:
                key = self.dropout_key(i)
                h = row_dropout(h, graph.partition.local_nodes, self.dropout, self.training, key)
            elif not conv.takes_row_source:  # type: ignore[union-attr]
                h = h.full()  # type: ignore[union-attr]
            h = conv(h, graph)
        self.next_free_step()
        return h
