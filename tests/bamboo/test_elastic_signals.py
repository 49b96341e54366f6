"""Signals and crashes as a spot machine sends them, under ``python -m lightning_bamboo.launch``.

The tests send real signals from outside to the PIDs the workers write (``pid_member{m}``) or to the
supervisor, and check what is left: exit codes, the final state against the uninterrupted run (float64), the
checkpoint folder, and that no process outlives the job. Workers hold at a step boundary
(``--hold``, :mod:`tests.bamboo.signal_callbacks`) so the signal lands at a known step.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset

from lightning_bamboo.callbacks import BambooMetrics, BambooNotices
from lightning_bamboo.checkpoint import periodic as fb
from lightning_bamboo.checkpoint.sharded import consolidate_checkpoint
from lightning_bamboo.control.coordinator import Coordinator
from lightning_bamboo.notices.signals import SigtermNoticeSource
from lightning_bamboo.protocol import crash
from lightning_bamboo.strategy import BambooStrategy
from lightning_bamboo.wiring import watch_sigterm
from tests.bamboo.launch_record import NAME, Record, record_env, wait_record, worker_events
from tests.bamboo.pipe_mlp import PipeMLP, make_data
from tests.bamboo.served_store import serve_store
from tests.bamboo.test_elastic import SCRIPT, STEPS, TOL, check_final
from tests.process import REPO, run_process, start

TIMEOUT_S = 300.0


class Job:
    """The launcher running in the background (output to a file), and what its workers wrote."""

    def __init__(self, out: Path, nproc: int, stages: int, *args: str, launch_args: tuple[str, ...] = ()):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.log_path = out.parent / f"{out.name}.log"
        cmd = [
            sys.executable, "-m", "lightning_bamboo.launch", "--nproc", str(nproc), *launch_args, str(SCRIPT),
            "--out", str(out), "--stages", str(stages), "--steps", str(STEPS), *args,
        ]
        self._stream = self.log_path.open("w")
        # a fresh interpreter: the supervisor installs its own SIGTERM handler, which the test signals
        self.proc = start(cmd, REPO, record_env(out), self._stream, process_group=None, fresh=True)
        self.deadline = time.monotonic() + TIMEOUT_S

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    @property
    def record(self) -> Record:
        """The supervisor's record of the job (``BAMBOO_EVENTS``) as last written."""
        return Record.read(self.out / NAME)

    def wait_record(self, what: str, until: Callable[[Record], bool]) -> Record:
        """Wait until the supervisor's record says ``until``."""
        return wait_record(self.out / NAME, until, lambda: self.proc.poll() is None, self.deadline, what)

    def wait_for(self, name: str) -> Path:
        path = self.out / name
        while not path.exists():
            assert self.proc.poll() is None, f"the job ended before {name}:\n{self.log[-4000:]}"
            assert time.monotonic() < self.deadline, f"no {name} in {TIMEOUT_S}s:\n{self.log[-4000:]}"
            time.sleep(0.05)
        return path

    def pid(self, member: int) -> int:
        return int(self.wait_for(f"pid_member{member}").read_text())

    def worker_pids(self) -> list[int]:
        return [int(p.read_text()) for p in self.out.glob("pid_member*")]

    def wait(self) -> int:
        timeout = max(self.deadline - time.monotonic(), 1.0)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the job outlived {TIMEOUT_S}s:\n{self.log[-4000:]}") from None

    def kill_all(self) -> None:
        """Whatever is left (a failed test): the supervisor's session, then each worker by PID."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid in self.worker_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._stream.close()


@pytest.fixture
def jobs() -> Iterator[list[Job]]:
    started: list[Job] = []
    yield started
    for job in started:
        job.kill_all()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_drain_is_the_elastic_default_with_an_opt_out() -> None:
    """The elastic strategy adds one ``BambooNotices`` when the trainer has none; its ``sigterm`` (unset)
    follows the strategy's ``drain_on_sigterm``; ``False`` on either side turns the SIGTERM source off."""
    for drain in (True, False):
        strategy = BambooStrategy(num_stages=2, drain_on_sigterm=drain)
        user = [Callback(), BambooMetrics(), ModelCheckpoint()]
        trainer = SimpleNamespace(callbacks=list(user), strategy=strategy)
        watch_sigterm(trainer, strategy.drain_on_sigterm)  # type: ignore[arg-type]
        watch_sigterm(trainer, strategy.drain_on_sigterm)  # type: ignore[arg-type]
        added = [c for c in trainer.callbacks if c not in user]
        assert [type(c) for c in added] == ([BambooNotices] if drain else [])
        assert trainer.callbacks == user[:1] + added + user[1:]  # a drain shows in its step's metrics
    for drain, given, watches in [(True, None, True), (False, None, False), (True, False, False),
                                  (False, True, True)]:
        notices = BambooNotices(sigterm=given)
        notices.setup(SimpleNamespace(strategy=SimpleNamespace(drain_on_sigterm=drain)), None, "fit")
        assert notices.watcher is not None
        assert any(isinstance(s, SigtermNoticeSource) for s in notices.watcher.sources) == watches


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_to_a_worker_drains_it_by_default(
    tmp_path: Path, jobs: list[Job], elastic_reference: dict[str, torch.Tensor]
) -> None:
    """The user added no callback: SIGTERM to member 1 (the last stage) by PID while it holds at step 3.
    The strategy's default SIGTERM drain makes it leave at the next boundary as an announced departure (exit
    0, no failure); member 0 promotes its replica and finishes every step equal to the uninterrupted run."""
    job = Job(tmp_path / "run", 2, 2, "--hold", "1:3:sigterm")
    jobs.append(job)
    job.wait_for("reached3_member1")
    os.kill(job.pid(1), signal.SIGTERM)
    assert job.wait() == 0, job.log[-4000:]
    record = job.record
    assert [(c.kind, c.lost, c.left) for c in record.changes] == [("drain", [], [1])]
    assert record.exits == {0: 0, 1: 0}  # it left (exit 0); nothing lost
    assert "aborted" not in job.log  # nothing replayed
    assert not (job.out / "final_member1.safetensors").exists()  # it left
    check_final(job.out, elastic_reference)
    assert not any(alive(pid) for pid in job.worker_pids())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_drained_rank_zero_runs_no_code_after_fit(tmp_path: Path, jobs: list[Job]) -> None:
    """3 stages on 3 members; member 0 (rank 0) is SIGTERMed while it holds at step 3 and drains. Its process
    exits 0 at the end of its ``fit`` (``BambooDeparted``): it writes no after-``fit`` marker, so "rank 0
    saves the result" runs once, on the survivor that became rank 0 (exactly one marker says
    ``is_global_zero``). The survivors' ``trainer.test`` and ``trainer.save_checkpoint`` after ``fit`` (both
    collective) work: the test loss is the uninterrupted run's, the checkpoint consolidates to its final
    parameters (float64)."""
    reference_out = tmp_path / "reference"
    run_process([sys.executable, str(SCRIPT), "--out", str(reference_out), "--strategy", "auto", "--stages",
                 "3", "--steps", str(STEPS), "--after-fit"], timeout=240)
    reference = load_file(str(reference_out / "final_reference.safetensors"))
    job = Job(tmp_path / "run", 3, 3, "--hold", "0:3:sigterm", "--after-fit")
    jobs.append(job)
    job.wait_for("reached3_member0")
    os.kill(job.pid(0), signal.SIGTERM)
    assert job.wait() == 0, job.log[-4000:]
    record = job.record
    assert [(c.kind, c.lost, c.left) for c in record.changes] == [("drain", [], [0])]
    assert record.exits == {0: 0, 1: 0, 2: 0}  # it left (exit 0)
    assert "Traceback" not in job.log, job.log[-4000:]
    markers = {int(p.stem.removeprefix("after_fit_member")): json.loads(p.read_text())
               for p in job.out.glob("after_fit_member*.json")}
    assert sorted(markers) == [1, 2]  # the leaver ran nothing after fit
    assert [m for m, after in markers.items() if after["is_global_zero"]] == [1]
    assert sorted(after["rank"] for after in markers.values()) == [0, 1]
    expected = json.loads((reference_out / "after_fit_reference.json").read_text())["test_loss"]
    for after in markers.values():
        assert after["world_size"] == 2 and after["global_step"] == STEPS
        torch.testing.assert_close(after["test_loss"], expected, **TOL)
    check_final(job.out, reference)
    merged = consolidate_checkpoint(job.out / "after_fit_ckpt")
    own = {k.removeprefix("own/"): v for k, v in reference.items() if k.startswith("own/")}
    assert merged.keys() == own.keys()
    for key, value in merged.items():
        torch.testing.assert_close(value, own[key], **TOL, msg=key)
    assert not any(alive(pid) for pid in job.worker_pids())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_during_the_sanity_check_drains_at_the_first_boundaries(
    tmp_path: Path, jobs: list[Job]
) -> None:
    """Validation every 3 steps, so Lightning's sanity check runs first: member 1 is SIGTERMed while it holds
    at its end. The signal is a notice there too (not Lightning's SIGTERMException, which would end the
    worker with exit 0 and leave member 0 waiting): member 1 drains after step 2, and the final state and
    both logged val_loss values equal the uninterrupted run's."""
    validate = ("--validate", "3")
    run_process([sys.executable, str(SCRIPT), "--out", str(tmp_path / "reference"), "--strategy", "auto",
                 "--steps", str(STEPS), *validate], timeout=240)
    reference = load_file(str(tmp_path / "reference" / "final_reference.safetensors"))
    job = Job(tmp_path / "run", 2, 2, "--hold", "1:0:sigterm", "--events", *validate)
    jobs.append(job)
    job.wait_for("reached0_member1")
    os.kill(job.pid(1), signal.SIGTERM)
    assert job.wait() == 0, job.log[-4000:]
    record = job.record
    assert [(c.kind, c.lost, c.left) for c in record.changes] == [("drain", [], [1])]
    assert record.exits == {0: 0, 1: 0}
    (drain,) = worker_events(job.out, 0, "on_drain")  # as the survivor saw it
    assert (drain["member"], drain["step"]) == (1, 2)
    assert "aborted" not in job.log
    check_final(job.out, reference)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_to_the_supervisor_stops_the_workers_with_a_final_checkpoint(
    tmp_path: Path, jobs: list[Job], elastic_reference: dict[str, torch.Tensor]
) -> None:
    """SIGTERM to the supervisor while member 0 holds at step 3 (fallback checkpoints every 2 steps): it
    publishes a stop, member 1 (already blocked in step 4 on member 0) is cut out of that step and aborts
    it, both leave at step 3 after writing a final checkpoint of step 3, and the supervisor exits 143 with
    no worker left; neither runs the script's code after ``fit``. The checkpoint equals the uninterrupted
    run after 3 steps (float64). The stop's Lightning checkpoint (``stop-step=3.ckpt``) consolidates to the
    same parameters, and a new job resumed from it with ``fit(ckpt_path=...)`` ends equal to the
    uninterrupted run."""
    ckpt = tmp_path / "ckpt"
    job = Job(tmp_path / "run", 2, 2, "--hold", "0:3:release", "--checkpoint-every", "2",
              "--checkpoint-dir", str(ckpt), "--after-fit")
    jobs.append(job)
    job.wait_for("reached3_member0")
    pids = [job.pid(0), job.pid(1)]
    os.kill(job.proc.pid, signal.SIGTERM)
    job.wait_record("the stop", lambda record: record["stop"] is not None)  # the stop generation is out
    (job.out / "release").write_text("")  # member 0 goes on to its next step boundary
    assert job.wait() == 128 + signal.SIGTERM, job.log[-4000:]
    record = job.record
    assert record["stop"] == {"reason": "SIGTERM received", "code": 143, "killed": []}  # all left in time
    assert record["changes"] == [] and record["returncode"] == 143  # no failover
    assert not any(alive(pid) for pid in pids)
    assert not list(job.out.glob("final_*"))  # the script did not go on as if training had finished
    assert not list(job.out.glob("after_fit_*"))

    (root,) = ckpt.iterdir()  # <checkpoint_dir>/<job id>
    assert fb.latest_complete(root) == 3
    assert not list(root.glob("*.partial"))
    # the final checkpoint is step 3 of the uninterrupted trajectory: parameters and Adam state
    model, optimizer = reference_after(3, tmp_path / "reference")
    template = PipeMLP(pairs=3).pipeline
    layers = list(range(len(template)))
    held, _ = fb.load_layers(fb.folder(root, 3), layers, lambda i: template[i], torch.device("cpu"))
    assert sorted(held) == layers
    for layer in layers:
        for name, p in model.pipeline[layer].named_parameters():
            where = f"layer {layer} {name}"
            torch.testing.assert_close(dict(held[layer].module.named_parameters())[name], p, **TOL, msg=where)
            for key, value in optimizer.state[p].items():
                torch.testing.assert_close(held[layer].state[name][key], value, **TOL, msg=f"{where} {key}")

    with pytest.raises(ValueError, match="is a snapshot of BambooStrategy's checkpoint fallback"):
        consolidate_checkpoint(fb.folder(root, 3))  # layers only: not what fit(ckpt_path=...) resumes
    stopped = root / "stop-step=3.ckpt"  # both left after step 3
    merged = consolidate_checkpoint(stopped)
    assert merged.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(merged[key], value, **TOL, msg=key)
    ledger = tmp_path / "resumed.jsonl"
    resumed = Job(tmp_path / "resumed", 2, 2, "--resume", str(stopped), "--ledger", str(ledger))
    jobs.append(resumed)
    assert resumed.wait() == 0, resumed.log[-4000:]
    assert [json.loads(line)["step"] for line in ledger.read_text().splitlines()] == [3, 4, 5]  # resumed
    check_final(resumed.out, elastic_reference)


def reference_after(steps: int, root: Path) -> tuple[PipeMLP, torch.optim.Optimizer]:
    """``train_elastic.py --strategy auto``'s model and optimizer after ``steps`` of its STEPS steps (same
    seed, model, data and order), trained in this process."""
    torch.set_num_threads(1)
    seed_everything(0)
    model = PipeMLP(pairs=3, optimizer="adam")
    x, y = make_data(STEPS * 8)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=steps, max_epochs=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=root)
    trainer.fit(model, DataLoader(TensorDataset(x[order], y[order]), batch_size=8, shuffle=False))
    assert trainer.global_step == steps
    return model, trainer.optimizers[0]


def test_communication_errors_are_told_from_errors_of_the_code() -> None:
    """The messages are gloo's, as torch 2.13 raised them in an experiment (a peer SIGKILLed in a recv, a
    silent peer, a collective after the member aborted its own groups)."""
    closed = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:11700. This is typically caused by a remote worker crashing."
    )
    silent = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
        "3000ms for recv operation to complete"
    )
    aborted = ValueError("Default process group has not been initialized, please make sure to call "
                         "init_process_group.")
    for err in (closed, silent, aborted, dist.DistNetworkError("x"), TimeoutError(), ConnectionResetError()):
        assert crash.is_communication_error(err), err
    for err in (ValueError("user bug"), RuntimeError("mat1 and mat2 must have the same dtype"), KeyError()):
        assert not crash.is_communication_error(err), err
    try:
        try:
            raise closed
        except RuntimeError as cause:
            raise RuntimeError("moving layer 3 failed") from cause
    except RuntimeError as err:
        assert crash.is_communication_error(err)  # caused by a lost peer

    store = dist.HashStore()
    assert crash.recorded(store, 1) is None
    try:
        raise ValueError("user bug")
    except ValueError as err:
        crash.record(store, 1, err)
    failure = crash.recorded(store, 1)
    assert failure is not None
    assert (failure["member"], failure["type"], failure["message"]) == (1, "ValueError", "user bug")
    assert 'raise ValueError("user bug")' in failure["traceback"]


def test_the_supervisor_stops_on_a_recorded_error_unless_a_worker_was_killed() -> None:
    """A worker that exited 1 with a recorded error stops the job; lost together with one killed by a
    signal (a preemption), it is a failover as before."""
    lines: list[str] = []
    served = serve_store()
    supervisor = Coordinator(served.client(), log=lambda text, **_: lines.append(text), codes={0: 1, 1: -9})
    crash.record(supervisor.store, 0, ValueError("user bug"))
    assert supervisor._failure_in_code({0, 1}) is None  # member 1 was preempted: fail over
    assert supervisor.error is None and not lines
    failure = supervisor._failure_in_code({0})
    assert failure is not None and failure["message"] == "user bug" and supervisor.error == failure
    assert lines == [
        "[bamboo.launch] member 0 failed with ValueError: user bug (an error of the training code, not a "
        "preemption; its traceback is in the worker's output): stopping the job"
    ]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_error_in_user_code_stops_the_job_without_failover(tmp_path: Path, jobs: list[Job]) -> None:
    """Member 1's loss raises ``ValueError("user bug")`` at step 2. Handled as a lost peer, member 0 would
    take its stage over and the job would go on or die after a chain of failovers; instead the job stops at
    once: the supervisor prints the error, stops member 0 by the stop protocol, and exits 1; the traceback
    is printed once (by the failing worker) and no process is left."""
    job = Job(tmp_path / "run", 2, 2, "--raise-at", "1:2", "--events")
    jobs.append(job)
    pids = [job.pid(0), job.pid(1)]
    assert job.wait() == 1, job.log[-4000:]
    log = job.log
    assert log.count("Traceback (most recent call last)") == 1, log[-6000:]
    assert log.count('raise ValueError("user bug")') == 1 and log.count("ValueError: user bug\n") == 1
    record = job.record
    error = record["error"]
    assert (error["member"], error["type"], error["message"]) == (1, "ValueError", "user bug")
    assert 'raise ValueError("user bug")' in error["traceback"]
    assert record["stop"] == {"reason": "member 1 failed", "code": 1, "killed": []}  # member 0 left in time
    assert record["changes"] == [], record["changes"]  # no failover
    # member 0 left by the stop protocol after step 2, which no member aborted (nothing replayed)
    stops = [(e["member"], e["step"]) for e in worker_events(job.out, 0, "on_job_stop")]
    assert stops == [(0, 2)], log[-6000:]
    assert not [e for m in (0, 1) for e in worker_events(job.out, m) if e["event"] == "on_step_aborted"]
    assert not any(alive(pid) for pid in pids)
