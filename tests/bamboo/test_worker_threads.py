"""The workers a machine starts share its cores: ``OMP_NUM_THREADS`` = cores / workers (at least 1) unless
the user set it, as Lightning's launchers and torchrun do (K workers with a thread per core each
oversubscribe the machine K-fold)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_bamboo.control import workers
from lightning_bamboo.control.workers import LocalWorkers, available_cores, thread_env


def test_thread_env_shares_the_cores_among_the_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(workers, "available_cores", lambda: 16)
    assert thread_env(4) == {"OMP_NUM_THREADS": "4"}
    assert thread_env(3) == {"OMP_NUM_THREADS": "5"}
    assert thread_env(32) == {"OMP_NUM_THREADS": "1"}  # never 0
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # the user's choice is left alone
    assert thread_env(4) == {}


def test_a_started_worker_runs_with_its_share_of_the_cores(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    out = tmp_path / "threads"
    command = [sys.executable, "-c",
               f"import torch; open({str(out)!r}, 'w').write(str(torch.get_num_threads()))"]
    local = LocalWorkers(command, dist.HashStore(), hang_timeout=60, log=lambda *a, **k: None,
                         workers_on_machine=2)
    local.start(0, {})
    deadline = time.monotonic() + 120
    while not local.all_exited() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert local.returncode(0) == 0
    assert int(out.read_text()) == max(1, available_cores() // 2)
