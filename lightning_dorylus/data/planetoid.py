"""Planetoid citation graphs (Cora, CiteSeer, PubMed) from local raw files only; never downloads.

PyG's ``Planetoid`` keeps raw and processed files under one root. Here the raw files may sit in a read-only
folder (e.g. a shared data directory): they are read from ``<root>/<name>/raw/`` and PyG's processed file
goes to ``<processed_root>/<name>/processed/``.

Every graph server of a job loads the graph, and an external launcher (torchrun, SLURM) starts them at the
same moment: PyG would then process into the same file from several processes, and one reads the other's
half-written file. A file lock beside the processed folder lets the first process write it and the others
load what it wrote.
"""

from __future__ import annotations

import os.path as osp
from pathlib import Path

from filelock import FileLock
from torch_geometric.datasets import Planetoid
from typing_extensions import override

from lightning_dorylus.data.cache import default_cache_dir

PLANETOID_NAMES = ("Cora", "CiteSeer", "PubMed")
_RAW_SUFFIXES = ("x", "tx", "allx", "y", "ty", "ally", "graph", "test.index")


class LocalPlanetoid(Planetoid):
    """``Planetoid`` (public split) that reads raw files from ``root`` and writes processed files elsewhere.

    Args:
        root: Folder holding ``<name>/raw/ind.<name>.*`` (may be read-only).
        name: ``"Cora"``, ``"CiteSeer"`` or ``"PubMed"``.
        processed_root: Writable folder for PyG's processed file (``<processed_root>/<name>/processed``).
    """

    def __init__(self, root: str | Path, name: str, processed_root: str | Path) -> None:
        self.processed_root = str(processed_root)
        lock = processing_lock(processed_root, name)
        lock.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(lock):  # one process writes the processed file; the others wait, then load it
            super().__init__(str(root), name, split="public")

    @property
    @override
    def processed_dir(self) -> str:
        return osp.join(self.processed_root, self.name, "processed")

    @override
    def download(self) -> None:
        raise FileNotFoundError(
            f"Planetoid {self.name!r} raw files are missing from {self.raw_dir}; lightning_dorylus never "
            "downloads: copy PyG's raw Planetoid files (ind.<name>.*) there"
        )


def processing_lock(processed_root: str | Path, name: str) -> Path:
    """The lock file that processes loading ``name`` under ``processed_root`` take in turn."""
    return Path(processed_root) / name / "processing.lock"


def load_planetoid(
    root: str | Path, name: str = "Cora", processed_root: str | Path | None = None
) -> Planetoid:
    """Loads a Planetoid graph with the standard public split (Cora: 140 train / 500 val / 1000 test).

    Args:
        root: Folder holding ``<name>/raw/`` with PyG's raw Planetoid files (``ind.cora.x`` ...).
        name: ``"Cora"``, ``"CiteSeer"`` or ``"PubMed"``.
        processed_root: Writable folder for PyG's processed file; default
            ``$XDG_CACHE_HOME/lightning_dorylus/planetoid``.

    Returns:
        The one-graph dataset; ``dataset[0]`` is the ``Data``.
    """
    if name not in PLANETOID_NAMES:
        raise ValueError(f"name={name!r} is not a Planetoid graph; expected one of {list(PLANETOID_NAMES)}")
    raw_dir = Path(root) / name / "raw"
    expected = [f"ind.{name.lower()}.{suffix}" for suffix in _RAW_SUFFIXES]
    missing = [file for file in expected if not (raw_dir / file).is_file()]
    if missing:
        raise FileNotFoundError(
            f"Planetoid {name!r} raw files {missing} are missing from {raw_dir}; lightning_dorylus never "
            "downloads: copy PyG's raw Planetoid files there"
        )
    if processed_root is None:
        processed_root = default_cache_dir().parent / "planetoid"
    return LocalPlanetoid(root, name, processed_root)
