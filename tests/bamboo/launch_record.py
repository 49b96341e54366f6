"""The supervisor's JSON record of a job (``BAMBOO_EVENTS``, docs/bamboo-elastic-reference.md), read by the
tests instead of the lines and grids it prints."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_bamboo.layout.ownership import OwnershipMap
from tests.process import launch_env

NAME = "launch_record.json"
"""The record's file name in a test's output folder."""


def record_env(out: Path, fault: str = "") -> dict[str, str]:
    """The launch environment (:func:`~tests.process.launch_env`) with ``fault`` injected (``BAMBOO_FAULT``)
    and the supervisor's record kept in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    return launch_env({"BAMBOO_FAULT": fault, "BAMBOO_EVENTS": str(out / NAME)})


@dataclass(frozen=True)
class Change:
    """One generation change the supervisor published."""

    kind: str
    lost: list[int]
    left: list[int]
    joined: list[int]
    old: OwnershipMap
    new: OwnershipMap


def grid(owners: OwnershipMap) -> list[list[int]]:
    """The map as its printed grid: one row per pipeline (by id), the owner of each stage."""
    return [[owners.pipelines[p][s] for s in range(owners.num_stages)] for p in owners.pipeline_ids()]


@dataclass(frozen=True)
class Record:
    """The record as the supervisor last wrote it."""

    data: dict[str, Any]

    @classmethod
    def read(cls, path: Path) -> Record:
        assert path.exists(), f"the supervisor wrote no record at {path}"
        return cls(json.loads(path.read_text()))

    @property
    def changes(self) -> list[Change]:
        return [
            Change(c["kind"], c["lost"], c["left"], c["joined"], OwnershipMap.from_json(c["old"]),
                   OwnershipMap.from_json(c["new"]))
            for c in self.data["changes"]
        ]

    def summary(self) -> list[tuple[str, list[int]]]:
        """``(kind, lost)`` of every change, in order (as the headlines ``failover: lost [1]`` say)."""
        return [(c.kind, c.lost) for c in self.changes]

    def history(self) -> list[tuple[str, list[int], list[int]]]:
        """``(kind, lost, joined)`` of every change, in order."""
        return [(c.kind, c.lost, c.joined) for c in self.changes]

    def grids(self) -> list[list[list[int]]]:
        """The grid of every new map, in order."""
        return [grid(c.new) for c in self.changes]

    @property
    def exits(self) -> dict[int, int | None]:
        return {int(m): code for m, code in self.data["exits"].items()}

    def __getitem__(self, key: str) -> Any:
        return self.data[key]


def wait_record(path: Path, until: Callable[[Record], bool], alive: Callable[[], bool], deadline: float,
                what: str) -> Record:
    """Poll the record file until ``until`` holds (the job must stay ``alive`` and finish by ``deadline``,
    a ``time.monotonic()`` value)."""
    while True:
        if path.exists():
            record = Record.read(path)
            if until(record):
                return record
        assert alive(), f"the job ended before {what}"
        assert time.monotonic() < deadline, f"no {what} before the deadline"
        time.sleep(0.05)


def worker_events(out: Path, member: int, event: str | None = None) -> list[dict[str, Any]]:
    """The Bamboo events member ``member`` logged (``train_elastic.py --events``: ``BambooEventLog``), all or
    those named ``event``; none when it logged none (the log's file is made by the first event)."""
    path = out / "events" / f"events-member{member}.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in records if event is None or r["event"] == event]
