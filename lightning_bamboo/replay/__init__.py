"""Spot-trace replay: what Bamboo, checkpoint-restart and on-demand machines train and cost on one trace.

    python -m lightning_bamboo.replay data/spot-traces/aws-p3-trace.csv --plot p3.png

Costs come from the live preemption benchmark's JSON (``benchmarks/results/bamboo_preemption.json``).
The model and its assumptions: docs/bamboo-replay.md.
"""

from lightning_bamboo.replay.costs import Costs, load_costs
from lightning_bamboo.replay.model import Prices, Result
from lightning_bamboo.replay.published import Repairs
from lightning_bamboo.replay.run import Comparison, Validation, replay, validate
from lightning_bamboo.replay.traces import (
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
    "Trace",
    "TraceFormatError",
    "TraceQuirksWarning",
    "Validation",
    "load_costs",
    "parse_events",
    "parse_trace",
    "replay",
    "validate",
]
