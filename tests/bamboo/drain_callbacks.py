"""Callbacks of the elastic drain test's workers: each member polls its own (fake) IMDSv2, the warned one
waits for its notice at a chosen step, and every member logs the Bamboo events it saw (``BambooEventLog``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch import Callback

from lightning_bamboo.callbacks import BambooEventLog, BambooMetrics, BambooNotices


class WaitForNotice(Callback):
    """At step boundary ``at``: write ``<out>/reached{at}`` (the fake IMDS starts serving the notice), then
    hold this member until its watcher has seen the notice, so the drain's step does not depend on timing."""

    def __init__(self, out: Path, at: int, notices: BambooNotices) -> None:
        self.out, self.at, self.notices = out, at, notices

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step != self.at:
            return
        (self.out / f"reached{self.at}").write_text("")
        deadline = time.monotonic() + 60
        assert self.notices.watcher is not None
        while self.notices.watcher.pending() is None:
            if time.monotonic() > deadline:
                raise TimeoutError("the fake IMDS notice was not seen within 60 s")
            time.sleep(0.01)


class RecordEnd(Callback):
    """Writes ``<out>/end_member{m}.json`` when ``fit`` ends: its last global step and bamboo/ metrics."""

    def __init__(self, out: Path, member: int) -> None:
        self.out, self.member = out, member

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """At teardown, not ``on_train_end``: a member that left ends its ``fit`` at the drain boundary."""
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("bamboo/")}
        record = {"metrics": metrics, "global_step": trainer.global_step}
        (self.out / f"end_member{self.member}.json").write_text(json.dumps(record, indent=1))


def notice_callbacks(out: Path, member: int, endpoints: list[str], wait: str = "") -> list[Callback]:
    """This member's callbacks: its own IMDS endpoint (if any) polled every 50 ms, hooks recorded, metrics.

    ``wait`` is ``"MEMBER:STEP"``: that member waits at that step boundary until it has seen its notice.
    """
    url = endpoints[member] if member < len(endpoints) else ""
    aws = {"enabled": True, "endpoint": url, "poll_interval_s": 0.05, "timeout_s": 2.0} if url else None
    notices = BambooNotices(aws=aws)
    waits: list[Callback] = []
    if wait and int(wait.split(":")[0]) == member:
        waits.append(WaitForNotice(out, int(wait.split(":")[1]), notices))
    # order: the wait, then the notices (flag at this boundary), metrics after notices
    return [*waits, BambooEventLog(out / "events"), notices, BambooMetrics(), RecordEnd(out, member)]
