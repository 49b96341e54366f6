"""Text form of a schedule (rank x step grid) and simple read-outs of it."""

from __future__ import annotations

from .actions import Action, Schedule

__all__ = ["bubble_fraction", "format_grid", "parse_grid", "rank_program"]

_BUBBLE = "."


def format_grid(schedule: Schedule, mark: tuple[int, int] | None = None) -> str:
    """Render ``schedule`` as a rank x step grid; bubbles print as ``.``.

    Args:
        schedule: the schedule to print.
        mark: optional ``(rank, step)`` cell to flag as ``[cell]!``; used in error messages.

    Returns:
        Right-aligned columns, one row per rank, headed by the step numbers; ``parse_grid`` reads it back.
    """
    _check_rectangular(schedule)
    ranks = sorted(schedule)
    num_steps = len(schedule[ranks[0]]) if ranks else 0
    cells = {
        rank: [_BUBBLE if action is None else str(action) for action in schedule[rank]] for rank in ranks
    }
    if mark is not None:
        rank, step = mark
        if rank in cells and 0 <= step < num_steps:
            cells[rank][step] = f"[{cells[rank][step]}]!"
    labels = [f"rank{rank}" for rank in ranks]
    label_width = max([len("step"), *map(len, labels)])
    widths = [max([len(str(step)), *(len(cells[rank][step]) for rank in ranks)]) for step in range(num_steps)]
    lines = ["  ".join(["step".ljust(label_width), *(str(s).rjust(w) for s, w in enumerate(widths))])]
    for rank, label in zip(ranks, labels):
        row = (cell.rjust(width) for cell, width in zip(cells[rank], widths))
        lines.append("  ".join([label.ljust(label_width), *row]))
    return "\n".join(line.rstrip() for line in lines) + "\n"


def parse_grid(text: str) -> Schedule:
    """Read a grid written by ``format_grid`` back into a schedule (blank lines are ignored).

    Raises:
        ValueError: on a missing header, a row label that is not ``rank<N>``, a duplicated rank, or a row
            whose number of cells differs from the header's number of steps.
    """
    lines = [line.split() for line in text.splitlines() if line.strip()]
    if not lines or lines[0][0] != "step":
        raise ValueError(f"grid must start with a 'step 0 1 ...' header line, got {text[:40]!r}")
    num_steps = len(lines[0]) - 1
    schedule: Schedule = {}
    for tokens in lines[1:]:
        label, cells = tokens[0], tokens[1:]
        if not label.startswith("rank") or not label[4:].isdigit():
            raise ValueError(f"grid row label must be 'rank<N>', got {label!r}")
        rank = int(label[4:])
        if rank in schedule:
            raise ValueError(f"grid has two rows for rank {rank}")
        if len(cells) != num_steps:
            raise ValueError(f"grid row {label} has {len(cells)} cells, the header has {num_steps} steps")
        schedule[rank] = [None if cell == _BUBBLE else Action.parse(cell) for cell in cells]
    return schedule


def rank_program(schedule: Schedule, rank: int) -> list[Action]:
    """The actions ``rank`` executes, in order, with bubbles dropped (what the runtime iterates over)."""
    if rank not in schedule:
        raise KeyError(f"rank {rank} is not in the schedule (ranks: {sorted(schedule)})")
    return [action for action in schedule[rank] if action is not None]


def bubble_fraction(schedule: Schedule) -> float:
    """Idle slots / all slots over all ranks; ``(p-1)/(m+p-1)`` for plain 1F1B with unit-time F and B."""
    _check_rectangular(schedule)
    total = sum(len(slots) for slots in schedule.values())
    if total == 0:
        raise ValueError("bubble_fraction of an empty schedule is undefined")
    idle = sum(action is None for slots in schedule.values() for action in slots)
    return idle / total


def _check_rectangular(schedule: Schedule) -> None:
    lengths = {rank: len(slots) for rank, slots in schedule.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"all ranks of a schedule must have the same number of slots, got {lengths}")
