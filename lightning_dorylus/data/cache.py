"""On-disk partition cache (safetensors + JSON; nothing is pickled), with a checksum per file.

Layout::

    <cache_dir>/
    └── <graph_hash[:16]>-<partitioner>-p<num_parts>-i<interval_size>-s<seed>/
        ├── meta.json            # format version, options, full graph hash, sizes, edge cut, per-part stats,
        │                        # and the manifest: "files": {"part_<k>.safetensors": {"bytes", "sha256"}}
        ├── part_0.safetensors   # GraphPartition 0 (send_index flattened to send_index + send_ptr)
        ├── part_1.safetensors
        └── ...

``graph_hash`` (:mod:`fingerprint`) is a sha256 over the raw bytes, dtypes and shapes of ``edge_index``,
``edge_weight``, ``x``, ``y`` and the three masks plus ``num_nodes``, so a changed graph gets a new
directory (the old one is left in place). A directory, manifest included, is written under a temporary name
and renamed into place when complete, so readers never see a half-written cache, and two processes racing to
write it both end with the same content. Every read checks the file against the manifest (:mod:`integrity`);
a damaged directory is rebuilt by :func:`partition_to_cache`, with a warning naming the file.

Single graphs (e.g. synthetic ones) are stored as one ``.safetensors`` file by :func:`save_graph`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor
from torch_geometric.data import Data

from lightning_dorylus.data.build import DEFAULT_INTERVAL_SIZE, partition_graph
from lightning_dorylus.data.fingerprint import GRAPH_FIELDS, graph_hash
from lightning_dorylus.data.integrity import (
    CorruptCacheError,
    check_file,
    manifest_entry,
    verify_file,
)
from lightning_dorylus.data.partition import GraphPartition
from lightning_dorylus.data.prune import delete_directory, mark_used, prune_cache
from lightning_dorylus.data.validation import (
    check_cache_dir,
    check_interval_size,
    check_partitioner,
    is_integer,
    removed_edges,
    warn_removed_edges,
)

FORMAT_VERSION = 2
"""Bumped whenever the partition layout changes (2: the manifest of checksums); checked in ``meta.json``."""

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
_PART_OPTIONAL_TENSORS = ("edge_weight", "weighted_in_degree")
"""Written only when set (a weighted graph); an older file without them reads as unweighted."""
_PART_INTS = ("part_id", "num_parts", "num_global_nodes", "num_train_global")


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/lightning_dorylus/partitions`` (``~/.cache/...`` when the variable is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lightning_dorylus" / "partitions"


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
    max_age_s: float | None = None,
    max_bytes: int | None = None,
) -> Path:
    """Partitions ``data`` into ``cache_dir`` unless an identical, intact partitioning is already there.

    An existing partitioning is checked file by file against its manifest (size and sha256); a damaged or
    incomplete one is rebuilt from ``data``, with a warning naming what was wrong.

    Args:
        data: The global graph.
        num_parts: Number of graph servers.
        partitioner: ``"metis"``, ``"bfs"``, ``"contiguous"`` or ``"random"``.
        interval_size: Vertices per interval, ``>= 1``.
        seed: Partitioner seed.
        cache_dir: Cache root; ``None`` means :func:`default_cache_dir`.
        digest: ``graph_hash(data)`` if the caller already has it.
        max_age_s: Then delete the other partitionings of ``cache_dir`` unused for longer (``None``: none).
        max_bytes: ... and the least recently used ones beyond this total size (``None``: no bound). See
            :mod:`.prune` (never the one in use, nor one used in the last hour).

    Returns:
        The partitioning's directory (holding ``meta.json`` and ``part_<k>.safetensors``).
    """
    check_partitioner(partitioner)
    interval_size = check_interval_size(interval_size)
    if not is_integer(num_parts) or num_parts < 1:
        raise ValueError(f"num_parts ({num_parts!r}) must be an integer >= 1")
    num_parts, seed = int(num_parts), int(seed)
    root = check_cache_dir(cache_dir if cache_dir is not None else default_cache_dir())
    digest = digest or graph_hash(data)
    target = root / cache_name(digest, partitioner, num_parts, interval_size, seed)
    problem = cache_problem(target, digest)
    if problem is None:
        damage = damaged_files(target)
        if not damage:  # a cached run warns about the removed edges as the run that partitioned did
            warn_removed_edges(**json.loads((target / "meta.json").read_text()).get("removed_edges", {}),
                               stacklevel=3)
            mark_used(target)
            prune_cache(root, target, max_age_s, max_bytes)
            return target
        problem = "; ".join(damage)
    if target.exists():
        warnings.warn(f"partition cache {target} cannot be used ({problem}); rebuilding it from the graph",
                      stacklevel=2)

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
        "num_classes": _num_classes(parts),
        "num_train_global": parts[0].num_train_global,
        "edge_cut": sum(int((p.edge_index[0] >= p.n_local).sum()) for p in parts),  # edges with a ghost src
        "removed_edges": removed_edges(data.edge_index, parts[0].num_global_nodes),  # warned on cached runs
        "parts": [
            {"n_local": p.n_local, "n_ghost": p.n_ghost, "edges": p.num_edges, "intervals": p.num_intervals}
            for p in parts
        ],
        "files": {},  # the manifest: file name -> {"bytes", "sha256"}, checked whenever a file is read
    }
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    try:
        for part in parts:
            path = tmp / part_file(part.part_id)
            save_partition(part, path)
            meta["files"][path.name] = manifest_entry(path)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        _move_into_place(tmp, target, digest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    prune_cache(root, target, max_age_s, max_bytes)
    return target


def _move_into_place(tmp: Path, target: Path, digest: str) -> None:
    """Renames the finished directory ``tmp`` to ``target``, first moving a damaged ``target`` aside."""
    if target.exists() and cache_problem(target, digest) is None and not damaged_files(target):
        return  # an identical writer (another node on a shared file system) finished first
    if target.exists():
        delete_directory(target, "damaged")  # another writer may have moved it aside first
    try:
        os.rename(tmp, target)
    except OSError:
        if cache_problem(target, digest) is not None:  # losing a race to an identical writer is fine
            raise


def _num_classes(parts: list[GraphPartition]) -> int:
    """``max(y) + 1`` over every partition's class labels; ``C`` for multi-label targets ``(n, C)``."""
    if parts[0].multi_label:
        return int(parts[0].y.size(1))
    return max(int(p.y.max()) if p.n_local else -1 for p in parts) + 1


def part_file(part_id: int) -> str:
    """File name of partition ``part_id`` inside a partitioning directory."""
    return f"part_{part_id}.safetensors"


def cache_problem(directory: Path, digest: str | None = None) -> str | None:
    """Why ``directory`` is not a finished partitioning of the current format (and graph ``digest``), from
    ``meta.json`` and the files' presence only; ``None`` if it is one. Damaged files are found by
    :func:`damaged_files` (all of them) and :func:`load_partition` (the one it reads)."""
    meta_path = directory / "meta.json"
    if not meta_path.is_file():
        return f"{meta_path} is missing"
    try:
        meta = json.loads(meta_path.read_text())
        if meta["format_version"] != FORMAT_VERSION:
            return (
                f"{directory} was written in format version {meta['format_version']}; this "
                f"lightning_dorylus reads version {FORMAT_VERSION} (with a checksum per file)"
            )
        if digest is not None and meta["graph_hash"] != digest:
            return f"{meta_path} belongs to another graph"
        files = meta["files"]
        for k in meta.get("built_parts", range(meta["num_parts"])):  # one machine's subset, if streamed
            name = part_file(k)
            if name not in files:
                return f"{meta_path} has no manifest entry for {name}"
            if not (directory / name).is_file():
                return f"{directory / name} is missing"
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
        return f"{meta_path} is not a valid partition manifest ({type(err).__name__}: {err})"
    return None


def is_complete(directory: Path, digest: str | None = None) -> bool:
    """Whether ``directory`` holds a finished partitioning of the current format (and graph ``digest``)."""
    return cache_problem(directory, digest) is None


def damaged_files(directory: Path) -> list[str]:
    """What is wrong with each partition file of a complete ``directory`` against its manifest (size and
    sha256, the files hashed in parallel threads); empty if every file matches."""
    files = json.loads((directory / "meta.json").read_text())["files"]
    with ThreadPoolExecutor(max_workers=min(len(files), os.cpu_count() or 1)) as pool:
        found = pool.map(lambda item: verify_file(directory / item[0], item[1]), sorted(files.items()))
        return [problem for problem in found if problem is not None]


def read_meta(directory: str | Path) -> dict[str, Any]:
    """The ``meta.json`` of a partitioning directory (raises naming the directory if it is not one)."""
    directory = Path(directory)
    problem = cache_problem(directory)
    if problem is not None:
        raise FileNotFoundError(
            f"{directory} is not a complete lightning_dorylus partition directory (format version "
            f"{FORMAT_VERSION}: meta.json with a manifest + part_<k>.safetensors): {problem}. "
            f"{rebuild_hint(directory)}"
        )
    return json.loads((directory / "meta.json").read_text())


def rebuild_hint(directory: Path) -> str:
    """How to get an intact partitioning back in ``directory``'s place."""
    return (
        f"Delete {directory} and partition the graph again: DorylusDataModule(graph, ...) rebuilds a "
        "damaged cache from the graph by itself in prepare_data (as does partition_to_cache(graph, ...))"
    )


def save_partition(part: GraphPartition, path: Path) -> None:
    """Writes one partition as safetensors (``send_index`` flattened to ``send_index`` + ``send_ptr``)."""
    tensors = {name: getattr(part, name).contiguous().clone() for name in _PART_TENSORS}
    for name in _PART_OPTIONAL_TENSORS:
        if getattr(part, name) is not None:
            tensors[name] = getattr(part, name).contiguous().clone()
    tensors["send_index"] = torch.cat([torch.zeros(0, dtype=torch.long), *part.send_index])
    sizes = torch.tensor([t.numel() for t in part.send_index], dtype=torch.long)
    tensors["send_ptr"] = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
    metadata = {name: str(getattr(part, name)) for name in _PART_INTS}
    metadata["format_version"] = str(FORMAT_VERSION)
    save_file(tensors, str(path), metadata=metadata)


def load_partition(directory: str | Path, part_id: int) -> GraphPartition:
    """Loads partition ``part_id`` from a partitioning directory (tensors on CPU), after checking its size
    and sha256 against the manifest.

    Raises:
        CorruptCacheError: the file does not match its manifest entry (names the file and how to rebuild).
    """
    directory = Path(directory)
    meta = read_meta(directory)
    if not 0 <= part_id < meta["num_parts"]:
        raise ValueError(f"part_id ({part_id}) must lie in [0, {meta['num_parts']}) for {directory}")
    path = directory / part_file(part_id)
    if path.name not in meta["files"]:
        raise FileNotFoundError(
            f"{directory} holds partitions {meta.get('built_parts')} of this machine, not partition "
            f"{part_id}: "
            "each machine prepares the partitions of its own graph servers (prepare_data on every node)"
        )
    check_file(path, meta["files"][path.name], rebuild_hint(directory))
    fields, metadata = _read_safetensors(path)
    send_index, send_ptr = fields.pop("send_index"), fields.pop("send_ptr")
    fields["send_index"] = [send_index[send_ptr[q] : send_ptr[q + 1]] for q in range(send_ptr.numel() - 1)]
    fields.update({name: int(metadata[name]) for name in _PART_INTS})
    return GraphPartition(**fields)


def save_graph(data: Data, path: str | Path) -> None:
    """Writes a graph's ``edge_index``/``x``/``y``/masks to one safetensors file (atomic replace)."""
    path = Path(path)
    present = [name for name in GRAPH_FIELDS if getattr(data, name, None) is not None]
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
    tensors, metadata = _read_safetensors(path)
    if "num_nodes" not in metadata:
        raise ValueError(f"{path} is not a lightning_dorylus graph file (no num_nodes in its metadata)")
    return Data(num_nodes=int(metadata["num_nodes"]), **tensors)


def _read_safetensors(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Tensors and metadata of a safetensors file; one that cannot be parsed raises naming it."""
    try:
        with safe_open(str(path), "pt") as handle:
            metadata = handle.metadata() or {}
        return load_file(str(path)), metadata
    except (SafetensorError, OSError) as err:
        raise CorruptCacheError(
            path, f"{path} cannot be read as safetensors ({type(err).__name__}: {err}): the file is damaged"
        ) from err
