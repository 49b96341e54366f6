"""Input checks and normalisation: bad graphs fail here with an error naming what is wrong.

``graph_tensors(data)`` turns a PyG ``Data`` into :class:`GraphTensors`: a coalesced edge list (self loops and
duplicate edges removed, with a warning saying how many) plus features, labels and boolean masks of the
right sizes.
"""

from __future__ import annotations

import numbers
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from torch_geometric.data import Data

PARTITIONERS = ("metis", "bfs", "contiguous", "random")
"""Valid ``partitioner`` strings (see :mod:`lightning_dorylus.data.partitioner`)."""

MASK_NAMES = ("train_mask", "val_mask", "test_mask")

IGNORED_EDGE_FIELDS = ("edge_weight", "edge_attr")
"""PyG edge attributes the partitions do not carry (warned about, see :func:`warn_ignored_attributes`)."""


@dataclass
class GraphTensors:
    """A validated, coalesced global graph (the partitioner's input)."""

    edge_index: Tensor  # (2, E) int64 [src, dst], sorted by (dst, src), no duplicates, no self loops
    num_nodes: int
    x: Tensor  # (N, F) floating point
    y: Tensor  # (N,) int64, -1 where unlabeled
    train_mask: Tensor  # (N,) bool
    val_mask: Tensor  # (N,) bool
    test_mask: Tensor  # (N,) bool


def check_partitioner(partitioner: str) -> str:
    """Returns ``partitioner`` if valid, else raises naming the bad value and the valid ones."""
    if partitioner not in PARTITIONERS:
        raise ValueError(
            f"partitioner={partitioner!r} is not supported; expected one of {list(PARTITIONERS)}"
        )
    return partitioner


def check_interval_size(interval_size: int) -> int:
    """Returns ``interval_size`` as an ``int`` if it is an integer >= 1."""
    if not is_integer(interval_size) or interval_size < 1:
        raise ValueError(f"interval_size ({interval_size!r}) must be an integer >= 1 (vertices per interval)")
    return int(interval_size)


def check_num_parts(num_parts: int, num_nodes: int) -> int:
    """Returns ``num_parts`` as an ``int`` if ``1 <= num_parts <= num_nodes``."""
    if not is_integer(num_parts) or num_parts < 1:
        raise ValueError(f"num_parts ({num_parts!r}) must be an integer >= 1")
    if num_parts > num_nodes:
        raise ValueError(f"num_parts ({num_parts}) is greater than the number of vertices ({num_nodes})")
    return int(num_parts)


def is_integer(value: object) -> bool:
    """Python and numpy integers, not bools."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def graph_tensors(data: Data, num_classes: int | None = None) -> GraphTensors:
    """Validates ``data`` and returns its coalesced, normalised tensors.

    Args:
        data: A PyG graph with ``edge_index`` and ``x``; ``y`` and ``train_mask``/``val_mask``/``test_mask``
            are optional (missing labels become ``-1``, missing masks all ``False``).
        num_classes: If given, every label must be ``< num_classes``.
    """
    graph = _validated(data, num_classes)
    graph.edge_index = coalesce(graph.edge_index, graph.num_nodes)
    return graph


def check_graph(data: Data, num_classes: int | None = None) -> None:
    """Every check of :func:`graph_tensors` (edges, finite features, labels, masks), without coalescing.

    ``DorylusDataModule`` runs it when it is built, in every process, so bad input fails there, naming the
    vertex and the fix, instead of on one graph server after the others started.
    """
    _validated(data, num_classes)


def _validated(data: Data, num_classes: int | None) -> GraphTensors:
    if not isinstance(data, Data):
        raise TypeError(f"data must be a torch_geometric.data.Data, got {type(data).__name__}")
    num_nodes = data.num_nodes
    if num_nodes is None or num_nodes < 1:
        raise ValueError(f"data.num_nodes is {num_nodes!r}; the graph needs at least one vertex")
    num_nodes = int(num_nodes)
    edge_index = _check_edge_index(data.edge_index, num_nodes)
    x = _check_x(data.x, num_nodes)
    y = _check_y(data.y, num_nodes, num_classes)
    masks = {name: _check_mask(getattr(data, name, None), name, num_nodes) for name in MASK_NAMES}
    for name, mask in masks.items():
        unlabeled = mask & (y < 0)
        if bool(unlabeled.any()):
            first = int(unlabeled.nonzero()[0, 0])
            raise ValueError(
                f"{name} selects {int(unlabeled.sum())} vertices without a label (y = -1 or y missing), the "
                f"first at node {first}: every vertex a mask selects needs a class label >= 0. Label them, "
                f"or leave them out of the mask: data.{name} &= data.y >= 0"
            )
    return GraphTensors(edge_index=edge_index, num_nodes=num_nodes, x=x, y=y, **masks)


def coalesce(edge_index: Tensor, num_nodes: int) -> Tensor:
    """Removes self loops and duplicate edges (warning with counts); returns edges sorted by ``(dst, src)``.

    Self loops are dropped because the GNN layers add their own (``in_degree`` counts raw edges only).
    """
    key, num_loops, num_dupes = _coalesced_keys(edge_index, num_nodes)
    warn_removed_edges(num_loops, num_dupes, stacklevel=4)
    return torch.stack([key % num_nodes, key // num_nodes])


def removed_edges(edge_index: Tensor, num_nodes: int) -> dict[str, int]:
    """``{"self_loops": n, "duplicates": m}``: what :func:`coalesce` removes from ``edge_index`` (kept in the
    partition cache's metadata, so that a run reading the cache warns as the run that partitioned did)."""
    _, num_loops, num_dupes = _coalesced_keys(edge_index, num_nodes)
    return {"self_loops": num_loops, "duplicates": num_dupes}


def warn_removed_edges(self_loops: int = 0, duplicates: int = 0, stacklevel: int = 2) -> None:
    """The warning for removed self loops / duplicate edges (none if there were none)."""
    if self_loops or duplicates:
        warnings.warn(
            f"edge_index had {self_loops} self loops and {duplicates} duplicate edges; they were removed "
            "(the GNN layers add self loops themselves)",
            stacklevel=stacklevel,
        )


def _coalesced_keys(edge_index: Tensor, num_nodes: int) -> tuple[Tensor, int, int]:
    """Sorted unique ``dst * num_nodes + src`` keys without self loops; the loops and duplicates dropped."""
    src, dst = edge_index
    loops = src == dst
    num_loops = int(loops.sum())
    if num_loops:
        src, dst = src[~loops], dst[~loops]
    key = torch.unique(dst * num_nodes + src)  # sorted: by dst, then src
    return key, num_loops, int(src.numel() - key.numel())


def _check_edge_index(edge_index: Tensor | None, num_nodes: int) -> Tensor:
    if edge_index is None:
        raise ValueError("data.edge_index is None; expected an int64 tensor of shape (2, E)")
    if edge_index.dim() != 2 or edge_index.size(0) != 2:
        raise ValueError(f"edge_index must have shape (2, E), got {tuple(edge_index.shape)}")
    if edge_index.dtype.is_floating_point or edge_index.dtype == torch.bool:
        raise ValueError(f"edge_index must be an integer tensor, got dtype {edge_index.dtype}")
    edge_index = edge_index.to(device="cpu", dtype=torch.long)
    if edge_index.numel():
        lo, hi = int(edge_index.min()), int(edge_index.max())
        if lo < 0:
            raise ValueError(f"edge_index contains negative node index {lo}")
        if hi >= num_nodes:
            raise ValueError(f"edge_index contains node index {hi} but num_nodes is {num_nodes}")
    return edge_index


def check_features(x: Tensor | None, num_nodes: int) -> None:
    """Cheap checks of ``data.x`` (no pass over its values): present, dense, floating point, ``(N, F)``.

    Run before hashing or partitioning, so a featureless or sparse ``x`` fails naming the argument instead of
    deep inside the cache or a layer.
    """
    if x is None:
        raise ValueError(
            f"data.x is None; expected node features of shape (num_nodes={num_nodes}, F). For a "
            "featureless graph make some first, e.g. transform=T.OneHotDegree(max_degree) or "
            "data.x = torch.ones(num_nodes, 1)"
        )
    if not isinstance(x, Tensor):
        raise TypeError(f"data.x must be a torch.Tensor, got {type(x).__name__}")
    if x.layout != torch.strided:
        raise ValueError(
            f"x is a sparse tensor (layout {x.layout}); partitions hold dense feature rows: pass "
            "data.x = data.x.to_dense() (the first layer's dropout still only touches the nonzeros)"
        )
    if x.dim() != 2 or x.size(0) != num_nodes:
        raise ValueError(f"x has shape {tuple(x.shape)} but expected (num_nodes={num_nodes}, F)")
    if not x.dtype.is_floating_point:
        raise ValueError(f"x must be a floating point tensor, got dtype {x.dtype}")


def ignored_attributes(data: Data) -> list[str]:
    """Edge attributes of ``data`` that the Dorylus layers do not read (``edge_weight``, ``edge_attr``)."""
    return [name for name in IGNORED_EDGE_FIELDS if getattr(data, name, None) is not None]


def warn_ignored_attributes(data: Data, stacklevel: int = 3) -> None:
    """Warns that ``edge_weight``/``edge_attr`` are not used: PyG's ``GCNConv`` would weight edges by
    ``edge_weight``; the Dorylus layers aggregate unweighted edges (GCN normalises by in-degrees)."""
    names = ignored_attributes(data)
    if names:
        warnings.warn(
            f"data.{' and data.'.join(names)} {'is' if len(names) == 1 else 'are'} ignored: the Dorylus "
            "layers (GCNConv, GATConv, SAGEConv) aggregate over unweighted edges (GCN normalises by "
            "in-degrees); PyG's GCNConv would use edge_weight. Drop the attribute to silence this",
            stacklevel=stacklevel,
        )


def _check_x(x: Tensor | None, num_nodes: int) -> Tensor:
    check_features(x, num_nodes)
    assert x is not None
    x = x.cpu()
    bad = ~torch.isfinite(x)
    num_bad = int(bad.sum())
    if num_bad:
        first, column = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"x contains {num_bad} non-finite values (NaN/inf), the first at node {first} "
            f"(x[{first}, {column}] = {float(x[first, column])}): clean the features first, e.g. "
            "data.x = torch.nan_to_num(data.x), or drop those vertices"
        )
    return x.contiguous()


def check_num_classes(num_classes: int | None) -> int | None:
    """Returns ``num_classes`` as an ``int`` (or ``None``) if it is ``None`` or an integer >= 1."""
    if num_classes is not None and (not is_integer(num_classes) or num_classes < 1):
        raise ValueError(f"num_classes ({num_classes!r}) must be None (= max(y) + 1) or an integer >= 1")
    return None if num_classes is None else int(num_classes)


def _check_y(y: Tensor | None, num_nodes: int, num_classes: int | None = None) -> Tensor:
    if y is None:
        return torch.full((num_nodes,), -1, dtype=torch.long)
    if y.dim() == 2 and y.size(1) == 1:
        y = y.view(-1)
    if y.dim() != 1 or y.size(0) != num_nodes:
        raise ValueError(f"y has shape {tuple(y.shape)} but expected (num_nodes={num_nodes},) class labels")
    if y.dtype.is_floating_point or y.dtype == torch.bool:
        raise ValueError(f"y must hold integer class labels, got dtype {y.dtype}")
    y = y.to(device="cpu", dtype=torch.long).contiguous()
    if y.numel() and int(y.min()) < -1:
        first = int((y < -1).nonzero()[0, 0])
        raise ValueError(
            f"y contains {int(y.min())}; expected class labels >= 0, or -1 for unlabeled vertices (the first "
            f"bad label is y[{first}] = {int(y[first])})"
        )
    if num_classes is not None and y.numel() and int(y.max()) >= num_classes:
        first = int((y >= num_classes).nonzero()[0, 0])
        raise ValueError(
            f"y[{first}] = {int(y[first])} but num_classes is {num_classes}: class labels must lie in "
            f"[0, {num_classes}) (-1 marks an unlabeled vertex). Pass num_classes={int(y.max()) + 1} or "
            "fix the labels"
        )
    return y


def check_cache_dir(cache_dir: str | Path) -> Path:
    """``cache_dir`` as a ``Path`` if it is a directory or can become one (nothing on its path is a file)."""
    path = Path(cache_dir)
    for ancestor in (path, *path.parents):
        if ancestor.exists():
            if not ancestor.is_dir():
                where = "is" if ancestor == path else f"lies under {str(ancestor)!r}, which is"
                raise NotADirectoryError(
                    f"cache_dir={str(path)!r} {where} an existing file, not a directory: pass a directory "
                    "for the partition cache (created if missing), or move the file away"
                )
            break
    return path


def check_world_size(num_parts: int, world_size: int) -> None:
    """One graph server per partition: raises with the arithmetic and both fixes when they differ."""
    if num_parts != world_size:
        raise ValueError(
            f"num_parts ({num_parts}) != world_size ({world_size}): DorylusStrategy runs one graph server "
            f"per partition, so every process loads exactly one; set devices * num_nodes = {num_parts} or "
            f"num_parts = {world_size} (or leave num_parts=None: one partition per process)"
        )


def _check_mask(mask: Tensor | None, name: str, num_nodes: int) -> Tensor:
    if mask is None:
        return torch.zeros(num_nodes, dtype=torch.bool)
    if mask.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor of shape ({num_nodes},), got dtype {mask.dtype}")
    if mask.dim() != 1 or mask.size(0) != num_nodes:
        raise ValueError(
            f"{name} has shape {tuple(mask.shape)} but expected ({num_nodes},) (one bool per node; "
            "multi-split masks must be reduced to one split first)"
        )
    return mask.cpu().contiguous()
