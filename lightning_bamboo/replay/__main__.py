"""Replay a spot trace against Bamboo, checkpoint-restart and on-demand machines, with measured costs.

    python -m lightning_bamboo.replay TRACE [--costs FILE] [--stages S] [--spot P] [--on-demand P] [--plot F]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lightning_bamboo.replay.costs import DEFAULT_COSTS, load_costs
from lightning_bamboo.replay.model import Prices
from lightning_bamboo.replay.plot import save_plot
from lightning_bamboo.replay.run import Comparison, replay, validate
from lightning_bamboo.replay.traces import TraceFormatError, parse_trace


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lightning_bamboo.replay", description=__doc__)
    p.add_argument("trace", type=Path, help="AWS 'time_ms,add|remove,node' or GCE 'date, time, count' trace")
    p.add_argument("--costs", type=Path, default=DEFAULT_COSTS, help=f"live benchmark JSON ({DEFAULT_COSTS})")
    p.add_argument("--stages", type=int, default=None, help="pipeline stages (default: the benchmark's)")
    p.add_argument("--spot", type=float, default=Prices.spot, help="spot $ per node-hour (default 0.91)")
    p.add_argument("--on-demand", type=float, default=Prices.on_demand, help="on-demand $/node-hour (3.06)")
    p.add_argument("--on-demand-nodes", type=int, default=None, help="default: the trace's mean nodes")
    p.add_argument("--max-pipelines", type=int, default=None, help="cap on data-parallel pipelines")
    p.add_argument("--compression", type=float, default=1.0,
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
    args = parser().parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
