"""Bamboo pipeline schedules as data: 1F1B, eager forward redundancy, validation, grids, lowering.

A schedule is ``dict[rank, list[Action | None]]`` (one entry per unit time slot, ``None`` = bubble), tested
with no processes at all; the runtime only executes ``rank_program(schedule, rank)``. See
``docs/bamboo-schedule.md``.
"""

from .actions import Action, ActionKind, Schedule, ScheduleError
from .cost import UNIT_COSTS, makespan, predicted_overhead, program_makespan
from .dependencies import dependencies, place_by_priority, place_programs
from .grid import bubble_fraction, format_grid, parse_grid, rank_program
from .lowering import Comm, CommKind, LoweredAction, format_program, lower_schedule
from .one_f_one_b import build_1f1b, one_f_one_b_program
from .redundancy import add_forward_redundancy, forward_redundancy_windows, place_in_bubbles
from .validate import validate_schedule

__all__ = [
    "UNIT_COSTS",
    "Action",
    "ActionKind",
    "Comm",
    "CommKind",
    "LoweredAction",
    "Schedule",
    "ScheduleError",
    "add_forward_redundancy",
    "bubble_fraction",
    "build_1f1b",
    "dependencies",
    "format_grid",
    "format_program",
    "forward_redundancy_windows",
    "lower_schedule",
    "makespan",
    "one_f_one_b_program",
    "parse_grid",
    "place_by_priority",
    "place_in_bubbles",
    "place_programs",
    "predicted_overhead",
    "program_makespan",
    "rank_program",
    "validate_schedule",
]
