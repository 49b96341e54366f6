"""Preflight advisor (first cut): replay the candidate configurations of a measured job and recommend one.

    python -m lightning_bamboo.advise [--costs FILE] [--trace TRACE] [--compression C] [--plot FILE]

Last line, exactly: ``advice=<configuration> projected_value_vs_on_demand=<x> sim_error=<e>``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lightning_bamboo.advise.advisor import INTERVAL_FACTORS, advise
from lightning_bamboo.simulate.costs import DEFAULT_COSTS, PRODUCER, load_costs
from lightning_bamboo.simulate.model import Prices
from lightning_bamboo.simulate.plot import save_plot
from lightning_bamboo.simulate.projection import PER, dollars, hours
from lightning_bamboo.simulate.traces import TraceFormatError, parse_trace

DEFAULT_TRACE = Path("data/spot-traces/aws-p3-trace.csv")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lightning_bamboo.advise", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--costs", type=Path, default=DEFAULT_COSTS,
                   help=f"the job's measured costs ({DEFAULT_COSTS}; written by {PRODUCER} [overrides])")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help=f"spot trace ({DEFAULT_TRACE})")
    p.add_argument("--compression", type=float, default=None,
                   help="trace seconds per replayed second (default: the costs' own, as measured)")
    p.add_argument("--spot", type=float, default=Prices.spot, help="spot $ per node-hour (0.91)")
    p.add_argument("--on-demand", type=float, default=Prices.on_demand, help="on-demand $/node-hour (3.06)")
    p.add_argument("--max-pipelines", type=int, default=None, help="cap on data-parallel pipelines")
    p.add_argument("--plot", type=Path, default=None,
                   help="nodes/throughput of the best Bamboo, the best checkpoint-restart and on-demand "
                        "configurations (PNG)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        costs = load_costs(args.costs)
        compression = args.compression
        if compression is None:  # the time scale at which the costs were measured and validated
            compression = float(costs.raw.get("compression", 1.0))
        trace = parse_trace(args.trace)
        advice = advise(trace, costs, Prices(args.spot, args.on_demand), compression, args.max_pipelines)
    except (FileNotFoundError, TraceFormatError, ValueError, KeyError) as err:
        print(f"error: {err.args[0] if isinstance(err, KeyError) else err}", file=sys.stderr)
        return 2
    if costs.raw.get("fixture"):
        print(f"WARNING: FIXTURE COSTS, NOT MEASURED: {costs.raw['fixture']}")
    print(f"costs {args.costs} ({costs.raw.get('model', 'model not named')}); trace {trace.name}: "
          f"{trace.duration_s / 3600:.2f} h, {trace.removal_groups()} preemption events, mean "
          f"{trace.mean_nodes():.1f} nodes; replayed at compression {compression:g}")
    print(f"candidates (checkpoint-restart at {', '.join(f'{f:g}' for f in INTERVAL_FACTORS)} x Young/Daly); "
          f"per {PER:,} samples:")
    print(f"{'configuration':<54}{'samples/s':>11}{'$/hour':>9}{'hours':>9}{'dollars':>10}{'samples/$':>12}")
    for c in sorted(advice.candidates, key=lambda c: -c.result.value):
        r = c.result
        mark = "  <- recommended" if c is advice.recommended else ""
        note = f"  ({c.note})" if c.note else ""
        print(f"{c.name:<54}{r.samples_per_s:>11.3f}{r.dollars_per_hour:>9.2f}{hours(r):>9.2f}"
              f"{dollars(r):>10.2f}{r.value:>12.1f}{mark}{note}")
    for system in advice.validation.live:
        print(f"validation {system}: predicted {advice.validation.predicted[system]:.3f} samples/s, live "
              f"{advice.validation.live[system]:.3f}, error {advice.validation.errors[system]:.3f}")
    if args.plot is not None:
        best = [max((c for c in advice.candidates if c.name.startswith(system)), key=lambda c: c.result.value)
                for system in ("bamboo", "checkpoint_restart")]
        shown = {id(c): c for c in (advice.recommended, *best, advice.on_demand)}.values()
        save_plot([c.result for c in shown], args.plot, f"advice: {advice.recommended.name} ({trace.name})",
                  3600.0 if trace.duration_s / compression > 7200 else 1.0)
        print(f"plot: {args.plot}")
    print(f"advice={advice.recommended.name} "
          f"projected_value_vs_on_demand={advice.value_vs_on_demand:.2f} "
          f"sim_error={advice.validation.sim_error:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
