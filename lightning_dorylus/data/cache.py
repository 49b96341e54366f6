"""On-disk partition cache (safetensors + JSON; nothing is pickled).

Layout::

    <cache_dir>/
    └── <graph_hash[:16]>-<partitioner>-p<num_parts>-i<interval_size>-s<seed>/
        ├── meta.json            # format version, options, full graph hash, sizes, edge cut, per-part stats
        ├── part_0.safetensors   # GraphPartition 0 (send_index flattened to send_index + send_ptr)
        ├── part_1.safetensors
        └── ...

``graph_hash`` is a sha256 over the raw bytes, dtypes and shapes of ``edge_index``, ``x``, ``y`` and the three
masks plus ``num_nodes``, so a changed graph gets a new directory (the old one is left in place). A
directory is written under a temporary name and renamed into place when complete, so readers never see a
half-written cache, and two processes racing to write it both end with the same content.

Single graphs (e.g. synthetic ones) are stored as one ``.safetensors`` file by :func:`save_graph`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor
from torch_geometric.data import Data

from lightning_dorylus.data.build import DEFAULT_INTERVAL_SIZE, partition_graph
from lightning_dorylus.data.partition import GraphPartition
from lightning_dorylus.data.validation import (
    MASK_NAMES,
    check_features,
    check_interval_size,
    check_partitioner,
    is_integer,
)

FORMAT_VERSION = 1
"""Bumped whenever the partition layout changes; part of the hash, so old caches are never misread."""

_GRAPH_FIELDS = ("edge_index", "x", "y", *MASK_NAMES)
_PART_TENSORS = (
    "local_nodes",
    "ghost_nodes",
    "ghost_owner",
    "recv_ptr",
    "edge_index",
    "dst_ptr",
    "in_degree",
    "x",
    "y",
    "train_mask",
    "val_mask",
    "test_mask",
    "interval_ptr",
)
_PART_INTS = ("part_id", "num_parts", "num_global_nodes", "num_train_global")


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/lightning_dorylus/partitions`` (``~/.cache/...`` when the variable is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lightning_dorylus" / "partitions"


def graph_hash(data: Data) -> str:
    """Hex sha256 of the graph's structure, features, labels and masks (raw bytes + dtypes + shapes)."""
    if isinstance(getattr(data, "x", None), Tensor):  # a sparse x fails here naming x, not in .contiguous()
        check_features(data.x, data.x.size(0))
    digest = hashlib.sha256(f"dorylus-graph-v{FORMAT_VERSION};num_nodes={data.num_nodes};".encode())
    for name in _GRAPH_FIELDS:
        value = getattr(data, name, None)
        if value is None:
            digest.update(f"{name}=None;".encode())
            continue
        tensor = value.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))  # raw bytes, any dtype
    return digest.hexdigest()


def cache_name(digest: str, partitioner: str, num_parts: int, interval_size: int, seed: int) -> str:
    """Directory name of one partitioning inside ``cache_dir``."""
    return f"{digest[:16]}-{partitioner}-p{num_parts}-i{interval_size}-s{seed}"


def partition_to_cache(
    data: Data,
    num_parts: int,
    partitioner: str = "metis",
    interval_size: int = DEFAULT_INTERVAL_SIZE,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    digest: str | None = None,
) -> Path:
    """Partitions ``data`` into ``cache_dir`` unless an identical partitioning is already there.

    Args:
        data: The global graph.
        num_parts: Number of graph servers.
        partitioner: ``"metis"``, ``"bfs"``, ``"contiguous"`` or ``"random"``.
        interval_size: Vertices per interval, ``>= 1``.
        seed: Partitioner seed.
        cache_dir: Cache root; ``None`` means :func:`default_cache_dir`.
        digest: ``graph_hash(data)`` if the caller already has it.

    Returns:
        The partitioning's directory (holding ``meta.json`` and ``part_<k>.safetensors``).
    """
    check_partitioner(partitioner)
    interval_size = check_interval_size(interval_size)
    if not is_integer(num_parts) or num_parts < 1:
        raise ValueError(f"num_parts ({num_parts!r}) must be an integer >= 1")
    num_parts, seed = int(num_parts), int(seed)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    digest = digest or graph_hash(data)
    target = root / cache_name(digest, partitioner, num_parts, interval_size, seed)
    if is_complete(target, digest):
        return target

    parts = partition_graph(data, num_parts, partitioner, interval_size, seed)
    meta = {
        "format_version": FORMAT_VERSION,
        "graph_hash": digest,
        "partitioner": partitioner,
        "num_parts": num_parts,
        "interval_size": interval_size,
        "seed": seed,
        "num_nodes": parts[0].num_global_nodes,
        "num_edges": sum(p.num_edges for p in parts),
        "num_features": parts[0].num_features,
        "num_classes": max(int(p.y.max()) if p.n_local else -1 for p in parts) + 1,
        "num_train_global": parts[0].num_train_global,
        "edge_cut": sum(int((p.edge_index[0] >= p.n_local).sum()) for p in parts),  # edges with a ghost src
        "parts": [
            {"n_local": p.n_local, "n_ghost": p.n_ghost, "edges": p.num_edges, "intervals": p.num_intervals}
            for p in parts
        ],
    }
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    try:
        for part in parts:
            save_partition(part, tmp / f"part_{part.part_id}.safetensors")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if target.exists() and not is_complete(target, digest):
            # Writers only ever rename complete directories into place, so this one was damaged by hand.
            warnings.warn(f"replacing the incomplete partition cache {target}", stacklevel=2)
            shutil.rmtree(target)
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_complete(target, digest):  # losing a race to an identical writer is fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def is_complete(directory: Path, digest: str | None = None) -> bool:
    """Whether ``directory`` holds a finished partitioning of the current format (and graph ``digest``)."""
    meta_path = directory / "meta.json"
    if not meta_path.is_file():
        return False
    try:
        meta = json.loads(meta_path.read_text())
        if meta["format_version"] != FORMAT_VERSION or (digest is not None and meta["graph_hash"] != digest):
            return False
        return all((directory / f"part_{k}.safetensors").is_file() for k in range(meta["num_parts"]))
    except (json.JSONDecodeError, KeyError, TypeError):
        return False


def read_meta(directory: str | Path) -> dict[str, Any]:
    """The ``meta.json`` of a partitioning directory (raises naming the directory if it is not one)."""
    directory = Path(directory)
    if not is_complete(directory):
        raise FileNotFoundError(
            f"{directory} is not a complete lightning_dorylus partition directory (format version "
            f"{FORMAT_VERSION}: meta.json + part_<k>.safetensors)"
        )
    return json.loads((directory / "meta.json").read_text())


def save_partition(part: GraphPartition, path: Path) -> None:
    """Writes one partition as safetensors (``send_index`` flattened to ``send_index`` + ``send_ptr``)."""
    tensors = {name: getattr(part, name).contiguous().clone() for name in _PART_TENSORS}
    tensors["send_index"] = torch.cat([torch.zeros(0, dtype=torch.long), *part.send_index])
    sizes = torch.tensor([t.numel() for t in part.send_index], dtype=torch.long)
    tensors["send_ptr"] = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
    metadata = {name: str(getattr(part, name)) for name in _PART_INTS}
    metadata["format_version"] = str(FORMAT_VERSION)
    save_file(tensors, str(path), metadata=metadata)


def load_partition(directory: str | Path, part_id: int) -> GraphPartition:
    """Loads partition ``part_id`` from a partitioning directory (tensors on CPU)."""
    meta = read_meta(directory)
    if not 0 <= part_id < meta["num_parts"]:
        raise ValueError(f"part_id ({part_id}) must lie in [0, {meta['num_parts']}) for {directory}")
    path = Path(directory) / f"part_{part_id}.safetensors"
    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata()
    fields: dict[str, Any] = load_file(str(path))
    send_index, send_ptr = fields.pop("send_index"), fields.pop("send_ptr")
    fields["send_index"] = [send_index[send_ptr[q] : send_ptr[q + 1]] for q in range(send_ptr.numel() - 1)]
    fields.update({name: int(metadata[name]) for name in _PART_INTS})
    return GraphPartition(**fields)


def save_graph(data: Data, path: str | Path) -> None:
    """Writes a graph's ``edge_index``/``x``/``y``/masks to one safetensors file (atomic replace)."""
    path = Path(path)
    present = [name for name in _GRAPH_FIELDS if getattr(data, name, None) is not None]
    tensors = {name: getattr(data, name).contiguous() for name in present}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    metadata = {"num_nodes": str(data.num_nodes), "format_version": str(FORMAT_VERSION)}
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def load_graph(path: str | Path) -> Data:
    """Reads a graph written by :func:`save_graph`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"graph file {path} does not exist")
    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata() or {}
    if "num_nodes" not in metadata:
        raise ValueError(f"{path} is not a lightning_dorylus graph file (no num_nodes in its metadata)")
    tensors: dict[str, Tensor] = load_file(str(path))
    return Data(num_nodes=int(metadata["num_nodes"]), **tensors)
