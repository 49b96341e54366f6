"""Workers started by :class:`~lightning_bamboo.control.workers.LocalWorkers` through the preload server
(:mod:`lbd_common.preload`) are what ``python train.py`` would be: argv, ``__main__``, the
supervisor's environment plus the worker's (``BAMBOO_*``, ``OMP_NUM_THREADS``), their own session, their exit
status, SIGKILL by PID; without a server they start as fresh interpreters."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from lbd_common.preload import PreloadedProcess, Preloader
from lightning_bamboo.control.workers import LocalWorkers, worker_env
from lightning_bamboo.protocol import store as ms

# writes what a fresh interpreter would see to argv[1], then exits with argv[2] or ("wait") sleeps
PROBE = """
import json, os, sys, time
import __main__
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump({"argv": sys.argv, "name": __name__, "spec": getattr(__main__.__spec__, "name", None),
               "env": {k: v for k, v in os.environ.items() if k in sys.argv[3].split(",")},
               "session_leader": os.getsid(0) == os.getpid(), "torch_preloaded": "torch" in sys.modules,
               "bamboo_imported": "lightning_bamboo" in sys.modules,
               "cwd": os.getcwd()}, f)
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
if sys.argv[2] == "wait":
    time.sleep(600)
sys.exit(int(sys.argv[2]))
"""


# the variables a supervisor gives its workers: the probe reports these (the test environment may hold other
# BAMBOO_* variables, e.g. the services' BAMBOO_TEST_ETCD, which a worker inherits as any variable)
TOLD = ",".join([ms.ENV_JOINING, ms.ENV_STORE, ms.ENV_JOB, ms.ENV_MEMBER, ms.ENV_NPROC, ms.ENV_LOCAL_RANK,
                 "OMP_NUM_THREADS"])


def _workers(
    tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch, **kwargs: bool
) -> tuple[LocalWorkers, Path]:
    (tmp_path / "probe.py").write_text(PROBE)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the supervisor's share: cores // workers
    monkeypatch.chdir(tmp_path)
    seen = tmp_path / "seen.json"
    command = [sys.executable, str(tmp_path / "probe.py"), str(seen), how, TOLD]
    return LocalWorkers(command, dist.HashStore(), hang_timeout=5.0, workers_on_machine=2, **kwargs), seen


def _read(seen: Path, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while not seen.exists():
        assert time.monotonic() < deadline, "the worker wrote nothing"
        time.sleep(0.05)
    return json.loads(seen.read_text())


@pytest.mark.multiprocess  # starts a preload server (shared by this session's LocalWorkers)
def test_a_preloaded_worker_is_the_fresh_interpreter_the_supervisor_would_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BAMBOO_PRELOAD", raising=False)
    workers, seen = _workers(tmp_path, "3", monkeypatch)
    assert workers.start(5, worker_env("tcp://127.0.0.1:1", "job1", 5, 2, joining=True)) == 0
    proc = workers.workers[5].proc
    assert isinstance(proc, PreloadedProcess)
    assert proc.wait(timeout=120) == 3
    threads = str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert _read(seen) == {
        "argv": [str(tmp_path / "probe.py"), str(seen), "3", TOLD], "name": "__main__", "spec": None,
        "env": {ms.ENV_JOINING: "1", ms.ENV_STORE: "tcp://127.0.0.1:1", ms.ENV_JOB: "job1",
                ms.ENV_MEMBER: "5", ms.ENV_NPROC: "2", ms.ENV_LOCAL_RANK: "0", "OMP_NUM_THREADS": threads},
        # the server imported lightning_bamboo to start; the worker imports it (and registers "bamboo") itself
        "session_leader": True, "torch_preloaded": True, "bamboo_imported": False, "cwd": str(tmp_path),
    }
    assert workers.exits() == {5: 3}


@pytest.mark.multiprocess
def test_a_preloaded_worker_is_killed_by_pid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BAMBOO_PRELOAD", raising=False)
    workers, seen = _workers(tmp_path, "wait", monkeypatch)
    workers.start(0, worker_env("tcp://127.0.0.1:1", "job2", 0, 1, joining=False))
    proc = workers.workers[0].proc
    assert isinstance(proc, PreloadedProcess)
    assert _read(seen)["session_leader"] and os.getsid(proc.pid) == proc.pid
    assert workers.live_members() == [0]
    workers.kill(0)
    proc.wait(timeout=30)
    assert proc.poll() == -signal.SIGKILL and workers.exits() == {0: -signal.SIGKILL}
    assert workers.live_members() == [] and workers.all_exited()


@pytest.mark.multiprocess
def test_without_preload_workers_start_as_fresh_interpreters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BAMBOO_PRELOAD", "0")
    workers, seen = _workers(tmp_path, "0", monkeypatch)
    workers.start(0, worker_env("tcp://127.0.0.1:1", "job3", 0, 1, joining=False))
    proc = workers.workers[0].proc
    assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=120) == 0
    assert _read(seen)["torch_preloaded"] is False

    monkeypatch.delenv("BAMBOO_PRELOAD")
    workers, _ = _workers(tmp_path, "0", monkeypatch, preload=False)  # --no-preload
    assert workers.preloader is None


@pytest.mark.multiprocess
def test_a_server_that_cannot_start_falls_back_to_fresh_interpreters(tmp_path: Path) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    said: list[str] = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    preloader = Preloader(env, log=lambda text, **_: said.append(text),
                          modules=("lightning_bamboo_no_such_module",))
    probe = [sys.executable, str(tmp_path / "probe.py")]
    procs = [preloader.start([*probe, str(tmp_path / f"{i}.json"), "0", TOLD], env) for i in range(2)]
    assert all(isinstance(p, subprocess.Popen) and p.wait(timeout=120) == 0 for p in procs)
    assert [_read(tmp_path / f"{i}.json")["name"] for i in range(2)] == ["__main__", "__main__"]
    assert len(said) == 1 and preloader.failed  # said once; no second try per worker
