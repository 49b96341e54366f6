"""``GraphPartition``: one graph server's share of the graph.

Local ids: the owned vertices are ``0 .. n_local-1`` (sorted by global id), ghost ``k`` is ``n_local + k``.
Ghosts are grouped by owner partition (ascending), and within one owner sorted by global id, which is the
order in which the owner keeps them (``send_index``), so a ghost exchange is a plain row copy in both
directions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class GraphPartition:
    """One graph server's share of the graph (see the module docstring for the local id layout).

    Attributes:
        part_id: This partition's index in ``0 .. num_parts-1`` (the graph server's rank).
        num_parts: Number of partitions (graph servers).
        num_global_nodes: Number of vertices in the whole graph.
        local_nodes: ``(n_local,)`` int64 global ids of the owned vertices, in local order (ascending).
        ghost_nodes: ``(n_ghost,)`` int64 global ids of ghosts, grouped by owner partition (ascending owner
            id), ascending global id within an owner.
        ghost_owner: ``(n_ghost,)`` int64 owner partition of each ghost.
        recv_ptr: ``(num_parts + 1,)`` int64: ghosts owned by partition ``p`` are ghost slots
            ``recv_ptr[p]:recv_ptr[p+1]``.
        send_index: Per partition ``p``, ``(k_p,)`` int64 LOCAL ids whose rows ``p`` holds as ghosts, in
            ``p``'s ghost-slot order for this owner; ``send_index[part_id]`` is empty.
        edge_index: ``(2, E_local)`` int64 ``[src, dst]`` in local ids; ``dst < n_local``, ``src`` may be a
            ghost. Every global edge is stored once, by the partition owning its ``dst``, sorted by ``dst``.
            Duplicate edges are kept, one column per copy (PyG's layers count each copy), the copies next to
            each other (as ``build_partitions`` stores them; the adjacency builds, which sum the copies of an
            edge into one entry, take a whole-list sort otherwise).
        dst_ptr: ``(n_local + 1,)`` int64 CSR pointer of ``edge_index`` over ``dst``.
        in_degree: ``(n_local + n_ghost,)`` int64 global in-degree (self loops removed, every copy of a
            duplicate edge counted).
        x: ``(n_local, F)`` float features.
        y: ``(n_local,)`` int64 class labels (``-1`` where the graph has none), or ``(n_local, C)`` float
            multi-label targets in ``[0, 1]`` (trained with BCE-with-logits).
        train_mask: ``(n_local,)`` bool.
        val_mask: ``(n_local,)`` bool.
        test_mask: ``(n_local,)`` bool.
        interval_ptr: ``(num_intervals + 1,)`` int64 local-vertex offsets: interval ``i`` is local ids
            ``interval_ptr[i]:interval_ptr[i+1]``; its in-edges are ``edge_index[:, dst_ptr[a]:dst_ptr[b]]``.
        num_train_global: Number of training vertices in the whole graph (for an exact global mean loss).
        edge_weight: ``(E_local,)`` float weight of each column of ``edge_index`` (PyG's ``edge_weight``,
            read by ``GCNConv`` only, as PyG's), or ``None``: every edge weighs 1.
        weighted_in_degree: ``(n_local + n_ghost,)`` float64 global sum of the in-edge weights of every
            local and ghost vertex (self loops removed; the weighted ``in_degree``), set exactly when
            ``edge_weight`` is; GCN's normalisation ``deg = weighted_in_degree + 1`` needs the ghosts' too.
    """

    part_id: int
    num_parts: int
    num_global_nodes: int
    local_nodes: Tensor
    ghost_nodes: Tensor
    ghost_owner: Tensor
    recv_ptr: Tensor
    send_index: list[Tensor]
    edge_index: Tensor
    dst_ptr: Tensor
    in_degree: Tensor
    x: Tensor
    y: Tensor
    train_mask: Tensor
    val_mask: Tensor
    test_mask: Tensor
    interval_ptr: Tensor
    num_train_global: int
    edge_weight: Tensor | None = None
    weighted_in_degree: Tensor | None = None

    def __post_init__(self) -> None:
        if (self.edge_weight is None) != (self.weighted_in_degree is None):
            raise ValueError(
                "GraphPartition: edge_weight and weighted_in_degree go together (both None: unweighted); "
                f"got edge_weight={_shape(self.edge_weight)}, weighted_in_degree="
                f"{_shape(self.weighted_in_degree)}"
            )

    @property
    def multi_label(self) -> bool:
        """Whether ``y`` holds multi-label targets ``(n_local, C)`` rather than class labels."""
        return self.y.dim() == 2

    @property
    def n_local(self) -> int:
        """Number of owned vertices."""
        return int(self.local_nodes.numel())

    @property
    def n_ghost(self) -> int:
        """Number of ghost vertices (read-only copies of other partitions' boundary vertices)."""
        return int(self.ghost_nodes.numel())

    @property
    def num_edges(self) -> int:
        """Number of edges stored here (the in-edges of the owned vertices)."""
        return int(self.edge_index.size(1))

    @property
    def num_intervals(self) -> int:
        """Number of vertex intervals (the unit of work sent to a tensor-op executor)."""
        return int(self.interval_ptr.numel()) - 1

    @property
    def num_features(self) -> int:
        """Feature width ``F``."""
        return int(self.x.size(1))

    def interval(self, i: int) -> tuple[int, int]:
        """Local vertex range ``(start, end)`` of interval ``i``."""
        if not 0 <= i < self.num_intervals:
            raise IndexError(f"interval index {i} is out of range for {self.num_intervals} intervals")
        return int(self.interval_ptr[i]), int(self.interval_ptr[i + 1])

    def interval_edges(self, i: int) -> tuple[int, int]:
        """Edge range ``(start, end)`` into ``edge_index`` of the in-edges of interval ``i``."""
        start, end = self.interval(i)
        return int(self.dst_ptr[start]), int(self.dst_ptr[end])

    def src_csr(self) -> tuple[Tensor, Tensor]:
        """The transposed adjacency (CSR over ``src``), for scatter-style backward passes.

        Returns:
            ``(src_ptr, src_perm)``: ``src_ptr`` is ``(n_local + n_ghost + 1,)``; the out-edges of local/ghost
            id ``v`` are ``edge_index[:, src_perm[src_ptr[v]:src_ptr[v+1]]]`` (ascending dst). One stable
            sort, ``O(E log E)``; computed on demand, not stored.
        """
        src = self.edge_index[0]
        src_perm = torch.sort(src, stable=True).indices
        counts = torch.bincount(src, minlength=self.n_local + self.n_ghost)
        src_ptr = torch.zeros(counts.numel() + 1, dtype=torch.long, device=src.device)
        torch.cumsum(counts, 0, out=src_ptr[1:])
        return src_ptr, src_perm

    def to(self, device: torch.device | str | int, non_blocking: bool = False) -> GraphPartition:
        """A copy with every tensor on ``device`` (Lightning's batch transfer calls this)."""

        def move(t: Tensor) -> Tensor:
            return t.to(device, non_blocking=non_blocking)

        changes: dict[str, Any] = {
            f.name: move(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        changes["send_index"] = [move(t) for t in self.send_index]
        return dataclasses.replace(self, **changes)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(part_id={self.part_id}, num_parts={self.num_parts}, "
            f"n_local={self.n_local}, n_ghost={self.n_ghost}, num_edges={self.num_edges}, "
            f"num_features={self.num_features}, num_intervals={self.num_intervals}, "
            f"num_train_global={self.num_train_global}, device={self.x.device})"
        )


def _shape(t: Tensor | None) -> str:
    return "None" if t is None else f"a tensor of shape {tuple(t.shape)}"
