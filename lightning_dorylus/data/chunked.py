"""``ChunkedGraph``: a graph on disk as ``.npy`` files, for graphs that do not fit in one machine's memory.

``DorylusDataModule(Data)`` holds the whole graph in every process and partitions it in one; that stops
somewhere below 100M edges on a 24 GiB machine. A :class:`ChunkedGraph` instead names files that are read
memory-mapped (``np.load(mmap_mode="r")``) one chunk at a time by the streaming preparation
(:mod:`.streaming`), so no process holds more than a few bytes per vertex plus one chunk of edges.

Layout (every path absolute or relative to ``root``)::

    edges:       one or more [2, E_i] int32/int64 .npy files (row 0: source, row 1: destination)
    edge_weight: optional, one [E_i] float .npy file per edge chunk (carried to the partitions per edge)
    x:           [N, F] float32/float16 (or float64) .npy
    y:           [N] integer .npy (-1: unlabeled), optional
    train/val/test: optional; each either an [N] bool mask .npy or an [k] integer index .npy

From an OGB-style ``edge_index`` + ``node_feat`` pair (e.g. ``ogbn-papers100M``'s ``data.npz``)::

    import numpy as np
    raw = np.load("raw/data.npz", mmap_mode="r")          # or the arrays your loader gives you
    np.save("g/x.npy", raw["node_feat"])                     # [N, F] float
    edge_index = raw["edge_index"]                           # [2, E] int64
    step = 50_000_000                                         # ~800 MB of int64 edges per chunk
    for i, a in enumerate(range(0, edge_index.shape[1], step)):
        np.save(f"g/edges_{i:03d}.npy", np.ascontiguousarray(edge_index[:, a:a + step]))
    graph = ChunkedGraph(root="g", edges=sorted(Path("g").glob("edges_*.npy")), x="x.npy",
                         y="y.npy", train="train_idx.npy", val="valid_idx.npy", test="test_idx.npy")
    datamodule = DorylusDataModule(graph, partitioner="fennel")

OGB's undirected graphs list each edge once: save both directions (a chunk and its ``[::-1]``) if the
model should aggregate both ways, as PyG's ``to_undirected`` would.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SPLITS = ("train", "val", "test")
_HEAD_BYTES = 1 << 20  # bytes of each file's start and end that enter the fingerprint (with size + mtime)


class ChunkedGraphError(ValueError):
    """A chunked graph's files do not match its description (the message names the file and the fix)."""


@dataclass(frozen=True)
class ChunkedGraph:
    """A graph stored as ``.npy`` files (see the module docstring for the layout and an OGB example).

    Attributes:
        edges: The edge chunk files, each ``[2, E_i]`` int32/int64 ``[src, dst]``.
        x: The ``[N, F]`` float features file (float16/float32/float64).
        y: The ``[N]`` integer labels file (``-1``: unlabeled), or ``None``.
        train: The training split: an ``[N]`` bool mask file or an integer index file, or ``None``.
        val: The validation split, as ``train``.
        test: The test split, as ``train``.
        edge_weight: ``None``, or one ``[E_i]`` float file per edge chunk (same order as ``edges``).
        root: Directory that relative paths are resolved against (default: the working directory).
    """

    edges: Sequence[str | Path]
    x: str | Path
    y: str | Path | None = None
    train: str | Path | None = None
    val: str | Path | None = None
    test: str | Path | None = None
    edge_weight: Sequence[str | Path] | None = None
    root: str | Path = "."

    def __post_init__(self) -> None:
        if isinstance(self.edges, (str, Path)):
            raise ChunkedGraphError(
                f"edges={str(self.edges)!r} is one path; expected a list of [2, E_i] .npy chunk files, "
                f"e.g. edges=[{str(self.edges)!r}]"
            )
        if not self.edges:
            raise ChunkedGraphError("edges is empty: expected at least one [2, E_i] .npy chunk file")
        if self.edge_weight is not None and len(self.edge_weight) != len(self.edges):
            raise ChunkedGraphError(
                f"edge_weight lists {len(self.edge_weight)} files but edges lists {len(self.edges)}: give "
                "one [E_i] weight file per edge chunk, in the same order (or edge_weight=None)"
            )

    # --- paths -----------------------------------------------------------------------------------------
    def path(self, value: str | Path) -> Path:
        """``value`` resolved against ``root``."""
        path = Path(value)
        return path if path.is_absolute() else Path(self.root) / path

    def edge_files(self) -> list[Path]:
        return [self.path(p) for p in self.edges]

    def weight_files(self) -> list[Path] | None:
        return None if self.edge_weight is None else [self.path(p) for p in self.edge_weight]

    def all_files(self) -> list[tuple[str, Path]]:
        """``(argument, path)`` of every file the description names, in a fixed order."""
        files = [(f"edges[{i}]", p) for i, p in enumerate(self.edge_files())]
        files += [(f"edge_weight[{i}]", p) for i, p in enumerate(self.weight_files() or [])]
        for name in ("x", "y", *SPLITS):
            value = getattr(self, name)
            if value is not None:
                files.append((name, self.path(value)))
        return files

    # --- reading (memory-mapped) -----------------------------------------------------------------------
    def load(self, name: str, value: str | Path) -> np.ndarray:
        """``np.load(path, mmap_mode="r")`` with an error naming the argument when it cannot be read."""
        path = self.path(value)
        if not path.is_file():
            raise ChunkedGraphError(f"{name}={str(value)!r}: {path} does not exist (expected a .npy file)")
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as err:
            raise ChunkedGraphError(
                f"{name}={str(value)!r}: {path} is not a readable .npy array ({err}); write it with np.save"
            ) from err
        return array

    def features(self) -> np.ndarray:
        return self.load("x", self.x)

    @property
    def num_nodes(self) -> int:
        return int(self.features().shape[0])

    @property
    def num_features(self) -> int:
        return int(self.features().shape[1])

    def chunks(self) -> Iterator[tuple[int, np.ndarray, np.ndarray | None]]:
        """``(chunk index, [2, E_i] edges, [E_i] weights or None)``, each memory-mapped."""
        for i, path in enumerate(self.edges):
            edges = self.load(f"edges[{i}]", path)
            weight = None if self.edge_weight is None else self.load(f"edge_weight[{i}]", self.edge_weight[i])
            yield i, edges, weight

    def labels(self) -> np.ndarray:
        """``[N]`` int64 labels, ``-1`` where there are none (a copy: 8 bytes per vertex)."""
        if self.y is None:
            return np.full(self.num_nodes, -1, dtype=np.int64)
        return np.asarray(self.load("y", self.y)).reshape(-1).astype(np.int64)

    def mask(self, split: str) -> np.ndarray:
        """``[N]`` bool mask of ``split`` (from a mask or an index file)."""
        n = self.num_nodes
        value = getattr(self, split)
        mask = np.zeros(n, dtype=bool)
        if value is None:
            return mask
        array = self.load(split, value)
        if array.dtype == np.bool_:
            return np.asarray(array).copy()
        mask[np.asarray(array).reshape(-1)] = True
        return mask

    # --- checks ----------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Checks every file's shape, dtype and value range (chunk by chunk: bounded memory).

        Raises:
            ChunkedGraphError: naming the argument, the file, what was expected and the fix.
        """
        x = self.features()
        if x.ndim != 2 or x.shape[0] < 1:
            raise ChunkedGraphError(
                f"x: {self.path(self.x)} has shape {x.shape}; expected [N, F] with N >= 1"
            )
        if x.dtype not in (np.float16, np.float32, np.float64):
            raise ChunkedGraphError(
                f"x: {self.path(self.x)} has dtype {x.dtype}; expected float16, float32 or float64 "
                "(convert with x.astype(np.float32))"
            )
        n = int(x.shape[0])
        for i, edges, weight in self.chunks():
            where = f"edges[{i}]: {self.edge_files()[i]}"
            if edges.ndim != 2 or edges.shape[0] != 2:
                raise ChunkedGraphError(
                    f"{where} has shape {edges.shape}; expected [2, E_i] (row 0 sources, row 1 "
                    "destinations); "
                    "an [E_i, 2] array needs np.ascontiguousarray(a.T)"
                )
            if edges.dtype not in (np.int32, np.int64):
                raise ChunkedGraphError(f"{where} has dtype {edges.dtype}; expected int32 or int64")
            if edges.shape[1]:
                lo, hi = int(edges.min()), int(edges.max())
                if lo < 0 or hi >= n:
                    raise ChunkedGraphError(
                        f"{where} holds vertex ids in [{lo}, {hi}] but x has {n} rows: ids must lie in "
                        f"[0, {n}) (one feature row per vertex)"
                    )
            if weight is not None:
                wpath = self.weight_files()[i]  # type: ignore[index]
                if weight.shape != (edges.shape[1],) or weight.dtype.kind != "f":
                    raise ChunkedGraphError(
                        f"edge_weight[{i}]: {wpath} has shape {weight.shape} and dtype {weight.dtype}; "
                        f"expected [{edges.shape[1]}] float, one weight per edge of edges[{i}]"
                    )
                if not bool(np.isfinite(weight).all()):
                    raise ChunkedGraphError(f"edge_weight[{i}]: {wpath} holds NaN or inf weights")
        if self.y is not None:
            y = self.load("y", self.y)
            if y.reshape(-1).shape != (n,) or y.dtype.kind not in "iu":
                raise ChunkedGraphError(
                    f"y: {self.path(self.y)} has shape {y.shape} and dtype {y.dtype}; expected [{n}] integer "
                    "class labels (-1: unlabeled)"
                )
            if y.size and int(y.min()) < -1:
                raise ChunkedGraphError(f"y: {self.path(self.y)} holds {int(y.min())}; labels are >= -1")
        labels = self.labels() if any(getattr(self, s) is not None for s in SPLITS) else None
        for split in SPLITS:
            value = getattr(self, split)
            if value is None:
                continue
            array = self.load(split, value)
            if array.dtype == np.bool_:
                if array.shape != (n,):
                    raise ChunkedGraphError(
                        f"{split}: {self.path(value)} is a bool mask of shape {array.shape}; expected ({n},)"
                    )
            elif array.dtype.kind in "iu":
                if array.size and (int(array.min()) < 0 or int(array.max()) >= n):
                    raise ChunkedGraphError(
                        f"{split}: {self.path(value)} holds indices outside [0, {n}): expected vertex ids"
                    )
            else:
                raise ChunkedGraphError(
                    f"{split}: {self.path(value)} has dtype {array.dtype}; expected an [N] bool mask or an "
                    "integer index array"
                )
            assert labels is not None
            unlabeled = self.mask(split) & (labels < 0)
            if unlabeled.any():
                raise ChunkedGraphError(
                    f"{split} selects {int(unlabeled.sum())} vertices without a label (y = -1 or no y), the "
                    f"first at node {int(unlabeled.nonzero()[0][0])}: label them or leave them out of {split}"
                )

    def digest(self) -> str:
        """Hex sha256 of the description and every file's size, mtime and first and last MiB (not the whole
        content: a rewrite that keeps a file's size, mtime and both ends is not noticed; ``touch`` it)."""
        digest = hashlib.sha256(b"dorylus-chunked-v1;")
        for name, path in self.all_files():
            stat = path.stat()
            digest.update(f"{name}={path.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
            with path.open("rb") as handle:
                digest.update(handle.read(_HEAD_BYTES))
                if stat.st_size > _HEAD_BYTES:
                    handle.seek(max(_HEAD_BYTES, stat.st_size - _HEAD_BYTES))
                    digest.update(handle.read(_HEAD_BYTES))
        return digest.hexdigest()

    def num_edges(self) -> int:
        """Edge entries over all chunks (from the headers; nothing is read)."""
        return sum(int(edges.shape[1]) for _, edges, _ in self.chunks())
