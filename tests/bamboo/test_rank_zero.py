"""A member that becomes rank 0 logs the row the lost rank 0 did not
(:mod:`lightning_bamboo.runtime.rank_zero`), and not one a ``CSVLogger`` already saved: the lost rank 0 may
have saved the row and been killed before it recorded that in the store (a window a loaded machine
stretches)."""

from __future__ import annotations

import csv
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger

from lightning_bamboo.runtime.rank_zero import LOGGED_KEY, RankZeroDuties


def saved_steps(logger: CSVLogger) -> list[int]:
    with open(logger.experiment.metrics_file_path, newline="") as file:
        return [int(row["step"]) for row in csv.DictReader(file) if row.get("train_loss")]


def take_over(logger: CSVLogger, store: dist.Store, step: int) -> None:
    duties = RankZeroDuties()
    duties.row = (step, {"train_loss": 0.5, "epoch": 0})
    trainer = SimpleNamespace(loggers=[logger], progress_bar_callback=None)
    duties.take_over(trainer, store)  # type: ignore[arg-type]


def test_a_row_the_lost_rank_zero_saved_but_did_not_record_is_not_logged_again(tmp_path: Path) -> None:
    old, new = (CSVLogger(tmp_path, name="logs", version=0) for _ in range(2))  # each member's, made at start
    new.experiment  # noqa: B018 (its writer exists before the old rank 0 writes, as on every member)
    for step in (7, 8):  # the lost rank 0 saved steps 7 and 8
        old.log_metrics({"train_loss": 1.0 / (step + 1), "epoch": 0}, step=step)
        old.save()
    store = dist.HashStore()
    store.set(LOGGED_KEY, "7")  # killed before recording step 8
    take_over(new, store, 8)
    assert saved_steps(new) == [7, 8]
    assert store.get(LOGGED_KEY) == b"8"


def test_a_row_the_lost_rank_zero_never_saved_is_logged_once(tmp_path: Path) -> None:
    old, new = (CSVLogger(tmp_path, name="logs", version=0) for _ in range(2))
    new.experiment  # noqa: B018
    old.log_metrics({"train_loss": 0.125, "epoch": 0}, step=7)
    old.save()
    store = dist.HashStore()
    store.set(LOGGED_KEY, "7")  # killed after committing step 8, before its row
    take_over(new, store, 8)
    assert saved_steps(new) == [7, 8]
