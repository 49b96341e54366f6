"""Bounds on the partition cache, so old partitionings do not pile up (issue 32).

Every other graph, partitioner, server count, interval size or seed gets a directory of its own in
``cache_dir``, and nothing deleted them. :func:`prune_cache` runs after :func:`~.cache.partition_to_cache`
has made or found the partitioning in use and deletes other partitioning directories of the same
``cache_dir``:

* unused for longer than ``max_age_s`` (last use = ``meta.json``'s modification time, which every cache hit
  refreshes);
* then, least recently used first, until the remaining ones hold at most ``max_bytes``.

A partitioning used within the last :data:`GRACE_S` seconds is never deleted (another job on a shared cache
may be loading it), nor is the one in use, nor anything whose name is not a partitioning's. A directory is
first renamed away (atomic: a reader sees it whole or not at all), then removed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

GRACE_S = 3600.0
_PARTITIONING = re.compile(r"^[0-9a-f]{16}-[a-z]+-p\d+-i\d+-s\d+$")  # cache.cache_name's shape


def mark_used(directory: Path) -> None:
    """Records a use of the partitioning ``directory`` (its ``meta.json``'s mtime), for the age bound; a
    read-only cache is left alone."""
    with contextlib.suppress(OSError):
        os.utime(directory / "meta.json")


def prune_cache(root: Path, keep: Path, max_age_s: float | None, max_bytes: int | None,
                now: float | None = None) -> list[Path]:
    """Deletes partitionings of ``root`` other than ``keep`` past the bounds (see the module docstring);
    returns the deleted directories."""
    if max_age_s is None and max_bytes is None:
        return []
    now = time.time() if now is None else now
    entries = []  # (last use, bytes, directory), most recently used first
    for directory in root.iterdir():
        meta = directory / "meta.json"
        if not _PARTITIONING.match(directory.name) or not meta.is_file() or directory.samefile(keep):
            continue
        size = sum(f.stat().st_size for f in directory.iterdir() if f.is_file())
        entries.append((meta.stat().st_mtime, size, directory))
    entries.sort(reverse=True)
    total = sum(f.stat().st_size for f in keep.iterdir() if f.is_file()) if keep.is_dir() else 0
    deleted = []
    for used, size, directory in entries:
        old = max_age_s is not None and now - used > max_age_s
        over = max_bytes is not None and total + size > max_bytes
        if (old or over) and now - used > GRACE_S:
            delete_directory(directory, "pruned")
            deleted.append(directory)
            log.info("partition cache: deleted %s (%d bytes, unused for %.1f days)", directory, size,
                     (now - used) / 86400)
        else:
            total += size
    return deleted


def delete_directory(directory: Path, why: str) -> None:
    """Renames ``directory`` to ``.<name>.<why>.*`` beside it (atomic for readers), then removes it; one
    that another process removed first is fine."""
    trash = Path(tempfile.mkdtemp(prefix=f".{directory.name}.{why}.", dir=directory.parent))
    with contextlib.suppress(FileNotFoundError):
        os.rename(directory, trash / directory.name)
    shutil.rmtree(trash, ignore_errors=True)
