"""Server-side graph structures derived once from a :class:`GraphPartition` and reused every epoch.

The graph server keeps these next to its partition: the normalised GCN adjacency ``Â`` (and its transpose for
∇GA) as sparse CSR matrices over local + ghost columns, and the in-edge list with self loops that GAT's
ApplyEdge works on. Building them costs a sort over the edges, so :class:`GraphCache` keeps them for the
partition a model sees again and again (Lightning hands the same partition to ``training_step`` every epoch).
"""

from __future__ import annotations

import itertools
import warnings
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lightning_dorylus.data.partition import GraphPartition


@dataclass
class GCNAdjacency:
    """``Â = D^-1/2 (A + I) D^-1/2`` restricted to this partition's rows (PyG's ``gcn_norm``).

    Attributes:
        adj: ``(n_local, n_local + n_ghost)`` sparse CSR: row ``i`` holds the weights of ``i``'s in-edges.
        adj_t: ``(n_local + n_ghost, n_local)`` sparse CSR: the transpose, used by ∇GA.
    """

    adj: Tensor
    adj_t: Tensor


@dataclass
class SelfLoopEdges:
    """In-edges of the local vertices plus one self loop per local vertex, sorted by ``dst`` (GAT's edge set).

    Attributes:
        src: ``(E',)`` int64 local/ghost ids.
        dst: ``(E',)`` int64 local ids, ascending.
        dst_ptr: ``(n_local + 1,)`` int64 CSR pointer over ``dst``.
    """

    src: Tensor
    dst: Tensor
    dst_ptr: Tensor


def gcn_adjacency(partition: GraphPartition, dtype: torch.dtype) -> GCNAdjacency:
    """Builds ``Â`` for the partition's rows with the GLOBAL degrees, so rows equal the full-graph ones.

    PyG's ``gcn_norm`` adds self loops of weight 1 and weights edge ``j -> i`` by
    ``w_ji / sqrt(deg_j * deg_i)`` with ``deg = Σ in-edge weights + 1`` (``w = 1`` and ``deg = in_degree + 1``
    without ``edge_weight``; a degree of 0 gives 0, as its ``inf`` is masked there); ghosts carry their global
    (weighted) in-degree in ``partition.in_degree`` / ``partition.weighted_in_degree``. Each copy of a
    duplicate edge counts, in the degree and in the entry (the copies' weights summed).
    """
    if partition.edge_weight is not None:
        if partition.weighted_in_degree is None:
            raise ValueError("the partition has edge_weight but no weighted_in_degree (GCN's degrees)")
        degree = partition.weighted_in_degree.to(torch.float64) + 1.0
    else:
        degree = partition.in_degree.to(torch.float64) + 1.0
    deg_inv_sqrt = degree.rsqrt().masked_fill_(degree == 0, 0.0)

    def weight(src: Tensor, dst: Tensor, multiplicity: Tensor | None) -> Tensor:
        value = deg_inv_sqrt.index_select(0, src) * deg_inv_sqrt.index_select(0, dst)
        return (value if multiplicity is None else value * multiplicity).to(dtype)

    # gcn_norm replaces existing self loops by one of weight 1
    return _adjacency(partition, weight, dtype, self_loops=True, values=partition.edge_weight)


def mean_adjacency(partition: GraphPartition, dtype: torch.dtype) -> GCNAdjacency:
    """GraphSAGE's mean aggregation as a matrix: row ``i`` holds ``1 / in_degree(i)`` per in-edge ``j -> i``.

    The partition holds every in-edge of its local vertices, so the degree is the global one and each row
    equals the full graph's (PyG's ``SAGEConv(aggr="mean")`` over ``edge_index`` as given; no in-edges: 0):
    a duplicate edge counts once per copy, and ``edge_weight`` is not read (PyG's ``SAGEConv`` takes none).
    """
    deg = torch.bincount(partition.edge_index[1], minlength=partition.n_local).to(torch.float64)
    inv_deg = 1.0 / deg.clamp_min(1.0)

    def weight(src: Tensor, dst: Tensor, multiplicity: Tensor | None) -> Tensor:
        value = inv_deg.index_select(0, dst)
        return (value if multiplicity is None else value * multiplicity).to(dtype)

    return _adjacency(partition, weight, dtype, self_loops=False)


#: Entries an adjacency build handles per step: its sort keys, orders and gathered weights stay a few MiB
#: instead of several copies of the whole edge list (at 10M edges per server those copies were ~600 MiB,
#: the graph server's peak).
BUILD_CHUNK = 1 << 18

Weight = Callable[[Tensor, Tensor, Tensor | None], Tensor]
"""``weight(src, dst, multiplicity)``: the entries ``src -> dst``'s values; ``multiplicity`` is the summed
edge weight (or copy count) of each entry, ``None`` where every entry stands for one edge of weight 1."""


def _adjacency(
    partition: GraphPartition, weight: Weight, dtype: torch.dtype, self_loops: bool,
    values: Tensor | None = None,
) -> GCNAdjacency:
    """``adj`` (rows: ``dst``) and ``adj_t`` (rows: ``src``) of the partition's in-edges, entry ``j -> i``
    weighted ``weight(j, i, m_ji)``; ``self_loops``: existing self loops dropped and one added (``m = 1``)
    per local vertex. ``values``: a multiplier per column of ``edge_index`` (``edge_weight``), else 1; the
    copies of a duplicate edge become one entry, ``m`` their summed multipliers (their count).

    The edge list is sorted by ``dst`` (as partitions are built), so both matrices are written in place,
    a block of destination rows at a time: ``adj``'s rows are contiguous, and each ``adj_t`` row takes its
    entries block after block, i.e. in ascending ``dst``. The arrays equal :func:`_csr`'s (columns ascending
    within a row), which remains the path for an edge list in any other order, or whose copies of an edge
    are not next to each other.
    """
    dst = partition.edge_index[1]
    if dst.numel() > 1 and not bool((dst[1:] >= dst[:-1]).all()):
        return _adjacency_by_sort(partition, weight, self_loops, values)
    for copies in (False, True):  # first as if every edge came once (no pass to find copies)
        built = _adjacency_in_place(partition, weight, dtype, self_loops, values, copies)
        if built is not None:
            return built
    return _adjacency_by_sort(partition, weight, self_loops, values)  # copies apart in the list


def _adjacency_in_place(
    partition: GraphPartition, weight: Weight, dtype: torch.dtype, self_loops: bool, values: Tensor | None,
    copies: bool,
) -> GCNAdjacency | None:
    """:func:`_adjacency` of an edge list sorted by ``dst``; ``None`` when an edge has copies and
    ``copies`` is False (each column counted as an entry), or when ``copies`` is True but the copies of an
    edge are not next to each other (entries counted per run of equal columns)."""
    n_local, n_total = partition.n_local, partition.n_local + partition.n_ghost
    src, dst = partition.edge_index
    in_edges = torch.bincount(dst, minlength=n_local)  # (n_local,) edges per destination row as stored
    if copies:
        first = torch.ones(src.numel(), dtype=torch.bool, device=src.device)  # first copy of its edge
        if src.numel() > 1:
            torch.logical_or(src[1:] != src[:-1], dst[1:] != dst[:-1], out=first[1:])
        counted = first & (src != dst) if self_loops else first
        row_counts = torch.bincount(dst[counted], minlength=n_local)
        col_counts = torch.bincount(src[counted], minlength=n_total)
        del first, counted
    else:
        row_counts, col_counts = in_edges.clone(), torch.bincount(src, minlength=n_total)
        if self_loops:
            loops = (src == dst).nonzero().squeeze(1)
            row_counts -= torch.bincount(dst[loops], minlength=n_local)
            col_counts -= torch.bincount(src[loops], minlength=n_total)
    if self_loops:
        row_counts += 1
        col_counts[:n_local] += 1
    nnz = int(row_counts.sum())
    index_dtype = _index_dtype(n_local, n_total, nnz)
    crow, crow_t = _offsets(row_counts, index_dtype), _offsets(col_counts, index_dtype)
    device = src.device
    col = torch.empty(nnz, dtype=index_dtype, device=device)
    value = torch.empty(nnz, dtype=dtype, device=device)
    col_t, value_t = torch.empty_like(col), torch.empty_like(value)
    cursor = crow_t[:-1].to(torch.long)  # (n_total,) next free slot of each adj_t row
    edge_ptr = _offsets(in_edges, torch.long)
    entry_ptr = crow.to(torch.long)
    targets = torch.arange(BUILD_CHUNK, max(nnz, BUILD_CHUNK), BUILD_CHUNK, device=device)
    bounds = sorted({0, n_local, *torch.searchsorted(entry_ptr, targets).clamp_max(n_local).tolist()})
    for r0, r1 in itertools.pairwise(bounds):
        e0, e1 = int(edge_ptr[r0]), int(edge_ptr[r1])
        s, d = src[e0:e1], dst[e0:e1]
        m = None if values is None else values[e0:e1].to(torch.float64)
        if copies and m is None:
            m = torch.ones(e1 - e0, dtype=torch.float64, device=device)
        if self_loops:
            keep = s != d
            if not bool(keep.all()):
                s, d, m = s[keep], d[keep], (None if m is None else m[keep])
            loop = torch.arange(r0, r1, device=device)
            s, d = torch.cat([s, loop]), torch.cat([d, loop])
            if m is not None:
                m = torch.cat([m, torch.ones(r1 - r0, dtype=torch.float64, device=device)])
        a, b = int(entry_ptr[r0]), int(entry_ptr[r1])
        # adj's rows r0:r1, columns ascending: the sorted (dst, src) keys are both indices
        key, perm = torch.sort(d * n_total + s)
        if copies:  # one entry per edge, the copies' multipliers summed
            key, inverse = torch.unique_consecutive(key, return_inverse=True)
            m = torch.zeros(key.numel(), dtype=torch.float64, device=device).index_add_(0, inverse, m[perm])
        elif m is not None:
            m = m[perm]
        if key.numel() != b - a or (key.numel() > 1 and bool((key[1:] == key[:-1]).any())):
            return None  # copies (not counted, or not next to each other)
        row, column = _split(key, n_total)
        col[a:b] = column
        value[a:b] = weight(column, row, m)
        # their entries of adj_t, grouped by row (src), dst ascending: each row's run goes to its cursor
        key, perm = torch.sort(column * n_local + row)
        row, column = _split(key, n_local)
        rows, counts = torch.unique_consecutive(row, return_counts=True)
        start = cursor.index_select(0, rows) - (torch.cumsum(counts, 0) - counts)
        slot = torch.arange(row.numel(), device=device) + torch.repeat_interleave(start, counts)
        col_t.index_copy_(0, slot, column.to(index_dtype))
        value_t.index_copy_(0, slot, value[a:b][perm])  # entry j -> i holds the same value in both
        cursor.index_add_(0, rows, counts)
    return GCNAdjacency(adj=_sparse_csr(crow, col, value, (n_local, n_total)),
                        adj_t=_sparse_csr(crow_t, col_t, value_t, (n_total, n_local)))


def _split(key: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """``key = row * width + column`` -> ``(row, column)``."""
    row = torch.div(key, width, rounding_mode="floor")
    return row, key - row * width


def _adjacency_by_sort(
    partition: GraphPartition, weight: Weight, self_loops: bool, values: Tensor | None = None
) -> GCNAdjacency:
    """:func:`_adjacency` for an edge list in any order: whole-list sorts (several copies of it at once)."""
    n_local, n_total = partition.n_local, partition.n_local + partition.n_ghost
    src, dst = partition.edge_index
    m = None if values is None else values.to(torch.float64)
    if self_loops:
        keep = src != dst
        loop = torch.arange(n_local, device=src.device)
        src, dst = torch.cat([src[keep], loop]), torch.cat([dst[keep], loop])
        if m is not None:
            m = torch.cat([m[keep], torch.ones(n_local, dtype=torch.float64, device=src.device)])
    key, inverse = torch.unique(dst * n_total + src, return_inverse=True)
    if key.numel() != src.numel():  # duplicate edges: one entry each, their multipliers summed
        ones = torch.ones(src.numel(), dtype=torch.float64, device=src.device)
        m = torch.zeros(key.numel(), dtype=torch.float64, device=src.device).index_add_(
            0, inverse, ones if m is None else m)
        dst, src = _split(key, n_total)
    value = weight(src, dst, m)
    return GCNAdjacency(
        adj=_csr(dst, src, value, (n_local, n_total)), adj_t=_csr(src, dst, value, (n_total, n_local))
    )


def _index_dtype(*sizes: int) -> torch.dtype:
    """int32 when every index and count of a sparse matrix (``sizes``) fits it (``torch.sparse.mm`` takes
    int32 CSR on CPU and CUDA: half the resident size of the index arrays), else int64."""
    return torch.int32 if max(sizes) < 2**31 - 1 else torch.long


def _offsets(counts: Tensor, dtype: torch.dtype) -> Tensor:
    """``(k,)`` counts -> ``(k + 1,)`` offsets with a leading zero (a CSR row pointer)."""
    out = torch.zeros(counts.numel() + 1, dtype=dtype, device=counts.device)
    torch.cumsum(counts, 0, out=out[1:])
    return out


def _sparse_csr(crow: Tensor, col: Tensor, value: Tensor, size: tuple[int, int]) -> Tensor:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return torch.sparse_csr_tensor(crow, col, value, size, check_invariants=False)


def _csr(row: Tensor, col: Tensor, value: Tensor, size: tuple[int, int]) -> Tensor:
    """A sparse CSR matrix from COO triplets (no duplicates), columns ascending within a row.

    Index arrays are int32 when every index and the number of entries fit (``torch.sparse.mm`` takes int32
    CSR on CPU and CUDA): half the resident size of the two adjacencies' column arrays.
    """
    order = torch.argsort(row * size[1] + col)
    index_dtype = _index_dtype(*size, row.numel())
    crow = _offsets(torch.bincount(row, minlength=size[0]), index_dtype)
    return _sparse_csr(crow, col[order].to(index_dtype), value[order], size)


@dataclass
class AdjacencyBlock:
    """Rows ``a:b`` (one vertex interval) of an adjacency, for per-interval GA, and the transpose of the
    rows of its *group* of consecutive intervals, for ∇GA, held by the group's last block.

    Why groups: an interval's transpose reaches about as many columns as it has entries (8192 rows of a
    20-edge graph: ~130k columns for ~190k entries), so one sparse product per interval costs a row visit
    per entry and a pass over the full-height output; with 62 intervals per server that was ~1.9x one whole
    ``Âᵀ`` product, and the 62 full-height row pointers ~340 MiB per server (1M-vertex benchmark). At most
    :data:`TRANSPOSE_GROUPS` groups per adjacency keep the pipeline's overlap (each group's product runs
    while later intervals' requests are out) at a fraction of that cost and memory.

    Attributes:
        rows: ``(a, b)``.
        adj: ``(b - a, n_local + n_ghost)`` sparse CSR: the interval's rows.
        group_rows: ``(a0, b1)``: the rows of this block's group (its first block's ``a``, its last's ``b``).
        adj_t: ``(len(cols), b1 - a0)`` sparse CSR: the group's rows transposed, restricted to the columns
            they touch; ``None`` unless this block closes its group.
        cols: ``(len(cols),)`` int64: the rows of ``[local; ghost]`` that ``adj_t``'s rows stand for
            (or None).
        adj_t_rows: ``adj_t`` with a row for every row of ``[local; ghost]`` (``adj.size(1)``), empty where
            ``cols`` has none; it shares ``adj_t``'s column and value arrays (or None).
    """

    rows: tuple[int, int]
    adj: Tensor
    group_rows: tuple[int, int]
    adj_t: Tensor | None = None
    cols: Tensor | None = None
    adj_t_rows: Tensor | None = None

    @property
    def closes_group(self) -> bool:
        """Whether this block holds its group's transpose (it is the group's last interval)."""
        return self.adj_t_rows is not None

    def add_transposed(self, out: Tensor, x: Tensor) -> Tensor:
        """``out[cols] += adj_t @ x`` in place for the group's rows ``x`` (``(b1 - a0, F)``): one sparse
        ``addmm``, no product temporary and no ``index_add_``."""
        if self.adj_t_rows is None:
            raise ValueError(f"block of rows {self.rows} does not close its group {self.group_rows}; add "
                             "through the group's last block (TransposedSum)")
        return out.addmm_(self.adj_t_rows, x)


#: At most this many transposed groups per adjacency (see :class:`AdjacencyBlock`).
TRANSPOSE_GROUPS = 8


class TransposedSum:
    """``out += Σ_i block_iᵀ x_i`` as interval results arrive in interval order: each group's rows are
    gathered and added with one product when the rows up to its end have arrived (:class:`AdjacencyBlock`;
    a :func:`whole_block` is one group: one product after the last interval)."""

    def __init__(self, blocks: list[AdjacencyBlock], out: Tensor) -> None:
        self.out = out
        self._closing = {block.group_rows[1]: block for block in blocks if block.closes_group}
        self._pending: list[Tensor] = []

    def add(self, x: Tensor, end: int) -> None:
        """The next interval's rows ``x`` (``(b - a, F)``, ending at row ``end = b``); intervals must come
        in order, none skipped."""
        self._pending.append(x)
        block = self._closing.get(end)
        if block is not None:
            rows = self._pending[0] if len(self._pending) == 1 else torch.cat(self._pending)
            self._pending.clear()
            block.add_transposed(self.out, rows)


def _group_ends(n: int, groups: int) -> list[int]:
    """Indices of the intervals that close a group: ``n`` intervals in at most ``groups`` runs of equal
    length (the last may be shorter)."""
    size = -(-n // max(groups, 1)) if n else 1
    return [min(i + size, n) - 1 for i in range(0, n, size)]


def interval_blocks(
    adjacency: GCNAdjacency, intervals: list[tuple[int, int]], groups: int = TRANSPOSE_GROUPS,
    own_group: tuple[int, int] | None = None,
) -> list[AdjacencyBlock]:
    """Cut ``adjacency.adj`` into one row block per interval, and transpose each run of consecutive
    intervals (at most ``groups`` runs), once per partition. ``own_group``: one more block, after the
    others and in a group of its own (the ghost columns of :func:`column_blocks`), transposed in the same
    pass over ``adjacency.adj_t``."""
    adj = adjacency.adj
    crow, col, value = adj.crow_indices(), adj.col_indices(), adj.values()
    n_total = adj.size(1)
    ends = _group_ends(len(intervals), groups)
    starts = [0, *(last + 1 for last in ends[:-1])]
    runs = [intervals[first : last + 1] for first, last in zip(starts, ends)]
    if own_group is not None:
        runs.append([own_group])
    group_rows = [(run[0][0], run[-1][1]) for run in runs]
    blocks: list[AdjacencyBlock] = []
    for run, (a0, b1), (adj_t, cols) in zip(runs, group_rows, _group_transposes(adjacency.adj_t, group_rows)):
        for a, b in run:
            blocks.append(AdjacencyBlock(rows=(a, b), adj=_row_block(crow, col, value, a, b, n_total),
                                         group_rows=(a0, b1)))
        closing = blocks[-1]
        closing.adj_t, closing.cols = adj_t, cols
        closing.adj_t_rows = _spread_rows(adj_t, cols, n_total)
    return blocks


def _group_transposes(adj_t: Tensor, group_rows: list[tuple[int, int]]) -> list[tuple[Tensor, Tensor]]:
    """For each group's rows ``(a0, b1)`` of an adjacency ``Â`` (disjoint groups), its compact transpose and
    the columns it reaches: ``(Â[a0:b1][:, cols]ᵀ, cols)``, a ``(len(cols), b1 - a0)`` CSR matrix.

    Read from ``adj_t`` (``Âᵀ``): its entries are in the order every group's transpose needs (row, then
    column ascending), so one pass labels each entry with its group (a table indexed by column), and each
    group's entries, picked in that order by one stable sort of the labels (a radix pass on one byte), are
    its CSR arrays as they stand; one count of (group, row) pairs gives every group's rows. No sort of
    columns (a sort of each group's entries by column was ~40 % of a pipelined server's first epoch on the
    100k-vertex time-to-accuracy graph), no search per entry, no per-group gather of the row of each entry
    (together ~2x this function's time before)."""
    crow, col, value = adj_t.crow_indices(), adj_t.col_indices(), adj_t.values()
    n_rows, n_groups = adj_t.size(0), len(group_rows)
    by_column = torch.zeros(adj_t.size(1) + 1, dtype=torch.uint8 if n_groups < 255 else torch.long,
                            device=col.device)  # 1 + the group of a column, 0 where it is in none
    for k, (a0, b1) in enumerate(group_rows):
        by_column[a0:b1] = k + 1
    label = by_column[col]
    order = torch.argsort(label, stable=True)  # each group's entries keep adj_t's order
    bounds = [0, *torch.cumsum(torch.bincount(label, minlength=n_groups + 1), 0).tolist()]
    key_dtype = _index_dtype((n_groups + 1) * n_rows)  # int32 keys: a third of an int64 count's time
    row = torch.repeat_interleave(torch.arange(n_rows, dtype=key_dtype, device=col.device),
                                  (crow[1:] - crow[:-1]).long())
    per_row = torch.bincount(label.to(key_dtype) * n_rows + row, minlength=(n_groups + 1) * n_rows)
    per_row = per_row.view(n_groups + 1, n_rows)  # entries of each (1 + group, row of adj_t)
    picked_col, picked_value = col[order], value[order]
    out = []
    for k, (a0, b1) in enumerate(group_rows):
        lo, hi = bounds[k + 1], bounds[k + 2]  # label 0 first: the entries outside every group
        reached = per_row[k + 1]
        cols = reached.nonzero().squeeze(1)
        index_dtype = _index_dtype(cols.numel(), b1 - a0, hi - lo)
        out.append((_sparse_csr(_offsets(reached[cols], index_dtype),
                                (picked_col[lo:hi] - a0).to(index_dtype), picked_value[lo:hi],
                                (cols.numel(), b1 - a0)), cols))
    return out


def _row_block(crow: Tensor, col: Tensor, value: Tensor, a: int, b: int, n_total: int) -> Tensor:
    """Rows ``a:b`` of the CSR ``(crow, col, value)`` as a ``(b - a, n_total)`` CSR matrix: views of its
    column and value arrays (columns already ascending within each row; no copy where the index type is
    already :func:`_csr`'s), no sort."""
    e0, e1 = int(crow[a]), int(crow[b])
    index_dtype = _index_dtype(b - a, n_total, e1 - e0)
    return _sparse_csr((crow[a : b + 1] - e0).to(index_dtype), col[e0:e1].to(index_dtype), value[e0:e1],
                       (b - a, n_total))


def _spread_rows(compact: Tensor, rows: Tensor, n_rows: int) -> Tensor:
    """``compact`` (CSR) with its row ``i`` moved to row ``rows[i]`` of ``n_rows`` rows, the others empty."""
    crow = compact.crow_indices()
    counts = torch.zeros(n_rows, dtype=torch.long, device=crow.device)
    counts[rows] = (crow[1:] - crow[:-1]).long()
    spread = torch.zeros(n_rows + 1, dtype=crow.dtype, device=crow.device)
    torch.cumsum(counts, 0, out=spread[1:])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return torch.sparse_csr_tensor(spread, compact.col_indices(), compact.values(),
                                       (n_rows, compact.size(1)), check_invariants=False)


def column_blocks(adjacency: GCNAdjacency, intervals: list[tuple[int, int]]) -> list[AdjacencyBlock]:
    """The columns of ``adjacency.adj`` cut per local interval, then one block for all ghost columns.

    Block ``j`` stands for ``Â[:, a:b]``: its ``adj`` is ``Âᵀ[a:b]`` (``(b - a, n_local)``, for ∇GA of the
    interval's rows), its ``adj_t`` the compact ``Â[cols, a:b]`` and ``cols`` the local rows it reaches. So
    ``Z = Σ_j Â[:, a:b] P[a:b]`` can be accumulated as interval ``j``'s rows ``P[a:b]`` arrive (weight-first
    GCN: AV before GA); the last block is ``Â[:, n_local:]``, the ghost columns.
    """
    n_local, n_total = adjacency.adj.shape
    transposed = GCNAdjacency(adj=adjacency.adj_t, adj_t=adjacency.adj)
    return interval_blocks(transposed, intervals, own_group=(n_local, n_total))


def whole_block(adjacency: GCNAdjacency) -> AdjacencyBlock:
    """All rows of ``adjacency`` as one block (one group) sharing its two matrices, no copy: GA in one
    product before the first request, ∇GA in one after the last result (the synchronous granularity)."""
    n_rows = adjacency.adj.size(0)
    return AdjacencyBlock(rows=(0, n_rows), adj=adjacency.adj, group_rows=(0, n_rows), adj_t=adjacency.adj_t,
                          adj_t_rows=adjacency.adj_t)


def self_loop_edges(partition: GraphPartition) -> SelfLoopEdges:
    """In-edges without self loops plus one self loop per local vertex (as PyG's GATConv)."""
    n_local = partition.n_local
    src, dst = partition.edge_index
    keep = src != dst
    loop = torch.arange(n_local, device=src.device)
    src = torch.cat([src[keep], loop])
    dst = torch.cat([dst[keep], loop])
    order = torch.sort(dst, stable=True).indices  # each vertex's self loop ends its in-edge segment
    src, dst = src[order], dst[order]
    counts = torch.bincount(dst, minlength=n_local)
    dst_ptr = torch.zeros(n_local + 1, dtype=torch.long, device=dst.device)
    torch.cumsum(counts, 0, out=dst_ptr[1:])
    return SelfLoopEdges(src=src, dst=dst, dst_ptr=dst_ptr)


def warn_edge_weight_unread(partition: GraphPartition, layer: str) -> None:
    """Warns, when the structure ``layer`` aggregates over is built, that a weighted partition's
    ``edge_weight`` is not read: only ``GCNConv`` reads it, as in PyG, whose ``GATConv`` and ``SAGEConv``
    take none (a PyG user would not pass it to them; here the partition carries it)."""
    if partition.edge_weight is not None:
        warnings.warn(
            f"{layer} does not read data.edge_weight (PyG's {layer} takes none): it aggregates over the "
            "edges unweighted, each copy of a duplicate edge counted; only GCNConv weights them",
            stacklevel=3,
        )


@dataclass
class GraphContext:
    """What a Dorylus layer needs about the graph in one forward: the partition and derived structures.

    Structures are computed on first use, so a GCN never builds GAT's edge list and vice versa.
    """

    partition: GraphPartition
    _gcn: dict[torch.dtype, GCNAdjacency] = field(default_factory=dict, repr=False)
    _mean: dict[torch.dtype, GCNAdjacency] = field(default_factory=dict, repr=False)
    _loops: SelfLoopEdges | None = field(default=None, repr=False)
    _blocks: dict[tuple[str, torch.dtype, bool], list[AdjacencyBlock]] = field(
        default_factory=dict, repr=False)
    _column_blocks: dict[tuple[torch.dtype, bool], list[AdjacencyBlock]] = field(
        default_factory=dict, repr=False)
    _building: dict[tuple, Future[list[AdjacencyBlock]]] = field(default_factory=dict, repr=False)
    _intervals: list[tuple[int, int]] | None = field(default=None, repr=False)
    num_intervals: int | None = None  # None: the partition's own interval_ptr; k: k even intervals (autotune)
    _nonzeros: tuple[tuple, tuple[Tensor, Tensor] | None] | None = field(default=None, repr=False)

    def feature_nonzeros(self, max_density: float = 0.25) -> tuple[Tensor, Tensor] | None:
        """``(flat_index, values)`` of the nonzero entries of ``partition.x`` when at most ``max_density``
        of them are nonzero (bag-of-words features such as Cora's), else ``None``.

        Computed once per feature tensor (keyed by its storage, shape and device) and reused every epoch.
        """
        x = self.partition.x
        key = (x.data_ptr(), tuple(x.shape), str(x.device), x.dtype)
        if self._nonzeros is None or self._nonzeros[0] != key:
            flat = x.reshape(-1)
            # Counted before any index is made: dense features would otherwise allocate 8 bytes per entry
            # (512 MiB for a 500k x 128 partition) only to be found dense.
            sparse = int(torch.count_nonzero(flat)) <= max_density * max(flat.numel(), 1)
            if sparse:
                index = flat.nonzero().squeeze(1)
                self._nonzeros = (key, (index, flat[index]))
            else:
                self._nonzeros = (key, None)
        return self._nonzeros[1]

    def gcn(self, dtype: torch.dtype) -> GCNAdjacency:
        """The normalised adjacency with values of ``dtype`` (built on first use)."""
        if dtype not in self._gcn:
            self._gcn[dtype] = gcn_adjacency(self.partition, dtype)
        return self._gcn[dtype]

    def mean(self, dtype: torch.dtype) -> GCNAdjacency:
        """The mean-aggregation matrix (GraphSAGE) with values of ``dtype`` (built on first use)."""
        if dtype not in self._mean:
            warn_edge_weight_unread(self.partition, "SAGEConv")
            self._mean[dtype] = mean_adjacency(self.partition, dtype)
        return self._mean[dtype]

    def _adjacency(self, kind: str, dtype: torch.dtype) -> GCNAdjacency:
        """The ``"gcn"`` or ``"mean"`` adjacency of ``dtype`` (a ValueError naming ``kind`` otherwise)."""
        if kind == "gcn":
            return self.gcn(dtype)
        if kind == "mean":
            return self.mean(dtype)
        raise ValueError(f"kind={kind!r}: expected 'gcn' or 'mean'")

    def blocks(self, kind: str, dtype: torch.dtype, per_interval: bool = True) -> list[AdjacencyBlock]:
        """Row blocks of the ``"gcn"`` or ``"mean"`` adjacency (built on first use, or taken from
        :meth:`build_ahead`): one per interval (:func:`interval_blocks`), or ``per_interval=False`` one
        :func:`whole_block` (no copy)."""
        key = (kind, dtype, per_interval)
        if key not in self._blocks:
            adjacency = self._adjacency(kind, dtype)
            built = self._building.pop(("rows", kind, dtype), None) if per_interval else None
            self._blocks[key] = (built.result() if built is not None
                                 else interval_blocks(adjacency, self.intervals) if per_interval
                                 else [whole_block(adjacency)])
        return self._blocks[key]

    def column_blocks(self, dtype: torch.dtype, per_interval: bool = True) -> list[AdjacencyBlock]:
        """Column blocks of the GCN adjacency: one per interval, then the ghost block
        (:func:`column_blocks`; built on first use, or taken from :meth:`build_ahead`); or
        ``per_interval=False`` one :func:`whole_block` of ``Âᵀ``, whose transposed sum is ``Â [local; ghost]``
        (no copy)."""
        key = (dtype, per_interval)
        if key not in self._column_blocks:
            adjacency = self.gcn(dtype)
            built = self._building.pop(("columns", "gcn", dtype), None) if per_interval else None
            self._column_blocks[key] = (
                built.result() if built is not None
                else column_blocks(adjacency, self.intervals) if per_interval
                else [whole_block(GCNAdjacency(adj=adjacency.adj_t, adj_t=adjacency.adj))]
            )
        return self._column_blocks[key]

    def build_ahead(self, blocks: str, kind: str, dtype: torch.dtype) -> None:
        """Starts building the per-interval ``blocks`` (``"rows"``: :meth:`blocks` of ``kind``;
        ``"columns"``: :meth:`column_blocks`, ``kind`` ``"gcn"``) on a background thread, unless they are
        built or being built; the next per-interval :meth:`blocks` / :meth:`column_blocks` takes them,
        waiting for the thread if it is not done.

        Why: a pipelined mode's first epoch runs its GA at the synchronous granularity (nothing to overlap
        the build with otherwise), and the build -- a re-layout of every adjacency entry, about a third of
        that epoch -- runs beside it, mostly inside torch kernels that release the GIL, while the server
        waits on its requests and ghost rows. The adjacency itself is built here, in the calling thread."""
        if blocks not in ("rows", "columns"):
            raise ValueError(f"blocks={blocks!r}: expected 'rows' or 'columns'")
        key = (blocks, kind, dtype)
        done = ((kind, dtype, True) in self._blocks if blocks == "rows"
                else (dtype, True) in self._column_blocks)
        if key in self._building or done:
            return
        if blocks == "rows":
            adjacency = self._adjacency(kind, dtype)
            build: Callable[[GCNAdjacency, list[tuple[int, int]]], list[AdjacencyBlock]] = interval_blocks
        else:
            adjacency, build = self.gcn(dtype), column_blocks
        pool = ThreadPoolExecutor(1, thread_name_prefix="dorylus-blocks")
        self._building[key] = pool.submit(build, adjacency, list(self.intervals))
        pool.shutdown(wait=False)  # the thread ends with its one build

    @property
    def self_loops(self) -> SelfLoopEdges:
        """The self-loop-augmented in-edge list (built on first use)."""
        if self._loops is None:
            warn_edge_weight_unread(self.partition, "GATConv")
            self._loops = self_loop_edges(self.partition)
        return self._loops

    def set_num_intervals(self, num_intervals: int | None) -> None:
        """Re-cut the local vertices into ``num_intervals`` even intervals (``None``: the partition's own)."""
        if num_intervals is not None and num_intervals < 1:
            raise ValueError(f"num_intervals={num_intervals} must be None or >= 1")
        if num_intervals != self.num_intervals:
            self.num_intervals, self._intervals = num_intervals, None
            self._blocks.clear()
            self._column_blocks.clear()
            self._building.clear()  # blocks of the old intervals: a build under way is left to finish unread

    @property
    def intervals(self) -> list[tuple[int, int]]:
        """Non-empty local vertex intervals ``(start, end)``: the unit of work sent to the executor."""
        if self._intervals is None and self.num_intervals is not None:
            n, k = self.partition.n_local, max(1, min(self.num_intervals, self.partition.n_local))
            bounds = [i * n // k for i in range(k + 1)]
            self._intervals = [(a, b) for a, b in itertools.pairwise(bounds) if b > a]
        if self._intervals is None:
            ptr = self.partition.interval_ptr.tolist()
            if not ptr or ptr[0] != 0 or ptr[-1] != self.partition.n_local:
                raise ValueError(
                    f"interval_ptr must run from 0 to n_local ({self.partition.n_local}); got "
                    f"{ptr[:1]} .. {ptr[-1:]}"
                )
            self._intervals = [(a, b) for a, b in itertools.pairwise(ptr) if b > a]
        return self._intervals


class GraphCache:
    """Keeps the :class:`GraphContext` of the last few partitions a model has seen.

    Lightning's batch transfer returns a new ``GraphPartition`` object each step, but its tensors are the same
    storage when already on the device, so contexts are keyed by the storage of ``edge_index``,
    ``interval_ptr`` and ``in_degree`` (the cached context holds references to them, so the key cannot be
    reused by another graph).

    Args:
        max_entries: How many partitions to remember (train/val/test share one; a device move makes another).
    """

    def __init__(self, max_entries: int = 4) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, GraphContext] = OrderedDict()
        self.num_intervals: int | None = None

    def set_num_intervals(self, num_intervals: int | None) -> None:
        """Cut every partition seen from now on (and those cached) into ``num_intervals`` even intervals."""
        self.num_intervals = num_intervals
        for ctx in self._entries.values():
            ctx.set_num_intervals(num_intervals)

    def context(self, partition: GraphPartition) -> GraphContext:
        """The context of ``partition``: cached structures if its graph was seen, this batch's tensors."""
        key = (
            partition.part_id,
            partition.num_parts,
            partition.edge_index.data_ptr(),
            tuple(partition.edge_index.shape),
            str(partition.edge_index.device),
            partition.interval_ptr.data_ptr(),
            partition.in_degree.data_ptr(),
            None if partition.edge_weight is None else partition.edge_weight.data_ptr(),
        )
        cached = self._entries.get(key)
        if cached is None:
            cached = GraphContext(partition, num_intervals=self.num_intervals)
            self._entries[key] = cached
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        else:  # same graph structure: keep the derived structures, read features/masks from this batch
            cached.partition = partition
            self._entries.move_to_end(key)
        return cached
