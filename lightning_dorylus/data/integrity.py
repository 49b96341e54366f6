"""Checksums of cache files: the manifest entry written with a file, and the check when it is read.

A partition file that was truncated, edited (scaled features, a swapped edge) or hit by a flipped bit
still parses as safetensors and would train on another graph, or on NaNs. Every partition file's size and
sha256 are recorded in the partition directory's ``meta.json`` (``"files"``) when it is written, and checked
when it is read (:func:`check_file`; sha256 hashes about 0.85 GB/s on one core with SHA-NI, see
``docs/dorylus-data.md`` for load times).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

CHECKSUM = "sha256"


class CorruptCacheError(ValueError):
    """A cache file does not match its manifest entry (or cannot be parsed); ``path`` names it."""

    def __init__(self, path: Path, message: str) -> None:
        super().__init__(message)
        self.path = path


def manifest_entry(path: Path) -> dict[str, Any]:
    """``{"bytes": size, "sha256": hex}`` of a file just written."""
    with path.open("rb") as handle:
        digest = hashlib.file_digest(handle, CHECKSUM).hexdigest()
    return {"bytes": path.stat().st_size, CHECKSUM: digest}


def check_size(path: Path, entry: dict[str, Any]) -> str | None:
    """What is wrong with ``path``'s size (a ``stat``, no read), or ``None``."""
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != entry["bytes"]:
        what = "truncated" if size < entry["bytes"] else "longer than written"
        return f"{path} is {what}: {size} bytes, the manifest says {entry['bytes']}"
    return None


def check_file(path: Path, entry: dict[str, Any], fix: str) -> None:
    """Checks ``path`` against its manifest ``entry`` (size, then sha256).

    Raises:
        CorruptCacheError: naming the file, what differs, and ``fix`` (how to get an intact one back).
    """
    problem = verify_file(path, entry)
    if problem is not None:
        raise CorruptCacheError(path, f"{problem}. {fix}")


def verify_file(path: Path, entry: dict[str, Any]) -> str | None:
    """What is wrong with ``path`` against ``entry`` (size, then checksum), or ``None`` if it matches."""
    problem = check_size(path, entry)
    if problem is not None:
        return problem
    with path.open("rb") as handle:
        actual = hashlib.file_digest(handle, CHECKSUM).hexdigest()
    if actual != entry[CHECKSUM]:
        return (
            f"{path} has changed since it was written: {CHECKSUM} {actual[:16]}... but the manifest says "
            f"{entry[CHECKSUM][:16]}... (edited tensors, or a damaged disk)"
        )
    return None
