"""Elastic Bamboo under a plain ``python train.py`` (``Trainer(devices=4)``, no launcher command): the
script's process supervises the workers, a worker SIGKILLed from outside mid-fit is survived, and the script
exits 0 with every step done on the survivors."""

from __future__ import annotations

import contextlib
import csv
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from lightning_bamboo.control.agent import first_formed
from lightning_bamboo.protocol import store as ms
from lightning_bamboo.runtime.launcher import SupervisorLauncher, script_command
from tests.bamboo.launch_record import NAME, Record, record_env, wait_record
from tests.process import REPO, launch_env

SCRIPT = Path(__file__).parent / "scripts" / "train_plain.py"
STEPS = 24


class Output:
    """The lines a process prints, collected by a thread (shown when a test fails)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append(line)

    @property
    def text(self) -> str:
        self._thread.join(timeout=10)
        return "".join(self.lines)


def run_and_kill(out: Path, devices: int, victim: int, *extra: str) -> str:
    """Run the plain script with ``devices`` workers, SIGKILL member ``victim``'s PID from outside a few steps
    into training, and return the output once the script has exited 0."""
    cmd = [sys.executable, str(SCRIPT), str(out), str(STEPS), "0.15", str(devices), *extra]
    path = out / NAME
    proc = subprocess.Popen(cmd, cwd=REPO, env=record_env(out), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output = Output(proc)
    worker_pids: list[int] = []
    try:
        # this process supervises the workers: its record names their PIDs once it started them
        started = wait_record(path, lambda r: len(r["pids"]) == devices, lambda: proc.poll() is None,
                              time.monotonic() + 120, f"{devices} workers")
        worker_pids = [started["pids"][str(m)] for m in range(devices)]
        store = ms.connect(started["store"], started["job"])
        deadline = time.monotonic() + 180
        while not first_formed(store):  # generation 0 formed: training runs
            assert proc.poll() is None and time.monotonic() < deadline, output.text[-4000:]
            time.sleep(0.1)
        time.sleep(2.0)  # a few steps in
        os.kill(worker_pids[victim], signal.SIGKILL)
        rc = proc.wait(timeout=300)
    finally:
        for pid in [proc.pid, *worker_pids]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        proc.wait(timeout=30)
    log = output.text
    assert rc == 0, log[-4000:]
    assert Record.read(path).summary() == [("failover", [victim])], log[-4000:]
    return log


@pytest.mark.slow
@pytest.mark.multiprocess
def test_plain_script_survives_a_sigkilled_worker(tmp_path: Path) -> None:
    run_and_kill(tmp_path, 4, 3)
    done = sorted(p.name for p in tmp_path.glob("done_member*.json"))
    assert done == ["done_member0.json", "done_member1.json", "done_member2.json"]
    for path in tmp_path.glob("done_member*.json"):
        assert f'"global_step": {STEPS}' in path.read_text()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_one_logger_version_through_a_failover_of_rank_zero(tmp_path: Path) -> None:
    """Member 0 (rank 0, the one that logs) is SIGKILLed: member 1 becomes rank 0 and logs on into the same
    CSVLogger version, and every step is logged exactly once."""
    run_and_kill(tmp_path, 2, 0, "csv")
    versions = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert versions == ["version_0"], versions
    rows = list(csv.DictReader((tmp_path / "logs" / "version_0" / "metrics.csv").open()))
    steps = [int(row["step"]) for row in rows if row.get("train_loss")]
    assert steps == list(range(STEPS)), steps


def test_script_command_reruns_this_script_or_module() -> None:
    command = script_command()
    assert command[0] == sys.executable
    assert command[1] == "-m" or os.path.isabs(command[1])


def test_launcher_is_not_interactive() -> None:
    assert SupervisorLauncher(2).is_interactive_compatible is False


def test_outside_launcher_gets_fixed_ranks_and_a_plain_script_a_supervisor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torchrun, SLURM or ranks started with LOCAL_RANK set: Bamboo launches nothing and trains on the ranks
    it was given (no failover: it says so at start); a plain script with devices=N supervises N workers."""
    from lightning.fabric.plugins.environments import LightningEnvironment, TorchElasticEnvironment

    from lightning_bamboo.strategy import BambooStrategy

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    plain = BambooStrategy(num_stages=2, cluster_environment=LightningEnvironment())
    plain.parallel_devices = [torch.device("cpu")] * 4
    plain._configure_launcher()
    assert isinstance(plain.launcher, SupervisorLauncher)
    for env in (TorchElasticEnvironment(), LightningEnvironment()):
        monkeypatch.setenv("LOCAL_RANK", "0")
        outside = BambooStrategy(num_stages=2, cluster_environment=env)
        outside.parallel_devices = [torch.device("cpu")] * 4
        outside._configure_launcher()
        assert outside.launcher is None
    single = BambooStrategy(num_stages=1, recovery="peers", cluster_environment=LightningEnvironment())
    monkeypatch.delenv("LOCAL_RANK")
    single.parallel_devices = [torch.device("cpu")]
    single._configure_launcher()
    assert single.launcher is None  # one process: nothing to supervise


def test_unreachable_store_is_named_with_what_was_tried(capsys: pytest.CaptureFixture[str]) -> None:
    """``--store etcd://127.0.0.1:1`` (nothing listens there): exit 2 and one line naming the address and the
    request tried, not a bare ConnectionFailedError traceback."""
    from lightning_bamboo.launch import main

    assert main(["--nproc", "1", "--store", "etcd://127.0.0.1:1", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach the job's etcd store at etcd://127.0.0.1:1" in err
    assert "POST http://127.0.0.1:1/v3/maintenance/status" in err


BAD_INPUT = Path(__file__).parent / "scripts" / "bad_input.py"


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("kind", "match"),
    [
        ("no-body", r"TypeError: .*found none on Model"),
        ("few-layers", r"ValueError: num_stages \(2\) is more than the 1 layers of the pipeline body"),
        ("outside", r"TypeError: BambooStrategy pipelines only Model.pipeline, but these trainable "
                    r"parameters live outside it: scale"),
    ],
    ids=["no-body", "few-layers", "outside"],
)
def test_bad_module_is_refused_before_any_worker_starts(tmp_path: Path, kind: str, match: str) -> None:
    """Under ``python train.py`` the script's process (the supervisor) holds the module: the strategy's checks
    of it run there, before any worker starts, and the script fails once with the error. No worker ran: the
    supervisor never ran (it writes ``BAMBOO_EVENTS`` whenever it started workers) and only the script's own
    process ran the script."""
    events = tmp_path / "events.json"
    env = launch_env({"BAMBOO_EVENTS": str(events)})
    proc = subprocess.run([sys.executable, str(BAD_INPUT), kind, str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert re.search(match, proc.stderr), proc.stderr[-3000:]
    assert proc.stderr.count("Traceback") == 1
    assert not events.exists()
    assert len(list(tmp_path.glob("ran-*"))) == 1


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_error_every_worker_meets_is_printed_once(tmp_path: Path) -> None:
    """A batch the micro-batches cannot split (only the workers see the loader): both workers raise it at the
    start of training; the first to record it prints its traceback, the other one line, and the supervisor
    names it once and exits 1."""
    events = tmp_path / "events.json"
    env = launch_env({"BAMBOO_EVENTS": str(events)})
    proc = subprocess.run([sys.executable, str(BAD_INPUT), "batch", str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    assert events.exists()  # the workers ran
    assert output.count("Traceback") == 1, output[-6000:]
    assert re.search(r"ValueError: .*batch_size \(3, the global batch\) is not divisible", output)
    assert output.count("failed with ValueError") == 1  # the supervisor names it once


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_good_module_starts_the_workers(tmp_path: Path) -> None:
    """The control of the test above: the same script with nothing wrong trains, the supervisor's events file
    is written and each of the 2 workers ran the script too. Lightning's start-up lines are printed by the
    script's process (it builds the Trainer before it knows it supervises) and by member 0, not member 1."""
    events = tmp_path / "events.json"
    env = launch_env({"BAMBOO_EVENTS": str(events)})
    proc = subprocess.run([sys.executable, str(BAD_INPUT), "ok", str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert events.exists() and len(list(tmp_path.glob("ran-*"))) == 3
    assert (proc.stdout + proc.stderr).count("GPU available:") == 2
