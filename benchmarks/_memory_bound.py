"""A graph server's memory-traffic bound: the bytes its epoch must move / this machine's stream bandwidth.

Why: a graph server's epoch is SpMMs, gathers and elementwise passes over arrays far larger than any cache,
so however little interpreter work is left, an epoch cannot take less than the time to stream those arrays
through memory once. The benchmarks report that bound beside the server's measured CPU seconds: the gap
between the two is what a leaner engine could still win on this machine.

The byte count is a lower bound for the benchmarks' 2-layer GCN (weight-first first layer ``F_in -> hidden``,
gather-first second layer ``hidden -> classes``), each array read or written once per use:

* **features**: the forward reads ``X`` (``n x F_in``) and writes its dropped-out rows to the wire buffers;
  the backward's ∇W requests read and write them again (the rows are remade, not kept): ``4 n F_in`` values.
* **CSR**: both layers' GA read ``Â`` (``n`` rows), both layers' ∇GA read ``Âᵀ`` (``n + ghosts`` rows):
  row pointers, column indices and values.
* **activations** (forward) and **gradients** (backward), per layer of gathered width ``w``: SC writes the
  ``[local; ghost]`` rows (``(n + g) w``), GA reads them and writes ``n w``; the AV request's input and output
  rows go over the wire (``n (w_in + w_out)``); backward the mirror (∇AV's gradient rows, ∇GA, ∇SC).

Only torch is needed (in the benchmarks' worker processes, never their parents).
"""

from __future__ import annotations

import time
from typing import Any


def stream_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Bytes per second of one thread copying a ``mib`` MiB float32 buffer into another (read + write), the
    best of ``repeats`` copies (the least disturbed by other jobs)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # a graph server's share: one thread on the benchmark's default
    try:
        src = torch.ones(mib << 18)  # float32: mib MiB
        dst = torch.empty_like(src)
        dst.copy_(src)  # fault the pages in first
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
        return 2 * src.numel() * src.element_size() / best
    finally:
        torch.set_num_threads(previous)


def gcn_epoch_bytes(
    n_local: int, n_ghost: int, nnz: int, features: int, hidden: int, classes: int, index_bytes: int = 4,
    value_bytes: int = 4,
) -> dict[str, int]:
    """The bytes one graph server's training epoch of the benchmarks' GCN must move, by kind (see the module
    docstring); ``nnz``: entries of its normalised adjacency (in-edges + self loops)."""
    n, g, v = n_local, n_ghost, value_bytes

    def csr(rows: int) -> int:
        return (rows + 1) * index_bytes + nnz * (index_bytes + value_bytes)

    def layer(width: int, av_in: int, av_out: int) -> int:
        return v * ((n + g) * width + (n + g) * width + n * width + n * (av_in + av_out))

    # layer 1: AV x W (features counted apart) -> P (hidden wide) -> SC -> GA; layer 2: SC -> GA -> AV
    one_way = layer(hidden, 0, hidden) + layer(hidden, hidden, classes)
    return {
        "features": 4 * n * features * v,
        "csr": 2 * csr(n) + 2 * csr(n + g),
        "activations": one_way,
        "gradients": one_way,
    }


def partition_bytes(partition: Any, features: int, hidden: int, classes: int) -> dict[str, int]:
    """:func:`gcn_epoch_bytes` of a loaded ``GraphPartition`` (its adjacency's index width as the graph
    server builds it: int32 below 2^31 entries)."""
    n, g = partition.n_local, partition.n_ghost
    nnz = int(partition.edge_index.size(1)) + n  # in-edges + the self loops gcn_norm adds
    index_bytes = 4 if max(n + g, nnz) < 2**31 - 1 else 8
    return gcn_epoch_bytes(n, g, nnz, features, hidden, classes, index_bytes)


def describe(per_server: list[dict[str, Any]], bandwidth: float) -> list[str]:
    """One line per graph server: CPU seconds per epoch, the bytes its epoch must move and their bound.

    ``per_server`` rows: ``rank``, ``cpu_s`` (the server process), ``worker_cpu_s`` (its executor workers),
    ``bytes`` (by kind).
    """
    lines = []
    for row in sorted(per_server, key=lambda r: r["rank"]):
        kinds = row["bytes"]
        total = sum(kinds.values())
        parts = ", ".join(f"{k} {b / 2**20:,.0f}" for k, b in kinds.items())
        lines.append(
            f"server {row['rank']}: CPU {row['cpu_s']:.3f} s/epoch (+ {row['worker_cpu_s']:.3f} in its "
            f"executor workers); must move {total / 2**20:,.0f} MiB/epoch ({parts}) = memory-traffic bound "
            f"{total / bandwidth:.3f} s at {bandwidth / 1e9:.1f} GB/s")
    return lines
