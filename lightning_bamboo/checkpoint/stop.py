"""The checkpoint a stopped job leaves: a Bamboo checkpoint folder ``trainer.fit(ckpt_path=...)`` resumes.

When the supervisor stops the job (SIGTERM to it), every member is at the same committed step ``k``, inside
the next step (its batch fetched, maybe half run and aborted) or at a step's end, and the generation's process
group may already be cut. The fallback's final snapshot (:mod:`.periodic`) holds layers only; a run resumes
from a Lightning checkpoint, which also holds the trainer's state (loops, callbacks, schedulers, the loader's
position). So each member takes Lightning's checkpoint dict (what ``trainer.save_checkpoint`` would write),
rewinds the batch in flight (the state a checkpoint saved in ``on_train_batch_end`` of step ``k`` has, which
Lightning resumes mid-epoch from), and the members write it in the format of :mod:`.sharded` meeting through
the job's store, not the process group: pipeline 0's members write their stages' tensors, rank 0 the trainer
state. ``consolidate_checkpoint`` reads it like any other.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_bamboo._lightning import private as _private
from lightning_bamboo.step import progress as trainer_progress

if TYPE_CHECKING:
    import lightning.pytorch as pl

FIT_LOOP = "fit_loop"


def path(root: Path, step: int) -> Path:
    """The stop checkpoint of step ``step`` under the job's checkpoint folder (beside the ``step_*``
    snapshots of the fallback, which the pruning of those never removes)."""
    return root / f"stop-step={step}.ckpt"


def trainer_checkpoint(trainer: pl.Trainer) -> dict[str, Any] | None:
    """Lightning's checkpoint dict of ``trainer`` as after the last committed step; ``None`` where it has no
    such state (the first batch of an epoch in flight: there is no mid-epoch state to rewind to; outside a
    training batch, e.g. inside validation)."""
    checkpoint = _private.dump_checkpoint(trainer)
    loop = checkpoint["loops"][FIT_LOOP]
    if trainer_progress.in_flight(loop):
        if loop[_private.FIT_LOOP_BATCH_PROGRESS]["current"]["completed"] == 0:
            return None
        trainer_progress.rewind_in_flight(loop)
        trainer_progress.rewind_loader_positions(loop)
        return checkpoint
    return checkpoint if trainer_progress.at_batch_end(loop) else None


def without_tensors(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` for a member that writes no tensors (not in pipeline 0): the trainer state and the
    optimizers' hyper-parameters only."""
    named = checkpoint["optimizer_states"]
    states = [{"state": {}, "param_groups": optimizer["param_groups"]} for optimizer in named]
    return {**checkpoint, "state_dict": {}, "optimizer_states": states}
