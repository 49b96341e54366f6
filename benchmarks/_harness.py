"""What the benchmarks (and the tests' launcher) share: a free port, ranks started the way torchrun starts
them, watched until they end, and Linux ``/proc`` probes (peak resident memory, CPU seconds).

Only the standard library: a benchmark's parent process imports this and nothing heavy. Benchmark scripts
import it as ``_harness`` (``python benchmarks/x.py`` puts ``benchmarks/`` first on ``sys.path``) or as
``benchmarks._harness`` (the checkout on ``sys.path``: tests, ``tests/process.py``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol


class Process(Protocol):
    """What the watcher needs of a started process (``subprocess.Popen`` or the tests' forked process)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


# --------------------------------------------------------------------------- launching
def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now (for ``MASTER_PORT``)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(base: Mapping[str, str], rank: int, world_size: int, master_port: int | str | None = None,
             master_addr: str = "127.0.0.1") -> dict[str, str]:
    """``base`` plus what torchrun sets for rank ``rank`` of ``world_size`` on one node (Lightning then
    launches nothing itself); ``master_port=None`` keeps ``base``'s ``MASTER_ADDR``/``MASTER_PORT``."""
    env = {**base, "WORLD_SIZE": str(world_size), "NODE_RANK": "0", "LOCAL_RANK": str(rank)}
    if master_port is not None:
        env.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    return env


def watch(procs: Sequence[Process], timeout: float, failure_grace: float = 0.0,
          tick: Callable[[], float] | None = None) -> str:
    """Wait until every process has ended; returns ``""`` or why it stopped waiting.

    Stops ``failure_grace`` seconds after a process fails (its peers would wait for it in a collective:
    the grace lets them print their side of it) or when ``timeout`` seconds have passed. ``tick`` runs
    every poll (e.g. granting turns) and returns how long to sleep before the next one (default 0.05 s).
    Whatever still runs afterwards is killed by :func:`kill_groups` (the caller's ``finally``).
    """
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    while None in (codes := [p.poll() for p in procs]):  # every one polled (any() would stop at the first)
        now = time.monotonic()
        if failed_at is None and any(code not in (None, 0) for code in codes):
            failed_at = now
        if failed_at is not None and now - failed_at >= failure_grace:
            break
        if now > deadline:
            return f"timed out after {timeout}s"
        time.sleep(tick() if tick is not None else 0.05)
    codes = [p.poll() for p in procs]
    return f"exited with {codes} (in launch order)" if any(codes) else ""


def kill_groups(procs: Sequence[Process]) -> None:
    """SIGKILL the process group of every process still running, then reap all.

    Each was started in a group of its own or in its first peer's (never this process's group, which is
    left alone), so whatever they started themselves goes with them.
    """
    for p in procs:
        if p.poll() is None:
            try:
                group = os.getpgid(p.pid)
                if group != os.getpgrp():
                    os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


# --------------------------------------------------------------------------- /proc probes (Linux)
def status_kib(pid: int | str, field: str) -> int:
    """One ``kB`` field (``VmHWM``, ``VmRSS``) of ``/proc/<pid>/status``; 0 if the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children, grandchildren, ...), found through ``/proc/*/stat``."""
    parent_of: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        # The command name (field 2) may hold spaces and parentheses: fields resume after the last ')'.
        parent_of[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        children = [child for child, parent in parent_of.items() if parent == current]
        found.extend(children)
        frontier.extend(children)
    return found


def peak_memory_mib(pid: int | None = None) -> dict[str, Any]:
    """The high-water RSS of ``pid`` (default: this process) and of its live descendants, in MiB.

    Call it while the descendants (executor workers) are still alive.
    """
    pid = os.getpid() if pid is None else pid
    workers = descendants(pid)
    worker_kib = [status_kib(child, "VmHWM") for child in workers]
    own = status_kib(pid, "VmHWM")
    return {
        "peak_self_mib": own / 1024,
        "peak_workers_mib": sum(worker_kib) / 1024,
        "num_workers": len(workers),
        "peak_total_mib": (own + sum(worker_kib)) / 1024,
    }


def stat_cpu_seconds(stat: str) -> float:
    """User + system CPU seconds from the text of a ``/proc/<pid>[/task/<tid>]/stat`` file."""
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | str) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return stat_cpu_seconds(f.read())
    except (FileNotFoundError, ProcessLookupError):
        return 0.0


def pin(pid: int, cores: set[int] | list[int]) -> None:
    """Run every thread of process ``pid`` on ``cores`` only (threads it starts later inherit the mask of
    the thread that starts them)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            os.sched_setaffinity(int(tid), set(cores))


def provenance() -> dict[str, Any]:
    """Where a result came from, for its JSON: the command, the date, this checkout's commit (``+dirty``
    with uncommitted changes) and the machine (cores, memory, load): a committed result that a tool reads
    by default must say what it measured, so a reader can tell when it is stale."""
    import datetime
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    with open("/proc/meminfo") as meminfo:
        total_kib = int(meminfo.readline().split()[1])
    return {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "machine": {"cores": os.cpu_count(), "memory_gib": round(total_kib / 2**20, 1),
                    "load_average": os.getloadavg()},
    }
