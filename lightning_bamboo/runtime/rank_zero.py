"""What rank 0 does for the user that a member takes over when it becomes rank 0 mid-``fit``.

Lightning's loggers and progress bar act on global rank 0 only. In an elastic job rank 0 changes when the
member that had it is lost or drained, and two of its duties would silently stop there:

* **The logged rows.** Lightning logs a step's row after the step's ``on_train_batch_end``; the step commits
  earlier (:mod:`lightning_bamboo.protocol.commit`). A rank 0 lost between the commit of step ``k`` and its
  row leaves step ``k`` committed (the survivors roll it forward) but never logged: the new rank 0 trained
  that batch as another rank, whose loggers do nothing. So rank 0 records in the job's store the last step
  whose row its loggers got (at the next batch's start, the first hook after Lightning logged), every member
  keeps the row its own step ``k`` computed (Lightning computes it on every rank), and a member that becomes
  rank 0 logs its kept row when the record says the old rank 0 did not. Each committed step is then logged
  once, except in one window: a rank 0 lost after its loggers saved step ``k``'s row and before the record
  of it (the training loader's next fetch). There a ``CSVLogger``'s file is read (it holds the row, or not:
  the row is written once), and any other logger gets the row again (at least once; a loaded machine
  stretches the window: a test killing rank 0 two seconds in landed there in 2 of 5 loaded runs).
* **The progress bar.** ``ProgressBar.setup`` disables the bar on every rank but 0; a member that becomes
  rank 0 enables it again and runs the bar's own start hooks (which make the training bar, TQDM or Rich).
"""

from __future__ import annotations

import csv
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_bamboo._lightning import private as _private

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch.distributed as dist

LOGGED_KEY = "rank0/logged_step"
"""The job's store key: the last step whose row rank 0's loggers got (absent: none yet)."""


class RankZeroDuties:
    """One member's part (see the module docstring); the strategy calls :meth:`batch_start` at every training
    batch's start and :meth:`take_over` when this member became rank 0 in a new generation."""

    def __init__(self) -> None:
        self._last_step = -1  # the last step whose row this member has seen
        self.row: tuple[int, dict[str, float]] | None = None  # (step, the row its loggers got or would)

    def batch_start(self, trainer: pl.Trainer, store: dist.Store, is_global_zero: bool) -> None:
        """After Lightning logged the last step (its row is computed on every rank): keep the row; rank 0
        records that its loggers have it."""
        step = trainer.global_step - 1
        if not trainer.loggers or step < 0 or step == self._last_step:
            return  # nothing logged, no step yet, or accumulating (the step's row comes at its last batch)
        self._last_step = step
        every = trainer.log_every_n_steps
        if every <= 0 or (step + 1) % every:  # Lightning's should_update_logs at that step's end
            return
        self.row = (step, {**_private.step_log_metrics(trainer), "epoch": trainer.current_epoch})
        if is_global_zero:
            store.set(LOGGED_KEY, str(step))

    def take_over(self, trainer: pl.Trainer, store: dist.Store) -> None:
        """This member is rank 0 now: log the row the old rank 0 did not, show the progress bar."""
        logged = int(store.get(LOGGED_KEY).decode()) if store.check([LOGGED_KEY]) else -1
        if self.row is not None and self.row[0] > logged and rank_zero_only.rank == 0:
            step, row = self.row
            for logger in trainer.loggers:
                if _saved(logger, step, row):
                    continue
                logger.log_metrics(row, step=step)
                logger.save()
            store.set(LOGGED_KEY, str(step))
        _show_progress_bar(trainer)


def _saved(logger: Logger, step: int, row: dict[str, float]) -> bool:
    """Whether ``logger`` already holds ``step``'s ``row``, where that can be read: a ``CSVLogger``'s file
    (the old rank 0 may have saved the row and been lost before it recorded that). Others: ``False``."""
    if not isinstance(logger, CSVLogger):
        return False
    path = logger.experiment.metrics_file_path
    fs = get_filesystem(path)
    if not fs.isfile(path):
        return False
    with fs.open(path, "r", newline="") as file:
        rows = list(csv.DictReader(file))
    names = [name for name in row if name != "epoch"]
    return any(
        saved.get("step") == str(step) and any(saved.get(name) not in (None, "") for name in names)
        for saved in rows
    )


def _show_progress_bar(trainer: pl.Trainer) -> None:
    """Enable the progress bar and run its own start hooks (they make the bar, which ``setup`` kept from
    being made on this rank); the next batch's end moves it to the epoch's batch."""
    bar: Any = trainer.progress_bar_callback
    if bar is None or bar.is_enabled or trainer.lightning_module is None:
        return
    bar.enable()
    if not bar.is_enabled:  # refresh_rate=0: the user turned it off
        return
    bar.on_train_start(trainer, trainer.lightning_module)
    bar.on_train_epoch_start(trainer, trainer.lightning_module)
