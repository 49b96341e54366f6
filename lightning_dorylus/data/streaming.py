"""Preparation of a :class:`ChunkedGraph` with bounded memory: partitions written to the cache without any
process holding the whole graph.

Steps, each reading the chunk files memory-mapped, one batch of edges at a time:

1. check every file (:meth:`ChunkedGraph.validate`) and count in-degrees (8 bytes per vertex);
2. assign every vertex (:mod:`.stream_assign`: Fennel, hash or range; 4 bytes per vertex);
3. bucket the edges of this machine's partitions into files on disk: ``in_<p>`` holds the edges whose
   destination ``p`` owns, ``out_<p>`` the (holder, source) pairs of ``p``'s vertices that another partition
   needs as ghosts;
4. build each partition from its own buckets (``O(E_p)``: the partition's own size, as its server holds it)
   and write it in the cache's format (:mod:`.cache`, ``part_<k>.safetensors`` + the manifest).

Semantics: self loops are dropped (the layers add their own) and counted; duplicate edges are KEPT, with
their multiplicity, as PyG's message passing counts them; an ``edge_weight`` is carried per edge into
``edge_weight_<k>.safetensors`` beside the partition (:func:`load_edge_weight`).

On several machines each one builds only its own partitions (``parts``), from the same shared chunk files,
into a directory named after them; the partitions of one machine never wait for another's. Everything is
written under a temporary name (holding this host and PID) and renamed into place when complete, so an
interrupted preparation leaves no directory a reader would take for finished; the next run removes the
leftovers of dead preparations and does the work again.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from lightning_dorylus.data.build import DEFAULT_INTERVAL_SIZE, interval_ptr
from lightning_dorylus.data.cache import (
    _PART_INTS,
    FORMAT_VERSION,
    cache_problem,
    damaged_files,
    part_file,
)
from lightning_dorylus.data.chunked import ChunkedGraph, ChunkedGraphError
from lightning_dorylus.data.integrity import check_file, manifest_entry
from lightning_dorylus.data.prune import delete_directory, mark_used
from lightning_dorylus.data.stream_assign import STREAM_PARTITIONERS, assign_vertices
from lightning_dorylus.data.validation import warn_removed_edges

_BATCH = 1 << 23  # edges per batch of the bucketing pass (about 200 MB of int64 temporaries)


def weight_file(part_id: int) -> str:
    """File name of partition ``part_id``'s edge weights (in ``edge_index`` order)."""
    return f"edge_weight_{part_id}.safetensors"


def streamed_name(digest: str, partitioner: str, num_parts: int, interval_size: int, seed: int,
                  parts: Sequence[int] | None = None) -> str:
    """Directory name of a streamed partitioning; ``parts``: the subset one machine builds (``None``: all)."""
    name = f"{digest[:16]}-{partitioner}-p{num_parts}-i{interval_size}-s{seed}"
    if parts is not None and list(parts) != list(range(num_parts)):
        name += f"-k{min(parts)}-{max(parts)}"
    return name


def node_parts(node_rank: int, devices_per_node: int, num_parts: int) -> list[int]:
    """The partitions (global ranks) one machine serves: ``node_rank * devices .. + devices - 1``."""
    first = node_rank * devices_per_node
    return list(range(first, min(num_parts, first + devices_per_node)))


def prepare_streamed(
    graph: ChunkedGraph,
    num_parts: int,
    partitioner: str = "fennel",
    interval_size: int = DEFAULT_INTERVAL_SIZE,
    seed: int = 0,
    cache_dir: str | Path = ".",
    parts: Sequence[int] | None = None,
    digest: str | None = None,
    restreams: int = 4,
) -> Path:
    """Builds partitions ``parts`` (default: all) of ``graph`` into ``cache_dir`` unless intact ones exist.

    Args:
        graph: The chunked graph (validated here, chunk by chunk).
        num_parts: Number of graph servers.
        partitioner: ``"fennel"``, ``"hash"`` or ``"range"`` (see :mod:`.stream_assign`).
        interval_size: Vertices per interval.
        seed: Seed of the assignment's hash.
        cache_dir: Cache root.
        parts: The partitions to build here (one machine's); ``None``: all.
        digest: ``graph.digest()`` if the caller has it.
        restreams: Fennel's restreaming passes (more: a lower edge cut, one pass over the edges each).

    Returns:
        The partitioning directory (``meta.json`` + the built ``part_<k>.safetensors``).
    """
    if partitioner not in STREAM_PARTITIONERS:
        raise ValueError(
            f"partitioner={partitioner!r} cannot partition a ChunkedGraph: METIS and BFS need the whole "
            f"graph in one process. Pass one of {list(STREAM_PARTITIONERS)} ('fennel': the lowest edge "
            "cut), or load a graph that fits into a torch_geometric Data for METIS"
        )
    parts = list(range(num_parts)) if parts is None else sorted(int(p) for p in parts)
    if not parts or parts[0] < 0 or parts[-1] >= num_parts:
        raise ValueError(f"parts={parts} must be a non-empty subset of [0, {num_parts}) (num_parts)")
    root = Path(cache_dir)
    digest = digest or graph.digest()
    target = root / streamed_name(digest, partitioner, num_parts, interval_size, seed, parts)
    if cache_problem(target, digest) is None and not damaged_files(target):
        meta = json.loads((target / "meta.json").read_text())
        warn_removed_edges(**meta.get("removed_edges", {}), stacklevel=3)
        mark_used(target)
        return target
    if target.exists():
        problem = cache_problem(target, digest) or "a file does not match the manifest"
        warnings.warn(f"partition cache {target} cannot be used ({problem}); preparing it again",
                      stacklevel=2)
    root.mkdir(parents=True, exist_ok=True)
    remove_dead_leftovers(root, target.name)
    tmp = root / f".{target.name}.{socket.gethostname()}-{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        graph.validate()
        n = graph.num_nodes
        if num_parts > n:
            raise ChunkedGraphError(f"num_parts ({num_parts}) is greater than the number of vertices ({n})")
        in_degree, self_loops = _in_degrees(graph)
        asg = assign_vertices(graph, num_parts, partitioner, seed, restreams)
        edge_cut, num_edges = _bucket(graph, asg, parts, tmp)
        labels = graph.labels()
        masks = {name: graph.mask(split) for name, split in
                 (("train_mask", "train"), ("val_mask", "val"), ("test_mask", "test"))}
        num_train = int(masks["train_mask"].sum())
        meta: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "graph_hash": digest,
            "partitioner": partitioner,
            "num_parts": num_parts,
            "interval_size": interval_size,
            "seed": seed,
            "num_nodes": n,
            "num_edges": num_edges,
            "num_features": graph.num_features,
            "num_classes": int(labels.max()) + 1 if labels.size else 0,
            "num_train_global": num_train,
            "edge_cut": edge_cut,
            "removed_edges": {"self_loops": self_loops, "duplicates": 0},
            "source": "chunked",
            "built_parts": parts,
            "parts": {},
            "files": {},
        }
        for p in parts:
            stats = _build_part(graph, asg, p, num_parts, in_degree, labels, masks, num_train, interval_size,
                                tmp, meta)
            meta["parts"][str(p)] = stats
        _write_meta(tmp, meta)
        if target.exists():
            delete_directory(target, "damaged")
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    warn_removed_edges(self_loops, 0, stacklevel=3)
    return target


def remove_dead_leftovers(root: Path, name: str) -> list[Path]:
    """Deletes ``.<name>.<this host>-<pid>.tmp`` directories whose preparing process is gone (interrupted:
    killed, OOM-killed, a machine restart); returns them."""
    host = socket.gethostname()
    removed = []
    for path in root.glob(f".{name}.{host}-*.tmp"):
        pid_text = path.name[len(f".{name}.{host}-") : -len(".tmp")]
        if pid_text.isdigit() and not _alive(int(pid_text)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_meta(directory: Path, meta: dict[str, Any]) -> None:
    tmp = directory / ".meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, directory / "meta.json")


def _in_degrees(graph: ChunkedGraph) -> tuple[np.ndarray, int]:
    """Global in-degree of every vertex (self loops left out, duplicates counted) and the self-loop count."""
    n = graph.num_nodes
    degree = np.zeros(n, dtype=np.int64)
    loops = 0
    for _, edges, _ in graph.chunks():
        for a in range(0, edges.shape[1], _BATCH):
            src = np.asarray(edges[0, a : a + _BATCH])
            dst = np.asarray(edges[1, a : a + _BATCH])
            keep = src != dst
            loops += int(keep.size - keep.sum())
            degree += np.bincount(dst[keep], minlength=n)
    return degree, loops


def _bucket(graph: ChunkedGraph, asg: np.ndarray, parts: list[int], tmp: Path) -> tuple[int, int]:
    """Appends each batch's edges to the bucket files of ``parts``; returns (edge cut, edges) of the graph."""
    n = graph.num_nodes
    weighted = graph.edge_weight is not None
    handles = {}
    for p in parts:
        handles[p] = {kind: (tmp / f"{kind}_{p}.bin").open("wb") for kind in
                      ("src", "dst", "out", *(("w",) if weighted else ()))}
    cut = total = 0
    try:
        for _, edges, weight in graph.chunks():
            for a in range(0, edges.shape[1], _BATCH):
                src = np.asarray(edges[0, a : a + _BATCH], dtype=np.int64)
                dst = np.asarray(edges[1, a : a + _BATCH], dtype=np.int64)
                w = None if weight is None else np.asarray(weight[a : a + _BATCH], dtype=np.float32)
                keep = src != dst
                src, dst = src[keep], dst[keep]
                w = None if w is None else w[keep]
                owner, source_part = asg[dst], asg[src]
                crossing = owner != source_part
                cut += int(crossing.sum())
                total += src.size
                for p in parts:
                    mine = owner == p
                    src[mine].tofile(handles[p]["src"])
                    dst[mine].tofile(handles[p]["dst"])
                    if w is not None:
                        w[mine].tofile(handles[p]["w"])
                    needed = crossing & (source_part == p)  # p's vertex is a ghost on the edge's owner
                    (owner[needed].astype(np.int64) * n + src[needed]).tofile(handles[p]["out"])
    finally:
        for files in handles.values():
            for handle in files.values():
                handle.close()
    return cut, total


def _unique(keys: np.ndarray) -> np.ndarray:
    """Sorted distinct values of ``keys`` (sorted in place; faster here than ``np.unique``'s hash table)."""
    keys.sort()
    return keys[np.concatenate([[True], keys[1:] != keys[:-1]])] if keys.size else keys


def _ptr(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _build_part(
    graph: ChunkedGraph,
    asg: np.ndarray,
    p: int,
    num_parts: int,
    in_degree: np.ndarray,
    labels: np.ndarray,
    masks: dict[str, np.ndarray],
    num_train: int,
    interval_size: int,
    tmp: Path,
    meta: dict[str, Any],
) -> dict[str, int]:
    """Partition ``p`` from its buckets, in the layout of :func:`.build.build_partitions` (edges sorted by
    (dst, src) global id; ghosts grouped by owner, ascending id within one); written to ``tmp``."""
    n = graph.num_nodes
    nodes = np.flatnonzero(asg == p).astype(np.int64)
    n_local = nodes.size

    key = np.fromfile(tmp / f"dst_{p}.bin", dtype=np.int64)
    key *= n
    key += np.fromfile(tmp / f"src_{p}.bin", dtype=np.int64)
    (tmp / f"dst_{p}.bin").unlink()
    (tmp / f"src_{p}.bin").unlink()
    weight = None
    if graph.edge_weight is not None:
        order = np.argsort(key, kind="stable")
        key = key[order]
        weight = np.fromfile(tmp / f"w_{p}.bin", dtype=np.float32)[order]
        del order
    else:
        key.sort(kind="stable")
    src = key % n
    dst = key // n
    del key
    edge_index = np.empty((2, src.size), dtype=np.int64)  # filled in place: no stacked copy
    local_src, local_dst = edge_index[0], edge_index[1]
    local_dst[:] = np.searchsorted(nodes, dst)
    del dst
    src_owner = asg[src]
    cross = src_owner != p
    ghost_key = _unique(src_owner[cross].astype(np.int64) * n + src[cross])
    local_src[~cross] = np.searchsorted(nodes, src[~cross])
    cross_key = src_owner[cross].astype(np.int64) * n + src[cross]
    local_src[cross] = n_local + np.searchsorted(ghost_key, cross_key)
    del cross_key
    del src, src_owner, cross
    ghosts = ghost_key % n
    ghost_owner = ghost_key // n
    del ghost_key

    sends = _unique(np.fromfile(tmp / f"out_{p}.bin", dtype=np.int64))
    (tmp / f"out_{p}.bin").unlink()
    send_holder = sends // n
    send_local = np.searchsorted(nodes, sends % n)
    del sends

    x = np.asarray(graph.features()[nodes])
    if x.dtype == np.float16:  # the layers compute in float32 at least
        x = x.astype(np.float32)
    tensors = {
        "local_nodes": torch.from_numpy(nodes),
        "ghost_nodes": torch.from_numpy(ghosts),
        "ghost_owner": torch.from_numpy(ghost_owner),
        "recv_ptr": torch.from_numpy(_ptr(np.bincount(ghost_owner, minlength=num_parts))),
        "edge_index": torch.from_numpy(edge_index),
        "dst_ptr": torch.from_numpy(_ptr(np.bincount(local_dst, minlength=n_local))),
        "in_degree": torch.from_numpy(np.concatenate([in_degree[nodes], in_degree[ghosts]])),
        "x": torch.from_numpy(np.ascontiguousarray(x)),
        "y": torch.from_numpy(labels[nodes]),
        "train_mask": torch.from_numpy(masks["train_mask"][nodes]),
        "val_mask": torch.from_numpy(masks["val_mask"][nodes]),
        "test_mask": torch.from_numpy(masks["test_mask"][nodes]),
        "interval_ptr": interval_ptr(n_local, interval_size),
        "send_index": torch.from_numpy(send_local),
        "send_ptr": torch.from_numpy(_ptr(np.bincount(send_holder, minlength=num_parts))),
    }
    num_edges, n_ghost = int(local_dst.size), int(ghosts.size)
    del local_src, local_dst, edge_index, x
    ints = {"part_id": p, "num_parts": num_parts, "num_global_nodes": n, "num_train_global": num_train}
    metadata = {name: str(ints[name]) for name in _PART_INTS}
    metadata["format_version"] = str(FORMAT_VERSION)
    path = tmp / part_file(p)
    write_safetensors(tensors, path, metadata)
    meta["files"][path.name] = manifest_entry(path)
    del tensors
    if weight is not None:
        wpath = tmp / weight_file(p)
        write_safetensors({"edge_weight": torch.from_numpy(weight)}, wpath, {})
        meta["files"][wpath.name] = manifest_entry(wpath)
        (tmp / f"w_{p}.bin").unlink()
    return {"n_local": int(n_local), "n_ghost": n_ghost, "edges": num_edges,
            "intervals": int(-(-n_local // interval_size))}


_DTYPES = {torch.int64: "I64", torch.int32: "I32", torch.float64: "F64", torch.float32: "F32",
           torch.float16: "F16", torch.bfloat16: "BF16", torch.bool: "BOOL", torch.uint8: "U8"}


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """Writes ``tensors`` as a safetensors file one tensor at a time (the same format ``save_file`` writes,
    read by ``load_file``): ``save_file`` first copies every tensor into one bytes object, twice the
    partition's size at the preparation's peak."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors pads it
    with path.open("wb") as handle:
        handle.write(len(encoded).to_bytes(8, "little"))
        handle.write(encoded)
        for name in sorted(tensors):
            tensor = tensors[name].contiguous()
            if tensor.numel():
                handle.write(memoryview(tensor.view(torch.uint8).numpy()) if tensor.dtype != torch.bool
                             else memoryview(tensor.numpy().view(np.uint8)))


def load_edge_weight(directory: str | Path, part_id: int) -> torch.Tensor | None:
    """Partition ``part_id``'s ``(E_local,)`` float32 edge weights in its ``edge_index`` order (checked
    against the manifest), or ``None`` when the graph has none."""
    directory = Path(directory)
    meta = json.loads((directory / "meta.json").read_text())
    entry = meta["files"].get(weight_file(part_id))
    if entry is None:
        return None
    path = directory / weight_file(part_id)
    check_file(path, entry, f"Delete {directory} and prepare the graph again")
    return load_file(str(path))["edge_weight"]
