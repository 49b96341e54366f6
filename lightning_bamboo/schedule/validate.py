"""Checks that a schedule in the normal layout (stage ``s`` on rank ``s``) can run and is complete."""

from __future__ import annotations

from ._checks import check_pipeline_shape
from .actions import Action, ActionKind, Schedule, ScheduleError
from .dependencies import dependencies
from .grid import format_grid

__all__ = ["validate_schedule"]


def _fail(schedule: Schedule, message: str, cell: tuple[int, int] | None = None) -> ScheduleError:
    return ScheduleError(f"{message}\n{format_grid(schedule, mark=cell)}")


def _misplaced(action: Action, rank: int, num_stages: int) -> str | None:
    """Why ``action`` cannot run on ``rank`` in the normal layout, or None if it can."""
    if action.kind is ActionKind.FORWARD_REDUNDANT:
        if num_stages < 2:
            return f"{action}: a single-stage pipeline has no replica to run"
        expected = (rank + 1) % num_stages
    else:
        expected = rank
    if action.stage != expected:
        return (
            f"{action} cannot run on rank {rank}: rank {rank} runs stage {rank} "
            f"and the replica of stage {(rank + 1) % num_stages}"
        )
    return None


def validate_schedule(schedule: Schedule, num_stages: int, num_microbatches: int) -> None:
    """Raise ``ScheduleError`` unless ``schedule`` is a complete, executable schedule.

    Checks: ranks are exactly ``0..num_stages-1`` with equal-length rows; every ``F(s, i)`` and ``B(s, i)``
    appears exactly once, on rank ``s``; forward redundancy is absent or complete (every rank ``s`` runs
    ``FR(s+1 mod num_stages, i)`` once per micro-batch, nothing else redundant); each action runs in a later
    slot than every action it depends on (see ``dependencies``); and the last rank's ``FR(0, i)`` runs no
    later than ``B(0, i)``. The error message prints the grid with the offending cell marked ``[..]!``.

    Raises:
        ValueError: if ``num_stages`` or ``num_microbatches`` is below 1.
        ScheduleError: on the first broken rule.
    """
    check_pipeline_shape(num_stages, num_microbatches)
    if sorted(schedule) != list(range(num_stages)):
        raise ScheduleError(f"schedule ranks must be 0..{num_stages - 1}, got {sorted(schedule)}")
    lengths = {len(slots) for slots in schedule.values()}
    if len(lengths) != 1:
        raise ScheduleError(f"all ranks must have the same number of slots, got {sorted(lengths)}")

    slot_of: dict[Action, tuple[int, int]] = {}
    for rank in range(num_stages):
        for t, action in enumerate(schedule[rank]):
            if action is None:
                continue
            if action in slot_of:
                raise _fail(
                    schedule,
                    f"{action} appears twice (first at rank {slot_of[action][0]}, step {slot_of[action][1]})",
                    (rank, t),
                )
            slot_of[action] = (rank, t)
            if action.microbatch >= num_microbatches:
                raise _fail(
                    schedule,
                    f"{action}: microbatch {action.microbatch} is out of range for "
                    f"num_microbatches ({num_microbatches})",
                    (rank, t),
                )
            if action.stage >= num_stages:
                raise _fail(
                    schedule,
                    f"{action}: stage {action.stage} is out of range for num_stages ({num_stages})",
                    (rank, t),
                )
            problem = _misplaced(action, rank, num_stages)
            if problem:
                raise _fail(schedule, problem, (rank, t))

    redundant = any(a.kind is ActionKind.FORWARD_REDUNDANT for a in slot_of)
    kinds = [ActionKind.FORWARD, ActionKind.BACKWARD]
    if redundant:
        kinds.append(ActionKind.FORWARD_REDUNDANT)
    for kind in kinds:
        for stage in range(num_stages):
            for mb in range(num_microbatches):
                if Action(stage, kind, mb) not in slot_of:
                    rank = stage if kind is not ActionKind.FORWARD_REDUNDANT else (stage - 1) % num_stages
                    raise _fail(schedule, f"{Action(stage, kind, mb)} is missing from rank {rank}")

    for action, (rank, t) in slot_of.items():
        if action.kind is ActionKind.FORWARD_REDUNDANT and action.stage == 0:
            own_backward = Action(0, ActionKind.BACKWARD, action.microbatch)
            if t > slot_of[own_backward][1]:
                raise _fail(
                    schedule,
                    f"{action} at rank {rank}, step {t} runs after {own_backward} (rank 0, step "
                    f"{slot_of[own_backward][1]}): stage 0 has freed those activations, the replica protects "
                    "nothing",
                    (rank, t),
                )
        for dep in dependencies(action, num_stages, redundant):
            dep_rank, dep_t = slot_of[dep]
            if dep_t >= t:
                raise _fail(
                    schedule,
                    f"{action} at rank {rank}, step {t} runs before its input {dep} "
                    f"(rank {dep_rank}, step {dep_t}) is ready",
                    (rank, t),
                )
