"""``GCNConv`` as Dorylus operations: SC -> GA (server) -> AV (executor, per interval)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lightning_dorylus.graph import GraphContext, gcn_gather
from lightning_dorylus.nn.base import DorylusLayer
from lightning_dorylus.nn.functions import ApplyVertex

ACTIVATIONS = ("relu", "elu", "none")


class GCNConv(DorylusLayer):
    """Kipf & Welling's graph convolution ``H' = act(Â H W + b)``, equal to PyG's ``GCNConv`` + activation.

    PyG applies ``lin`` before ``propagate`` (``Â (H W) + b``); Dorylus gathers first and applies the weights
    in ApplyVertex (``(Â H) W + b``), the same function. ``Â`` is PyG's ``gcn_norm`` (self loops, symmetric
    normalisation with global degrees).

    Args:
        in_channels: Input feature width.
        out_channels: Output feature width.
        activation: Applied in ApplyVertex: ``"relu"``, ``"elu"`` or ``"none"`` (last layer: logits).
        bias: Whether to add a learnable bias.
    """

    def __init__(
        self, in_channels: int, out_channels: int, activation: str = "relu", bias: bool = True
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not supported; expected one of {ACTIVATIONS}")
        self.in_channels, self.out_channels, self.activation = in_channels, out_channels, activation
        self.weight = nn.Parameter(torch.empty(in_channels, out_channels))  # (F_in, F_out): z @ weight
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Glorot-uniform weight and zero bias, as PyG's ``GCNConv``."""
        bound = math.sqrt(6.0 / (self.in_channels + self.out_channels))
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def gather(self, h_full: Tensor, graph: GraphContext) -> Tensor:
        """GA (PyG ``message`` + ``aggregate``): ``z_i = Σ_j Â_ij h_j`` over local and ghost ``j``."""
        return gcn_gather(h_full, graph.gcn(h_full.dtype))

    def apply_vertex(self, z: Tensor, graph: GraphContext) -> Tensor:
        """AV (PyG ``update``): ``act(z W + b)`` for each interval of rows, on the executor."""
        return ApplyVertex.apply(
            z, self.weight, self.bias, self.runtime.executor, graph.intervals, self.activation
        )

    def forward(self, x: Tensor, graph: GraphContext) -> Tensor:
        """``(n_local, F_in) -> (n_local, F_out)``.

        Args:
            x: This server's rows of the layer input (after dropout, so ghosts see the same dropped values).
            graph: The partition and its derived structures.
        """
        h_full = self.scatter(x, graph)  # SC of the previous layer's output: (n_local + n_ghost, F_in)
        z = self.gather(h_full, graph)  # GA: (n_local, F_in)
        return self.apply_vertex(z, graph)  # AV: (n_local, F_out)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, activation={self.activation!r}"
