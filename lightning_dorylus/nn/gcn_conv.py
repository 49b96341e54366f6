"""``GCNConv`` as Dorylus operations: SC -> GA -> AV, or AV -> SC -> GA -> update (narrower rows)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dorylus.graph import GraphContext
from lightning_dorylus.nn.base import DorylusLayer
from lightning_dorylus.nn.dropout import RowSource
from lightning_dorylus.ops.vertex import ACTIVATIONS

#: The server-side (torch) form of each activation the executors' numpy code implements.
TORCH_ACTIVATIONS = {"relu": F.relu, "elu": F.elu, "none": lambda z: z}
assert tuple(TORCH_ACTIVATIONS) == ACTIVATIONS
ORDERS = ("auto", "gather_first", "weight_first")


class GCNConv(DorylusLayer):
    """Kipf & Welling's graph convolution ``H' = act(Â H W + b)``, equal to PyG's ``GCNConv`` + activation.

    ``Â (H W) = (Â H) W``, so the layer has two legitimate Dorylus decompositions, chosen by ``order``:

    * ``"gather_first"``: SC ``H`` -> GA ``Z = Â H`` (server) -> AV ``act(Z W + b)`` per interval (executor).
      Dorylus's own ``act(A·H·W)`` order; the graph work is ``in_channels`` wide.
    * ``"weight_first"``: AV ``P = H W`` per interval (executor) -> SC ``P`` -> GA ``Z = Â P`` (server) ->
      update ``act(Z + b)`` (server, elementwise). PyG's order (``lin`` before ``propagate``); the ghost
      traffic, the ``[local; ghost]`` matrix and the aggregation are ``out_channels`` wide.
    * ``"auto"`` (default): ``weight_first`` when ``out_channels < in_channels`` (e.g. 128 -> 16: 8x less
      graph-server memory and SC traffic), else ``gather_first``.

    ``Â`` is PyG's ``gcn_norm`` (self loops of weight 1, symmetric normalisation with global degrees), with
    the partition's ``edge_weight`` when the graph has one (``data.edge_weight``, as PyG's
    ``GCNConv(x, edge_index, edge_weight)``); each copy of a duplicate edge counts, as in PyG.

    Args:
        in_channels: Input feature width.
        out_channels: Output feature width.
        activation: ``"relu"``, ``"elu"`` or ``"none"`` (last layer: logits).
        bias: Whether to add a learnable bias.
        order: ``"auto"``, ``"gather_first"`` or ``"weight_first"`` (see above).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        activation: str = "relu",
        bias: bool = True,
        order: str = "auto",
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not supported; expected one of {ACTIVATIONS}")
        if order not in ORDERS:
            raise ValueError(f"order={order!r} is not supported; expected one of {ORDERS}")
        self.in_channels, self.out_channels, self.activation = in_channels, out_channels, activation
        self.output_width = out_channels  # read before the first epoch (model_checks.output_width)
        if order == "auto":
            order = "weight_first" if out_channels < in_channels else "gather_first"
        self.order = order
        self.weight = nn.Parameter(torch.empty(in_channels, out_channels))  # (F_in, F_out): z @ weight
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Glorot-uniform weight and zero bias, as PyG's ``GCNConv``."""
        bound = math.sqrt(6.0 / (self.in_channels + self.out_channels))
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    @property
    def applies_first(self) -> bool:  # type: ignore[override]
        """Weight-first: the first stage is AV on the input rows (a first layer's made per interval)."""
        return self.order == "weight_first"

    def update(self, z: Tensor) -> Tensor:
        """The weight-first order's last step, on the server: ``act(z + b)`` (elementwise, cheap)."""
        if self.bias is not None:
            z = z + self.bias
        return TORCH_ACTIVATIONS[self.activation](z)

    def forward(self, x: Tensor | RowSource, graph: GraphContext) -> Tensor:
        """``(n_local, F_in) -> (n_local, F_out)``.

        Args:
            x: This server's rows of the layer input (after dropout, so ghosts see the same dropped values),
                or a :class:`RowSource` making them per interval (see :attr:`takes_row_source`).
            graph: The partition and its derived structures.
        """
        if self.order == "weight_first":  # AV (x W) -> SC -> GA, then bias + activation on the server
            return self.update(self.apply_gather(x, self.weight, graph))
        h_full = self.scatter(x, graph)  # SC of the previous layer's output: (n_local + n_ghost, F_in)
        attrs = {"activation": self.activation}  # GA (Â H), then AV act(Z W + b) per interval
        return self.gather_apply("gcn", h_full, "apply_vertex.forward", "z", graph, attrs,
                                 weight=self.weight, bias=self.bias)[0]

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, activation={self.activation!r}, order={self.order!r}"
        )
