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

import torch
from threadpoolctl import threadpool_limits

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


def limit_server_threads(num_threads: int | None, local_servers: int) -> int:
    """Applies :func:`server_threads` to torch's intra-op pool and to every loaded BLAS/OpenMP library.

    BLAS libraries whose own variable (:data:`BLAS_ENV_VARS`) the user set keep the user's count. Returns the
    count applied.
    """
    threads = server_threads(num_threads, local_servers)
    torch.set_num_threads(threads)
    user_set_blas = any(os.environ.get(var, "").strip() for var in BLAS_ENV_VARS)
    threadpool_limits(limits=threads, user_api="openmp")
    if not user_set_blas:
        threadpool_limits(limits=threads, user_api="blas")
    return threads
