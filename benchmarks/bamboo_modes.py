"""Bamboo's recovery modes side by side: one spot-trace segment applied to each mode on the same machines.

    sudo python benchmarks/bamboo_modes.py [--rounds 3] [--steps 2000] [--seed 0] [--out DIR]

Each round runs ``benchmarks/bamboo_nodes.py`` once per mode of ``BambooStrategy(recovery=...)``
(``"peers"``, ``"replica"``, ``"replica+forward"``): 3 machines as network namespaces, 2 workers each,
2 stages x 3 pipelines of the float64 ``PipeMLP``; the p3 segment of ``bamboo_nodes.py``, its machine losses
and replacements drawn with ``--seed``, the same for every mode. The modes' order rotates from round to round
(interleaved: a slow spell of the machine does not fall on one mode). Under this placement a machine holds
different stages of different pipelines (members ``m``, ``m + 3``), so every single machine loss is covered
by the replicas and by the peers alike: the modes differ in what they pay failure-free and at a failover.

Per mode, medians over the rounds of: the failure-free step of the full layout (before the first loss), the
committed samples/s while the segment's events are applied, every failover (a machine loss to the first step
committed by the next generation), and whether the final parameters and optimizer state equal the
uninterrupted single-process run's (``exact``). The line before the last is JSON (per mode and per run);
the last line, exactly::

    peers_overhead=<failure-free step, peers / no fault tolerance> replica_overhead=<failure-free step,
    replica / no fault tolerance> peers_vs_replica=<committed samples/s under the trace, peers / replica>
    best_vs_checkpoint_restart=<samples/s, best mode / checkpoint-restart> failover_s=<median, worst mode>
    exact=<true if every mode's final state equals the uninterrupted run>

(one line). No fault tolerance: each round also trains the same pipeline under torchrun on the same
machines, no trace applied (:func:`run_without_fault_tolerance`). NOT BUILT YET: checkpoint-restart on these
machines: ``best_vs_checkpoint_restart`` prints ``nan`` (``benchmarks/bamboo_preemption.py`` compares
Bamboo with it on one machine's workers).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# kept: the run without fault tolerance uses bamboo_nodes.py's shape and the test suite's network namespaces
# (``tests.netns``), which no install provides; ``python benchmarks/bamboo_modes.py`` puts only benchmarks/
# on sys.path
sys.path.insert(0, str(REPO))
NODES = REPO / "benchmarks" / "bamboo_nodes.py"
MODES = ("peers", "replica", "replica+forward")
WARMUP_STEPS = 5  # steps of a run without fault tolerance left out of its step time


def median(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else float("nan")


def run_mode(mode: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One ``bamboo_nodes.py`` run of ``mode``; its JSON result (the line before its last)."""
    command = [sys.executable, str(NODES), "--recovery", mode, "--steps", str(args.steps), "--seed",
               str(args.seed), "--lease", str(args.lease), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, check=False)
    (out / "bench.log").write_text(done.stdout + done.stderr)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or len(lines) < 2:
        raise RuntimeError(f"{mode}: bamboo_nodes.py exited {done.returncode}; see {out / 'bench.log'}")
    return json.loads(lines[-2])


def run_without_fault_tolerance(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The same pipeline without fault tolerance, no trace applied: ``recovery="peers"`` (no replica) under
    torchrun's static rendezvous on the 3 machines (fixed ranks: no agent, no per-step commit, no lease; a
    lost worker would end the job). Its failure-free step: the median interval between rank 0's step ends
    after the warm-up. torchrun numbers the ranks machine by machine, so a machine holds a whole pipeline
    here and a stage of two pipelines in the elastic runs; the namespaces share one kernel and no link is
    shaped, so both placements' links cost the same."""
    from benchmarks.bamboo_nodes import MACHINES, SCRIPT, global_batch
    from tests.netns import Network
    from tests.process import launch_env

    steps_file = out / "steps.txt"
    train = ["--stages", "2", "--steps", str(args.baseline_steps), "--batch-size", str(global_batch(2)),
             "--recovery", "peers", "--step-times", str(steps_file)]
    with Network(MACHINES) as net:
        master = net.hosts[0].address
        procs, logs = [], []
        for host in net.hosts:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(MACHINES),
                   "--node-rank", str(host.index), "--nproc-per-node", "2", "--master-addr", master,
                   "--master-port", "29500", str(SCRIPT), "--out", str(out), *train]
            logs.append((out / f"torchrun_h{host.index}.log").open("w"))
            procs.append(net.popen(host, cmd, env=launch_env({"GLOO_SOCKET_IFNAME": host.interface}),
                                   stdout=logs[-1]))
        codes = [proc.wait(timeout=args.timeout) for proc in procs]
        for log in logs:
            log.close()
    if any(codes):
        raise RuntimeError(f"no fault tolerance: torchrun exited {codes}; see {out}/torchrun_h*.log")
    times = [float(line.split()[1]) for line in steps_file.read_text().splitlines()]
    spans = [b - a for a, b in itertools.pairwise(times)][WARMUP_STEPS:]
    return {"step_s": statistics.median(spans), "steps": len(times)}


def summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per mode: medians over its runs, every failover, and whether every run was exact."""
    out = {}
    for mode, results in runs.items():
        failovers = [f for r in results for f in r["failover_s"]]
        out[mode] = {
            "full_layout_step_s": median([r["full_layout_step_s"] for r in results]),
            "segment_samples_per_s": median([r["segment_samples_per_s"] for r in results]),
            "failover_s": failovers,
            "failover_median_s": median(failovers),
            "exact": all(r["exact"] for r in results),
            "events_not_applied": sum(r["events_not_applied"] for r in results),
            # a run that ended before the segment did counted only part of it: its rate is too low
            "ended_before_segment": any(r.get("ended_before_segment", False) for r in results),
        }
    peers_step = out["peers"]["full_layout_step_s"]
    for mode in out:
        out[mode]["step_vs_peers"] = out[mode]["full_layout_step_s"] / peers_step
    return out


def last_line(modes: dict[str, dict[str, Any]], no_fault_tolerance_step_s: float = float("nan")) -> str:
    rates = {m: s["segment_samples_per_s"] for m, s in modes.items()}
    worst_failover = max((s["failover_median_s"] for s in modes.values()), default=float("nan"))
    exact = all(s["exact"] for s in modes.values())
    nan = float("nan")
    peers, replica = (modes[m]["full_layout_step_s"] / no_fault_tolerance_step_s
                      for m in ("peers", "replica"))
    return (f"peers_overhead={peers:.3f} replica_overhead={replica:.3f} "
            f"peers_vs_replica={rates['peers'] / rates['replica']:.3f} best_vs_checkpoint_restart={nan:.3f} "
            f"failover_s={worst_failover:.3f} exact={'true' if exact else 'false'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs per mode, interleaved")
    parser.add_argument("--steps", type=int, default=2000, help="steps per run (to outlast the segment)")
    parser.add_argument("--seed", type=int, default=0, help="which machine each removal takes (every mode)")
    parser.add_argument("--lease", type=float, default=3.0, help="--node-lease of the agents (seconds)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds one run may take")
    parser.add_argument("--baseline-steps", type=int, default=300,
                        help="steps of the run without fault tolerance per round (0: none, nan overheads)")
    parser.add_argument("--out", type=Path, default=None, help="keep every run's files here")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    with tempfile.TemporaryDirectory(prefix="bamboo-modes-") as tmp:
        root = args.out or Path(tmp)
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
        baselines: list[dict[str, Any]] = []
        for round_ in range(args.rounds):
            if args.baseline_steps:
                out = root / f"round{round_}-no-fault-tolerance"
                out.mkdir(parents=True, exist_ok=True)
                baselines.append(run_without_fault_tolerance(args, out))
                print(f"[modes] round {round_} no fault tolerance: step {baselines[-1]['step_s']:.3f} s",
                      flush=True)
            order = MODES[round_ % len(MODES):] + MODES[:round_ % len(MODES)]
            for mode in order:
                out = root / f"round{round_}-{mode}"
                out.mkdir(parents=True, exist_ok=True)
                result = run_mode(mode, args, out)
                runs[mode].append(result)
                print(f"[modes] round {round_} {mode}: full-layout step {result['full_layout_step_s']:.3f} "
                      f"s, {result['segment_samples_per_s']:.1f} samples/s under the segment, failovers "
                      f"{[round(f, 2) for f in result['failover_s']]} s, exact {result['exact']}", flush=True)
        modes = summary(runs)
    no_ft = median([b["step_s"] for b in baselines])
    for mode in modes.values():
        mode["step_vs_no_fault_tolerance"] = mode["full_layout_step_s"] / no_ft
    print(json.dumps({"modes": modes, "runs": runs, "no_fault_tolerance": baselines,
                      "no_fault_tolerance_step_s": no_ft, "rounds": args.rounds, "steps": args.steps,
                      "seed": args.seed}))
    print(last_line(modes, no_ft))


if __name__ == "__main__":
    main()
