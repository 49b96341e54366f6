"""Replay a spot trace against Bamboo, checkpoint-restart and on-demand machines, with measured costs.

    python -m lightning_bamboo.simulate TRACE [--costs FILE] [--stages S] [--spot P] [--on-demand P] \
        [--plot F]
    python -m lightning_bamboo.simulate --scenario NAME_OR_PATH [TRACE]  # a PROJECTION from published figures
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lightning_bamboo.simulate.costs import DEFAULT_COSTS, load_costs
from lightning_bamboo.simulate.model import Prices
from lightning_bamboo.simulate.plot import save_plot
from lightning_bamboo.simulate.projection import project
from lightning_bamboo.simulate.projection import report as projection_report
from lightning_bamboo.simulate.run import Comparison, replay, validate
from lightning_bamboo.simulate.scenario import ScenarioError, available, load_scenario
from lightning_bamboo.simulate.traces import TraceFormatError, parse_trace

COST_OPTIONS = ("costs", "stages", "spot", "on_demand", "on_demand_nodes", "max_pipelines", "compression",
                "plot", "validate")
DEFAULTS = {"costs": DEFAULT_COSTS, "spot": Prices.spot, "on_demand": Prices.on_demand, "compression": 1.0}
"""Filled in after parsing, so that an option given with its default value still counts as given."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lightning_bamboo.simulate", description=__doc__)
    p.add_argument("trace", type=Path, nargs="?", default=None,
                   help="AWS 'time_ms,add|remove,node' or GCE 'date, time, count' trace (with --scenario: "
                        "instead of the scenario's)")
    p.add_argument("--scenario", default=None,
                   help="print a PROJECTION from a scenario's published figures instead "
                        f"({', '.join(available())} or a YAML path); it gives every cost and price")
    p.add_argument("--costs", type=Path, default=None, help=f"live benchmark JSON ({DEFAULT_COSTS})")
    p.add_argument("--stages", type=int, default=None, help="pipeline stages (default: the benchmark's)")
    p.add_argument("--spot", type=float, default=None, help="spot $ per node-hour (default 0.91)")
    p.add_argument("--on-demand", type=float, default=None, help="on-demand $/node-hour (3.06)")
    p.add_argument("--on-demand-nodes", type=int, default=None, help="default: the trace's mean nodes")
    p.add_argument("--max-pipelines", type=int, default=None, help="cap on data-parallel pipelines")
    p.add_argument("--compression", type=float, default=None,
                   help="trace seconds per replayed second (the live benchmark's is in its JSON)")
    p.add_argument("--plot", type=Path, default=None, help="write the nodes/throughput figure here (PNG)")
    p.add_argument("--validate", action="store_true", help="also replay the benchmark's own segment")
    return p


def report(comparison: Comparison) -> list[str]:
    lines = [f"{'system':<20}{'samples/s':>12}{'$/hour':>10}{'samples/$':>14}  events"]
    for r in comparison.results:
        counts = " ".join(f"{k}={v}" for k, v in sorted(r.counts.items())) or "-"
        lines.append(
            f"{r.system:<20}{r.samples_per_s:>12.3f}{r.dollars_per_hour:>10.2f}{r.value:>14.1f}  {counts}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    cli = parser()
    args = cli.parse_args(argv)
    if args.scenario is not None:
        given = [f"--{name.replace('_', '-')}" for name in COST_OPTIONS
                 if getattr(args, name) not in (None, False)]
        if given:
            cli.error("--scenario gives every cost and price itself (a projection is never mixed with "
                      f"measured costs); drop {' '.join(given)}")
        return main_projection(args.scenario, args.trace)
    if args.trace is None:
        cli.error("the following arguments are required: trace (or --scenario)")
    for name, default in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    try:
        trace = parse_trace(args.trace)
        costs = load_costs(args.costs)
        prices = Prices(spot=args.spot, on_demand=args.on_demand)
        comparison = replay(trace, costs, args.stages, prices, args.compression, args.on_demand_nodes,
                            args.max_pipelines)
    except (FileNotFoundError, TraceFormatError, ValueError, KeyError) as err:
        print(f"error: {err.args[0] if isinstance(err, KeyError) else err}", file=sys.stderr)
        return 2
    print(f"trace {trace.name}: {trace.duration_s / 3600:.2f} h, {len(trace.events)} events, "
          f"{trace.removal_groups()} preemption events, mean {trace.mean_nodes():.1f} nodes; "
          f"compression {args.compression:g}; costs {args.costs}")
    print("\n".join(report(comparison)))
    if args.plot is not None:
        unit = 3600.0 if trace.duration_s / args.compression > 7200 else 1.0
        title = f"{trace.name} ({args.costs.name})"
        if costs.raw.get("fixture"):
            title += " - FIXTURE COSTS, NOT MEASURED"
        save_plot(comparison.results, args.plot, title, unit)
        print(f"plot: {args.plot}")
    if args.validate:
        v = validate(costs)
        for system in v.live:
            print(f"validation {system}: predicted {v.predicted[system]:.3f} samples/s, live "
                  f"{v.live[system]:.3f}, error {v.errors[system]:.3f}")
    print(f"vs_checkpoint_restart={comparison.vs_checkpoint_restart:.2f} "
          f"vs_on_demand_value={comparison.vs_on_demand_value:.2f}")
    return 0


def main_projection(name: str, trace_path: Path | None) -> int:
    """Print a scenario's projection: every parameter with its source, a row per combination of unknowns."""
    try:
        scenario = load_scenario(name)
        trace = parse_trace(trace_path or scenario.trace)
        rows = project(scenario, trace)
    except (FileNotFoundError, TraceFormatError, ScenarioError, ValueError, KeyError) as err:
        print(f"error: {err.args[0] if isinstance(err, KeyError) else err}", file=sys.stderr)
        return 2
    print("\n".join(projection_report(scenario, trace, rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
