"""Gather (GA): aggregate neighbour rows (local + ghost) into each local vertex, on the graph server.

GCN's gather is a sparse-dense product with the normalised adjacency in CSR form (no per-edge message
tensor is ever built); its backward (∇GA) is the product with the transposed adjacency. GAT's gather weights
each in-edge per head with the attention coefficients from ApplyEdge; it needs per-edge messages anyway, so it
is written with ``index_add_`` and differentiated by torch's autograd on the server.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_dorylus.graph.structure import GCNAdjacency, SelfLoopEdges


class _SparseGather(torch.autograd.Function):
    """``Z = Â H`` forward, ``∇H = Âᵀ ∇Z`` backward, with both CSR matrices precomputed on the server."""

    @staticmethod
    def forward(ctx: Any, h_full: Tensor, adj: Tensor, adj_t: Tensor) -> Tensor:
        ctx.adj_t = adj_t
        return torch.sparse.mm(adj, h_full.contiguous())

    @staticmethod
    def backward(ctx: Any, grad_z: Tensor) -> tuple[Tensor, None, None]:
        return torch.sparse.mm(ctx.adj_t, grad_z.contiguous()), None, None


def gcn_gather(h_full: Tensor, adjacency: GCNAdjacency) -> Tensor:
    """GA for GCN: ``(n_local, F) = Â (n_local + n_ghost, F)`` with ``Â`` from PyG's ``gcn_norm``.

    Args:
        h_full: Local rows followed by ghost rows.
        adjacency: The partition's normalised adjacency and its transpose.
    """
    if adjacency.adj.dtype != h_full.dtype:
        raise TypeError(f"adjacency dtype {adjacency.adj.dtype} does not match features dtype {h_full.dtype}")
    return _SparseGather.apply(h_full, adjacency.adj, adjacency.adj_t)


def mean_gather(h_full: Tensor, adjacency: GCNAdjacency) -> Tensor:
    """GA for GraphSAGE: ``(n_local, F)`` mean of each vertex's in-neighbour rows (local and ghost)."""
    return gcn_gather(h_full, adjacency)


def attention_gather(h_full: Tensor, attention: Tensor, edges: SelfLoopEdges, n_local: int) -> Tensor:
    """GA for GAT: ``out[i, k] = Σ_{j -> i} attention[e, k] * h[j, k]`` per head.

    Args:
        h_full: ``(n_local + n_ghost, H, C)`` projected rows (local then ghost).
        attention: ``(E', H)`` softmax-normalised coefficients of the self-loop-augmented in-edges.
        edges: The in-edge list (``src``, ``dst``) that ``attention`` is aligned with.
        n_local: Number of destination rows.

    Returns:
        ``(n_local, H, C)``.
    """
    messages = h_full.index_select(0, edges.src) * attention.unsqueeze(-1)  # (E', H, C)
    out = h_full.new_zeros((n_local, *h_full.shape[1:]))
    return out.index_add(0, edges.dst, messages)
