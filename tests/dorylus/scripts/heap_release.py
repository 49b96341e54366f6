"""Worker script: how much memory freeing 39 of 40 live 4 MiB buffers gives back to the OS (MiB).

``heap_release.py set`` fixes glibc's mmap threshold at 1 MiB first (what ``DorylusStrategy`` does in each
graph server); ``heap_release.py unset`` leaves glibc's dynamic threshold, which a freed 16 MiB block
raises, after which 4 MiB buffers come from the heap and stay resident below the last live one.
``heap_release.py both`` pays the import once and measures each mode in a forked child (a fresh glibc
threshold state per mode, the imported modules shared): prints ``set=<MiB> unset=<MiB>``.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from lightning_dorylus.memory import set_mmap_threshold


def rss_mib() -> float:
    """This process's resident memory."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def measure(mode: str) -> int:
    """MiB given back to the OS by freeing 39 of 40 4-MiB buffers, in ``mode`` ("set" or "unset")."""
    if mode == "set":
        assert set_mmap_threshold(1 << 20)
    big = np.ones(16 << 20, dtype=np.uint8)
    del big  # glibc raises its mmap threshold after freeing an mmapped block (unless it was fixed)
    chunks = [np.ones(4 << 20, dtype=np.uint8) for _ in range(40)]
    before = rss_mib()
    del chunks[:-1]  # the last chunk stays: heap memory below it cannot be trimmed
    return round(before - rss_mib())


def in_child(mode: str) -> int:
    """:func:`measure` in a forked child, so the parent's malloc state stays untouched for the next mode."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read)
        os.write(write, str(measure(mode)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        value = int(pipe.read())
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return value


def main() -> None:
    if sys.argv[1] == "both":
        print(f"set={in_child('set')} unset={in_child('unset')}")
    else:
        print(measure(sys.argv[1]))


if __name__ == "__main__":
    main()
