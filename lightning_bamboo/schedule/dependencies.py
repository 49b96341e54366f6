"""Data dependencies between actions, and placing per-rank programs onto unit time slots.

Time model: every action takes one slot; an action may run in slot ``t`` once everything it depends on ran
in a slot ``< t`` (the tensor is sent at the end of a slot and is there at the start of the next one).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from .actions import Action, ActionKind, Schedule, ScheduleError

__all__ = ["DependencyFn", "dependencies", "place_by_priority", "place_programs"]

DependencyFn = Callable[[Action], list[Action]]


def dependencies(action: Action, num_stages: int, redundant: bool) -> list[Action]:
    """The actions whose results ``action`` needs, in the normal layout (stage ``s`` on rank ``s``).

    Args:
        action: the action to look at.
        num_stages: pipeline length; stage ``num_stages - 1`` sends no gradient back from a successor.
        redundant: whether the schedule runs forward redundancy; then ``B(s, i)`` also waits for
            ``FR(s+1, i)`` on the same rank, because a replica forward after the gradient came back would
            protect nothing (the successor no longer needs its activations for that micro-batch). The
            last rank's ``FR(0, i)`` reads the micro-batch itself and has no such deadline.
    """
    stage, mb = action.stage, action.microbatch
    last = num_stages - 1
    if action.kind is ActionKind.FORWARD:
        return [Action(stage - 1, ActionKind.FORWARD, mb)] if stage > 0 else []
    if action.kind is ActionKind.BACKWARD:
        deps = [Action(stage, ActionKind.FORWARD, mb)]
        if stage < last:
            deps.append(Action(stage + 1, ActionKind.BACKWARD, mb))
        if redundant and stage < last:
            deps.append(Action((stage + 1) % num_stages, ActionKind.FORWARD_REDUNDANT, mb))
        return deps
    # FORWARD_REDUNDANT: the replica of stage t reads stage t-1's output; the replica of stage 0 reads the
    # micro-batch.
    return [Action(stage - 1, ActionKind.FORWARD, mb)] if stage > 0 else []


def _needs_with_producers(
    programs: Mapping[int, Sequence[Action]], deps: DependencyFn
) -> dict[Action, list[Action]]:
    """Each scheduled action's inputs; a ScheduleError if one of them is produced by no rank."""
    present = {action for program in programs.values() for action in program}
    needs = {action: deps(action) for action in present}
    for action, inputs in needs.items():
        missing = [dep for dep in inputs if dep not in present]
        if missing:
            raise ScheduleError(f"{action} depends on {', '.join(map(str, missing))}, which no rank runs")
    return needs


def place_programs(programs: Mapping[int, Sequence[Action]], deps: DependencyFn) -> Schedule:
    """List-schedule fixed per-rank programs: each action goes in the first slot where it is ready.

    The order inside each rank is kept; only the slots are chosen. Dependencies on actions that appear in no
    program are an error (a missing producer would block the pipeline forever).

    Raises:
        ScheduleError: on a missing producer, or when no rank can make progress (deadlock).
    """
    needs = _needs_with_producers(programs, deps)
    # Each action goes in slot max(previous action on its rank + 1, latest input + 1). Ranks are advanced
    # round-robin as far as their inputs are known; a full round with no progress is a deadlock.
    done_at: dict[Action, int] = {}
    cursor = {rank: 0 for rank in programs}
    free_at = {rank: 0 for rank in programs}
    remaining = sum(len(program) for program in programs.values())
    while remaining:
        progressed = False
        for rank, program in programs.items():
            while cursor[rank] < len(program):
                action = program[cursor[rank]]
                inputs = needs[action]
                if not all(dep in done_at for dep in inputs):
                    break
                t = max([free_at[rank], *(done_at[dep] + 1 for dep in inputs)])
                done_at[action] = t
                free_at[rank] = t + 1
                cursor[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            blocked = {
                rank: str(program[cursor[rank]])
                for rank, program in programs.items()
                if cursor[rank] < len(program)
            }
            raise ScheduleError(f"deadlock: every rank waits for an input no rank can produce ({blocked})")
    num_slots = max(free_at.values(), default=0)
    schedule: Schedule = {rank: [None] * num_slots for rank in programs}
    for rank, program in programs.items():
        for action in program:
            schedule[rank][done_at[action]] = action
    return schedule


def place_by_priority(programs: Mapping[int, Sequence[Action]], deps: DependencyFn) -> Schedule:
    """List-schedule with per-rank priorities: in each slot a rank runs its first-listed *ready* action.

    Unlike ``place_programs`` a rank may run a later-listed action while an earlier one waits, so any
    acyclic set of actions is placed without deadlock. The result is still a plain schedule whose per-rank
    order (``rank_program``) is consistent with one timeline, which is all a runtime with blocking receives
    needs to finish.

    Raises:
        ScheduleError: on a missing producer, or a dependency cycle (no rank can run anything).
    """
    needs = _needs_with_producers(programs, deps)
    pending = {rank: list(program) for rank, program in programs.items()}
    done_at: dict[Action, int] = {}
    schedule: Schedule = {rank: [] for rank in programs}
    t = 0
    while any(pending.values()):
        placed = []
        for rank, queue in pending.items():
            ready = next((a for a in queue if all(done_at.get(d, t) < t for d in needs[a])), None)
            schedule[rank].append(ready)
            if ready is not None:
                queue.remove(ready)
                placed.append(ready)
        if not placed:
            blocked = {rank: [str(a) for a in queue] for rank, queue in pending.items() if queue}
            raise ScheduleError(f"dependency cycle at step {t}: nothing can run (left: {blocked})")
        for action in placed:
            done_at[action] = t
        t += 1
    return schedule
