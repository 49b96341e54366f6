"""Streaming vertex assignment: every vertex to a graph server from passes over edge chunks, never the graph.

Memory is per vertex (the assignment, 4 bytes; Fennel's restreaming adds ``4 * num_parts`` bytes of
neighbour counts) plus one batch of edges; METIS needs the whole graph in one process and stays for graphs
that fit (``DorylusDataModule(Data)``).

- ``"hash"``: a seeded integer hash of the vertex id (balanced in expectation; cuts ``1 - 1/P`` of edges).
- ``"range"``: equal ranges of vertex ids (good when ids already have locality, e.g. a crawl order).
- ``"fennel"``: one Fennel pass (Tsourakakis et al., WSDM 2014: a vertex goes to the partition holding most
  of its already-placed neighbours, minus ``alpha * gamma * size^(gamma - 1)``), vectorised over batches of
  edges that grow from 4K to 1M, then ``restreams`` restreaming passes (Nishimura & Ugander, KDD 2013: each
  vertex moves to the partition holding most of its neighbours under the previous assignment). Every
  partition is capped at ``(1 + slack) * N / P`` vertices. Deterministic for a given chunk order and seed.

Every machine runs the same passes over the same files and gets the same assignment, so no machine waits for
another before building its own partitions.
"""

from __future__ import annotations

import numpy as np

from lightning_dorylus.data.chunked import ChunkedGraph

STREAM_PARTITIONERS = ("fennel", "hash", "range")
"""Partitioners of a :class:`ChunkedGraph` (METIS and BFS need the whole graph: pass a ``Data``)."""

SLACK = 0.05  # partitions may hold up to 5 % more than N / P vertices
_GAMMA = 1.5
_FIRST_BATCH, _MAX_BATCH = 1 << 8, 1 << 20
_RESTREAM_BATCH = 1 << 23
_SEEDS_PER_PART = 4  # vertices placed by hash before any has a placed neighbour
_HASH_MULT = np.uint64(0x9E3779B97F4A7C15)


def hash_parts(vertices: np.ndarray, num_parts: int, seed: int) -> np.ndarray:
    """``(k,)`` int32 partition of each vertex id by a seeded multiplicative hash (splitmix64's finaliser)."""
    z = vertices.astype(np.uint64) * _HASH_MULT + np.uint64(seed & 0xFFFFFFFF) * np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(31)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(29)
    return (z % np.uint64(num_parts)).astype(np.int32)


def assign_vertices(
    graph: ChunkedGraph, num_parts: int, method: str, seed: int = 0, restreams: int = 4
) -> np.ndarray:
    """``(N,)`` int32 partition of every vertex of ``graph`` by ``method`` (see the module docstring)."""
    n = graph.num_nodes
    if method not in STREAM_PARTITIONERS:
        raise ValueError(f"partitioner={method!r}: a ChunkedGraph is partitioned by {STREAM_PARTITIONERS}")
    if num_parts == 1:
        return np.zeros(n, dtype=np.int32)
    if method == "hash":
        out = np.empty(n, dtype=np.int32)
        step = 1 << 22
        for a in range(0, n, step):
            out[a : a + step] = hash_parts(np.arange(a, min(n, a + step), dtype=np.int64), num_parts, seed)
        return out
    if method == "range":
        return ((np.arange(n, dtype=np.int64) * num_parts) // n).astype(np.int32)
    return _fennel(graph, num_parts, seed, restreams)


def _capacity(n: int, num_parts: int) -> int:
    return int(np.ceil(n / num_parts * (1.0 + SLACK)))


def _alpha(graph: ChunkedGraph, n: int, num_parts: int) -> float:
    edges = max(1, graph.num_edges() // 2)  # undirected edges (chunks usually list both directions)
    return float(np.sqrt(num_parts) * edges / n**_GAMMA)


def _add_counts(counts: np.ndarray, keys: np.ndarray) -> None:
    """``counts[k] += 1`` for every ``k`` in ``keys`` (repeats counted): ``bincount`` where the key space is
    small against the batch, else sort and add each distinct key once (``np.add.at`` is ~0.5 us a key)."""
    if counts.size <= 4 * keys.size:
        counts += np.bincount(keys, minlength=counts.size).astype(counts.dtype)
        return
    keys.sort()
    starts = np.flatnonzero(np.concatenate([[True], keys[1:] != keys[:-1]]))
    counts[keys[starts]] += np.diff(np.append(starts, keys.size)).astype(counts.dtype)


def _batches(graph: ChunkedGraph, first: int = _FIRST_BATCH):
    """``(src, dst)`` int64 batches without self loops, the first small and growing (Fennel needs some
    placed vertices before its scores mean anything; restreaming passes start at full size)."""
    size = first
    for _, edges, _ in graph.chunks():
        a = 0
        while a < edges.shape[1]:
            src = np.asarray(edges[0, a : a + size], dtype=np.int64)
            dst = np.asarray(edges[1, a : a + size], dtype=np.int64)
            keep = src != dst
            yield src[keep], dst[keep]
            a += size
            size = max(size, min(2 * size, _MAX_BATCH))


def _fit(choice: np.ndarray, sizes: np.ndarray, cap: int) -> np.ndarray:
    """``choice`` with the vertices beyond a partition's room (``cap - sizes``) moved to partitions with room
    (in partition order); the earlier vertices of a batch keep their choice."""
    num_parts = sizes.size
    room = np.maximum(cap - sizes, 0)
    counts = np.bincount(choice, minlength=num_parts)
    if (counts <= room).all():
        return choice
    order = np.argsort(choice, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.empty(choice.size, dtype=np.int64)
    rank[order] = np.arange(choice.size) - starts[choice[order]]
    over = rank >= room[choice]
    left = room - np.minimum(counts, room)
    slot = np.searchsorted(np.cumsum(left), np.arange(int(over.sum())), side="right")
    out = choice.copy()
    out[over] = slot.astype(choice.dtype)
    return out


def _fennel(graph: ChunkedGraph, num_parts: int, seed: int, restreams: int) -> np.ndarray:
    n = graph.num_nodes
    cap = _capacity(n, num_parts)
    alpha = _alpha(graph, n, num_parts)
    asg = np.full(n, -1, dtype=np.int32)
    sizes = np.zeros(num_parts, dtype=np.int64)
    for src, dst in _batches(graph):
        u = np.concatenate([src, dst])
        v = np.concatenate([dst, src])
        new = asg[u] < 0
        u, v = u[new], v[new]
        if not u.size:
            continue
        uniq, inv = np.unique(u, return_inverse=True)
        av = asg[v]
        known = av >= 0
        counts = np.bincount(inv[known] * num_parts + av[known], minlength=uniq.size * num_parts)
        counts = counts.reshape(uniq.size, num_parts).astype(np.float64)
        score = counts - alpha * _GAMMA * np.sqrt(sizes.astype(np.float64))
        score[:, sizes >= cap] = -np.inf
        choice = np.argmax(score, axis=1).astype(np.int32)
        # No placed neighbour yet: wait for a later edge of the vertex (it has about avg_degree of them)
        # rather than guess; only the very first few vertices are placed by hash, as seeds.
        alone = counts.sum(axis=1) == 0
        if not sizes.any():
            seeds = np.flatnonzero(alone)[: _SEEDS_PER_PART * num_parts]
            choice[seeds] = hash_parts(uniq[seeds], num_parts, seed)
            alone[seeds] = False
        placed = ~alone
        uniq, choice = uniq[placed], _fit(choice[placed], sizes, cap)
        asg[uniq] = choice
        sizes += np.bincount(choice, minlength=num_parts)
    rest = np.flatnonzero(asg < 0)  # isolated vertices
    if rest.size:
        asg[rest] = _fit(hash_parts(rest, num_parts, seed), sizes, cap)
    for _ in range(restreams):
        asg = _restream(graph, asg, num_parts, alpha, cap)
    return asg


def _restream(graph: ChunkedGraph, asg: np.ndarray, num_parts: int, alpha: float, cap: int) -> np.ndarray:
    """One restreaming pass: neighbour counts per (vertex, partition) under ``asg``, then every vertex to
    its best partition (ties: where it is), in eight vertex blocks so that the balance term sees the moves."""
    n = asg.size
    counts = np.zeros(n * num_parts, dtype=np.int32)
    for src, dst in _batches(graph, first=_RESTREAM_BATCH):
        _add_counts(counts, np.concatenate([src * num_parts + asg[dst], dst * num_parts + asg[src]]))
    counts2 = counts.reshape(n, num_parts)
    out = asg.copy()
    sizes = np.bincount(asg, minlength=num_parts).astype(np.int64)
    block = -(-n // 8)
    for a in range(0, n, block):
        b = min(n, a + block)
        sizes -= np.bincount(out[a:b], minlength=num_parts)
        score = counts2[a:b].astype(np.float64) - alpha * _GAMMA * np.sqrt(sizes.astype(np.float64))
        score[np.arange(b - a), out[a:b]] += 0.5  # stay unless a neighbour more says move
        score[:, sizes >= cap] = -np.inf
        choice = _fit(np.argmax(score, axis=1).astype(np.int32), sizes, cap)
        out[a:b] = choice
        sizes += np.bincount(choice, minlength=num_parts)
    return out


def edge_cut_fraction(graph: ChunkedGraph, asg: np.ndarray) -> float:
    """Fraction of (non-loop) edges whose endpoints lie in different partitions."""
    cut = total = 0
    for src, dst in _batches(graph):
        cut += int((asg[src] != asg[dst]).sum())
        total += src.size
    return cut / max(total, 1)
