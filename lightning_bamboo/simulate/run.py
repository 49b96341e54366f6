"""Replay one trace against the three systems, compare them, and validate against the live benchmark."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning_bamboo.simulate.costs import Costs
from lightning_bamboo.simulate.model import (
    Prices,
    Result,
    simulate_bamboo,
    simulate_checkpoint_restart,
    simulate_on_demand,
    young_daly_interval,
)
from lightning_bamboo.simulate.traces import Trace, parse_events


@dataclass
class Comparison:
    bamboo: Result
    checkpoint_restart: Result
    on_demand: Result

    @property
    def results(self) -> list[Result]:
        return [self.bamboo, self.checkpoint_restart, self.on_demand]

    @property
    def vs_checkpoint_restart(self) -> float:
        """Bamboo's throughput over checkpoint-restart's, on the same spot nodes."""
        cr = self.checkpoint_restart.samples_per_s
        return self.bamboo.samples_per_s / cr if cr > 0 else math.inf

    @property
    def vs_on_demand_value(self) -> float:
        """Bamboo's samples per dollar over on-demand machines'."""
        od = self.on_demand.value
        return self.bamboo.value / od if od > 0 else math.inf


def replay(
    trace: Trace,
    costs: Costs,
    stages: int | None = None,
    prices: Prices | None = None,
    compression: float = 1.0,
    on_demand_nodes: int | None = None,
    max_pipelines: int | None = None,
    points: int = 400,
    recovery: str | None = None,
) -> Comparison:
    """Replay ``trace`` (its times divided by ``compression``) against Bamboo (under ``recovery``; default:
    the mode the costs were measured under, ``costs.recovery``),
    checkpoint-restart, on-demand.

    ``stages`` defaults to the benchmark's; ``on_demand_nodes`` to the trace's mean node count rounded to
    a multiple of ``stages``.
    """
    if compression <= 0:
        raise ValueError(f"compression must be > 0, got {compression}")
    prices = prices or Prices()
    stages = stages or costs.num_stages
    kwargs: dict[str, Any] = {"compression": compression, "cap": max_pipelines, "points": points}
    bamboo = replay_bamboo(trace, costs, stages, prices.spot, recovery, **kwargs)
    cr = simulate_checkpoint_restart(trace, costs, stages, prices.spot, **kwargs)
    if on_demand_nodes is None:
        on_demand_nodes = stages * max(1, round(trace.mean_nodes() / stages))
    od = simulate_on_demand(trace, costs, stages, prices.on_demand, on_demand_nodes, compression, points)
    return Comparison(bamboo, cr, od)


def replay_bamboo(trace: Trace, costs: Costs, stages: int, price: float, recovery: str | None,
                  **kwargs: Any) -> Result:
    """Bamboo under ``recovery`` (:func:`~lightning_bamboo.simulate.model.simulate_bamboo`), checkpointing
    only if its replay has fallbacks (then at the Young/Daly interval of its fallback rate)."""
    bamboo = simulate_bamboo(trace, costs, stages, price, recovery=recovery, **kwargs)
    fallbacks = bamboo.counts.get("fallbacks", 0)
    if fallbacks:
        interval = young_daly_interval(costs.checkpoint_s, bamboo.duration_s / fallbacks)
        bamboo = simulate_bamboo(trace, costs, stages, price, checkpoint_interval_s=interval,
                                 recovery=recovery, **kwargs)
    return bamboo


@dataclass
class Validation:
    """The replay of the live benchmark's own segment against what the benchmark measured."""

    predicted: dict[str, float]
    live: dict[str, float]

    @property
    def errors(self) -> dict[str, float]:
        return {k: abs(self.predicted[k] - self.live[k]) / self.live[k] for k in self.live}

    @property
    def sim_error(self) -> float:
        """Max relative error of the predicted samples/s over both systems."""
        return max(self.errors.values())


def validate(costs: Costs) -> Validation:
    """Replay the benchmark's compressed segment (``events``, already in run seconds) with its own costs.

    Each system replays the events its live run applied (``live.<system>.events`` when the file lists them:
    a Bamboo run without rejoin applies no adds), so the prediction and the run saw the same preemptions.

    Each system in ``live`` (``bamboo``, ``checkpoint_restart``: the benchmark has both, the advisor's probe
    the one it ran) replays its ``wall_s`` at its ``layout`` (default: ``num_stages x max_pipelines``), with
    checkpoints every ``checkpoint_interval_s`` of training when the run took them. Nodes that the events
    remove without adding them first were there from the start (as were ``initial_nodes`` if the system's
    entry or the file lists them).
    """
    raw = costs.raw
    live: dict[str, Any] = raw["live"] if isinstance(raw.get("live"), dict) else {}
    systems = [s for s in ("bamboo", "checkpoint_restart") if s in live]
    if not systems:
        raise ValueError("costs file has no live.bamboo or live.checkpoint_restart results to validate")
    events = raw.get("events")
    if not isinstance(events, list):
        raise ValueError(
            f"costs file: events must be a list of {{t_s, kind, node}}, got {type(events).__name__}"
        )
    initial = list(raw.get("initial_nodes") or [])
    predicted: dict[str, float] = {}
    measured: dict[str, float] = {}
    for system in systems:
        run = live[system]
        stages, pipelines = costs.num_stages, costs.max_pipelines
        if "layout" in run:
            stages, pipelines = (int(x) for x in str(run["layout"]).split("x"))
        applied = run.get("events", events)  # what this system's run applied (e.g. adds without rejoin)
        start = list(run.get("initial_nodes", initial))  # the nodes this run started with
        trace = parse_events(applied, run["wall_s"], start, stages * pipelines)
        interval = run.get("checkpoint_interval_s") or None
        if system == "bamboo":
            result = simulate_bamboo(trace, costs, stages, 1.0, cap=pipelines, checkpoint_interval_s=interval,
                                     recovery=str(run.get("recovery", costs.recovery)))
        else:
            result = simulate_checkpoint_restart(
                trace, costs, stages, 1.0, cap=pipelines, checkpoint_interval_s=interval,
            )
        predicted[system] = result.samples_per_s
        measured[system] = float(run["samples_per_s"])
    return Validation(predicted, measured)
