"""Spot-trace replay: what Bamboo, checkpoint-restart and on-demand machines train and cost on one trace.

    python -m lightning_bamboo.simulate data/spot-traces/aws-p3-trace.csv --plot p3.png
    python -m lightning_bamboo.simulate --scenario gpt2-p3     # a PROJECTION from published GPU-scale figures

Costs come from the live preemption benchmark's JSON (``benchmarks/results/bamboo_preemption.json``), or,
for a projection, from a scenario whose every parameter names its source (``scenarios/*.yaml``). The model
and its assumptions: docs/bamboo-replay.md.
"""

from lightning_bamboo.simulate.costs import Costs, load_costs
from lightning_bamboo.simulate.model import Prices, Result
from lightning_bamboo.simulate.projection import project
from lightning_bamboo.simulate.published import Repairs
from lightning_bamboo.simulate.run import Comparison, Validation, replay, validate
from lightning_bamboo.simulate.scenario import Scenario, ScenarioError, load_scenario
from lightning_bamboo.simulate.traces import (
    Event,
    Trace,
    TraceFormatError,
    TraceQuirksWarning,
    parse_events,
    parse_trace,
)

__all__ = [
    "Comparison",
    "Costs",
    "Event",
    "Prices",
    "Repairs",
    "Result",
    "Scenario",
    "ScenarioError",
    "Trace",
    "TraceFormatError",
    "TraceQuirksWarning",
    "Validation",
    "load_costs",
    "load_scenario",
    "parse_events",
    "parse_trace",
    "project",
    "replay",
    "validate",
]
