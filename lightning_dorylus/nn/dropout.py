"""Dropout whose mask depends on (seed, epoch, step, site, GLOBAL vertex/edge id), never on the partition.

Why: with ``torch``'s generator, every graph server seeded by ``seed_everything`` draws the same stream, so
local row ``i`` of every server got the same mask -- correlated dropout a single process does not have. Here
each mask entry is a counter-based hash (SplitMix64 per row, then a 32-bit MurmurHash3 finalizer per entry)
of a per-site key and the entry's global coordinates, so:

- servers draw independent masks for their (different) vertices, and a new mask every epoch and layer;
- any partitioning of the graph, and one process, draw exactly the same masks (the multi-server exactness
  tests hold with dropout on);
- features, hidden rows and GAT attention all follow the same rule; sparse features hash only their
  nonzeros (a dropped zero is still zero), so the sparse and dense paths give identical outputs.

Each entry is kept with probability ``1 - p`` (to within ``2**-32``) and scaled by ``1 / (1 - p)``, as
``F.dropout``. Cost: about 1.3x ``F.dropout``'s per-entry work (int32 hashing instead of Philox draws) as
whole-tensor torch ops; on CPU the hash runs in cache-sized numpy chunks (:data:`CHUNK_ENTRIES`), 2-3x faster.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from lightning_dorylus.graph import GraphContext

_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15
_MIX64 = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
_GOLDEN32 = 0x9E3779B9  # odd: multiplying column indices by it is a bijection mod 2**32
_MIX32 = (0x85EBCA6B, 0xC2B2AE35)


def _signed(value: int, bits: int) -> int:
    """Two's-complement reading of the low ``bits`` bits (torch integer tensors are signed)."""
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


def _splitmix64(value: int) -> int:
    """SplitMix64's finalizer on a Python int (reference for the tensor version below)."""
    z = (value + _GOLDEN64) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX64[0]) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX64[1]) & _MASK64
    return z ^ (z >> 31)


def dropout_key(seed: int, *parts: int) -> int:
    """The 64-bit key of one dropout site in one step, e.g. ``dropout_key(seed, epoch, step, site)``."""
    key = _splitmix64(seed & _MASK64)
    for part in parts:
        key = _splitmix64(key ^ (part & _MASK64))
    return _signed(key, 64)


def _lsr(z: Tensor, shift: int, bits: int) -> Tensor:
    """Logical right shift of a signed integer tensor (``>>`` on torch ints is arithmetic)."""
    return (z >> shift) & ((1 << (bits - shift)) - 1)


def _row_keys(key: int, row_ids: Tensor) -> Tensor:
    """``(n,)`` int32 per-row keys: SplitMix64 of ``key + row_id * golden`` (int64 arithmetic wraps)."""
    z = row_ids.to(torch.int64).mul(_signed(_GOLDEN64, 64)).add_(_signed(key + _GOLDEN64, 64))
    z.bitwise_xor_(_lsr(z, 30, 64)).mul_(_signed(_MIX64[0], 64))
    z.bitwise_xor_(_lsr(z, 27, 64)).mul_(_signed(_MIX64[1], 64))
    z.bitwise_xor_(_lsr(z, 31, 64))
    return ((z & 0xFFFFFFFF) - ((z & 0x80000000) << 1)).to(torch.int32)  # low 32 bits, signed


def _entry_hash_(z: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finalizer in place on int32 (a bijection: distinct in, distinct out).

    One scratch tensor serves the three logical shifts: a first layer's dropout hashes ``n x F_in`` entries,
    and each fresh temporary of that size is a new mapping whose pages the kernel zeroes."""
    scratch = torch.empty_like(z)
    for shift, mix in ((16, _MIX32[0]), (13, _MIX32[1]), (16, None)):
        torch.bitwise_right_shift(z, shift, out=scratch).bitwise_and_((1 << (32 - shift)) - 1)
        z.bitwise_xor_(scratch)
        if mix is not None:
            z.mul_(_signed(mix, 32))
    return z


#: Entries hashed per pass on CPU: a chunk (and its scratch) stays in the L2 cache, where the ~12 passes of
#: the hash cost a fraction of what they cost streaming a first layer's whole ``n x F_in`` grid from memory.
CHUNK_ENTRIES = 1 << 17


def _murmur_np_(z: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """:func:`_entry_hash_` on uint32 numpy arrays, in place (uint32: ``>>`` is logical, no masking pass)."""
    for shift, mix in ((16, _MIX32[0]), (13, _MIX32[1]), (16, None)):
        np.right_shift(z, np.uint32(shift), out=scratch)
        np.bitwise_xor(z, scratch, out=z)
        if mix is not None:
            np.multiply(z, np.uint32(mix), out=z)
    return z


#: Chunks ``(a, b, keep)`` of a keep mask: rows ``a:b``, ``keep`` a ``(b - a, width)`` bool array.
Keeps = Iterator[tuple[int, int, np.ndarray]]


def _grid_keep(key: int, row_ids: Tensor, width: int, p: float) -> Iterator[tuple[int, int, np.ndarray]]:
    """``(a, b, keep)``: :func:`_keep` of the hashes of entries ``(r, j)`` for rows ``a:b``, all ``width``
    columns, as a ``(b - a, width)`` bool array valid until the next chunk.

    The same values as ``_keep(_entry_hash_(_row_keys(key, row_ids)[:, None] + cols), p)``, made
    :data:`CHUNK_ENTRIES` entries at a time in reused buffers with numpy (uint32 shifts; its int32 compare
    and bool casts are ~5x torch's here). CPU tensors only.
    """
    keys = _row_keys(key, row_ids).numpy().view(np.uint32)
    cols = np.arange(width, dtype=np.uint32) * np.uint32(_GOLDEN32)
    threshold = round(p * 2**32) - 2**31
    step = _rows_per_chunk(width)
    z = np.empty((min(step, len(keys)), width), np.uint32)
    scratch, keep = np.empty_like(z), np.zeros(z.shape, bool)
    for a in range(0, len(keys), step):
        b = min(a + step, len(keys))
        zc, kc = z[: b - a], keep[: b - a]
        if threshold < 2**31:  # else keep nothing (p = 1): kc stays False
            np.add(keys[a:b, None], cols, out=zc)
            np.greater_equal(_murmur_np_(zc, scratch[: b - a]).view(np.int32), np.int32(threshold), out=kc)
        yield a, b, kc


def _rows_per_chunk(width: int) -> int:
    """Rows of ``width`` entries hashed per pass (at least one)."""
    return max(1, CHUNK_ENTRIES // max(width, 1))


def _mask_into(out: Tensor, keep: np.ndarray) -> None:
    """``out[...] = keep`` (0 or 1 in ``out``'s dtype); numpy's cast when it has the dtype (faster)."""
    try:
        np.copyto(out.numpy(), keep, casting="unsafe")
    except TypeError:  # a dtype numpy lacks (bfloat16)
        out.copy_(torch.from_numpy(keep))


def _keep(hashed: Tensor, p: float) -> Tensor:
    """Entries kept with probability ``1 - p``: hashes (uniform over int32) at or above a threshold."""
    threshold = round(p * 2**32) - 2**31
    if threshold >= 2**31:
        return torch.zeros_like(hashed, dtype=torch.bool)
    return hashed >= threshold


def entry_hashes(key: int, row_ids: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """int32 hashes of entries ``(rows[k], cols[k])``; row ``r``'s global id is ``row_ids[r]``."""
    z = _row_keys(key, row_ids)[rows].add_(cols.to(torch.int32).mul(_signed(_GOLDEN32, 32)))
    return _entry_hash_(z)


def _scale_(mask: Tensor, p: float) -> Tensor:
    """A 0/1 mask scaled in place to 0 or ``1 / (1 - p)`` (left 0/1 for ``p = 1``, where all is dropped)."""
    return mask.div_(1.0 - p) if p < 1.0 else mask


def _scale_mask(keep: Tensor, p: float, dtype: torch.dtype) -> Tensor:
    return _scale_(keep.to(dtype), p)


def _check_p(p: float) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability p={p} must be in [0, 1]")


def row_dropout(x: Tensor, row_ids: Tensor, p: float, training: bool, key: int) -> Tensor:
    """Dropout of ``x`` (``(n, ...)``) whose row ``r`` belongs to the global vertex/edge ``row_ids[r]``.

    Entry ``(r, j)`` (``j`` indexing the flattened trailing dimensions) is kept iff the hash of
    ``(key, row_ids[r], j)`` clears the threshold, so it does not matter which server holds the row.

    Args:
        x: Rows to drop from; gradients flow through like ``F.dropout``.
        row_ids: ``(n,)`` int64 global ids of the rows.
        p: Drop probability in ``[0, 1]``.
        training: Identity when false.
        key: The site's key from :func:`dropout_key` (a new one per step and per site).
    """
    _check_p(p)
    if not training or p == 0.0:
        return x
    if row_ids.shape != x.shape[:1]:
        raise ValueError(f"row_ids has shape {tuple(row_ids.shape)}; expected ({x.shape[0]},) for x of "
                         f"shape {tuple(x.shape)}")
    width = x[0].numel() if x.shape[0] else 0
    if x.requires_grad or x.device.type != "cpu":  # autograd keeps the mask for the backward
        return x * dropout_mask(row_ids, width, p, key, x.dtype).view(x.shape)
    flat = x.reshape(x.shape[0], width)
    return _times_keep(flat, _grid_keep(key, row_ids, width, p), p).view(x.shape)


def _times_keep(flat: Tensor, keeps: Keeps, p: float, out: Tensor | None = None) -> Tensor:
    """``flat (n, width)`` times the scaled mask of ``keeps`` (:func:`_grid_keep`'s chunks), chunk by chunk:
    no full-size mask. Into ``out`` if given (``flat``'s shape and dtype). CPU only."""
    n, width = flat.shape
    if out is None:
        out = torch.empty((n, width), dtype=flat.dtype)
    elif out.shape != flat.shape or out.dtype != flat.dtype:
        raise ValueError(f"out has shape {tuple(out.shape)} and dtype {out.dtype}; expected "
                         f"{tuple(flat.shape)} and {flat.dtype}")
    try:  # numpy multiplies by the bool chunk directly: no 0/1 mask filled and scaled per chunk
        flat_np, out_np = flat.numpy(), out.numpy()
    except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16): the mask, chunk by chunk
        mask = torch.empty((min(_rows_per_chunk(width), n), width), dtype=flat.dtype)
        for a, b, keep in keeps:
            _mask_into(mask[: b - a], keep)
            torch.mul(flat[a:b], _scale_(mask[: b - a], p), out=out[a:b])
        return out
    # the value a kept entry's mask has (1 / (1 - p) rounded in flat's dtype, as the mask's division
    # makes it); x * keep * scale equals x * mask bit for bit: x * 1 is exact, x * 0 keeps x's sign and NaN
    scale = _scale_(torch.ones((), dtype=flat.dtype), p).numpy()
    with np.errstate(all="ignore"):  # inf * 0 is NaN, as torch makes it, without numpy's warning
        for a, b, keep in keeps:
            np.multiply(flat_np[a:b], keep, out=out_np[a:b])
            np.multiply(out_np[a:b], scale, out=out_np[a:b])
    return out


def _packing(keeps: Keeps, bits: np.ndarray) -> Keeps:
    """``keeps`` passed through, each chunk also packed into ``bits[a:b]`` (8 entries per byte)."""
    for a, b, keep in keeps:
        bits[a:b] = np.packbits(keep, axis=1)
        yield a, b, keep


def _unpacking(bits: np.ndarray, width: int) -> Keeps:
    """The chunks :func:`_packing` packed, as :func:`_grid_keep` made them (``(b - a, width)`` bool)."""
    step = _rows_per_chunk(width)
    for a in range(0, len(bits), step):
        b = min(a + step, len(bits))
        yield a, b, np.unpackbits(bits[a:b], axis=1, count=width).view(bool)


def dropout_mask(row_ids: Tensor, width: int, p: float, key: int, dtype: torch.dtype) -> Tensor:
    """The ``(n, width)`` scaled mask :func:`row_dropout` multiplies by (``0`` or ``1 / (1 - p)``).

    Kept by a layer that applies the mask itself and needs it again in its backward (the pipelined GAT
    layer drops each interval's attention and multiplies its gradient by the same entries)."""
    _check_p(p)
    if row_ids.device.type == "cpu":
        mask = torch.empty((row_ids.numel(), width), dtype=dtype)
        for a, b, keep in _grid_keep(key, row_ids, width, p):
            _mask_into(mask[a:b], keep)
        return _scale_(mask, p)
    return _device_mask(row_ids, width, p, key, dtype)


def _device_mask(row_ids: Tensor, width: int, p: float, key: int, dtype: torch.dtype) -> Tensor:
    """:func:`dropout_mask` in whole-tensor torch ops (any device; the CPU path must equal it)."""
    cols = torch.arange(width, dtype=torch.int32, device=row_ids.device).mul_(_signed(_GOLDEN32, 32))
    hashed = _entry_hash_(_row_keys(key, row_ids)[:, None] + cols)  # (n, width) int32, one allocation
    return _scale_mask(_keep(hashed, p), p, dtype)


def feature_dropout(graph: GraphContext, p: float, training: bool, key: int) -> Tensor:
    """Dropout with probability ``p`` of ``graph.partition.x`` (the layer-1 input, which needs no gradient).

    Bag-of-words features (Cora: 1433 columns, 1.3 % nonzero) make dense dropout the most expensive step
    of a small GNN's epoch although dropping a zero changes nothing: when the features are sparse, only
    the nonzeros (found once per partition by :meth:`GraphContext.feature_nonzeros`) are hashed. The
    result is identical to :func:`row_dropout` on the dense matrix, whichever path a partition takes.

    Args:
        graph: The partition's context (its global vertex ids and cached nonzero pattern).
        p: Drop probability in ``[0, 1]``.
        training: Identity when false, as ``F.dropout``.
        key: The site's key from :func:`dropout_key`.

    Returns:
        A new ``(n_local, F)`` tensor in training mode, ``partition.x`` itself otherwise.
    """
    _check_p(p)
    x = graph.partition.x
    if not training or p == 0.0:
        return x
    row_ids = graph.partition.local_nodes
    if x.shape[0] != row_ids.numel():
        raise ValueError(f"partition.x has {x.shape[0]} rows; the partition owns {row_ids.numel()} vertices")
    nonzeros = graph.feature_nonzeros() if not x.requires_grad else None
    if nonzeros is None:  # dense features (or features that need a gradient)
        return row_dropout(x, row_ids, p, training, key)
    index, values = nonzeros
    width = x.shape[1]
    keep = _keep(entry_hashes(key, row_ids, index // width, index % width), p)
    out = torch.zeros_like(x)
    out.view(-1).index_copy_(0, index, values * _scale_mask(keep, p, x.dtype))
    return out


@dataclass
class RowSource:
    """The first layer's input, ``feature_dropout(graph, p, training, key)``, made on demand by row range.

    A weight-first layer asks for interval ``a:b`` just before sending its request, so the server's dropout
    of one interval overlaps the requests of the previous ones, and no ``(n_local, F)`` copy of the input is
    ever held. Entries are the same as :func:`feature_dropout`'s (each is hashed from its global
    coordinates), whatever the cut. A dense dropout on the CPU records which entries it kept, 1 bit each
    (1/32 of float32 rows), and a sparse one which nonzeros it kept, 1 byte each, so the backward can
    :meth:`remake` the rows its requests need without hashing (the hash was about a sixth of a Cora epoch's
    server time, half of it spent again in the backward).
    """

    graph: GraphContext
    p: float
    training: bool
    key: int
    next_key: int | None = None  # the key of the next training step's rows, if known (run-ahead)
    _kept: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _recorded: set[tuple[int, int]] = field(default_factory=set, init=False, repr=False, compare=False)
    _sparse_kept: dict[tuple[int, int], Tensor] = field(default_factory=dict, init=False, repr=False,
                                                         compare=False)

    def full(self) -> Tensor:
        """All rows, as :func:`feature_dropout`."""
        return feature_dropout(self.graph, self.p, self.training, self.key)

    def rows(self, a: int, b: int, out: Tensor | None = None) -> Tensor:
        """Rows ``a:b`` of :meth:`full`: a new tensor in training mode (written into ``out``, ``(b - a, F)``
        of ``x``'s dtype, where given and the rows are a dense dropout), a view of ``x`` otherwise."""
        _check_p(self.p)
        partition = self.graph.partition
        x = partition.x
        if x.requires_grad:
            raise ValueError("RowSource makes the features' dropout, which needs no gradient; x requires one")
        if not self.training or self.p == 0.0:
            return x[a:b]
        if out is not None and (out.shape != x[a:b].shape or out.dtype != x.dtype or out.device != x.device):
            raise ValueError(f"out has shape {tuple(out.shape)}, dtype {out.dtype} and device {out.device}; "
                             f"expected {tuple(x[a:b].shape)}, {x.dtype} and {x.device}")
        row_ids = partition.local_nodes[a:b]
        nonzeros = self.graph.feature_nonzeros()
        if nonzeros is not None:
            return self._sparse_rows(a, b, row_ids, nonzeros, out)
        if x.device.type != "cpu":
            return row_dropout(x[a:b], row_ids, self.p, self.training, self.key)
        width = x.shape[1]
        if self._kept is None:
            self._kept = np.empty((x.shape[0], (width + 7) // 8), np.uint8)
        keeps = _packing(_grid_keep(self.key, row_ids, width, self.p), self._kept[a:b])
        rows = _times_keep(x[a:b], keeps, self.p, out)
        self._recorded.add((a, b))
        return rows

    def remake(self, a: int, b: int, out: Tensor | None = None) -> Tensor:
        """Rows ``a:b`` again, equal to :meth:`rows`'s: from the kept entries :meth:`rows` recorded for
        exactly these rows (a few cheap passes instead of the hash's), else made anew."""
        kept = self._sparse_kept.get((a, b))
        if kept is not None:
            nonzeros = self.graph.feature_nonzeros()
            assert nonzeros is not None
            return self._sparse_rows(a, b, self.graph.partition.local_nodes[a:b], nonzeros, out, kept)
        if (a, b) not in self._recorded or self._kept is None:
            return self.rows(a, b, out)
        x = self.graph.partition.x
        return _times_keep(x[a:b], _unpacking(self._kept[a:b], x.shape[1]), self.p, out)

    def _sparse_rows(self, a: int, b: int, row_ids: Tensor, nonzeros: tuple[Tensor, Tensor],
                     out: Tensor | None = None, keep: Tensor | None = None) -> Tensor:
        """Rows ``a:b`` of sparse features' dropout (into ``out``, zeroed first): only their nonzeros are
        hashed, unless ``keep`` (which of them this span kept, as recorded here) is given."""
        x = self.graph.partition.x
        index, values = nonzeros
        width = x.shape[1]
        lo, hi = torch.searchsorted(index, torch.tensor([a * width, b * width], device=index.device)).tolist()
        index, values = index[lo:hi] - a * width, values[lo:hi]
        if keep is None:
            keep = _keep(entry_hashes(self.key, row_ids, index // width, index % width), self.p)
            self._sparse_kept[(a, b)] = keep
        out = x.new_zeros((b - a, width)) if out is None else out.zero_()
        out.view(-1).index_copy_(0, index, values * _scale_mask(keep, self.p, x.dtype))
        return out


def edge_ids(graph: GraphContext) -> Tensor:
    """``(E',)`` int64 global ids of the self-loop-augmented in-edges: ``src * num_nodes + dst`` (global)."""
    part, edges = graph.partition, graph.self_loops
    global_ids = torch.cat([part.local_nodes, part.ghost_nodes])
    return global_ids[edges.src] * part.num_global_nodes + part.local_nodes[edges.dst]
