"""BLAS/OpenMP thread counts of a graph server: the machine's cores shared among the servers on it.

Every graph server multiplies dense matrices (its own ApplyVertex with the inline executor, backward
products, the loss) through torch and numpy. Left alone, numpy's OpenBLAS and torch's OpenMP pool each start
one thread per core in every server, and N servers on one machine oversubscribe it N-fold (matrix products
20x slower were seen with 2 servers on 2 cores). Rank 0 is the process that imported numpy before
Lightning's launcher ran, so environment variables set at launch come too late for it: the limits are set at
run time, through ``threadpoolctl`` (every BLAS/OpenMP library loaded in the process) and
``torch.set_num_threads``.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch
from threadpoolctl import ThreadpoolController, threadpool_limits

# Per-library variables: a user who sets one has chosen that library's threads; it is then left alone.
BLAS_ENV_VARS = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS")


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS tells it, else all cores)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def server_threads(num_threads: int | None, local_servers: int) -> int:
    """The thread count of one graph server.

    Precedence: ``num_threads`` (the strategy argument) > ``OMP_NUM_THREADS`` in the environment (the user's,
    or the one Lightning's launcher sets to the same cores / processes) > available cores / ``local_servers``
    (at least 1).
    """
    if num_threads is not None:
        return num_threads
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"OMP_NUM_THREADS={env!r} in the environment: expected an integer >= 1")
        return int(env)
    return max(1, available_cores() // max(1, local_servers))


def colocated_worker_threads(executor: Any, cores: set[int] | None = None) -> int:
    """BLAS/OpenMP threads of ``executor``'s local worker processes that may run on ``cores`` (default: the
    cores this process may run on); 0 for executors with no local workers (inline, Lambda).

    ``executor`` or the executor it wraps (``inner``, e.g. a ``TimedExecutor``) names its workers through
    ``worker_pids`` and their threads through ``threads_per_worker`` (the ``local`` pool). Workers pinned to
    other cores do not count.
    """
    pool = executor
    for _ in range(8):  # wrappers of wrappers, never a cycle
        if pool is None or hasattr(pool, "worker_pids"):
            break
        pool = getattr(pool, "inner", None)
    if pool is None or not hasattr(pool, "worker_pids"):
        return 0
    own = cores if cores is not None else set(os.sched_getaffinity(0))
    shared = 0
    for pid in pool.worker_pids:
        try:
            if set(os.sched_getaffinity(pid)) & own:
                shared += int(getattr(pool, "threads_per_worker", 1))
        except (ProcessLookupError, PermissionError):  # a worker that just died is respawned elsewhere
            continue
    return shared


def pipelined_server_threads(threads: int, colocated: int) -> int:
    """A pipelined graph server's thread count: ``threads`` less the ``colocated`` worker threads that share
    its cores (at least 1).

    Why: with GA per interval (``staleness`` set) the executor workers compute while the server computes, on
    the same cores when they share them. An OpenMP pool as large as the server's share of the cores then has
    more threads than free cores, and its threads wait at every parallel region's barrier for a thread the
    workers have descheduled, spinning meanwhile: one graph server with 2 threads next to its worker on 2
    cores spent 2.8x the CPU seconds of its 1-thread twin on the same work (issue 31). The synchronous mode
    keeps the full count: its GA is one whole-partition product before the requests go out (and ∇GA one
    after their results), so its workers are idle while the server's GCN/GraphSAGE work runs.
    """
    return max(1, threads - colocated)


def limit_server_threads(num_threads: int | None, local_servers: int) -> int:
    """Applies :func:`server_threads` to torch's intra-op pool and to every loaded BLAS/OpenMP library.

    BLAS libraries whose own variable (:data:`BLAS_ENV_VARS`) the user set keep the user's count. Returns the
    count applied.
    """
    threads = server_threads(num_threads, local_servers)
    torch.set_num_threads(threads)
    threadpool_limits(limits=threads, user_api="openmp")
    if not user_set_blas():
        threadpool_limits(limits=threads, user_api="blas")
    return threads


def user_set_blas() -> bool:
    """Whether the user chose the BLAS threads (one of :data:`BLAS_ENV_VARS` is set): then left alone."""
    return any(os.environ.get(var, "").strip() for var in BLAS_ENV_VARS)


class OneBlasThread:
    """A context in which numpy's BLAS runs one thread: around the numpy handlers that run in this process
    (the ``inline`` executor; the package's layers under ``strategy="auto"``).

    Why: those handlers run between this process's own torch work. numpy's OpenBLAS and torch's OpenMP pool
    then both keep threads spinning on the same cores after their calls, and each takes the cores the other
    needs. Quiet 2-core machine: Cora, GCN, one graph server, 100 epochs: 14.6-15.0 s before, 4.8-6.5 s
    with this; under ``strategy="auto"`` 0.112-0.147 s/epoch before, 0.028 with this, as with every pool at
    one thread (``benchmarks/dorylus_auto_threads.py``); the price, on a 200k-vertex, 128-feature graph on one
    server: 14.1 s against 12.3 (medians of 4 noisy runs). Scoped, not process-wide: the
    user's own numpy keeps its threads. Contexts may nest and overlap across threads (an inline pool): the
    first one in sets 1, the last one out restores the count. A user who set a BLAS variable
    (:data:`BLAS_ENV_VARS`) chose the count: nothing is changed then. Local-pool and Lambda workers run their
    handlers in processes of their own and are not concerned.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._restore: Any = None
        self._controller: Any = None

    def __enter__(self) -> None:
        with self._lock:
            self._depth += 1
            if self._depth == 1 and not user_set_blas():
                if self._controller is None:  # inspecting the loaded libraries is slow: once per process
                    self._controller = ThreadpoolController()
                self._restore = self._controller.limit(limits=1, user_api="blas")

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0 and self._restore is not None:
                self._restore.restore_original_limits()
                self._restore = None


one_blas_thread = OneBlasThread()
"""The process's :class:`OneBlasThread` (one per process: its counter spans every inline executor)."""
