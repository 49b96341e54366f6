"""Spot traces: AWS ``time_ms,add|remove,node`` event lines and GCE-style ``date, time, count`` samples."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Literal

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


_AWS = re.compile(r"^\s*(\d+)\s*,\s*(add|remove)\s*,\s*(\S+)\s*$")
_GCE = re.compile(r"^\s*(\d{4}-\d{2}-\d{2})\s*,\s*(\d{2}:\d{2}:\d{2})\s*,\s*(\d+)\s*$")


def parse_trace(path: str | Path, duration_s: float | None = None) -> Trace:
    """Read a trace file in either format (decided by its first data line).

    AWS lines ``time_ms,add|remove,node``: a removal of a node that is not alive, an add of one that is,
    or time going backwards is an error. GCE lines ``YYYY-MM-DD, HH:MM:SS, count``: each change of the
    count becomes adds of fresh nodes ``gce-<k>`` or removals of the most recently added ones (LIFO).
    Blank lines and ``#`` comments are skipped. ``duration_s`` defaults to the last event's time.

    Raises:
        TraceFormatError: naming the file, the line number and the line.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file {str(path)!r} does not exist")
    lines = [(n, line.rstrip("\n")) for n, line in enumerate(path.read_text().splitlines(), start=1)]
    data = [(n, line) for n, line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not data:
        raise TraceFormatError(f"{path}: no events (empty trace)")
    fmt = "gce" if _GCE.match(data[0][1]) else "aws"
    events = _parse_gce(path, data) if fmt == "gce" else _parse_aws(path, data)
    end = events[-1].t_s if events else 0.0
    if duration_s is not None and duration_s < end:
        raise ValueError(f"duration_s ({duration_s}) ends before the trace's last event at {end} s")
    return Trace(tuple(events), duration_s if duration_s is not None else end, path.name)


def _bad(path: Path, number: int, line: str, expected: str) -> TraceFormatError:
    return TraceFormatError(f"{path}:{number}: expected {expected}, got {line!r}")


def _parse_aws(path: Path, data: list[tuple[int, str]]) -> list[Event]:
    events: list[Event] = []
    alive: set[str] = set()
    last = 0.0
    for number, line in data:
        match = _AWS.match(line)
        if match is None:
            raise _bad(path, number, line, "'time_ms,add|remove,node' (AWS trace line)")
        t_s, kind, node = int(match[1]) / 1000.0, match[2], match[3]
        if t_s < last:
            raise _bad(path, number, line, f"a time >= the previous line's {int(last * 1000)} ms")
        if kind == "add" and node in alive:
            raise _bad(path, number, line, f"an add of a node that is not alive ({node} already is)")
        if kind == "remove" and node not in alive:
            raise _bad(path, number, line, f"a remove of an alive node ({node} is not alive)")
        (alive.add if kind == "add" else alive.discard)(node)
        events.append(Event(t_s, kind, node))  # type: ignore[arg-type]
        last = t_s
    return events


def _parse_gce(path: Path, data: list[tuple[int, str]]) -> list[Event]:
    events: list[Event] = []
    alive: list[str] = []
    start: datetime | None = None
    last = 0.0
    fresh = 0
    for number, line in data:
        match = _GCE.match(line)
        if match is None:
            raise _bad(path, number, line, "'YYYY-MM-DD, HH:MM:SS, count' (GCE count sample)")
        try:
            when = datetime.fromisoformat(f"{match[1]}T{match[2]}")
        except ValueError:
            raise _bad(path, number, line, "a valid date and time") from None
        start = start or when
        t_s = (when - start).total_seconds()
        if t_s < last:
            raise _bad(path, number, line, "a time at or after the previous sample's")
        count = int(match[3])
        while len(alive) < count:
            fresh += 1
            alive.append(f"gce-{fresh}")
            events.append(Event(t_s, "add", alive[-1]))
        while len(alive) > count:
            events.append(Event(t_s, "remove", alive.pop()))
        last = t_s
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
    for event in checked:
        if event.node not in seen and event.kind == "remove":
            start.append(event.node)
        seen.add(event.node)
    k = 0
    starts_with_adds = any(e.kind == "add" and e.t_s == 0 for e in checked)
    while not starts_with_adds and len(start) < fill_to:
        k += 1
        if f"initial-{k}" not in seen:
            start.append(f"initial-{k}")
    lines = [f"0,add,{node}" for node in start] + [
        f"{round(e.t_s * 1000)},{e.kind},{e.node}" for e in sorted(checked, key=lambda e: e.t_s)
    ]
    parsed = _parse_aws(Path("<benchmark events>"), list(enumerate(lines, start=1)))
    return Trace(tuple(parsed), duration_s, "benchmark segment")
