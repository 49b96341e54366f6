"""The costs file the probe writes: the replay's own format (:mod:`lightning_bamboo.simulate.costs`,
schema 2), filled from one run's measurements, with the source of every cost.

What the first steps of a run cannot show (a failover, a rejoin, killing a job) is taken from a reference
costs file measured live by ``benchmarks/bamboo_preemption.py`` and named as such in ``sources``.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lightning_bamboo.simulate.costs import SCHEMA, Costs

PRODUCER = "lightning_bamboo.advise.AdvisorProbe"
MODES_REFERENCE = Path("benchmarks/results/bamboo_modes.json")
"""The recovery modes benchmark's results (``benchmarks/bamboo_modes.py``), which price a peers failover."""
FROM_REFERENCE = ("failover_s", "rejoin_s", "rejoin_delay_s", "failover_warmup_s", "rejoin_warmup_s")
"""Costs of events a probe's steps do not contain: the runtime's failover and rejoin on the reference job."""


@dataclass
class RankReport:
    """One rank's measurements; gathered as one float64 row per rank (field order), nothing pickled."""

    stage: float
    pipeline: float
    step_s: float
    compute_s: float
    fr_s: float
    wait_s: float
    allreduce_s: float
    parameters: float
    parameter_bytes: float
    optimizer_bytes: float
    replica_bytes: float
    startup_s: float
    first_step_s: float
    checkpoint_s: float
    without_fr_s: float = 0.0
    """Mean step with the replica forwards switched off (0: not measured)."""

    @classmethod
    def width(cls) -> int:
        return len(cls.__dataclass_fields__)

    def row(self) -> list[float]:
        return [float(v) for v in asdict(self).values()]

    @classmethod
    def from_row(cls, row: Sequence[float]) -> RankReport:
        return cls(*[float(v) for v in row])


@dataclass(frozen=True)
class Run:
    """What the probe knows about the run it measured."""

    model: str
    num_stages: int
    pipelines: int
    num_microbatches: int
    redundancy: bool
    samples_per_step: float
    warmup_steps: int
    steps: int
    checkpoint_bytes: int
    block_steps: int = 0
    """Measured steps alternated with validation ones in blocks of this many (0 or ``steps``: not)."""
    without_fr_steps: int = 0
    """Steps also measured with the replica forwards switched off (0 or ``steps``), in the blocks after the
    measured ones."""

    @property
    def measured_steps(self) -> str:
        return self._steps_label(0)

    @property
    def without_fr_measured_steps(self) -> str:
        return self._steps_label(1)

    def _steps_label(self, offset: int) -> str:
        """Which steps of the run a set measured: the ``offset``-th role of the probe's cycle of blocks."""
        cycle = 3 if self.without_fr_steps else 2
        block = self.block_steps if 0 < self.block_steps < self.steps else self.steps
        first = self.warmup_steps + 1 + offset * block
        blocks, within = divmod(self.steps - 1, block)
        last = first + cycle * blocks * block + within
        if block < self.steps:
            every = "alternate blocks" if cycle == 2 else f"one block in {cycle}"
            return f"{self.steps} of steps {first}-{last} ({every} of {block})"
        return f"steps {first}-{last}"

    @property
    def layout(self) -> str:
        return f"{self.num_stages}x{self.pipelines}"


def per_stage(ranks: Sequence[RankReport]) -> list[dict[str, float]]:
    """Per stage: the mean over its pipelines of each time, the bubble share, and its state's bytes."""
    out = []
    for stage in sorted({int(r.stage) for r in ranks}):
        mine = [r for r in ranks if int(r.stage) == stage]

        def mean(field: str, rows: list[RankReport] = mine) -> float:
            return statistics.fmean(getattr(r, field) for r in rows)

        step = mean("step_s")
        out.append({
            "stage": stage,
            "step_s": step,
            "compute_s": mean("compute_s"),
            "fr_s": mean("fr_s"),
            "wait_s": mean("wait_s"),
            "allreduce_s": mean("allreduce_s"),
            "bubble_share": mean("wait_s") / step if step > 0 else 0.0,
            "parameters": int(mine[0].parameters),
            "parameter_bytes": int(mine[0].parameter_bytes),
            "optimizer_bytes": int(mine[0].optimizer_bytes),
            "state_bytes": int(mine[0].parameter_bytes + mine[0].optimizer_bytes),
            "replica_bytes": int(mine[0].replica_bytes),
        })
    return out


def plain_step_estimate(step_s: float, stages: list[dict[str, float]]) -> float:
    """The step without redundancy, estimated from a redundant run's per-action times: without the replica
    forward every rank's step shortens by at most its ``FR`` time and the pipeline waits for the slowest rank,
    so ``step - min over stages of fr_s``, but never below the busiest stage's own compute and all-reduce.
    Redundancy costs more than its FR time (the replica's optimizer step and sync, not in the engine's
    trace), so this is too slow, against checkpoint-restart (docs/bamboo-advise.md has the figures); a
    probe run with ``recovery="peers"`` measures the step instead."""
    saved = min(s["fr_s"] for s in stages)
    return max(step_s - saved, max(s["compute_s"] + s["allreduce_s"] for s in stages), 1e-9)


WITHOUT_FR = "measured with FR switched off"
"""The source of a step without redundancy measured in a redundant run (``set_forward_redundancy(False)``)."""


def _quality(source: str) -> int:
    """How directly a source measured a step: estimated, measured in a redundant run with the replica
    forwards switched off (the replica's exchange still in it), measured (a run with that setting)."""
    if source.startswith("estimated"):
        return 0
    return 1 if source.startswith(WITHOUT_FR) else 2


def _reference_value(reference: Costs, key: str) -> Any:
    return reference.raw["costs"].get(key)


def load_modes_reference(path: Path | None, option: str) -> tuple[dict[str, Any] | None, Path | None]:
    """The recovery modes benchmark's results and where they came from: ``path`` (named by the user as
    ``option``; it must exist), else this checkout's committed results if it has them, else ``(None,
    None)``."""
    if path is None:
        packaged = Path(__file__).resolve().parents[2] / MODES_REFERENCE
        path = packaged if packaged.is_file() else None
    elif not path.is_file():
        raise FileNotFoundError(f"{option}: {str(path)!r} does not exist; it prices a failover under "
                                "recovery='peers'; measure it with: python benchmarks/bamboo_modes.py")
    return (json.loads(path.read_text()), path) if path is not None else (None, None)


def peers_failover(reference: Costs, modes: dict[str, Any], modes_path: str) -> tuple[float, str] | None:
    """A failover under ``recovery="peers"`` on the reference job, with its source: the reference's failover
    (under ``reference.recovery``, the mode the preemption benchmark ran) times the ratio of the two modes'
    failover medians that ``benchmarks/bamboo_modes.py`` measured on the same machines under the same
    segment. None when the modes file lacks either median."""
    base = reference.recovery
    try:
        medians = {m: float(modes["modes"][m]["failover_median_s"]) for m in ("peers", base)}
    except (KeyError, TypeError, ValueError):
        return None
    if not all(value > 0 for value in medians.values()):  # also false for nan
        return None
    ratio = medians["peers"] / medians[base]
    return reference.failover_s * ratio, (
        f"reference: failover_s x {ratio:.3f}, the peers / {base} ratio of the failover medians "
        f"({medians['peers']:.3f} / {medians[base]:.3f} s) measured by "
        f"benchmarks/bamboo_modes.py ({modes_path})")


def build(run: Run, ranks: Sequence[RankReport], reference: Costs, reference_path: str,
          modes: dict[str, Any] | None = None, modes_path: str = "") -> dict[str, Any]:
    """The costs file of one run: its measured layout's step (under ``step_s_by_layout`` when it ran with
    redundancy, else ``checkpoint_restart_step_s_by_layout``), the other one measured with the replica
    forwards switched off when the run took such steps (else estimated from its ``FR`` times), checkpoint
    and relaunch costs measured, the rest from ``reference``; a peers failover from ``modes`` (the recovery
    modes benchmark's results) when given (:func:`peers_failover`)."""
    stages = per_stage(ranks)
    step_s = statistics.fmean(r.step_s for r in ranks)
    checkpoint_s = max(r.checkpoint_s for r in ranks)
    startup_s = max(r.startup_s for r in ranks)
    warmup_s = max(r.first_step_s for r in ranks) - step_s  # the first step's excess over a steady one
    relaunch_s = startup_s + checkpoint_s + max(warmup_s, 0.0)
    measured = f"measured: {run.measured_steps} of this run"
    ref = f"reference: {reference_path}"
    sources: dict[str, str] = {}
    costs: dict[str, Any] = {"step_s_by_layout": {}, "checkpoint_restart_step_s_by_layout": {},
                             "replica_step_s_by_layout": {}}
    own, other = ("step_s_by_layout", "checkpoint_restart_step_s_by_layout") if run.redundancy else \
        ("checkpoint_restart_step_s_by_layout", "step_s_by_layout")
    costs[own][run.layout] = step_s
    redundancy = "on" if run.redundancy else "off"
    step = "median of 5 means of consecutive steps"
    sources[f"{own}[{run.layout}]"] = f"{measured} ({step}, redundancy {redundancy})"
    if run.redundancy and run.without_fr_steps:
        costs[other][run.layout] = statistics.fmean(r.without_fr_s for r in ranks)
        sources[f"{other}[{run.layout}]"] = (
            f"{WITHOUT_FR}: {run.without_fr_measured_steps} of this run ({step}, the replica forwards "
            "switched off; the replica's exchange and optimizer step still ran)")
        costs["replica_step_s_by_layout"][run.layout] = costs[other][run.layout]  # recovery="replica"'s step
        sources[f"replica_step_s_by_layout[{run.layout}]"] = (
            f"measured: {run.without_fr_measured_steps} of this run ({step}, recovery='replica': the replica "
            "kept current, its forwards switched off)")
    elif run.redundancy:
        costs[other][run.layout] = plain_step_estimate(step_s, stages)
        sources[f"{other}[{run.layout}]"] = (
            "estimated: the measured redundant step less the smallest per-stage FR time (engine trace); "
            "run the probe with recovery='peers' to measure it")
    costs["step_s"] = step_s
    sources["step_s"] = sources[f"{own}[{run.layout}]"]
    costs["step_s_by_shape"] = {}
    costs["checkpoint_s"] = checkpoint_s
    sources["checkpoint_s"] = (
        "measured: trainer.save_checkpoint of the run's state (median save, slowest rank)")
    costs["relaunch_s_by_layout"] = {run.layout: relaunch_s}
    sources[f"relaunch_s_by_layout[{run.layout}]"] = (
        f"measured: process creation -> training start {startup_s:.3g} s (slowest rank) + restore priced as "
        f"the measured checkpoint save {checkpoint_s:.3g} s + first step's excess {max(warmup_s, 0.0):.3g} s")
    costs["relaunch_warmup_s_by_layout"] = {run.layout: 0.0}
    sources[f"relaunch_warmup_s_by_layout[{run.layout}]"] = "measured: in relaunch_s (first step's excess)"
    stops = dict(reference.restart_stop_s)
    if "drain" in stops:  # a drain saves a checkpoint: this run's, plus the reference's stop around it
        stops["drain"] = max(stops["drain"] - reference.checkpoint_s, 0.0) + checkpoint_s
        sources["restart_stop_s[drain]"] = f"measured checkpoint_s + the rest of the drain from {ref}"
    if "kill" in stops:
        sources["restart_stop_s[kill]"] = ref
    costs["restart_stop_s"] = stops
    costs["restart_s"] = stops.get("kill", 0.0) + relaunch_s
    sources["restart_s"] = "restart_stop_s[kill] + relaunch_s"
    for key in FROM_REFERENCE:
        costs[key] = _reference_value(reference, key)
        sources[key] = ref
    costs["fallback_s"] = None
    sources["fallback_s"] = "none: a fallback is priced as restart_s"
    peers = peers_failover(reference, modes, modes_path) if modes is not None else None
    if peers is not None:
        costs["peers_failover_s"], sources["peers_failover_s"] = peers
    return {
        "schema": SCHEMA,
        "producer": PRODUCER,
        "model": run.model,
        "fingerprint": fingerprint(run),
        "compression": 1.0,
        "num_stages": run.num_stages,
        "max_pipelines": run.pipelines,
        "samples_per_step": run.samples_per_step,
        "events": [],
        "initial_nodes": [f"rank{i}" for i in range(run.num_stages * run.pipelines)],
        "costs": costs,
        "sources": sources,
        "stages": {run.layout: stages},
        "probe": {run.layout: {"redundancy": run.redundancy, "num_microbatches": run.num_microbatches,
                               "warmup_steps": run.warmup_steps, "steps": run.steps,
                               "block_steps": run.block_steps or run.steps,
                               "startup_s": startup_s, "first_step_s": step_s + warmup_s,
                               "checkpoint_bytes": run.checkpoint_bytes}},
        "reference": reference_path,
    }


def fingerprint(run: Run) -> dict[str, Any]:
    """What must agree for two runs' measurements to describe one job (stage counts and widths may differ)."""
    return {"model": run.model, "samples_per_step": run.samples_per_step}


def merge(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new`` with the layouts ``old`` measured (for the same job) kept where ``new`` did not measure them:
    a probe run with redundancy on and one with it off (or at other stage counts) fill one file. A step
    never replaces a more direct measurement of it (estimated < measured with FR switched off < measured
    in a run without redundancy)."""
    if old.get("producer") != PRODUCER or old.get("fingerprint") != new["fingerprint"]:
        return new
    out = json.loads(json.dumps(new))
    for key in ("step_s_by_layout", "checkpoint_restart_step_s_by_layout", "replica_step_s_by_layout",
                "relaunch_s_by_layout", "relaunch_warmup_s_by_layout"):
        out["costs"].setdefault(key, {})
        for layout, value in old["costs"].get(key, {}).items():
            name = f"{key}[{layout}]"
            old_source = old["sources"].get(name, "")
            new_source = out["sources"].get(name)
            better = new_source is not None and _quality(old_source) > _quality(new_source)
            if new_source is None or better:
                out["costs"][key][layout] = value
                out["sources"][name] = old_source
    for key in ("stages", "probe"):
        out[key] = {**old.get(key, {}), **new[key]}
    out["live"] = {**old.get("live", {}), **new.get("live", {})}
    return out


def write(path: Path, data: dict[str, Any]) -> None:
    """Write atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
