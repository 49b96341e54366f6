"""``GINConv`` from Dorylus verbs: SC, GA (a sum over in-neighbours, on the graph server), AV (the user op
``gin.mlp`` from ``gin_ops.py``, per interval on the executor). Equals PyG's ``GINConv(MLP)`` with
``MLP = Linear(fi, hid) -> ReLU -> Linear(hid, fo)``."""

from __future__ import annotations

import gin_ops  # noqa: F401  (registers "gin.mlp.forward"/"gin.mlp.backward"; executors import it by name)
import torch
from torch import Tensor, nn

from lightning_dorylus.graph import GraphContext
from lightning_dorylus.nn import DorylusLayer


class GINConv(DorylusLayer):
    """``h_i = MLP((1 + eps) x_i + Σ_{j -> i} x_j)`` (Xu et al.); weights stored ``(in, out)``."""

    def __init__(self, in_channels: int, hidden_channels: int, out_channels: int, eps: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.w1 = nn.Parameter(torch.empty(in_channels, hidden_channels))
        self.b1 = nn.Parameter(torch.empty(hidden_channels))
        self.w2 = nn.Parameter(torch.empty(hidden_channels, out_channels))
        self.b2 = nn.Parameter(torch.empty(out_channels))
        for w, b in ((self.w1, self.b1), (self.w2, self.b2)):  # torch.nn.Linear's initialisation
            bound = 1.0 / w.shape[0] ** 0.5
            nn.init.uniform_(w, -bound, bound)
            nn.init.uniform_(b, -bound, bound)

    def forward(self, x: Tensor, graph: GraphContext) -> Tensor:
        """``(n_local, in) -> (n_local, out)``."""
        x_full = self.scatter(x, graph)  # SC: own rows, then ghost rows from their owners
        src, dst = graph.partition.edge_index  # local ids; dst are owned vertices
        z = (1 + self.eps) * x + torch.zeros_like(x).index_add_(0, dst, x_full[src])  # GA (sum)
        (h,) = self.run_op("gin.mlp.forward", graph, z=z, w1=self.w1, b1=self.b1, w2=self.w2, b2=self.b2)
        return h  # AV: the numpy op per interval on the executor, differentiable
