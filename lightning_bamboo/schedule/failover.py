"""Failover as passes over schedule data: who owns which stage, and what the survivors run next.

When rank ``f`` of a pipeline is preempted, its predecessor ``q = (f - 1) % num_stages`` already holds stage
``f``'s replica (layers and optimizer state) and already runs ``FR(f, i)``, the forward of stage ``f``, on
every micro-batch. So the survivors go on without a restart: ``q`` serves stage ``f`` through the replica,
``FR(f, i)`` feeds stage ``f + 1`` in place of ``F(f, i)``, and the lazy replica backward ``BR(f, i)``
replaces ``B(f, i)``. Stage ``f + 1`` is no longer replicated (its replica lived on ``f``) until the job
re-forms, so a second failure next to the first falls back to a checkpoint.

Scope: the rewrite is the schedule for the iterations after the failure (the in-flight iteration is
replayed from its start by the survivors, with no checkpoint load); resuming mid-iteration from the eager
``FR`` activations is the runtime's job and is not modelled here.
"""

from __future__ import annotations

from ._checks import check_pipeline_shape
from .actions import Action, ActionKind, Schedule, ScheduleError
from .dependencies import dependencies, place_by_priority
from .grid import format_grid, rank_program

__all__ = [
    "failover_dependencies",
    "remap_after_failure",
    "rewrite_after_failure",
    "validate_failover_schedule",
]

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
FR, BR = ActionKind.FORWARD_REDUNDANT, ActionKind.BACKWARD_REDUNDANT


def _check_failure(num_stages: int, failed_stage: int) -> None:
    if not isinstance(num_stages, int) or num_stages < 2:
        raise ValueError(
            f"failover needs num_stages >= 2 (a single stage has no replica), got {num_stages!r}"
        )
    if not isinstance(failed_stage, int) or not 0 <= failed_stage < num_stages:
        raise ValueError(f"failed_stage must be in 0..{num_stages - 1}, got {failed_stage!r}")


def remap_after_failure(num_stages: int, failed_stage: int) -> dict[int, list[int]]:
    """Stage ownership of one pipeline after rank ``failed_stage`` is gone.

    Its predecessor ``(failed_stage - 1) % num_stages`` holds the failed stage's replica (layers, optimizer
    state and, thanks to eager ``FR``, the activations), so it now runs both stages; every other survivor
    keeps its own. The lost stage is listed after the predecessor's own.

    Args:
        num_stages: pipeline length before the failure; at least 2 (one stage has no replica to fall back on).
        failed_stage: the rank (= stage) that was lost, in ``0..num_stages-1``.

    Returns:
        surviving rank -> stages it owns, ranks in increasing order.

    Raises:
        ValueError: if ``num_stages < 2`` or ``failed_stage`` is out of range.
    """
    _check_failure(num_stages, failed_stage)
    predecessor = (failed_stage - 1) % num_stages
    owners = {rank: [rank] for rank in range(num_stages) if rank != failed_stage}
    owners[predecessor].append(failed_stage)
    return owners


def failover_dependencies(action: Action, num_stages: int, failed_stage: int) -> list[Action]:
    """``dependencies`` with stage ``failed_stage`` served by its replica: ``F``->``FR``, ``B``->``BR``."""
    replaced = {
        Action(failed_stage, F, action.microbatch): Action(failed_stage, FR, action.microbatch),
        Action(failed_stage, B, action.microbatch): Action(failed_stage, BR, action.microbatch),
    }
    return [replaced.get(dep, dep) for dep in dependencies(action, num_stages, redundant=True)]


def _expected_owner(action: Action, num_stages: int, failed_stage: int) -> int | None:
    """The surviving rank that must run ``action`` after the failure, or None if nobody does."""
    if action.kind is BR:
        return (failed_stage - 1) % num_stages if action.stage == failed_stage else None
    rank = (action.stage - 1) % num_stages if action.kind is FR else action.stage
    return None if rank == failed_stage else rank


def rewrite_after_failure(
    schedule: Schedule, num_stages: int, num_microbatches: int, failed_stage: int
) -> Schedule:
    """The schedule the survivors run once rank ``failed_stage`` is gone.

    Each survivor keeps its program from the redundant ``schedule`` as its priority order. The failed rank's
    row goes; its ``FR(f+1, i)`` go with it. On the predecessor ``q``, ``FR(f, i)`` moves right after
    ``F(q, i)`` (it is now on the critical path: stage ``f + 1`` waits for it) and ``BR(f, i)`` goes right
    before ``B(q, i)``, which needs its input gradient (for ``f = 0``: right after ``B(q, i)``, since nothing
    after stage 0 waits for it). Slots are then chosen by ``place_by_priority``: the predecessor runs two
    stages, so a fixed order could stall; running the first *ready* action cannot.

    Args:
        schedule: a complete redundant schedule (``add_forward_redundancy``) in the normal layout.
        num_stages: pipeline length before the failure, at least 2.
        num_microbatches: micro-batches per iteration.
        failed_stage: the lost rank (= stage).

    Returns:
        surviving rank -> slots; the ranks keep their numbers, so ``failed_stage`` is missing.

    Raises:
        ValueError: on bad sizes, or a schedule without forward redundancy (nothing to fail over to).
    """
    from .validate import validate_schedule

    check_pipeline_shape(num_stages, num_microbatches)
    _check_failure(num_stages, failed_stage)
    validate_schedule(schedule, num_stages, num_microbatches)
    if not any(a is not None and a.kind is FR for a in schedule[0]):
        raise ValueError(
            "rewrite_after_failure needs a schedule with forward redundancy (add_forward_redundancy)"
        )
    f, q = failed_stage, (failed_stage - 1) % num_stages
    programs = {rank: rank_program(schedule, rank) for rank in range(num_stages) if rank != f}
    merged: list[Action] = []
    for action in (a for a in programs[q] if a.kind is not FR or f == 0):
        mb = action.microbatch
        if action.kind is F and f != 0:
            merged += [action, Action(f, FR, mb)]
        elif action.kind is B and f != 0:
            merged += [Action(f, BR, mb), action]
        elif action.kind is B:
            merged += [action, Action(f, BR, mb)]
        else:
            merged.append(action)
    programs[q] = merged
    return place_by_priority(programs, lambda a: failover_dependencies(a, num_stages, f))


def validate_failover_schedule(
    schedule: Schedule, num_stages: int, num_microbatches: int, failed_stage: int
) -> None:
    """Raise ``ScheduleError`` unless ``schedule`` is what the survivors of ``failed_stage`` can run.

    Checks: the ranks are the survivors; every action runs exactly once on its owner (``F``/``B`` of each
    surviving stage on its rank, ``FR(s+1, i)`` on each survivor ``s`` whose successor is alive or failed,
    ``BR(f, i)`` on the predecessor); and every action runs after its inputs (``failover_dependencies``).
    """
    check_pipeline_shape(num_stages, num_microbatches)
    _check_failure(num_stages, failed_stage)
    survivors = sorted(remap_after_failure(num_stages, failed_stage))
    if sorted(schedule) != survivors:
        raise ScheduleError(
            f"failover schedule ranks must be the survivors {survivors}, got {sorted(schedule)}"
        )
    slot_of: dict[Action, tuple[int, int]] = {}
    for rank, row in schedule.items():
        for t, action in enumerate(row):
            if action is None:
                continue
            owner = _expected_owner(action, num_stages, failed_stage)
            if owner != rank or action.microbatch >= num_microbatches or action in slot_of:
                raise ScheduleError(
                    f"{action} does not belong at rank {rank} (expected owner: {owner}, or already placed)\n"
                    + format_grid(schedule, mark=(rank, t))
                )
            slot_of[action] = (rank, t)
    for mb in range(num_microbatches):
        for stage in range(num_stages):
            kinds = (FR, BR) if stage == failed_stage else (F, B, FR)
            for kind in kinds:
                action = Action(stage, kind, mb)
                owner = _expected_owner(action, num_stages, failed_stage)
                if owner is not None and action not in slot_of:
                    raise ScheduleError(f"{action} is missing from rank {owner}\n" + format_grid(schedule))
    for action, (rank, t) in slot_of.items():
        for dep in failover_dependencies(action, num_stages, failed_stage):
            if dep in slot_of and slot_of[dep][1] >= t:
                raise ScheduleError(
                    f"{action} at rank {rank}, step {t} runs before its input {dep} is ready\n"
                    + format_grid(schedule, mark=(rank, t))
                )
