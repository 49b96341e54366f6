"""Where the live preemption benchmark's wall time goes, per restart, failover and join (measured, from the
workers' step and phase files): the replay prices exactly these (docs/bamboo-replay.md, "The model").

A checkpoint-restart restart is split into: ``stop_s`` (kill: SIGKILL of every process; grow: the drain —
the next step boundary, the checkpoint, the processes' exit), ``relaunch_s`` (launch -> first completed step,
less one failure-free step: after it the job trains), split again by the workers' ``phases-*.json`` into
spawn, imports, set-up (model, data, trainer, process-group rendezvous), restore (checkpoint load, pipeline
build) and the first step; then ``warmup_s``, the excess of the next ``WARMUP_WINDOW`` steps over as many
failure-free steps (a fresh process's first steps: allocator, autograd and gloo buffers, caches).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

WARMUP_WINDOW = 10
"""Steps after the first one of a fresh launch (or failover, join) over which the warm-up is measured."""

Row = tuple[int, float, str, str]  # (global_step, wall time, layout, source): benchmarks.bamboo_preemption


def warmup_excess(
    times: Sequence[float], steady_s: float, checkpoints: Sequence[tuple[float, float]], end: float
) -> tuple[float, int] | None:
    """Excess of the steps after ``times[0]`` (consecutive steps' completion times, the first included)
    over ``steady_s`` each, for up to ``WARMUP_WINDOW`` steps completed before ``end``; checkpoints
    ``(time, cost)`` between them are not warm-up and are taken out. ``(excess s, steps)``, or ``None``."""
    window = [t for t in times[: WARMUP_WINDOW + 1] if t <= end]
    if len(window) < 2:
        return None
    span = window[-1] - window[0]
    span -= sum(cost for t, cost in checkpoints if window[0] < t <= window[-1])
    steps = len(window) - 1
    return span - steps * steady_s, steps


def _phases(run_dir: Path, launch: int) -> dict[str, float] | None:
    """Each phase's time over the launch's ranks: the latest (a collective waits for the last rank)."""
    found = [json.loads(p.read_text()) for p in sorted(run_dir.glob(f"phases-launch{launch}-rank*.json"))]
    if not found:
        return None
    return {key: max(f[key] for f in found) for key in found[0]}


def restart_records(
    run_dir: Path,
    t0: float,
    restarts: Sequence[dict[str, Any]],
    rows: Sequence[Row],
    checkpoints: Sequence[tuple[float, float]],
    steady: dict[str, float],
) -> list[dict[str, Any]]:
    """One record per checkpoint-restart restart (times in seconds; ``None`` where the launch was stopped
    before it trained: a later event came first)."""
    records = []
    for i, r in enumerate(restarts):
        end = t0 + restarts[i + 1]["t_s"] if i + 1 < len(restarts) else float("inf")
        mine = [row for row in rows if row[3] == f"steps-launch{r['launch']}-rank0" and row[1] <= end]
        layout = mine[0][2] if mine else r["layout"]
        step = steady.get(layout, 0.0)
        launched = t0 + r["stopped_s"]  # the launch begins (its processes are created from here)
        record: dict[str, Any] = {
            "t_s": r["t_s"], "why": r["why"], "drained": r["drained"], "layout": layout,
            "stop_s": r["stopped_s"] - r["t_s"], "relaunch_s": None, "warmup_s": None, "warmup_steps": 0,
            "phases_s": None,
        }
        if mine:
            record["relaunch_s"] = mine[0][1] - launched - step
            warm = warmup_excess([row[1] for row in mine], step, checkpoints, end)
            if warm is not None:
                record["warmup_s"], record["warmup_steps"] = warm
            phases = _phases(run_dir, r["launch"])
            if phases is not None and "train_start" in phases:
                record["phases_s"] = {
                    "spawn": phases["exec"] - launched,
                    "imports": phases["imported"] - phases["exec"],
                    "setup_and_rendezvous": phases["setup"] - phases["imported"],
                    "restore": phases["train_start"] - phases["setup"],
                    "first_step": mine[0][1] - phases["train_start"],
                }
        records.append(record)
    return records


def event_warmups(
    rows: Sequence[Row], resumed: Sequence[float], ends: Sequence[float], steady: dict[str, float]
) -> list[dict[str, Any]]:
    """Bamboo: per failover or join that completed at ``resumed[i]`` (the first step after it), the warm-up
    of the steps that follow on the new layout (their first completion on any member), until ``ends[i]``."""
    first: dict[int, tuple[float, str]] = {}
    for s, t, layout, _ in rows:
        first.setdefault(s, (t, layout))
    ordered = sorted(first.values())
    out = []
    for at, end in zip(resumed, ends, strict=True):
        after = [(t, layout) for t, layout in ordered if t >= at - 1e-9]
        if not after:
            continue
        layout = after[0][1]
        same = []
        for t, lay in after:
            if lay != layout:
                break
            same.append(t)
        warm = warmup_excess(same, steady.get(layout, 0.0), (), end)
        if warm is not None:
            out.append({"layout": layout, "warmup_s": warm[0], "warmup_steps": warm[1]})
    return out


def median_by(records: Sequence[dict[str, Any]], key: str, field: str) -> dict[str, float]:
    """Median of ``field`` over the records grouped by ``key`` (records without a value are skipped), as a
    cost: a negative median (a warm-up within the steps' noise) is no cost, 0."""
    groups: dict[str, list[float]] = {}
    for r in records:
        if r.get(field) is not None:
            groups.setdefault(str(r[key]), []).append(float(r[field]))
    return {k: max(0.0, statistics.median(v)) for k, v in sorted(groups.items())}


def median_of(records: Sequence[dict[str, Any]], field: str) -> float | None:
    """Median of ``field`` over the records as a cost (>= 0, as :func:`median_by`); ``None`` when none has
    it (not measured in this run)."""
    values = [float(r[field]) for r in records if r.get(field) is not None]
    return max(0.0, statistics.median(values)) if values else None
