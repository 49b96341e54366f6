"""Preflight advisor: replay the candidate configurations of a measured job on a spot trace, recommend one.

    python -m lightning_bamboo.advise --costs bamboo_costs.json [--trace TRACE] [--plot FILE]

``--costs``: what ``AdvisorProbe`` wrote from the job's own first steps (or the live preemption benchmark's
JSON). Prints what was measured (per stage) and where every cost comes from, the PROJECTED candidates, the
validation of the replay against the run's own validation window, and last, exactly:
``advice=<configuration> projected_value_vs_on_demand=<x> sim_error=<e>``. docs/bamboo-advise.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from lightning_bamboo.advise.advisor import INTERVAL_FACTORS, Advice, advise
from lightning_bamboo.advise.costs_file import PRODUCER as PROBE
from lightning_bamboo.advise.costs_file import load_modes_reference, peers_failover
from lightning_bamboo.simulate.costs import DEFAULT_COSTS, PRODUCER, load_costs
from lightning_bamboo.simulate.model import Prices
from lightning_bamboo.simulate.plot import save_plot
from lightning_bamboo.simulate.projection import PER, dollars, hours
from lightning_bamboo.simulate.traces import TraceFormatError, parse_trace

CHECKOUT = Path(__file__).resolve().parents[2]
"""The checkout this package is in: the defaults below are found from any working directory."""
DEFAULT_TRACE = CHECKOUT / "data" / "spot-traces" / "aws-p3-trace.csv"
SIM_ERROR_WARNING = 0.10
"""Above this validation error the replay's projection is not trusted without a warning."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lightning_bamboo.advise", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--costs", type=Path, default=CHECKOUT / DEFAULT_COSTS,
                   help="the job's measured costs: AdvisorProbe's file, or the live benchmark's "
                        f"({DEFAULT_COSTS}; written by {PRODUCER} [overrides])")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help=f"spot trace ({DEFAULT_TRACE})")
    p.add_argument("--compression", type=float, default=None,
                   help="trace seconds per replayed second (default: the costs' own, as measured)")
    p.add_argument("--spot", type=float, default=Prices.spot, help="spot $ per node-hour (0.91)")
    p.add_argument("--on-demand", type=float, default=Prices.on_demand, help="on-demand $/node-hour (3.06)")
    p.add_argument("--max-pipelines", type=int, default=None, help="cap on data-parallel pipelines")
    p.add_argument("--modes", type=Path, default=None,
                   help="the recovery modes benchmark's results (benchmarks/bamboo_modes.py), pricing a "
                        "peers failover the costs lack (default: this checkout's "
                        "benchmarks/results/bamboo_modes.json if present)")
    p.add_argument("--plot", type=Path, default=None,
                   help="nodes/throughput of the best Bamboo, the best checkpoint-restart and on-demand "
                        "configurations (PNG)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        costs = load_costs(args.costs)
        modes, modes_path = load_modes_reference(args.modes, "--modes")
        derived = peers_failover(costs, modes, str(modes_path)) \
            if costs.peers_failover_s is None and modes is not None else None
        if derived is not None:  # a probe's file that has one lists its source among its sources
            costs = dataclasses.replace(costs, peers_failover_s=derived[0])
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
    print("\n".join(measured_lines(costs.raw)))
    estimated = sorted(name for name, source in costs.raw.get("sources", {}).items()
                       if name.startswith("checkpoint_restart_step_s") and source.startswith("estimated"))
    if estimated:
        print(f"WARNING: {', '.join(estimated)} ESTIMATED from the FR time only (the replica's optimizer "
              "step and sync are not in it: the step without redundancy is priced too slow, against "
              "checkpoint-restart and on-demand); measure it: the probe with recovery='peers'")
    if costs.peers_failover_s is None and any(c.recovery == "peers" for c in advice.candidates):
        print("WARNING: recovery='peers' failovers PRICED AS THE REPLICA'S (costs.failover_s): these costs "
              "hold no measured peers failover (costs.peers_failover_s: state moved from a peer pipeline)")
    elif derived is not None:
        print(f"peers_failover_s {derived[0]:.3f} s: {derived[1]}")
    print(f"PROJECTED (the replay of the trace with these costs; checkpoint-restart at "
          f"{', '.join(f'{f:g}' for f in INTERVAL_FACTORS)} x Young/Daly); per {PER:,} samples:")
    print(f"{'configuration':<54}{'recovery':>16}{'samples/s':>11}{'$/hour':>9}{'hours':>9}{'dollars':>10}"
          f"{'samples/$':>12}")
    for c in sorted(advice.candidates, key=lambda c: -c.result.value):
        r = c.result
        mark = "  <- recommended" if c is advice.recommended else ""
        note = f"  ({c.note})" if c.note else ""
        print(f"{c.name:<54}{c.recovery or '-':>16}{r.samples_per_s:>11.3f}{r.dollars_per_hour:>9.2f}"
              f"{hours(r):>9.2f}{dollars(r):>10.2f}{r.value:>12.1f}{mark}{note}")
    if advice.validation is None:
        print("WARNING: NOT VALIDATED: the costs hold no live run to check the replay against (the probe's "
              "validation window: train more steps after the measured ones)")
    else:
        where = "the probe's validation window (the steps of the run it did not measure)" \
            if costs.raw.get("producer") == PROBE else "the live benchmark run"
        print(f"validation against {where}:")
        for system in advice.validation.live:
            print(f"  {system}: projected {advice.validation.predicted[system]:.3f} samples/s, measured "
                  f"{advice.validation.live[system]:.3f}, error {advice.validation.errors[system]:.3f}")
    if advice.sim_error > SIM_ERROR_WARNING:
        print(f"WARNING: the replay's validation error is {advice.sim_error:.1%} (above "
              f"{SIM_ERROR_WARNING:.0%}): the projected values may rank the configurations wrongly; measure "
              "the costs again on a quieter machine or with more steps (AdvisorProbe's validation window)")
    if args.plot is not None:
        print(plot(advice, args.plot, trace.name, trace.duration_s / compression))
    print(f"advice={advice.recommended.name} "
          f"projected_value_vs_on_demand={advice.value_vs_on_demand:.2f} "
          f"sim_error={advice.sim_error:.3f}")
    return 0


def measured_lines(raw: dict[str, Any]) -> list[str]:
    """What the probe measured per stage, and the source of every cost (only for a probe's costs file)."""
    if raw.get("producer") != PROBE:
        return [f"MEASURED: every cost, by the live benchmark ({raw.get('trace', 'its trace')})"]
    lines = ["MEASURED per stage (mean over pipelines; bubble = share of the step blocked on a neighbour):",
             f"  {'layout':<7}{'stage':>6}{'step_s':>9}{'compute_s':>10}{'FR_s':>8}{'bubble':>8}"
             f"{'state MB':>10}{'replica MB':>11}"]
    for layout, stages in sorted(raw.get("stages", {}).items()):
        for s in stages:
            lines.append(f"  {layout:<7}{s['stage']:>6}{s['step_s']:>9.4f}{s['compute_s']:>10.4f}"
                         f"{s['fr_s']:>8.4f}{s['bubble_share']:>8.2f}{s['state_bytes'] / 1e6:>10.3f}"
                         f"{s['replica_bytes'] / 1e6:>11.3f}")
    lines.append("sources of the costs:")
    lines += [f"  {name}: {source}" for name, source in sorted(raw.get("sources", {}).items())]
    return lines


def plot(advice: Advice, path: Path, trace_name: str, duration_s: float) -> str:
    """Draw the recommended, best Bamboo, best checkpoint-restart and on-demand configurations; the line to
    print (it says so when matplotlib is not installed)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return f"plot: not drawn ({path}): matplotlib is not installed (pip install matplotlib)"
    best = [max((c for c in advice.candidates if c.name.startswith(system)), key=lambda c: c.result.value)
            for system in ("bamboo", "checkpoint_restart")]
    shown = {id(c): c for c in (advice.recommended, *best, advice.on_demand)}.values()
    save_plot([c.result for c in shown], path, f"advice: {advice.recommended.name} ({trace_name})",
              3600.0 if duration_s > 7200 else 1.0)
    return f"plot: {path}"


if __name__ == "__main__":
    sys.exit(main())
