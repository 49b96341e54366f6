"""Input checks and normalisation: bad graphs fail here with an error naming what is wrong.

``graph_tensors(data)`` turns a PyG ``Data`` into :class:`GraphTensors`: the edge list sorted by destination
(self loops removed, with a warning saying how many; duplicate edges kept, one column per copy, as PyG's
layers count them), its ``edge_weight`` if any, plus features, labels (class labels or multi-label
targets) and boolean masks of the right sizes (index-tensor masks converted as PyG's ``index_to_mask``).
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

IGNORED_EDGE_FIELDS = ("edge_attr",)
"""PyG edge attributes the partitions do not carry (warned about, see :func:`warn_ignored_attributes`).
``edge_weight`` is carried: ``GCNConv`` reads it, as PyG's does."""


@dataclass
class GraphTensors:
    """A validated, coalesced global graph (the partitioner's input)."""

    edge_index: Tensor  # (2, E) int64 [src, dst], sorted by (dst, src), duplicates kept, no self loops
    num_nodes: int
    x: Tensor  # (N, F) floating point
    y: Tensor  # (N,) int64, -1 where unlabeled; or (N, C) float multi-label targets in [0, 1]
    train_mask: Tensor  # (N,) bool
    val_mask: Tensor  # (N,) bool
    test_mask: Tensor  # (N,) bool
    edge_weight: Tensor | None = None  # (E,) floating point, aligned with edge_index; None: all 1


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
    """Validates ``data`` and returns its normalised tensors, edges sorted by destination.

    Args:
        data: A PyG graph with ``edge_index`` and ``x``; ``edge_weight``, ``y`` and ``train_mask``/
            ``val_mask``/``test_mask`` are optional (missing labels become ``-1``, missing masks all
            ``False``).
        num_classes: If given, every label must be ``< num_classes`` (multi-label: ``C == num_classes``).
    """
    graph = _validated(data, num_classes)
    graph.edge_index, graph.edge_weight = sort_edges(graph.edge_index, graph.num_nodes, graph.edge_weight)
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
    edge_weight = _check_edge_weight(getattr(data, "edge_weight", None), edge_index, num_nodes)
    x = _check_x(data.x, num_nodes)
    y = _check_y(data.y, num_nodes, num_classes)
    masks = {name: _check_mask(getattr(data, name, None), name, num_nodes) for name in MASK_NAMES}
    for name, mask in masks.items():
        if y.dim() == 2:  # multi-label targets: every vertex has one
            continue
        unlabeled = mask & (y < 0)
        if bool(unlabeled.any()):
            first = int(unlabeled.nonzero()[0, 0])
            raise ValueError(
                f"{name} selects {int(unlabeled.sum())} vertices without a label (y = -1 or y missing), the "
                f"first at node {first}: every vertex a mask selects needs a class label >= 0. Label them, "
                f"or leave them out of the mask: data.{name} &= data.y >= 0"
            )
    return GraphTensors(edge_index=edge_index, num_nodes=num_nodes, x=x, y=y, **masks,
                        edge_weight=edge_weight)


def coalesce(edge_index: Tensor, num_nodes: int) -> Tensor:
    """:func:`sort_edges` of an unweighted edge list: self loops removed (warned), sorted by ``(dst, src)``,
    duplicate edges kept."""
    return sort_edges(edge_index, num_nodes)[0]


def sort_edges(
    edge_index: Tensor, num_nodes: int, edge_weight: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """Removes self loops (warning with the count); returns the edges sorted by ``(dst, src)`` and their
    weights in the same order.

    Self loops are dropped because the GNN layers add their own, of weight 1 (PyG's ``gcn_norm`` would keep
    a weighted loop's weight: :func:`_check_edge_weight` refuses loops weighing anything else). Duplicate
    edges are kept, one column per copy, next to each other: PyG's ``GCNConv`` counts every copy in the
    degree and passes a message per copy, ``SAGEConv`` averages over copies, ``GATConv`` softmaxes over
    them (``torch_geometric.utils.coalesce`` first merges them, if that is what is wanted).
    """
    src, dst = edge_index
    loops = src == dst
    num_loops = int(loops.sum())
    warn_removed_edges(num_loops, stacklevel=4)
    if num_loops:
        src, dst = src[~loops], dst[~loops]
        edge_weight = None if edge_weight is None else edge_weight[~loops]
    order = torch.sort(dst * num_nodes + src, stable=True).indices  # by dst, then src: copies adjacent
    edge_weight = None if edge_weight is None else edge_weight[order].contiguous()
    return torch.stack([src[order], dst[order]]), edge_weight


def removed_edges(edge_index: Tensor, num_nodes: int) -> dict[str, int]:
    """``{"self_loops": n}``: what :func:`coalesce` removes from ``edge_index`` (kept in the partition
    cache's metadata, so that a run reading the cache warns as the run that partitioned did)."""
    return {"self_loops": int((edge_index[0] == edge_index[1]).sum())}


def warn_removed_edges(self_loops: int = 0, duplicates: int = 0, stacklevel: int = 2) -> None:
    """The warning for removed self loops (none if there were none). ``duplicates``: the count a cache
    written before duplicate edges were kept recorded as removed (warned about as then)."""
    if self_loops or duplicates:
        dupes = f" and {duplicates} duplicate edges" if duplicates else ""
        warnings.warn(
            f"edge_index had {self_loops} self loops{dupes}; they were removed "
            "(the GNN layers add self loops themselves, of weight 1)",
            stacklevel=stacklevel,
        )


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
    """Edge attributes of ``data`` that no Dorylus layer reads (``edge_attr``)."""
    return [name for name in IGNORED_EDGE_FIELDS if getattr(data, name, None) is not None]


def warn_ignored_attributes(data: Data, stacklevel: int = 3) -> None:
    """Warns that ``edge_attr`` is not used: no Dorylus layer reads edge features (PyG's ``GATConv``
    without ``edge_dim`` ignores them too; its ``GCNConv`` and ``SAGEConv`` take none)."""
    names = ignored_attributes(data)
    if names:
        warnings.warn(
            f"data.{' and data.'.join(names)} {'is' if len(names) == 1 else 'are'} ignored: no Dorylus "
            "layer (GCNConv, GATConv, SAGEConv) reads edge features, as PyG's GATConv without edge_dim "
            "ignores them (GCNConv reads data.edge_weight, which is used). Drop the attribute to silence "
            "this",
            stacklevel=stacklevel,
        )


def _check_edge_weight(edge_weight: Tensor | None, edge_index: Tensor, num_nodes: int) -> Tensor | None:
    """``edge_weight`` as a CPU tensor if it is ``(E,)``, floating point and finite, its self loops weigh 1
    and every vertex's GCN degree ``1 + Σ in-edge weights`` is >= 0 (PyG's ``gcn_norm`` makes NaN of a
    negative one)."""
    if edge_weight is None:
        return None
    num_edges = edge_index.size(1)
    if not isinstance(edge_weight, Tensor):
        raise TypeError(f"data.edge_weight must be a torch.Tensor of shape ({num_edges},), got "
                        f"{type(edge_weight).__name__}")
    if edge_weight.dim() == 2 and edge_weight.size(1) == 1:
        edge_weight = edge_weight.view(-1)
    if edge_weight.dim() != 1 or edge_weight.size(0) != num_edges:
        raise ValueError(
            f"edge_weight has shape {tuple(edge_weight.shape)} but expected (num_edges={num_edges},): one "
            "weight per column of edge_index, as PyG's GCNConv takes it (edge features of another shape "
            "belong in data.edge_attr)"
        )
    if not edge_weight.dtype.is_floating_point:
        raise ValueError(f"edge_weight must be a floating point tensor, got dtype {edge_weight.dtype}: "
                         "pass data.edge_weight = data.edge_weight.to(data.x.dtype)")
    edge_weight = edge_weight.detach().cpu().contiguous()
    bad = ~torch.isfinite(edge_weight)
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        raise ValueError(f"edge_weight contains {int(bad.sum())} non-finite values (NaN/inf), the first at "
                         f"edge {first} (edge_weight[{first}] = {float(edge_weight[first])})")
    src, dst = edge_index
    loops = (src == dst) & (edge_weight != 1)
    if bool(loops.any()):
        first = int(loops.nonzero()[0, 0])
        raise ValueError(
            f"edge_weight gives {int(loops.sum())} self loops a weight other than 1, the first at edge "
            f"{first} (node {int(src[first])}, weight {float(edge_weight[first])}): the Dorylus layers add a "
            "self loop of weight 1 to every vertex, where PyG's gcn_norm (add_remaining_self_loops) would "
            "keep this weight. Remove them first (torch_geometric.utils.remove_self_loops(edge_index, "
            "edge_weight)) or set their weight to 1"
        )
    degree = torch.ones(num_nodes, dtype=torch.float64).index_add_(0, dst[src != dst],
                                                                  edge_weight[src != dst].double())
    if bool((degree < 0).any()):
        first = int((degree < 0).nonzero()[0, 0])
        raise ValueError(
            f"edge_weight gives node {first} a negative GCN degree (1 + the sum of its in-edge weights = "
            f"{float(degree[first])}), whose inverse square root is NaN (as in PyG's gcn_norm): use weights "
            "whose per-vertex sums stay above -1, e.g. non-negative ones"
        )
    return edge_weight


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
    if is_multi_label(y):
        return _check_multi_label(y, num_nodes, num_classes)
    if y.dim() == 2 and y.size(1) == 1:
        y = y.view(-1)
    if y.dim() != 1 or y.size(0) != num_nodes:
        raise ValueError(f"y has shape {tuple(y.shape)} but expected (num_nodes={num_nodes},) class labels, "
                         f"or (num_nodes={num_nodes}, C) multi-label targets")
    if y.dtype.is_floating_point or y.dtype == torch.bool:
        raise ValueError(
            f"y must hold integer class labels, got dtype {y.dtype} of shape {tuple(y.shape)}; multi-label "
            f"targets (BCE) are 2-D: y of shape (num_nodes={num_nodes}, C), 0/1 or in [0, 1]"
        )
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


def is_multi_label(y: Tensor) -> bool:
    """``y`` holds multi-label targets: 2-D with several columns (ogbn-proteins' ``(N, 112)`` 0/1), or a
    floating-point ``(N, 1)`` (one binary target). An integer ``(N, 1)`` is class labels, as PyG's
    Planetoid-style ``y.view(-1)``."""
    return y.dim() == 2 and (y.size(1) > 1 or y.dtype.is_floating_point)


def _check_multi_label(y: Tensor, num_nodes: int, num_classes: int | None) -> Tensor:
    """Multi-label targets ``(N, C)`` as float (bool/integer 0/1 become float32; float kept): values in
    ``[0, 1]``, the BCE-with-logits targets; ``num_classes``, if given, must be ``C``."""
    if y.size(0) != num_nodes:
        raise ValueError(f"y has shape {tuple(y.shape)} but expected (num_nodes={num_nodes}, C) multi-label "
                         "targets")
    if num_classes is not None and y.size(1) != num_classes:
        raise ValueError(f"y holds {y.size(1)} multi-label targets per vertex (shape {tuple(y.shape)}) but "
                         f"num_classes is {num_classes}: pass num_classes={y.size(1)} (one output per label)")
    y = y.detach().cpu()
    if not y.dtype.is_floating_point:
        y = y.to(torch.float32)  # 0/1 exactly
    bad = ~(torch.isfinite(y) & (y >= 0) & (y <= 1))
    if bool(bad.any()):
        row, column = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"y holds multi-label targets (shape {tuple(y.shape)}) but y[{row}, {column}] = "
            f"{float(y[row, column])}: BCE-with-logits targets lie in [0, 1] (0/1 per label). Class labels "
            f"belong in a 1-D y of shape ({num_nodes},)"
        )
    return y.contiguous()


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
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (a bool mask of shape ({num_nodes},) or a LongTensor "
                        f"of vertex indices), got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point and not mask.is_complex():
        return _index_mask(mask, name, num_nodes)
    if mask.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor of shape ({num_nodes},) or an integer tensor of "
                         f"vertex indices, got dtype {mask.dtype}")
    if mask.dim() != 1 or mask.size(0) != num_nodes:
        raise ValueError(
            f"{name} has shape {tuple(mask.shape)} but expected ({num_nodes},) (one bool per node; "
            "multi-split masks must be reduced to one split first)"
        )
    return mask.cpu().contiguous()


def _index_mask(index: Tensor, name: str, num_nodes: int) -> Tensor:
    """A 1-D integer ``name`` as vertex indices, made a bool mask as PyG's
    ``torch_geometric.utils.index_to_mask(index, size=num_nodes)``; refused where it reads as a 0/1 mask
    (``num_nodes`` entries, all 0 or 1) or an index is out of range."""
    fix = (f"pass a bool mask (data.{name} = data.{name}.bool() if it holds 0/1 per vertex) or vertex "
           f"indices as torch_geometric.utils.index_to_mask(index, size={num_nodes}) expects")
    if index.dim() != 1:
        raise ValueError(f"{name} has dtype {index.dtype} and shape {tuple(index.shape)}: {fix}")
    index = index.detach().cpu().to(torch.long)
    if index.numel() == num_nodes and num_nodes > 2 and bool(((index == 0) | (index == 1)).all()):
        raise ValueError(
            f"{name} is an integer tensor of {num_nodes} zeros and ones: it may be a 0/1 mask or the vertex "
            f"indices 0 and 1, so it is not guessed: {fix}"
        )
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= num_nodes):
        raise ValueError(
            f"{name} holds vertex indices in [{int(index.min())}, {int(index.max())}] but the graph has "
            f"{num_nodes} vertices (indices 0 .. {num_nodes - 1}): {fix}"
        )
    mask = torch.zeros(num_nodes, dtype=torch.bool)
    mask[index] = True
    return mask
