"""Graph servers limit their own BLAS/OpenMP threads: cores / local servers unless the user chose a count."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy  # loads numpy's OpenBLAS: a BLAS library for threadpoolctl to limit
import pytest
import torch
from threadpoolctl import threadpool_info, threadpool_limits

from lightning_dorylus import DorylusStrategy
from lightning_dorylus.executors import InlineExecutor, LocalPoolExecutor
from lightning_dorylus.executors.base import TensorOpRequest
from lightning_dorylus.threads import (
    BLAS_ENV_VARS,
    available_cores,
    colocated_worker_threads,
    limit_server_threads,
    one_blas_thread,
    pipelined_server_threads,
    server_threads,
)
from lightning_dorylus.value import TimedExecutor


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """No thread variables in the environment; this process's thread counts restored afterwards."""
    for var in ("OMP_NUM_THREADS", *BLAS_ENV_VARS):
        monkeypatch.delenv(var, raising=False)
    torch_threads = torch.get_num_threads()
    with threadpool_limits(limits=None):  # restores every library's count on exit
        yield monkeypatch
    torch.set_num_threads(torch_threads)


def blas_threads() -> set[int]:
    return {lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}


def test_thread_count_precedence(clean_env: pytest.MonkeyPatch) -> None:
    cores = available_cores()
    assert server_threads(None, 2) == max(1, cores // 2)
    assert server_threads(None, 4 * cores) == 1  # never 0
    clean_env.setenv("OMP_NUM_THREADS", "3")
    assert server_threads(None, 2) == 3  # the environment (user's, or Lightning's launcher's) wins
    assert server_threads(5, 2) == 5  # the strategy argument wins over both
    clean_env.setenv("OMP_NUM_THREADS", "two")
    with pytest.raises(ValueError, match=r"OMP_NUM_THREADS='two' in the environment: expected an integer"):
        server_threads(None, 2)


def test_limits_torch_and_the_loaded_blas(clean_env: pytest.MonkeyPatch) -> None:
    assert blas_threads(), "numpy's BLAS library should be loaded and visible to threadpoolctl"
    assert limit_server_threads(1, 2) == 1
    assert torch.get_num_threads() == 1
    assert blas_threads() == {1}


def test_user_blas_variable_keeps_its_library_alone(clean_env: pytest.MonkeyPatch) -> None:
    with threadpool_limits(limits=2, user_api="blas"):
        clean_env.setenv("OPENBLAS_NUM_THREADS", "2")
        assert limit_server_threads(1, 2) == 1
        assert torch.get_num_threads() == 1
        assert blas_threads() == {2}


def test_inline_handlers_run_with_one_blas_thread_and_leave_the_count_as_it_was(
    clean_env: pytest.MonkeyPatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """numpy's BLAS threads would spin against torch's pool on this process's cores (Cora on one server, 2
    cores: 3.3x slower): the inline executor's handlers run with one (OpenBLAS reports a pool thread's own
    count, so only the calling thread's is checked); the count is back after them, also after overlapping
    contexts in a pool's threads, and a user's BLAS variable is left alone."""
    import lightning_dorylus.executors.inline as inline

    seen: list[set[int]] = []
    def run_op(*args: object) -> dict[str, numpy.ndarray]:
        seen.append(blas_threads())
        return {"y": numpy.zeros(2)}

    monkeypatch.setattr(inline, "run_op", run_op)
    request = TensorOpRequest("any op", {"x": torch.randn(4, 3)})
    with threadpool_limits(limits=2, user_api="blas"):
        InlineExecutor().submit(request).result()
        assert seen == [{1}] and blas_threads() == {2}
        pool = InlineExecutor(num_threads=3)  # overlapping contexts in pool threads
        for future in [pool.submit(request) for _ in range(12)]:
            future.result()
        pool.close()
        assert blas_threads() == {2}
        with one_blas_thread, one_blas_thread:
            assert blas_threads() == {1}
        assert blas_threads() == {2}
        clean_env.setenv("OPENBLAS_NUM_THREADS", "2")
        InlineExecutor().submit(request).result()
        assert seen[-1] == {2}


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_strategy_rejects_a_bad_thread_count(bad: object) -> None:
    with pytest.raises(ValueError, match=r"num_threads=.* must be None \(automatic\) or an integer >= 1"):
        DorylusStrategy(num_threads=bad)  # type: ignore[arg-type]


def test_a_pipelined_server_leaves_its_colocated_workers_their_cores() -> None:
    """The local pool's workers count when they may run on the server's cores (through wrappers too), not
    when pinned elsewhere; the server keeps at least one thread."""
    assert pipelined_server_threads(2, 1) == 1 and pipelined_server_threads(8, 2) == 6
    assert pipelined_server_threads(1, 3) == 1
    assert colocated_worker_threads(InlineExecutor()) == 0
    own = sorted(os.sched_getaffinity(0))
    with LocalPoolExecutor(num_workers=2, threads_per_worker=1) as pool:
        assert colocated_worker_threads(pool) == 2
        assert colocated_worker_threads(TimedExecutor(pool)) == 2
        if len(own) >= 2:  # one worker pinned off the cores asked about: it no longer counts
            os.sched_setaffinity(pool.worker_pids[0], {own[1]})
            assert colocated_worker_threads(pool, cores={own[0]}) == 1
