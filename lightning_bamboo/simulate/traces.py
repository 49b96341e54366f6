"""Spot traces: AWS ``time_ms,add|remove,node`` event lines and GCE-style ``date, time, count`` samples
(as published: see :mod:`lightning_bamboo.simulate.published` for repeated rows and time that goes back)."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Literal, cast

from lightning_bamboo.simulate.published import Repairs, Row, in_replay_order

EventKind = Literal["add", "remove"]


@dataclass(frozen=True)
class Event:
    """Node ``node`` joins (``add``) or is preempted (``remove``) at ``t_s`` seconds from the trace start."""

    t_s: float
    kind: EventKind
    node: str


@dataclass(frozen=True)
class Trace:
    """Events in time order, and how long the trace lasts (seconds)."""

    events: tuple[Event, ...]
    duration_s: float
    name: str = ""
    repairs: Repairs = field(default_factory=Repairs)
    """What was done to replay the published file (segments joined, repeats dropped, gaps)."""

    def nodes_at(self, t_s: float) -> int:
        alive = 0
        for event in self.events:
            if event.t_s > t_s:
                break
            alive += 1 if event.kind == "add" else -1
        return alive

    def removal_groups(self) -> int:
        """Preemption events: removals at distinct timestamps (one bulk preemption counts once)."""
        return len({e.t_s for e in self.events if e.kind == "remove"})

    def mean_nodes(self) -> float:
        """Time-averaged number of alive nodes."""
        if self.duration_s <= 0:
            return float(self.nodes_at(0.0))
        total, alive, last = 0.0, 0, 0.0
        for event in self.events:
            total += alive * (min(event.t_s, self.duration_s) - last)
            last = min(event.t_s, self.duration_s)
            alive += 1 if event.kind == "add" else -1
        total += alive * (self.duration_s - last)
        return total / self.duration_s


class TraceFormatError(ValueError):
    """A trace line that is neither format, with its file and line number."""


class TraceQuirksWarning(UserWarning):
    """A published trace was replayed with repairs (segments joined, repeats dropped, gaps held)."""


_AWS = re.compile(r"^\s*(\d+)\s*,\s*(add|remove)\s*,\s*(\S+)\s*$")
_GCE = re.compile(r"^\s*(\d{4}-\d{2}-\d{2})\s*,\s*(\d{2}:\d{2}:\d{2})\s*,\s*(\d+)\s*$")


def parse_trace(path: str | Path, duration_s: float | None = None) -> Trace:
    """Read a trace file in either format (decided by its first data line), as published.

    AWS lines ``time_ms,add|remove,node``; GCE lines ``YYYY-MM-DD, HH:MM:SS, count``, where each change of
    the count becomes adds of fresh nodes ``gce-<k>`` or removals of the most recently added ones (LIFO).
    Blank lines and ``#`` comments are skipped. Published files repeat rows, go back in time and have gaps:
    exact repeats are dropped, the file is cut into segments at every backwards jump and they are replayed
    one after another (:mod:`lightning_bamboo.simulate.published`), with one :class:`TraceQuirksWarning`
    saying what was done. ``duration_s`` defaults to the last event's time.

    Raises:
        TraceFormatError: naming the file, the line number and the line, for a line in neither format, an
            invalid date, or (AWS) an add of a node that is alive or a removal of one that is not.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file {str(path)!r} does not exist")
    lines = [(n, line.rstrip("\n")) for n, line in enumerate(path.read_text().splitlines(), start=1)]
    data = [(n, line) for n, line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not data:
        raise TraceFormatError(f"{path}: no events (empty trace)")
    counts = _GCE.match(data[0][1]) is not None
    rows, repairs = in_replay_order(_gce_rows(path, data) if counts else _aws_rows(path, data), counts)
    if repairs:
        warnings.warn(f"{path}: {repairs.describe()} (policy: docs/bamboo-replay.md, Traces as published)",
                      TraceQuirksWarning, stacklevel=2)
    events = _gce_events(rows) if counts else _aws_events(path, rows, joined=repairs.segments > 1)
    end = events[-1].t_s if events else 0.0
    if duration_s is not None and duration_s < end:
        raise ValueError(f"duration_s ({duration_s}) ends before the trace's last event at {end} s")
    return Trace(tuple(events), duration_s if duration_s is not None else end, path.name, repairs)


def _bad(path: Path, number: int, line: str, expected: str) -> TraceFormatError:
    return TraceFormatError(f"{path}:{number}: expected {expected}, got {line!r}")


def _aws_rows(path: Path, data: list[tuple[int, str]]) -> list[Row]:
    rows = []
    for number, line in data:
        match = _AWS.match(line)
        if match is None:
            raise _bad(path, number, line, "'time_ms,add|remove,node' (AWS trace line)")
        rows.append(Row(number, line, int(match[1]) / 1000.0, (int(match[1]), match[2], match[3])))
    return rows


def _aws_events(path: Path, rows: list[Row], joined: bool = False) -> list[Event]:
    """Events of AWS rows already in replay order; every add and removal must fit the nodes alive."""
    events: list[Event] = []
    alive: set[str] = set()
    where = " once the segments are joined" if joined else ""
    for row in rows:
        _, kind, node = cast(tuple[int, EventKind, str], row.key)
        if kind == "add" and node in alive:
            expected = f"an add of a node that is not alive ({node} already is{where})"
            raise _bad(path, row.number, row.line, expected)
        if kind == "remove" and node not in alive:
            raise _bad(path, row.number, row.line, f"a remove of an alive node ({node} is not alive{where})")
        (alive.add if kind == "add" else alive.discard)(node)
        events.append(Event(row.t_s, kind, node))
    return events


def _gce_rows(path: Path, data: list[tuple[int, str]]) -> list[Row]:
    rows = []
    start: datetime | None = None
    for number, line in data:
        match = _GCE.match(line)
        if match is None:
            raise _bad(path, number, line, "'YYYY-MM-DD, HH:MM:SS, count' (GCE count sample)")
        try:
            when = datetime.fromisoformat(f"{match[1]}T{match[2]}")
        except ValueError:
            raise _bad(path, number, line, "a valid date and time") from None
        start = start or when
        rows.append(Row(number, line, (when - start).total_seconds(), (when, int(match[3]))))
    return rows


def _gce_events(rows: list[Row]) -> list[Event]:
    """Each change of the count: adds of fresh nodes, or removals of the most recently added (LIFO)."""
    events: list[Event] = []
    alive: list[str] = []
    fresh = 0
    for row in rows:
        _, count = cast(tuple[datetime, int], row.key)
        while len(alive) < count:
            fresh += 1
            alive.append(f"gce-{fresh}")
            events.append(Event(row.t_s, "add", alive[-1]))
        while len(alive) > count:
            events.append(Event(row.t_s, "remove", alive.pop()))
    return events


def parse_events(
    events: list[dict[str, object]], duration_s: float, initial: list[str] | None = None, fill_to: int = 0
) -> Trace:
    """A trace from the benchmark JSON's ``events`` (``{"t_s", "kind", "node"}``, seconds of run time).

    The nodes alive at the start are ``initial``, plus every node whose first event is a removal, plus
    fresh ``initial-<k>`` nodes up to ``fill_to`` (unless the events add nodes at t=0 themselves); they join
    at t=0 ahead of the events.
    """
    checked: list[Event] = []
    for i, event in enumerate(events):
        try:
            t_s, kind, node = float(event["t_s"]), str(event["kind"]), str(event["node"])  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError):
            raise TraceFormatError(f"events[{i}]: expected {{t_s, kind, node}}, got {event!r}") from None
        if kind not in ("add", "remove"):
            raise TraceFormatError(f"events[{i}]: kind must be 'add' or 'remove', got {kind!r}")
        checked.append(Event(t_s, kind, node))  # type: ignore[arg-type]
    start = list(initial or [])
    seen: set[str] = set(start)
    for applied in checked:
        if applied.node not in seen and applied.kind == "remove":
            start.append(applied.node)
        seen.add(applied.node)
    k = 0
    starts_with_adds = any(e.kind == "add" and e.t_s == 0 for e in checked)
    while not starts_with_adds and len(start) < fill_to:
        k += 1
        if f"initial-{k}" not in seen:
            start.append(f"initial-{k}")
    lines = [f"0,add,{node}" for node in start] + [
        f"{round(e.t_s * 1000)},{e.kind},{e.node}" for e in sorted(checked, key=lambda e: e.t_s)
    ]
    where = Path("<benchmark events>")
    parsed = _aws_events(where, _aws_rows(where, list(enumerate(lines, start=1))))
    return Trace(tuple(parsed), duration_s, "benchmark segment")
