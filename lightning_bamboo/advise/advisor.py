"""Candidate configurations of one measured job, each replayed over a trace, and the one to recommend."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_bamboo.layout.ownership import RECOVERY_MODES
from lightning_bamboo.simulate.costs import Costs
from lightning_bamboo.simulate.model import (
    Prices,
    Result,
    simulate_checkpoint_restart,
    young_daly_interval,
)
from lightning_bamboo.simulate.run import Validation, replay, replay_bamboo, validate
from lightning_bamboo.simulate.traces import Trace

INTERVAL_FACTORS = (0.5, 1.0, 2.0)
"""Checkpoint-restart candidates: the Young/Daly interval times these (1.0: Young/Daly itself)."""


@dataclass(frozen=True)
class Candidate:
    """One configuration (``system:stages=S[:key=value]``) and its replay; ``recovery``: Bamboo's mode
    (``BambooStrategy(recovery=...)``), ``None`` for the other systems."""

    name: str
    stages: int
    result: Result
    note: str = ""
    recovery: str | None = None


@dataclass(frozen=True)
class Advice:
    candidates: list[Candidate]
    recommended: Candidate
    on_demand: Candidate
    validation: Validation | None
    """The replay of the measured run's own window against what it did; ``None`` when the costs have none."""

    @property
    def sim_error(self) -> float:
        return self.validation.sim_error if self.validation is not None else math.nan

    @property
    def value_vs_on_demand(self) -> float:
        """The recommended configuration's samples per dollar over on-demand machines' (same stages)."""
        od = self.on_demand.result.value
        return self.recommended.result.value / od if od > 0 else math.inf


def _stage_counts(layouts: dict[str, float]) -> set[int]:
    """The stage counts of layouts keyed ``'SxP'``."""
    return {int(k.split("x")[0]) for k in layouts}


def measured_stages(costs: Costs) -> list[int]:
    """Stage counts (>= 2: a replica needs a neighbour) with a measured step time for Bamboo (redundancy on),
    one without it, and a measured relaunch for checkpoint-restart."""
    plain = _stage_counts(costs.cr_step_s_by_layout or costs.step_s_by_layout)
    both = _stage_counts(costs.step_s_by_layout) & plain & _stage_counts(costs.relaunch_s_by_layout)
    return sorted(s for s in both if s >= 2)


def priced_recoveries(costs: Costs, stages: int) -> list[str]:
    """The recovery modes whose failure-free step the costs measured at ``stages`` stages
    (the mode the costs were measured under always: the measured stage counts have it)."""
    return [mode for mode in RECOVERY_MODES if stages in _stage_counts(costs.recovery_steps(mode))]


def advise(
    trace: Trace,
    costs: Costs,
    prices: Prices,
    compression: float,
    max_pipelines: int | None = None,
) -> Advice:
    """Replay every candidate: per measured stage count, Bamboo under every recovery mode the costs price
    (:func:`priced_recoveries`; checkpoints only if it falls back), checkpoint-restart at the Young/Daly
    interval times each of :data:`INTERVAL_FACTORS`, and on-demand machines; recommend the most samples per
    dollar (on-demand included).

    Raises:
        ValueError: when the costs measured no stage count for both systems, or their live results are
            malformed.
    """
    stages_measured = measured_stages(costs)
    if not stages_measured:
        raise ValueError(
            f"the costs measure no stage count >= 2 with and without redundancy and a relaunch "
            f"(step_s_by_layout {sorted(costs.step_s_by_layout)}, checkpoint_restart_step_s_by_layout "
            f"{sorted(costs.cr_step_s_by_layout)}, relaunch_s_by_layout {sorted(costs.relaunch_s_by_layout)})"
        )
    candidates: list[Candidate] = []
    on_demand: dict[int, Candidate] = {}
    for stages in stages_measured:
        comparison = replay(trace, costs, stages, prices, compression, max_pipelines=max_pipelines)
        for recovery in priced_recoveries(costs, stages):
            bamboo = comparison.bamboo if recovery == costs.recovery else replay_bamboo(
                trace, costs, stages, prices.spot, recovery, compression=compression, cap=max_pipelines)
            checkpoints = bamboo.checkpoint_interval_s
            candidates.append(Candidate(f"bamboo:stages={stages}:recovery={recovery}", stages, bamboo,
                                        "no checkpoints" if checkpoints is None else
                                        f"falls back: checkpoints every {checkpoints:.3g} s (Young/Daly)",
                                        recovery))
        duration = trace.duration_s / compression
        groups = trace.removal_groups()
        mtbf = duration / groups if groups else math.inf
        base = young_daly_interval(costs.checkpoint_s, mtbf) if groups else None
        for factor in INTERVAL_FACTORS if base is not None else (1.0,):
            interval = None if base is None else base * factor
            result = comparison.checkpoint_restart if factor == 1.0 else simulate_checkpoint_restart(
                trace, costs, stages, prices.spot, compression, max_pipelines, checkpoint_interval_s=interval
            )
            name = f"checkpoint_restart:stages={stages}"
            if interval is not None:
                name += f":checkpoint_every={interval:.3g}s"
            note = "no preemptions: no checkpoints" if interval is None else f"{factor:g} x Young/Daly"
            candidates.append(Candidate(name, stages, result, note))
        nodes = round(comparison.on_demand.node_seconds / comparison.on_demand.duration_s)
        name = f"on_demand:stages={stages}:nodes={nodes}"
        on_demand[stages] = Candidate(name, stages, comparison.on_demand)
        candidates.append(on_demand[stages])
    best = max(candidates, key=lambda c: c.result.value)
    validation = validate(costs) if costs.raw.get("live") else None
    return Advice(candidates, best, on_demand[best.stages], validation)
