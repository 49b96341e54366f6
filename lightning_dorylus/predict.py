"""Whole-graph predictions: each graph server's rows of its owned vertices, gathered into global vertex order.

A graph server's ``predict_step`` sees only its partition, so its output has one row per OWNED vertex in
``partition.local_nodes`` order. :func:`gather_vertex_rows` all-gathers those rows (and the global ids they
belong to) from every server and puts row ``v`` of the result at global vertex ``v``: every rank gets the
``(num_global_nodes, ...)`` tensor that one process computes on the whole graph. No pickle: a fixed-size
int64 header per rank first (rows, trailing shape, dtype: a code of :mod:`lbd_common.codec`'s allow-list), so
every rank agrees on what follows, or every rank raises the same error instead of one of them waiting in a
collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lbd_common import codec

MAX_DIMS = codec.MAX_DIMS  # trailing dimensions a gathered tensor may have


def _header(rows: Tensor, n_local: int) -> Tensor:
    """``[ok, n_rows, dtype code, ndim, *trailing shape (padded with -1)]`` of this rank's output."""
    head = torch.full((4 + MAX_DIMS,), -1, dtype=torch.long)
    allowed = codec.allowed(rows.dtype)
    ok = rows.dim() >= 1 and rows.dim() - 1 <= MAX_DIMS and allowed and rows.size(0) == n_local
    head[0], head[1] = int(ok), rows.size(0) if rows.dim() else -1
    head[2] = codec.dtype_code(rows.dtype) if allowed else -1
    head[3] = rows.dim()
    if ok:
        head[4 : 4 + rows.dim() - 1] = torch.tensor(rows.shape[1:], dtype=torch.long)
    return head


def _check_headers(heads: Tensor, n_locals: list[int]) -> None:
    """Raises (the same error on every rank) unless every rank sent rows of one shape and dtype per vertex."""
    for rank, head in enumerate(heads.tolist()):
        if not head[0]:
            raise ValueError(
                f"predict_step on graph server {rank} returned a tensor of shape "
                f"{'(' + str(head[1]) + ', ...)' if head[1] >= 0 else 'with no rows'} (dim {head[3]}); "
                f"DorylusStrategy gathers one row per owned vertex: expected ({n_locals[rank]}, ...) = "
                f"(batch.n_local, ...), in batch.local_nodes order, with at most {MAX_DIMS} trailing dims"
            )
    first = heads[0, 2:]
    for rank in range(1, heads.size(0)):
        if not torch.equal(heads[rank, 2:], first):
            raise ValueError(
                f"predict_step returned rows of dtype/shape {_describe(heads[rank])} on graph server {rank} "
                f"but {_describe(heads[0])} on server 0: every server must return the same dtype and "
                "trailing shape"
            )


def _describe(head: Tensor) -> str:
    dims = ", ".join(str(d) for d in head[4 : 4 + int(head[3]) - 1].tolist())
    dtype = codec.dtype_from_code(int(head[2]), "prediction header")
    return f"{dtype} (n, {dims})" if dims else f"{dtype} (n,)"


def gather_vertex_rows(rows: Tensor, local_nodes: Tensor, num_global_nodes: int) -> Tensor:
    """``(num_global_nodes, ...)``: every server's ``(n_local, ...)`` ``rows``, in global order.

    A collective: every graph server calls it with its own rows. On one process (no process group) the rows
    are only put in global order.

    Raises:
        ValueError: on every rank, when some server's ``rows`` are not one row per owned vertex or the servers
            disagree on dtype or trailing shape; or when the servers' vertices do not cover the graph once.
    """
    n_local = int(local_nodes.numel())
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        _check_headers(_header(rows, n_local)[None], [n_local])
        return _place([rows], [local_nodes], num_global_nodes)
    device = rows.device if rows.dim() else local_nodes.device
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([n_local], dtype=torch.long, device=device))
    n_locals = [int(s) for s in sizes]
    heads = [torch.zeros(4 + MAX_DIMS, dtype=torch.long, device=device) for _ in range(world)]
    dist.all_gather(heads, _header(rows, n_local).to(device))
    _check_headers(torch.stack(heads).cpu(), n_locals)
    longest = max(n_locals)
    ids = [torch.empty(longest, dtype=torch.long, device=device) for _ in range(world)]
    dist.all_gather(ids, _pad(local_nodes.to(device, torch.long), longest))
    wire = rows.to(torch.uint8) if rows.dtype == torch.bool else rows  # gloo gathers no bool
    parts = [torch.empty((longest, *rows.shape[1:]), dtype=wire.dtype, device=device) for _ in range(world)]
    dist.all_gather(parts, _pad(wire.contiguous(), longest))
    parts = [p.to(rows.dtype) for p in parts]
    return _place([p[:n] for p, n in zip(parts, n_locals)], [i[:n] for i, n in zip(ids, n_locals)],
                  num_global_nodes)


def _pad(t: Tensor, rows: int) -> Tensor:
    if t.size(0) == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.size(0), *t.shape[1:]))])


def _place(parts: list[Tensor], ids: list[Tensor], num_global_nodes: int) -> Tensor:
    """Row ``i`` of ``parts[r]`` at global id ``ids[r][i]``; raises unless every vertex is covered once."""
    all_ids = torch.cat(ids)
    counts = torch.bincount(all_ids.cpu(), minlength=num_global_nodes)
    if all_ids.numel() != num_global_nodes or counts.numel() != num_global_nodes or bool((counts != 1).any()):
        missing = int((counts[:num_global_nodes] == 0).sum())
        raise ValueError(
            f"the graph servers own {all_ids.numel()} vertices ({missing} of {num_global_nodes} missing, "
            f"{int((counts > 1).sum())} owned twice): the partitions must cover the graph once"
        )
    rows = torch.cat(parts)
    out = torch.empty((num_global_nodes, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    out[all_ids.to(rows.device)] = rows
    return out
