"""``GATConv`` as Dorylus operations: AV (project) -> SC -> AE (attention) -> GA (weighted sum)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lightning_dorylus.graph import GraphContext
from lightning_dorylus.nn.base import DorylusLayer
from lightning_dorylus.nn.dropout import RowSource


class GATConv(DorylusLayer):
    """Graph attention (Veličković et al.), faithful to PyG's ``GATConv`` (self loops, LeakyReLU, softmax,
    attention dropout, concat or mean over heads, bias).

    Flow: AV ``gat.project`` gives ``h = x W`` and per-head scores ``alpha_src``, ``alpha_dst`` of local rows;
    SC sends ``[h, alpha_src]`` of boundary rows to ghosts; AE computes each in-edge's attention per interval;
    dropout on the attention (server); GA sums ``attention * h_src`` per head (server). In the pipeline
    engine (``staleness`` 0 or S) AE, dropout and GA run interval by interval, overlapped
    (:mod:`~lightning_dorylus.nn.edge_pipeline`), and a first layer's input rows are made per interval.

    Args:
        in_channels: Input feature width.
        out_channels: Width per head.
        heads: Number of attention heads.
        concat: Concatenate heads (``heads * out_channels`` outputs) or average them (``out_channels``).
        negative_slope: LeakyReLU slope of the attention logits.
        dropout: Dropout probability on the attention coefficients (training only).
        bias: Whether to add a learnable bias after aggregation.
    """

    applies_first = True  # AV gat.project on the input rows: a first layer's made per interval

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        heads: int = 1,
        concat: bool = True,
        negative_slope: float = 0.2,
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        if heads < 1:
            raise ValueError(f"heads={heads} must be >= 1")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout={dropout} must be in [0, 1)")
        self.in_channels, self.out_channels, self.heads = in_channels, out_channels, heads
        self.concat, self.negative_slope, self.dropout = concat, negative_slope, dropout
        self.weight = nn.Parameter(torch.empty(in_channels, heads * out_channels))  # (F_in, H*C)
        self.att_src = nn.Parameter(torch.empty(heads, out_channels))  # (H, C)
        self.att_dst = nn.Parameter(torch.empty(heads, out_channels))  # (H, C)
        width = heads * out_channels if concat else out_channels
        self.output_width = width  # read before the first epoch (model_checks.output_width)
        self.bias = nn.Parameter(torch.empty(width)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Glorot-uniform weight and attention vectors, zero bias, as PyG's ``GATConv``."""
        bound = math.sqrt(6.0 / (self.in_channels + self.heads * self.out_channels))
        nn.init.uniform_(self.weight, -bound, bound)
        att_bound = math.sqrt(6.0 / (self.heads + self.out_channels))
        nn.init.uniform_(self.att_src, -att_bound, att_bound)
        nn.init.uniform_(self.att_dst, -att_bound, att_bound)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor | RowSource, graph: GraphContext, dropout_key: int | None = None) -> Tensor:
        """``(n_local, F_in) -> (n_local, H*C)`` (concat) or ``(n_local, C)`` (mean).

        Args:
            x: This server's rows of the layer input, or a :class:`RowSource` making them per interval (see
                :attr:`takes_row_source`).
            graph: The partition and its derived structures.
            dropout_key: Key of the attention dropout (see :func:`lightning_dorylus.nn.dropout.dropout_key`);
                ``None`` draws one from torch's global generator, like ``F.dropout``.
        """
        h, alpha_src, alpha_dst = self.run_op(  # AV (PyG lin + attention scores): (n, H*C), (n, H), (n, H)
            "gat.project.forward", graph, x=x, weight=self.weight, att_src=self.att_src, att_dst=self.att_dst
        )
        boundary = torch.cat([h, alpha_src], dim=1)  # one SC message per row: (n, H*C + H)
        full = self.scatter(boundary, graph)  # SC: (n_local + n_ghost, H*C + H)
        h_full, alpha_src_full = full.split([self.heads * self.out_channels, self.heads], dim=1)
        out = self.edge_gather(  # AE (attention), dropout, GA (weighted sum): (n_local, H, C)
            "apply_edge.forward", h_full.view(-1, self.heads, self.out_channels), alpha_src_full, alpha_dst,
            graph, {"negative_slope": self.negative_slope}, self.dropout, dropout_key,
        )
        out = out.reshape(out.size(0), self.heads * self.out_channels) if self.concat else out.mean(dim=1)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, heads={self.heads}, concat={self.concat}"
