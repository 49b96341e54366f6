"""The workers' environment on NCCL (``lightning_bamboo/protocol/nccl_env.py``): the supervisor's and the
agents' workers get the variables only when the backend is NCCL, a user's own value wins, and a worker on
NCCL that lacks them (another launcher) warns naming them. Also which release each backend gets
(``lightning_bamboo/runtime/release.py``)."""

from __future__ import annotations

import sys
import warnings
from datetime import timedelta

import pytest
import torch

from lightning_bamboo.control.workers import LocalWorkers
from lightning_bamboo.protocol import nccl_env
from lightning_bamboo.runtime import release
from lightning_bamboo.wiring import warn_nccl_env


def test_nccl_workers_get_every_variable_and_other_backends_none() -> None:
    assert nccl_env.for_workers("nccl", environ={}) == nccl_env.NCCL_ENV
    assert nccl_env.for_workers("cpu:gloo,cuda:nccl", environ={}) == nccl_env.NCCL_ENV
    assert nccl_env.NCCL_ENV["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    assert nccl_env.NCCL_ENV["NCCL_NVLS_ENABLE"] == "0"
    for other in ("gloo", "nccl-like"):
        assert nccl_env.for_workers(other, environ={}) == {}


def test_a_users_value_wins_and_the_opt_out_starts_workers_with_torchs_defaults() -> None:
    mine = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    added = nccl_env.for_workers("nccl", environ=mine)
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in added and len(added) == len(nccl_env.NCCL_ENV) - 1
    assert nccl_env.for_workers("nccl", environ={nccl_env.OPT_OUT: "0"}) == {}


def test_the_workers_backend_comes_from_bamboo_backend_else_the_machine() -> None:
    assert nccl_env.workers_backend({nccl_env.BACKEND: "nccl"}) == "nccl"
    assert nccl_env.workers_backend({}) == ("nccl" if torch.cuda.is_available() else "gloo")


def test_local_workers_start_nccl_workers_with_the_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in nccl_env.NCCL_ENV:
        monkeypatch.delenv(key, raising=False)
    nccl = LocalWorkers([sys.executable, "-c", "pass"], store=None, hang_timeout=5.0, preload=False,
                        backend="nccl")
    gloo = LocalWorkers([sys.executable, "-c", "pass"], store=None, hang_timeout=5.0, preload=False,
                        backend="gloo")
    assert nccl.nccl == nccl_env.NCCL_ENV and gloo.nccl == {}


def test_a_worker_on_nccl_without_the_variables_warns_naming_them(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in nccl_env.NCCL_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    with pytest.warns(UserWarning, match="TORCH_NCCL_DUMP_ON_TIMEOUT") as seen:
        warn_nccl_env("nccl")
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING," not in str(seen[0].message).split("not set")[0]
    for key, value in nccl_env.NCCL_ENV.items():
        monkeypatch.setenv(key, value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_nccl_env("nccl")  # nothing missing: no warning
        warn_nccl_env("gloo")


def test_each_backend_gets_its_release() -> None:
    def cpu() -> torch.device:
        return torch.device("cpu")

    for backend in ("nccl", "nccl-like", "cpu:gloo,cuda:nccl"):
        chosen = release.for_backend(backend, None, cpu, timedelta(seconds=10))
        assert isinstance(chosen, release.AbortBackends)
        assert chosen.pg_timeout(timedelta(seconds=10)) == timedelta(seconds=20)  # above the deadline
    gloo = release.for_backend("gloo", None, cpu, timedelta(seconds=10))
    assert type(gloo) is release.Release and gloo.pg_timeout(timedelta(seconds=10)) == timedelta(seconds=10)
