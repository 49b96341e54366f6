"""Published traces as they are: repeated rows, time that goes back, gaps — put into one replayable order.

Policy (docs/bamboo-replay.md, "Traces as published"): exact repeats of an earlier row are dropped; the rows
left are cut into segments at every backwards jump in time; the segments are replayed one after another,
each shifted to start where the previous one ended. Rows keep their file order inside a segment. In a count
trace the last sample at an instant wins (the ones before it held for no time).
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from itertools import pairwise

GAP_FACTOR = 10.0
"""A count trace's interval longer than this many median sampling intervals is reported as a gap."""


@dataclass(frozen=True)
class Row:
    """One data line: its number in the file, its text, its time (seconds) and what makes it the same row
    as another (the parsed fields, so whitespace does not count)."""

    number: int
    line: str
    t_s: float
    key: Hashable


@dataclass(frozen=True)
class Repairs:
    """What :func:`in_replay_order` did to a trace's rows."""

    segments: int = 1
    """Runs of rows in time order that were replayed one after another (1: time never went back)."""
    jumps: tuple[int, ...] = ()
    """Line numbers where time went back (each starts a segment)."""
    duplicates: tuple[int, ...] = ()
    """Line numbers of the exact repeats that were dropped."""
    superseded: tuple[int, ...] = ()
    """Line numbers of count samples dropped for a later sample at the same instant."""
    gaps: tuple[tuple[int, float], ...] = ()
    """``(line, seconds)`` of sampling gaps in a count trace (its count holds through each)."""

    def __bool__(self) -> bool:
        return self.segments > 1 or bool(self.duplicates) or bool(self.superseded) or bool(self.gaps)

    def describe(self) -> str:
        """One sentence with the counts, for the warning."""
        parts = []
        if self.segments > 1:
            parts.append(f"time went back {len(self.jumps)} times (lines {_lines(self.jumps)}): replayed as "
                         f"{self.segments} segments one after another")
        if self.duplicates:
            parts.append(f"dropped {len(self.duplicates)} exact repeated rows "
                         f"(lines {_lines(self.duplicates)})")
        if self.superseded:
            parts.append(f"dropped {len(self.superseded)} count samples superseded by a later one at the "
                         f"same time (lines {_lines(self.superseded)})")
        if self.gaps:
            longest = max(seconds for _, seconds in self.gaps)
            parts.append(f"{len(self.gaps)} sampling gaps longer than {GAP_FACTOR:g}x the median interval "
                         f"(lines {_lines([n for n, _ in self.gaps])}; longest {longest:g} s): the count "
                         "before each holds through it")
        return "; ".join(parts)


def _lines(numbers: Sequence[int], shown: int = 5) -> str:
    text = ", ".join(str(n) for n in numbers[:shown])
    return text + (f", ... ({len(numbers) - shown} more)" if len(numbers) > shown else "")


def in_replay_order(rows: Sequence[Row], count_samples: bool = False) -> tuple[list[Row], Repairs]:
    """The rows to replay, their times shifted so that they never go back, and what was done.

    ``count_samples``: the rows sample a count at an interval (GCE): the last sample at an instant wins, and
    long silences are reported as gaps.
    """
    seen: set[Hashable] = set()
    kept: list[Row] = []
    duplicates: list[int] = []
    for row in rows:
        if row.key in seen:
            duplicates.append(row.number)
            continue
        seen.add(row.key)
        kept.append(row)
    ordered: list[Row] = []
    jumps: list[int] = []
    shift = 0.0
    for previous, row in zip([None, *kept[:-1]], kept):
        if previous is not None and row.t_s < previous.t_s:
            jumps.append(row.number)
            shift = ordered[-1].t_s - row.t_s  # this segment starts where the previous one ended
        ordered.append(row if shift == 0.0 else replace(row, t_s=row.t_s + shift))
    superseded: list[int] = []
    if count_samples:
        superseded = [row.number for row, after in pairwise(ordered) if after.t_s == row.t_s]
        dropped = set(superseded)
        ordered = [row for row in ordered if row.number not in dropped]
    gaps = _gaps(ordered) if count_samples else []
    return ordered, Repairs(len(jumps) + 1, tuple(jumps), tuple(duplicates), tuple(superseded), tuple(gaps))


def _gaps(rows: Sequence[Row]) -> list[tuple[int, float]]:
    steps = [(b.number, b.t_s - a.t_s) for a, b in pairwise(rows) if b.t_s > a.t_s]
    if len(steps) < 2:
        return []
    typical = statistics.median(seconds for _, seconds in steps)
    return [(n, seconds) for n, seconds in steps if seconds > GAP_FACTOR * typical]
