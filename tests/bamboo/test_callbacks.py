"""Bamboo's event hooks: dispatch (fake trainer), metrics, and a notice drained at a step boundary."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_bamboo.callbacks import BambooCallback, BambooMetrics, BambooNotices
from lightning_bamboo.notices import Notice
from lightning_bamboo.runtime.events import fire


class Recorder(BambooCallback):
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, dict[str, Any]]] = []

    def on_preemption_notice(self, trainer, pl_module, notice, **info):  # type: ignore[no-untyped-def]
        self.calls.append(("notice", pl_module, {"notice": notice, **info}))

    def on_drain(self, trainer, pl_module, member, rank, **info):  # type: ignore[no-untyped-def]
        self.calls.append(("drain", pl_module, {"member": member, "rank": rank, **info}))

    def on_failover(self, trainer, pl_module, old_map, new_map, **info):  # type: ignore[no-untyped-def]
        self.calls.append(("failover", pl_module, {"old_map": old_map, "new_map": new_map, **info}))

    def on_rejoin(self, trainer, pl_module, old_map, new_map, **info):  # type: ignore[no-untyped-def]
        self.calls.append(("rejoin", pl_module, {"old_map": old_map, "new_map": new_map, **info}))

    def on_fallback(self, trainer, pl_module, checkpoint_path, **info):  # type: ignore[no-untyped-def]
        self.calls.append(("fallback", pl_module, {"checkpoint_path": checkpoint_path, **info}))


def fake_trainer(*callbacks: object) -> SimpleNamespace:
    strategy = SimpleNamespace(num_stages=4)
    return SimpleNamespace(callbacks=list(callbacks), lightning_module="module", strategy=strategy)


def test_fire_calls_each_hook_once_with_its_payload() -> None:
    recorder, metrics = Recorder(), BambooMetrics()
    trainer = fake_trainer(recorder, object(), metrics)  # a callback without the hooks is skipped
    notice = Notice(source="aws", rank=2)
    assert fire(trainer, "on_preemption_notice", notice=notice) == 2  # type: ignore[arg-type]
    fire(trainer, "on_drain", member=5, rank=2, step=7)  # type: ignore[arg-type]
    fire(trainer, "on_failover", old_map={0: 0, 1: 1}, new_map={0: 0, 1: 0}, seconds_lost=1.5,  # type: ignore[arg-type]
         pipeline_length=3, cause="drain", members=[5])
    fire(trainer, "on_rejoin", old_map={0: 0, 1: 0}, new_map={0: 0, 1: 1}, seconds_lost=0.5)  # type: ignore[arg-type]
    fire(trainer, "on_fallback", checkpoint_path="/ckpt")  # type: ignore[arg-type]
    assert recorder.calls == [
        ("notice", "module", {"notice": notice}),
        ("drain", "module", {"member": 5, "rank": 2, "step": 7}),
        ("failover", "module", {"old_map": {0: 0, 1: 1}, "new_map": {0: 0, 1: 0}, "seconds_lost": 1.5,
                                "pipeline_length": 3, "cause": "drain", "members": [5]}),
        ("rejoin", "module", {"old_map": {0: 0, 1: 0}, "new_map": {0: 0, 1: 1}, "seconds_lost": 0.5}),
        ("fallback", "module", {"checkpoint_path": "/ckpt"}),
    ]
    assert metrics.metrics(trainer) == {  # type: ignore[arg-type]
        "bamboo/preemptions": 1.0, "bamboo/drains": 1.0, "bamboo/failovers": 1.0, "bamboo/rejoins": 1.0,
        "bamboo/fallbacks": 1.0,
        "bamboo/seconds_lost": 2.0, "bamboo/pipeline_length": 3.0,
    }
    assert BambooMetrics().metrics(trainer)["bamboo/pipeline_length"] == 4.0  # type: ignore[arg-type]


def test_event_log_writes_one_json_line_per_event(tmp_path: Path) -> None:
    from lightning_bamboo.callbacks import BambooEventLog
    from lightning_bamboo.layout.ownership import initial

    log = BambooEventLog(tmp_path / "events")
    trainer = SimpleNamespace(callbacks=[log], lightning_module="module", strategy=SimpleNamespace(member=3),
                              global_step=7, global_rank=1, default_root_dir=str(tmp_path))
    old = initial(2, [0, 3])
    fire(trainer, "on_preemption_notice", notice=Notice(source="gce", rank=1, received_at=1.0))  # type: ignore[arg-type]
    fire(trainer, "on_failover", old_map=old, new_map=old, cause="lost", members=[0])  # type: ignore[arg-type]
    text = (tmp_path / "events" / "events-member3.jsonl").read_text()
    lines = [json.loads(line) for line in text.splitlines()]
    events = [(r["event"], r["global_step"]) for r in lines]
    assert events == [("on_preemption_notice", 7), ("on_failover", 7)]
    assert lines[0]["notice"] == Notice(source="gce", rank=1, received_at=1.0).to_dict()
    assert lines[1]["old_map"] == json.loads(old.to_json()) and lines[1]["members"] == [0]


def test_fire_rejects_bad_events() -> None:
    trainer = fake_trainer(Recorder())
    with pytest.raises(ValueError, match=re.escape("unknown Bamboo event 'on_boom'; expected one of")):
        fire(trainer, "on_boom")  # type: ignore[arg-type]
    message = ("event 'on_failover' needs payload keys ['old_map', 'new_map'] (optional ['seconds_lost', "
               "'pipeline_length', 'step', 'cause', 'members', 'microbatch', 'generation']); "
               "missing ['new_map'], unexpected ['extra']")
    with pytest.raises(ValueError, match=re.escape(message)):
        fire(trainer, "on_failover", old_map={}, extra=1)  # type: ignore[arg-type]


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_injected_drain_fires_hooks_checkpoints_and_stops(tmp_path: Path) -> None:
    """Single process (no failover runtime): the drain checkpoints after step 3 and training stops there."""
    recorder, metrics = Recorder(), BambooMetrics()
    notices = BambooNotices(faults=[{"rank": 0, "at_step": 3}], checkpoint_dir=tmp_path / "drain")
    data = DataLoader(TensorDataset(torch.randn(40, 2), torch.randn(40, 1)), batch_size=2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=10, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        callbacks=[recorder, notices, metrics],  # metrics after notices: logs this step's events
    )
    trainer.fit(Tiny(), data)
    assert trainer.global_step == 3
    assert [name for name, _, _ in recorder.calls] == ["notice", "fallback"]
    notice = recorder.calls[0][2]["notice"]
    assert notice.source == "fault" and notice.rank == 0
    assert notice.detail == "injected drain of rank 0 at step 3"
    assert recorder.calls[1][2] == {"checkpoint_path": str(tmp_path / "drain" / "step3.ckpt")}
    saved = torch.load(tmp_path / "drain" / "step3.ckpt", weights_only=True)
    assert saved["global_step"] == 3
    assert torch.equal(saved["state_dict"]["layer.weight"], trainer.lightning_module.layer.weight)
    assert trainer.callback_metrics["bamboo/preemptions"] == 1.0
    assert trainer.callback_metrics["bamboo/fallbacks"] == 1.0
    assert trainer.progress_bar_metrics["bamboo/preemptions"] == 1.0


@pytest.mark.multiprocess
@pytest.mark.slow
def test_aws_notice_mid_training_drains_at_a_step_boundary(tmp_path: Path) -> None:
    """Two Bamboo ranks; rank 1's fake IMDS starts serving a spot notice mid-training.

    Every rank fires ``on_preemption_notice`` (rank 1's AWS notice) and ``on_fallback`` once, at the same
    step boundary; the drain checkpoint holds that step, whose parameters equal an uninterrupted run's.
    """
    from safetensors.torch import load_file

    from lightning_bamboo.checkpoint.sharded import consolidate_checkpoint
    from tests.bamboo.fake_metadata import FakeMetadata
    from tests.bamboo.launch import run_script

    steps = 12
    with FakeMetadata(notice=True, notice_after=8) as fake:  # ~8 x 50 ms of 404s, then the notice
        # one launch: the uninterrupted reference first (nothing polled), then the run polling the fake IMDS
        args = ["--ref-out", str(tmp_path / "ref"), "--out", str(tmp_path / "run"), "--steps", str(steps),
                "--aws", fake.url]
        run_script("train_notice.py", args, timeout=300, nprocs=2)
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert json.loads((ref / "summary.json").read_text())["global_step"] == steps
    assert json.loads((ref / "events_rank0.json").read_text()) == []
    stopped = json.loads((run / "summary.json").read_text())["global_step"]
    assert 1 <= stopped < steps
    for rank in (0, 1):
        events = json.loads((run / f"events_rank{rank}.json").read_text())
        assert [e["event"] for e in events] == ["notice", "fallback"]
        notice, fallback = events
        assert notice["rank"] == 1 and notice["source"] == "aws"
        assert notice["deadline"] == "2026-11-22T19:40:00Z"
        assert notice["step"] == fallback["step"] == stopped
        assert fallback["path"] == str(run / "drain" / f"step{stopped}.ckpt")
        # no step lost: the last completed step equals the uninterrupted run's same step, exactly
        mine = load_file(run / f"step{stopped}_rank{rank}.safetensors")
        theirs = load_file(ref / f"step{stopped}_rank{rank}.safetensors")
        assert mine.keys() == theirs.keys()
        for name in mine:
            torch.testing.assert_close(mine[name], theirs[name], rtol=0, atol=0)
    assert not (run / f"step{stopped + 1}_rank0.safetensors").exists()
    # the drain checkpoint holds exactly that step
    full = consolidate_checkpoint(run / "drain" / f"step{stopped}.ckpt")
    for rank in (0, 1):
        for name, value in load_file(ref / f"step{stopped}_rank{rank}.safetensors").items():
            torch.testing.assert_close(full[name], value, rtol=0, atol=0)
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["bamboo/preemptions"] == 1.0 and metrics["bamboo/fallbacks"] == 1.0
    assert metrics["bamboo/pipeline_length"] == 2.0


class SigtermAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # let the watcher thread (0.1 s poll) see it within a few steps


def test_sigterm_during_training_drains_instead_of_ending(tmp_path: Path) -> None:
    """Lightning alone ends training on SIGTERM; with the SIGTERM source it becomes a notice and a drain."""
    recorder = Recorder()
    notices = BambooNotices(sigterm=True, checkpoint_dir=tmp_path / "drain")
    data = DataLoader(TensorDataset(torch.randn(80, 2), torch.randn(80, 1)), batch_size=2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=40, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[SigtermAt(2), recorder, notices],
    )
    trainer.fit(Tiny(), data)
    assert 2 <= trainer.global_step < 40
    assert [name for name, _, _ in recorder.calls] == ["notice", "fallback"]
    assert recorder.calls[0][2]["notice"].source == "sigterm"
    assert (tmp_path / "drain" / f"step{trainer.global_step}.ckpt").exists()
    assert not trainer.received_sigterm  # Lightning's handler was not the one that ran
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # everything restored after fit
