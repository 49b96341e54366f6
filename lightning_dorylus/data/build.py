"""From a global graph and a vertex assignment to one :class:`GraphPartition` per graph server.

All partitions are built together with whole-graph tensor operations (sorts, ``unique``, ``bincount``);
the only Python loop is over partitions, slicing the results.

Ghost layout: partition ``q`` holds, as ghosts, every vertex of another partition that is the source of
one of ``q``'s edges. They are numbered after ``q``'s own vertices, grouped by owner (ascending owner id)
and by global id within an owner, so ``p.send_index[q]`` (the rows ``p`` sends to ``q``) lists them in
exactly that order.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor
from torch_geometric.data import Data

from lightning_dorylus.data.partition import GraphPartition
from lightning_dorylus.data.partitioner import partition_nodes
from lightning_dorylus.data.validation import (
    GraphTensors,
    check_interval_size,
    check_num_parts,
    check_partitioner,
    graph_tensors,
    warn_ignored_attributes,
)

DEFAULT_INTERVAL_SIZE = 512
"""Vertices per interval. 512 rows of Cora's 1433 float32 features are 2.9 MB, inside a Lambda's 6 MB."""


def partition_graph(
    data: Data,
    num_parts: int,
    partitioner: str = "metis",
    interval_size: int = DEFAULT_INTERVAL_SIZE,
    seed: int = 0,
) -> list[GraphPartition]:
    """Partitions ``data`` into ``num_parts`` graph-server partitions (in memory; see ``cache`` for disk).

    Args:
        data: A PyG graph (``edge_index``, ``x``; optional ``y`` and the ``train``/``val``/``test`` masks).
        num_parts: Number of graph servers.
        partitioner: ``"metis"`` (default), ``"bfs"``, ``"contiguous"`` or ``"random"``.
        interval_size: Vertices per interval (the unit of work sent to an executor), ``>= 1``.
        seed: Seed for METIS and the random partitioner.

    Returns:
        ``num_parts`` partitions; element ``k`` is partition ``k``.
    """
    check_partitioner(partitioner)
    interval_size = check_interval_size(interval_size)
    graph = graph_tensors(data)
    warn_ignored_attributes(data)  # edge_attr; edge_weight is carried (graph.edge_weight)
    num_parts = check_num_parts(num_parts, graph.num_nodes)
    assignment = partition_nodes(graph.edge_index, graph.num_nodes, num_parts, partitioner, seed)
    return build_partitions(graph, assignment, num_parts, interval_size)


def build_partitions(
    graph: GraphTensors, assignment: Tensor, num_parts: int, interval_size: int = DEFAULT_INTERVAL_SIZE
) -> list[GraphPartition]:
    """Builds every partition from a validated graph and ``assignment[v]`` (the partition of vertex ``v``)."""
    n, p_count = graph.num_nodes, num_parts
    if assignment.shape != (n,):
        raise ValueError(f"assignment has shape {tuple(assignment.shape)} but expected ({n},)")
    if n and (int(assignment.min()) < 0 or int(assignment.max()) >= p_count):
        lo, hi = int(assignment.min()), int(assignment.max())
        raise ValueError(f"assignment values must lie in [0, {p_count}) (num_parts), got [{lo}, {hi}]")
    asg = assignment.to(torch.long)

    # Vertices: grouped by partition, ascending global id inside one (stable sort).
    n_local = torch.bincount(asg, minlength=p_count)  # (P,)
    node_ptr = _ptr(n_local)
    order = torch.sort(asg, stable=True).indices  # (N,) global ids in partition-major order
    pos = torch.empty(n, dtype=torch.long)
    pos[order] = torch.arange(n)  # position of each vertex in `order`
    local_id = pos - node_ptr[asg]  # (N,) local id inside its own partition
    empty = (n_local == 0).nonzero().view(-1).tolist()
    if empty:
        warnings.warn(f"partitions {empty} own no vertices ({p_count} parts, {n} vertices)", stacklevel=2)

    # Edges: owned by the partition of dst; grouped by owner, keeping the (dst, src) order (so the copies
    # of a duplicate edge stay next to each other).
    src, dst = graph.edge_index
    e_owner = asg[dst]
    eperm = torch.sort(e_owner, stable=True).indices
    src, dst, e_owner = src[eperm], dst[eperm], e_owner[eperm]
    weight = None if graph.edge_weight is None else graph.edge_weight[eperm]
    edge_ptr = _ptr(torch.bincount(e_owner, minlength=p_count))
    cross = asg[src] != e_owner  # edges whose source is a ghost on the owner

    # Ghost slots: unique (holder, source) pairs, sorted by holder, then owner, then global id.
    cross_holder = e_owner[cross]
    pair_key, inverse = torch.unique(cross_holder * n + pos[src[cross]], return_inverse=True)
    g_holder = pair_key // n
    g_node = order[pair_key % n]
    g_owner = asg[g_node]
    ghost_ptr = _ptr(torch.bincount(g_holder, minlength=p_count))
    pair_counts = torch.bincount(g_holder * p_count + g_owner, minlength=p_count * p_count)
    pair_counts = pair_counts.view(p_count, p_count)  # [holder, owner]

    local_src = local_id[src]
    local_src[cross] = n_local[cross_holder] + inverse - ghost_ptr[cross_holder]
    local_dst = local_id[dst]

    # Send lists: the same pairs re-sorted by (owner, holder); segment (p, q) = rows p sends to q.
    sperm = torch.sort(g_owner * p_count + g_holder, stable=True).indices
    send_local = local_id[g_node[sperm]]
    send_ptr = _ptr(pair_counts.t().reshape(-1))  # flattened over (owner, holder)

    in_degree = torch.bincount(graph.edge_index[1], minlength=n)  # every copy of a duplicate edge counts
    weighted_degree = None
    if graph.edge_weight is not None:  # PyG's gcn_norm: the sum of the in-edge weights
        weighted_degree = torch.zeros(n, dtype=torch.float64).index_add_(
            0, graph.edge_index[1], graph.edge_weight.to(torch.float64))
    num_train_global = int(graph.train_mask.sum())

    parts = []
    for p in range(p_count):
        nodes = order[node_ptr[p] : node_ptr[p + 1]].clone()
        ghosts = g_node[ghost_ptr[p] : ghost_ptr[p + 1]].clone()
        e_a, e_b = int(edge_ptr[p]), int(edge_ptr[p + 1])
        edge_index = torch.stack([local_src[e_a:e_b], local_dst[e_a:e_b]])
        row = send_ptr[p * p_count : (p + 1) * p_count + 1]
        send_index = [send_local[row[q] : row[q + 1]].clone() for q in range(p_count)]
        held = torch.cat([nodes, ghosts])
        parts.append(
            GraphPartition(
                part_id=p,
                num_parts=p_count,
                num_global_nodes=n,
                local_nodes=nodes,
                ghost_nodes=ghosts,
                ghost_owner=asg[ghosts],
                recv_ptr=_ptr(pair_counts[p]),
                send_index=send_index,
                edge_index=edge_index,
                dst_ptr=_ptr(torch.bincount(local_dst[e_a:e_b], minlength=nodes.numel())),
                in_degree=in_degree[held],
                x=graph.x[nodes],
                y=graph.y[nodes],
                train_mask=graph.train_mask[nodes],
                val_mask=graph.val_mask[nodes],
                test_mask=graph.test_mask[nodes],
                interval_ptr=interval_ptr(nodes.numel(), interval_size),
                num_train_global=num_train_global,
                edge_weight=None if weight is None else weight[e_a:e_b].clone(),
                weighted_in_degree=None if weighted_degree is None else weighted_degree[held],
            )
        )
    return parts


def interval_ptr(n_local: int, interval_size: int) -> Tensor:
    """Offsets cutting ``n_local`` vertices into intervals of ``interval_size`` (the last may be shorter)."""
    interval_size = check_interval_size(interval_size)
    starts = torch.arange(0, n_local, interval_size, dtype=torch.long)
    return torch.cat([starts, torch.tensor([n_local], dtype=torch.long)])


def _ptr(counts: Tensor) -> Tensor:
    """Exclusive prefix sum with a leading zero: ``(k,)`` counts -> ``(k + 1,)`` offsets."""
    out = torch.zeros(counts.numel() + 1, dtype=torch.long)
    torch.cumsum(counts, 0, out=out[1:])
    return out
