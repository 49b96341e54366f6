"""The unit-cost model: how long a schedule takes when each rank runs its program in order.

Unit slots say which actions may run together; they do not say how long a step takes, because a backward
costs about twice a forward. This model runs every rank's program (``rank_program``) in order, as the
engine does: an action starts once the rank is free and every input it depends on has finished
(transfers take no time), and takes ``costs[kind]`` time units. With ``F = 1, B = 2, FR = 1`` (a no-grad
forward of equal-cost stages) it predicts the figures of ``benchmarks/bamboo_overhead.py`` on hardware
where nothing overlaps with compute (see ``docs/bamboo-benchmark.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from .actions import Action, ActionKind, Schedule, ScheduleError
from .dependencies import dependencies
from .grid import rank_program

__all__ = ["UNIT_COSTS", "makespan", "predicted_overhead", "program_makespan"]

UNIT_COSTS: Mapping[ActionKind, float] = {
    ActionKind.FORWARD: 1.0,
    ActionKind.BACKWARD: 2.0,
    ActionKind.FORWARD_REDUNDANT: 1.0,
}
"""Forward 1, backward 2, redundant forward 1 (the model of ``docs/bamboo-benchmark.md``)."""


def program_makespan(
    programs: Mapping[int, Sequence[Action]],
    num_stages: int,
    costs: Mapping[ActionKind, float] = UNIT_COSTS,
    *,
    duration: Callable[[int, int, Action], float] | None = None,
) -> float:
    """Time until the last rank finishes, each rank running its ``programs[rank]`` in order.

    ``duration(rank, index, action)``, when given, is the time of the ``index``-th action of ``rank``'s
    program instead of ``costs[action.kind]`` (measured costs differ by rank, and an action may carry other
    work, e.g. the replica update run by a rank's first ``FR``).

    Raises:
        ScheduleError: if the programs deadlock (a rank waits for an action that never runs before it).
    """
    redundant = any(a.kind is ActionKind.FORWARD_REDUNDANT for program in programs.values() for a in program)
    end: dict[Action, float] = {}
    free = dict.fromkeys(programs, 0.0)
    cursor = dict.fromkeys(programs, 0)
    remaining = sum(len(program) for program in programs.values())
    while remaining:
        progressed = False
        for rank, program in programs.items():
            while cursor[rank] < len(program):
                action = program[cursor[rank]]
                inputs = dependencies(action, num_stages, redundant)
                if not all(dep in end for dep in inputs):
                    break
                start = max([free[rank], *(end[dep] for dep in inputs)])
                cost = costs[action.kind] if duration is None else duration(rank, cursor[rank], action)
                end[action] = free[rank] = start + cost
                cursor[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ScheduleError("deadlock: the programs wait on each other")
    return max(free.values(), default=0.0)


def makespan(schedule: Schedule, costs: Mapping[ActionKind, float] = UNIT_COSTS) -> float:
    """:func:`program_makespan` of the schedule's per-rank programs."""
    programs = {rank: rank_program(schedule, rank) for rank in schedule}
    return program_makespan(programs, len(schedule), costs)


def predicted_overhead(
    redundant: Schedule, plain: Schedule, costs: Mapping[ActionKind, float] = UNIT_COSTS
) -> float:
    """The model's ``rc_overhead``: step time of ``redundant`` over step time of ``plain``."""
    return makespan(redundant, costs) / makespan(plain, costs)
