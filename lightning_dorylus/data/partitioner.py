"""Vertex partitioners: map every vertex to a graph server, ``assignment[v] in 0..num_parts-1``.

- ``"metis"``: METIS k-way edge-cut (through ``pymetis``, the ``metis`` extra) on the symmetrised graph, as
  in Dorylus. If ``pymetis`` cannot be imported, a warning says so and ``"bfs"`` is used instead.
- ``"bfs"``: breadth-first (reverse Cuthill-McKee, scipy) vertex order cut into ``num_parts`` equal ranges;
  keeps neighbourhoods together without METIS. Deterministic.
- ``"contiguous"``: equal ranges of global ids (good when ids already have locality).
- ``"random"``: a seeded random balanced assignment (the worst case for communication; a baseline).

Everything is vectorised (torch / numpy / scipy); no Python loops over vertices or edges.
"""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType

import numpy as np
import scipy.sparse as sp
import torch
from scipy.sparse.csgraph import reverse_cuthill_mckee
from torch import Tensor

from lightning_dorylus.data.validation import check_num_parts, check_partitioner


def partition_nodes(
    edge_index: Tensor, num_nodes: int, num_parts: int, partitioner: str = "metis", seed: int = 0
) -> Tensor:
    """Assigns every vertex to a partition.

    Args:
        edge_index: ``(2, E)`` int64 global edges (any direction; symmetrised internally where needed).
        num_nodes: Number of vertices.
        num_parts: Number of partitions, ``1 <= num_parts <= num_nodes``.
        partitioner: One of ``"metis"``, ``"bfs"``, ``"contiguous"``, ``"random"``.
        seed: Seed for METIS and ``"random"``.

    Returns:
        ``(num_nodes,)`` int64 partition id of every vertex.
    """
    check_partitioner(partitioner)
    num_parts = check_num_parts(num_parts, num_nodes)
    if num_parts == 1:
        return torch.zeros(num_nodes, dtype=torch.long)
    if partitioner == "metis":
        try:
            pymetis = importlib.import_module("pymetis")
        except ImportError:
            warnings.warn(
                "partitioner='metis' needs pymetis (pip install 'lightning-bamboo-dorylus[metis]'), "
                "which is not importable; falling back to partitioner='bfs' (breadth-first order cut into "
                "equal ranges, a higher edge cut than METIS)",
                stacklevel=2,
            )
            return bfs_partition(edge_index, num_nodes, num_parts)
        return metis_partition(edge_index, num_nodes, num_parts, seed, pymetis)
    if partitioner == "bfs":
        return bfs_partition(edge_index, num_nodes, num_parts)
    if partitioner == "contiguous":
        return _ranges(torch.arange(num_nodes), num_parts)
    return _ranges(torch.randperm(num_nodes, generator=torch.Generator().manual_seed(seed)), num_parts)


def metis_partition(
    edge_index: Tensor, num_nodes: int, num_parts: int, seed: int, pymetis: ModuleType
) -> Tensor:
    """METIS k-way edge-cut partition of the symmetrised graph (self loops and duplicates removed)."""
    idx_dtype = pymetis.zero_copy_dtype()  # METIS's idx_t: int32 or int64; avoids a copy inside pymetis
    xadj, adjncy = _symmetric_csr(edge_index, num_nodes)
    adjacency = pymetis.CSRAdjacency(adj_starts=xadj.astype(idx_dtype), adjacent=adjncy.astype(idx_dtype))
    _, membership = pymetis.part_graph(num_parts, adjacency=adjacency, options=pymetis.Options(seed=seed))
    return torch.from_numpy(np.asarray(membership, dtype=np.int64))


def bfs_partition(edge_index: Tensor, num_nodes: int, num_parts: int) -> Tensor:
    """Reverse Cuthill-McKee (breadth-first) vertex order cut into ``num_parts`` equal ranges."""
    xadj, adjncy = _symmetric_csr(edge_index, num_nodes)
    data = np.ones(adjncy.size, dtype=np.int8)
    matrix = sp.csr_matrix((data, adjncy.astype(np.int32), xadj), shape=(num_nodes, num_nodes))
    order = reverse_cuthill_mckee(matrix, symmetric_mode=True)
    return _ranges(torch.from_numpy(order.astype(np.int64)), num_parts)


def edge_cut(edge_index: Tensor, assignment: Tensor) -> int:
    """Number of (directed) edges whose endpoints lie in different partitions."""
    return int((assignment[edge_index[0]] != assignment[edge_index[1]]).sum())


def _ranges(order: Tensor, num_parts: int) -> Tensor:
    """Cuts ``order`` (a vertex permutation) into ``num_parts`` near-equal consecutive ranges."""
    n = order.numel()
    assignment = torch.empty(n, dtype=torch.long)
    assignment[order] = torch.arange(n) * num_parts // n
    return assignment


def _symmetric_csr(edge_index: Tensor, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR ``(xadj, adjncy)`` (int64 numpy) of the undirected simple graph spanned by ``edge_index``."""
    src, dst = edge_index
    keep = src != dst
    a = torch.cat([src[keep], dst[keep]])
    b = torch.cat([dst[keep], src[keep]])
    key = torch.unique(a * num_nodes + b)  # sorted by row, then column
    rows, cols = key // num_nodes, key % num_nodes
    xadj = torch.zeros(num_nodes + 1, dtype=torch.long)
    torch.cumsum(torch.bincount(rows, minlength=num_nodes), 0, out=xadj[1:])
    return xadj.numpy(), cols.numpy()
