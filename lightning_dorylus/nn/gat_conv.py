"""``GATConv`` as Dorylus operations: AV (project) -> SC -> AE (attention) -> GA (weighted sum)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lightning_dorylus.graph import GraphContext, attention_gather
from lightning_dorylus.nn.base import DorylusLayer
from lightning_dorylus.nn.dropout import RowSource, edge_ids, row_dropout
from lightning_dorylus.nn.edge_pipeline import EdgeDropout, apply_edge_gather
from lightning_dorylus.nn.functions import OpCall, tensor_op
from lightning_dorylus.nn.row_apply import apply_rows


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

    def apply_vertex(self, x: Tensor | RowSource, graph: GraphContext) -> tuple[Tensor, Tensor, Tensor]:
        """AV (PyG ``lin`` + attention scores): ``h (n, H*C)``, ``alpha_src (n, H)``, ``alpha_dst (n, H)``.

        A :class:`RowSource` input (a first layer in the pipeline engine) is made per interval, each
        interval's rows just before its request goes out (``nn.row_apply``); with ``staleness >= 1`` in
        training, the next step's requests go out during this step's backward (``nn.runahead``)."""
        call = OpCall("gat.project.forward", self.runtime.executor, graph.intervals)
        weights = {"weight": self.weight, "att_src": self.att_src, "att_dst": self.att_dst}
        if isinstance(x, RowSource) and graph.intervals:
            runahead = self.runtime.runahead if self.runtime.runs_ahead and self.training else None
            outs = apply_rows(call, x, "x", runahead, self.layer_index, **weights)
            return outs  # type: ignore[return-value]
        if isinstance(x, RowSource):  # an empty partition: nothing to cut
            x = x.full()
        return tensor_op(call, x=x, **weights)  # type: ignore[return-value]

    @property
    def takes_row_source(self) -> bool:
        """In the pipeline engine: a first layer's input is made per interval, as its AV requests go out."""
        return self.runtime.pipelined

    def apply_edge(
        self, alpha_src_full: Tensor, alpha_dst: Tensor, graph: GraphContext, dropout_key: int | None = None
    ) -> Tensor:
        """AE (PyG ``message``'s attention): ``(E', H)`` softmax over each dst's in-edges, then dropout.

        The dropout mask of an edge hashes ``dropout_key`` and the edge's global ``(src, dst)``, so it is the
        same whichever server owns ``dst``; ``None`` draws a key from torch's global generator.
        """
        edges = graph.self_loops
        alpha_src_e = alpha_src_full.index_select(0, edges.src)  # (E', H): the server gathers source scores
        attrs = {"negative_slope": self.negative_slope}
        call = OpCall("apply_edge.forward", self.runtime.executor, graph.intervals, attrs)
        (attention,) = tensor_op(
            call, alpha_src_e=alpha_src_e, alpha_dst=alpha_dst, dst_ptr=edges.dst_ptr
        )
        if not self.training or self.dropout == 0.0:
            return attention
        if dropout_key is None:
            dropout_key = int(torch.randint(-(2**63), 2**63 - 1, ()))
        return row_dropout(attention, edge_ids(graph), self.dropout, True, dropout_key)

    def gather(self, h_full: Tensor, attention: Tensor, graph: GraphContext) -> Tensor:
        """GA (PyG ``aggregate``): ``out_i = Σ_j attention_ij h_j`` per head -> ``(n_local, H, C)``."""
        h_full = h_full.view(-1, self.heads, self.out_channels)
        return attention_gather(h_full, attention, graph.self_loops, graph.partition.n_local)

    def forward(self, x: Tensor | RowSource, graph: GraphContext, dropout_key: int | None = None) -> Tensor:
        """``(n_local, F_in) -> (n_local, H*C)`` (concat) or ``(n_local, C)`` (mean).

        Args:
            x: This server's rows of the layer input, or a :class:`RowSource` making them per interval (see
                :attr:`takes_row_source`).
            graph: The partition and its derived structures.
            dropout_key: Key of the attention dropout (see :func:`lightning_dorylus.nn.dropout.dropout_key`);
                ``None`` draws one from torch's global generator, like ``F.dropout``.
        """
        h, alpha_src, alpha_dst = self.apply_vertex(x, graph)  # AV: (n, H*C), (n, H), (n, H)
        boundary = torch.cat([h, alpha_src], dim=1)  # one SC message per row: (n, H*C + H)
        full = self.scatter(boundary, graph)  # SC: (n_local + n_ghost, H*C + H)
        h_full, alpha_src_full = full.split([self.heads * self.out_channels, self.heads], dim=1)
        if self.runtime.pipelined and graph.intervals:  # AE, dropout and GA pipelined per interval
            out = self._pipelined_edge_gather(h_full, alpha_src_full, alpha_dst, graph, dropout_key)
        else:
            attention = self.apply_edge(alpha_src_full, alpha_dst, graph, dropout_key)  # AE: (E', H)
            out = self.gather(h_full, attention, graph)  # GA: (n_local, H, C)
        out = out.reshape(out.size(0), self.heads * self.out_channels) if self.concat else out.mean(dim=1)
        return out if self.bias is None else out + self.bias

    def _pipelined_edge_gather(
        self, h_full: Tensor, alpha_src_full: Tensor, alpha_dst: Tensor, graph: GraphContext,
        dropout_key: int | None,
    ) -> Tensor:
        """The pipeline engine's AE -> dropout -> GA: interval ``i``'s AE request in flight while the server
        drops out and gathers the intervals that came back before it (``nn.edge_pipeline``)."""
        attrs = {"negative_slope": self.negative_slope}
        call = OpCall("apply_edge.forward", self.runtime.executor, graph.intervals, attrs)
        dropout = None
        if self.training and self.dropout > 0.0:
            if dropout_key is None:
                dropout_key = int(torch.randint(-(2**63), 2**63 - 1, ()))
            dropout = EdgeDropout(self.dropout, dropout_key, edge_ids(graph))
        h_full = h_full.view(-1, self.heads, self.out_channels)
        return apply_edge_gather(call, graph.self_loops, h_full, alpha_src_full, alpha_dst, dropout)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, heads={self.heads}, concat={self.concat}"
