"""``SAGEConv`` (mean aggregator) as Dorylus operations: SC -> GA (mean) -> AV (``update``)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lightning_dorylus.graph import GraphContext
from lightning_dorylus.nn.base import DorylusLayer
from lightning_dorylus.ops.vertex import ACTIVATIONS


class SAGEConv(DorylusLayer):
    """Hamilton et al.'s GraphSAGE layer with the mean aggregator, equal to PyG's ``SAGEConv`` + activation:
    ``h_i = act(W_l · mean_{j -> i} x_j + b + W_r · x_i)``.

    The whole layer, in PyG's vocabulary: ``message`` is ``x_j`` and ``aggregate`` the mean (GA, on the graph
    server, over local and ghost rows after SC); ``update`` is the executor op ``sage.update`` (AV, per
    interval; numpy forward/backward in ``lightning_dorylus/ops/sage.py``, declared once in its ``OPS``).

    Args:
        in_channels: Input feature width.
        out_channels: Output feature width.
        activation: ``"relu"``, ``"elu"`` or ``"none"`` (last layer: logits).
        bias: Whether ``lin_l`` has a bias (PyG's default: yes).
    """

    def __init__(
        self, in_channels: int, out_channels: int, activation: str = "relu", bias: bool = True
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not supported; expected one of {ACTIVATIONS}")
        self.in_channels, self.out_channels, self.activation = in_channels, out_channels, activation
        self.output_width = out_channels  # read before the first epoch (model_checks.output_width)
        self.weight_l = nn.Parameter(torch.empty(in_channels, out_channels))  # neighbours: agg @ weight_l
        self.weight_r = nn.Parameter(torch.empty(in_channels, out_channels))  # root: x @ weight_r
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Kaiming-uniform weights and bias as ``torch.nn.Linear`` (PyG's ``Linear`` default)."""
        bound = 1.0 / math.sqrt(self.in_channels)
        for weight in (self.weight_l, self.weight_r):
            nn.init.uniform_(weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: Tensor, graph: GraphContext) -> Tensor:
        """``(n_local, F_in) -> (n_local, F_out)``: SC, GA (mean), AV (``sage.update``)."""
        x_full = self.scatter(x, graph)  # SC: (n_local + n_ghost, F_in)
        attrs = {"activation": self.activation}
        return self.gather_apply("mean", x_full, "sage.update.forward", "agg", graph, attrs, x=x,
                                 weight_l=self.weight_l, weight_r=self.weight_r, bias=self.bias)[0]

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, aggr='mean', activation={self.activation!r}"
