"""cgroup v1 memory cgroups: a "machine" of M GiB on this host, and whether a process in it was OOM-killed.

A :class:`MemoryCgroup` is ``/sys/fs/cgroup/memory/<prefix>-<pid>-<name>`` with ``memory.limit_in_bytes``
set (swap is off on the test machine, so the limit is the memory the processes may hold, page cache
included: the kernel reclaims clean cache before it kills). :meth:`wrap` prefixes a command so that it enters
the cgroup before it ``exec``s; :meth:`oom_kills` reads ``memory.oom_control``. :meth:`close` kills every
process left inside (by PID) and removes the directory; :func:`sweep` removes this prefix's leftovers whose
creating PID is dead. Needs root and the v1 memory controller.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/memory")
PREFIX = "h48"
_NAME = re.compile(rf"^{PREFIX}-(\d+)-[A-Za-z0-9_.-]+$")


class CgroupUnavailable(RuntimeError):
    """No writable cgroup v1 memory controller here (not root, or a cgroup v2-only host)."""


def available() -> str | None:
    """Why memory cgroups cannot be made here, or ``None``."""
    if os.geteuid() != 0:
        return "memory cgroups need root (run with sudo)"
    if not (ROOT / "memory.limit_in_bytes").is_file():
        return f"{ROOT} is not a cgroup v1 memory controller"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _empty_and_remove(path: Path) -> None:
    for _ in range(100):
        pids = [int(p) for p in (path / "cgroup.procs").read_text().split()] if path.exists() else []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"cannot remove the cgroup {path}: processes are still inside")


def sweep() -> list[str]:
    """Removes this prefix's cgroups whose creating process is dead (left by a killed benchmark or test)."""
    removed = []
    if not ROOT.is_dir():
        return removed
    for path in ROOT.iterdir():
        match = _NAME.match(path.name)
        if match and path.is_dir() and not _alive(int(match.group(1))):
            _empty_and_remove(path)
            removed.append(path.name)
    return removed


class MemoryCgroup:
    """One memory cgroup of ``limit_bytes`` (see the module docstring)."""

    def __init__(self, name: str, limit_bytes: int) -> None:
        problem = available()
        if problem is not None:
            raise CgroupUnavailable(problem)
        self.path = ROOT / f"{PREFIX}-{os.getpid()}-{name}"
        self.path.mkdir()
        try:
            (self.path / "memory.limit_in_bytes").write_text(str(int(limit_bytes)))
        except OSError:
            self.path.rmdir()
            raise
        self.limit_bytes = int(limit_bytes)

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` run inside this cgroup (a shell puts itself in, then ``exec``s the command)."""
        return ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "sh", *cmd]

    def oom_kills(self) -> int:
        """Processes the kernel's OOM killer has killed in this cgroup (``memory.oom_control``'s
        ``oom_kill``; 0 on kernels without that line)."""
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def peak_bytes(self) -> int:
        """``memory.max_usage_in_bytes``: the cgroup's peak, page cache included."""
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    def close(self) -> None:
        """Kills what is left inside and removes the cgroup."""
        if self.path.exists():
            _empty_and_remove(self.path)

    def __enter__(self) -> MemoryCgroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
