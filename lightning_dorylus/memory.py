"""Host memory of a graph server: glibc's mmap threshold, fixed so large freed buffers go back to the OS.

glibc's default threshold grows after the first large free, after which an epoch's many 1-32 MiB buffers
(per-interval pieces, 16-wide layer outputs) come from the heap, fragment it, and a server's peak creeps up
epoch after epoch (+500 MiB over 4 epochs on the 1M-vertex benchmark). ``DorylusStrategy(mmap_threshold=...)``
fixes it in every graph server (:func:`apply_mmap_threshold`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

MMAP_THRESHOLD_MAX = 32 * 1024 * 1024
"""glibc's largest ``M_MMAP_THRESHOLD`` on 64-bit (``HEAP_MAX_SIZE / 2``)."""
_M_MMAP_THRESHOLD = -3  # glibc <malloc.h>


def set_mmap_threshold(threshold: int) -> bool:
    """Calls glibc's ``mallopt(M_MMAP_THRESHOLD, threshold)`` for this process (fixes the threshold, which
    also turns off glibc's dynamic raising of it). Returns ``False`` where there is no glibc ``mallopt``.
    """
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))


def apply_mmap_threshold(threshold: int | None) -> None:
    """:func:`set_mmap_threshold` unless ``threshold`` is ``None`` (the allocator left alone); a C library
    without ``mallopt`` logs a warning instead of failing the run (only memory is at stake)."""
    if threshold is not None and not set_mmap_threshold(threshold):
        log.warning("mmap_threshold=%d not applied: this C library has no glibc mallopt", threshold)
