"""What Bamboo saves on a real spot fleet: the AWS p3 trace replayed with the costs measured live.

    python benchmarks/bamboo_replay.py            # needs benchmarks/results/bamboo_preemption.json
    python benchmarks/bamboo_replay.py --trace data/spot-traces/aws-g4dn-trace.csv --plot g4dn.png

Reads the step, failover, rejoin, checkpoint and restart costs that ``benchmarks/bamboo_preemption.py``
measured (nothing is typed in), replays the trace against Bamboo, checkpoint-restart (Young/Daly interval)
and on-demand machines (``lightning_bamboo.simulate``), and checks the model first: the replay of the live
benchmark's own segment must predict its measured samples/s (``sim_error`` = max relative error).

The trace is replayed at the benchmark's time compression (``compression`` in its JSON: trace seconds per
benchmark second), the time scale at which the costs were measured and the model validated; ``--compression
1`` replays it in real time (then the tiny benchmark model's seconds-long restarts are small against the
trace's minutes between preemptions). The last line printed is exactly
``vs_checkpoint_restart=<x> vs_on_demand_value=<y> sim_error=<e>``. Bamboo is priced under the recovery mode
the costs were measured under; ``--recovery MODE`` prices another (a warning names both).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lightning_bamboo.layout.ownership import RECOVERY_MODES
from lightning_bamboo.simulate import Prices, load_costs, parse_trace, replay, validate
from lightning_bamboo.simulate.__main__ import report
from lightning_bamboo.simulate.costs import PRODUCER
from lightning_bamboo.simulate.plot import save_plot

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--costs", type=Path, default=REPO / "benchmarks/results/bamboo_preemption.json")
    parser.add_argument("--trace", type=Path, default=REPO / "data/spot-traces/aws-p3-trace.csv")
    parser.add_argument("--compression", type=float, default=None, help="default: the benchmark's")
    parser.add_argument("--spot", type=float, default=Prices.spot)
    parser.add_argument("--on-demand", type=float, default=Prices.on_demand)
    parser.add_argument("--recovery", choices=RECOVERY_MODES, default=None,
                        help="Bamboo's mode to price (default: the one the costs were measured under)")
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--allow-fixture", action="store_true", help="tests only: accept a labelled fixture")
    args = parser.parse_args()
    if not args.costs.is_file():
        print(f"error: {args.costs} does not exist: the replay needs the costs measured by the live "
              f"preemption benchmark; run: {PRODUCER}", file=sys.stderr)
        return 2
    try:
        costs = load_costs(args.costs)
    except ValueError as err:  # a wrong schema, a missing key, a bad duration: named in the message
        print(f"error: {err}", file=sys.stderr)
        return 2
    if costs.raw.get("fixture"):
        if args.allow_fixture:
            print(f"WARNING: fixture costs, not measured: {costs.raw['fixture']}")
        else:
            print(f"error: {args.costs} is a test fixture, not measured costs ({costs.raw['fixture']})",
                  file=sys.stderr)
            return 2
    recovery = args.recovery or costs.recovery
    if recovery != costs.recovery:
        print(f"WARNING: {args.costs} was measured under recovery={costs.recovery!r}; pricing "
              f"recovery={recovery!r} from that run's costs (that mode's step as the file measured it)")
    compression = args.compression if args.compression is not None else float(costs.raw["compression"])
    trace = parse_trace(args.trace)
    try:
        comparison = replay(trace, costs, prices=Prices(args.spot, args.on_demand), compression=compression,
                            recovery=recovery)
        check = validate(costs)
    except KeyError as err:  # a cost the replay needs that this benchmark run did not measure
        print(f"error: {err.args[0]}", file=sys.stderr)
        return 2
    print(f"trace {trace.name}: {trace.duration_s / 3600:.2f} h, {trace.removal_groups()} preemption events, "
          f"mean {trace.mean_nodes():.1f} nodes; replayed at compression {compression:g}; costs {args.costs} "
          f"(measured under recovery={costs.recovery!r}, commit {costs.raw.get('commit', 'not recorded')}); "
          f"Bamboo priced under recovery={recovery!r}")
    print("\n".join(report(comparison)))
    for system in check.live:
        print(f"validation {system}: predicted {check.predicted[system]:.3f} samples/s, live "
              f"{check.live[system]:.3f}, error {check.errors[system]:.3f}")
    if args.plot is not None:
        save_plot(comparison.results, args.plot, f"{trace.name}, compression {compression:g}",
                  3600.0 if trace.duration_s / compression > 7200 else 1.0)
        print(f"plot: {args.plot}")
    print(f"vs_checkpoint_restart={comparison.vs_checkpoint_restart:.2f} "
          f"vs_on_demand_value={comparison.vs_on_demand_value:.2f} sim_error={check.sim_error:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
