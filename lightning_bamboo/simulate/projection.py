"""A projection: the replay (run.replay, the same model that is validated against the live benchmark) over one
scenario's trace, once per combination of its unknown parameters, printed with every parameter's source."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_bamboo.simulate.model import Result
from lightning_bamboo.simulate.run import Comparison, replay
from lightning_bamboo.simulate.scenario import Scenario
from lightning_bamboo.simulate.traces import Trace

PER = 1_000_000
"""Hours and dollars are given per this many samples trained (at the trace's average rate and price)."""


@dataclass(frozen=True)
class Row:
    """One combination of the unknowns and what the three systems do with it."""

    chosen: dict[str, float]
    comparison: Comparison


def project(scenario: Scenario, trace: Trace) -> list[Row]:
    """Replay ``trace`` in real time (compression 1) for every combination of the scenario's unknowns."""
    rows = []
    for chosen in scenario.combinations():
        values = scenario.values(chosen)
        comparison = replay(
            trace,
            scenario.costs(chosen),
            stages=int(values["stages"]),
            prices=scenario.prices(chosen),
            on_demand_nodes=int(values["on_demand_nodes"]),
            max_pipelines=int(values["max_pipelines"]),
        )
        rows.append(Row(chosen, comparison))
    return rows


def hours(result: Result) -> float:
    """Hours to train ``PER`` samples at the trace's average rate."""
    return PER / result.samples_per_s / 3600.0 if result.samples_per_s > 0 else float("inf")


def dollars(result: Result) -> float:
    """Dollars to train ``PER`` samples (nodes paid for at the trace's average)."""
    return hours(result) * result.dollars_per_hour


def _value(value: object) -> str:
    if isinstance(value, dict):
        return " ".join(f"{k}:{v:g}" for k, v in value.items())
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


def report(scenario: Scenario, trace: Trace, rows: list[Row]) -> list[str]:
    """The projection's text: a banner, every parameter with its source, one table row per combination."""
    unknowns = [p.name for p in scenario.unknowns()]
    lines = [
        f"PROJECTION - NOT MEASURED. Scenario {scenario.name}: {scenario.title} ({scenario.path})",
        "Inputs: the figures below, each with its source; none comes from this repository's live benchmark.",
        "The table is a projection, not a measurement (docs/bamboo-replay.md, Projection at GPU scale).",
        f"trace {trace.name}: {trace.duration_s / 3600:.2f} h, {trace.removal_groups()} preemption events, "
        f"mean {trace.mean_nodes():.1f} nodes, replayed in real time; source: {scenario.trace_source}",
        f"{'parameter':<22}{'value':<30}source",
    ]
    for p in scenario.parameters.values():
        shown = "SWEPT " + ", ".join(f"{x:g}" for x in p.sweep) if p.unknown else _value(p.value)
        lines.append(f"{p.name:<22}{shown:<30}{p.source}")
        if p.note:
            lines.append(f"{'':<22}{'':<30}note: {p.note}")
    for key, reference in scenario.references.items():
        lines.append(f"reference {key}: {reference}")
    head = "".join(f"{name:>{max(len(name), 8) + 1}}" for name in unknowns)
    systems = ("bamboo", "checkpoint_restart", "on_demand")
    lines.append(f"one row per combination of the unknowns; per {PER:,} samples: hours, dollars; samples/$")
    lines.append(f"{'':{len(head)}} |" + "|".join(f"{s:^30}" for s in systems) + "|  Bamboo vs")
    lines.append(head + " |" + "|".join(f"{'h':>8}{'$':>10}{'samples/$':>12}" for _ in systems)
                 + "|  checkpoint-restart  on-demand value")
    for row in rows:
        cells = "".join(f"{row.chosen[name]:>{max(len(name), 8) + 1}g}" for name in unknowns)
        systems_cells = "|".join(
            f"{hours(r):>8.1f}{dollars(r):>10.0f}{r.value:>12.1f}" for r in row.comparison.results
        )
        ratios = f"{row.comparison.vs_checkpoint_restart:>18.2f}  {row.comparison.vs_on_demand_value:>15.2f}"
        lines.append(f"{cells} |{systems_cells}|  {ratios}")
    x = [r.comparison.vs_checkpoint_restart for r in rows]
    y = [r.comparison.vs_on_demand_value for r in rows]
    lines.append(f"projection={scenario.name} rows={len(rows)} "
                 f"vs_checkpoint_restart={min(x):.2f}..{max(x):.2f} "
                 f"vs_on_demand_value={min(y):.2f}..{max(y):.2f} (PROJECTION, not measured)")
    return lines
