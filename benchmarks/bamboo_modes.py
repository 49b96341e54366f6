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
machines, no trace applied (:func:`run_without_fault_tolerance`). Checkpoint-restart: each round also runs
it under the same segment on the same machines (:class:`CheckpointRestartJob`: torchrun relaunched on the
live machines at every loss and replacement, Young/Daly checkpoints, the steps since the last checkpoint
lost); ``--no-checkpoint-restart`` leaves it out (``best_vs_checkpoint_restart`` then prints ``nan``).

The advisor's model against these runs: each mode's run also writes its timeline as the replay's costs file
(``benchmarks/_nodes_replay.py``: the same events worker by worker, each layout's step, the failovers and
joins as that run measured them; kept as ``replay_costs.json`` with ``--out``), which
``lightning_bamboo.simulate.validate`` replays. Printed before the JSON: per mode, the median predicted and
measured samples/s and their error, the mode the replay recommends and the mode measured fastest (JSON
``advice``). ``--replay-kept DIR`` runs nothing: it replays the runs an earlier ``--out DIR`` kept with the
replay's model as it is now (their costs built again from what each run recorded), so a change of how a
cost is measured is checked on the same runs.
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
import time
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
CHECKPOINT_RESTART_STEPS = 10_000  # more than its window holds: the job is stopped when the window ends


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
    result = json.loads(lines[-2])
    if "replay" in result:
        result["replay_predicted_samples_per_s"] = replay_prediction(result.pop("replay"), out)
    return result


def replay_prediction(costs_file: dict[str, Any], out: Path) -> float:
    """The replay of one run's own segment with its own measured costs (``simulate.validate``, as for the
    preemption benchmark): the samples/s the advisor's model predicts for that run. The costs file is kept
    beside the run's logs (``replay_costs.json``)."""
    from lightning_bamboo.simulate.costs import load_costs
    from lightning_bamboo.simulate.run import validate

    path = out / "replay_costs.json"
    path.write_text(json.dumps(costs_file, indent=1))
    return validate(load_costs(path)).predicted["bamboo"]


def advice(modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The mode the replay recommends (the most samples/s predicted: every mode runs on the same machines,
    so samples per dollar orders them alike) against the mode the runs measured fastest, and each mode's
    relative error (median predicted over median measured samples/s)."""
    predicted = {m: s["replay_predicted_samples_per_s"] for m, s in modes.items()}
    measured = {m: s["segment_samples_per_s"] for m, s in modes.items()}
    errors = {m: abs(predicted[m] - measured[m]) / measured[m] for m in modes}
    return {"predicted_samples_per_s": predicted, "measured_samples_per_s": measured, "errors": errors,
            "sim_error": max(errors.values()), "recommended": max(predicted, key=predicted.__getitem__),
            "fastest_measured": max(measured, key=measured.__getitem__)}


def print_advice(what: str, advised: dict[str, Any]) -> None:
    """One line: per mode the median predicted and measured samples/s and the error, then the advice."""
    print(f"[modes] {what}, medians per mode: " + ", ".join(
        f"{m} predicted {predicted:.1f} / measured {advised['measured_samples_per_s'][m]:.1f} samples/s "
        f"({advised['errors'][m]:.1%})" for m, predicted in advised["predicted_samples_per_s"].items()
    ) + f"; recommends {advised['recommended']}, measured fastest {advised['fastest_measured']}", flush=True)


def replay_kept(root: Path) -> dict[str, Any]:
    """The advice for the runs an earlier ``--out root`` kept (``round{r}-{mode}``), each run's costs built
    again from its recorded commits (``_nodes_replay.replay_kept_run``) and replayed: how a change of the
    replay's model moves its error, on the same runs."""
    from benchmarks._nodes_replay import replay_kept_run

    modes: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        runs = sorted(path for path in root.glob(f"round*-{mode}") if (path / "commits.json").is_file())
        if not runs:
            continue
        predicted, measured = [], []
        for run in runs:
            costs_file = replay_kept_run(run)
            out = run / "replayed_again"
            out.mkdir(exist_ok=True)
            predicted.append(replay_prediction(costs_file, out))
            measured.append(costs_file["live"]["bamboo"]["samples_per_s"])
        modes[mode] = {"replay_predicted_samples_per_s": median(predicted),
                       "segment_samples_per_s": median(measured), "runs": [str(r) for r in runs]}
    if not modes:
        raise SystemExit(f"--replay-kept: no run kept under {root} (round*-<mode>/commits.json)")
    advised = advice(modes)
    print_advice("kept runs replayed again", advised)
    print(json.dumps({"modes": modes, "advice": advised}))
    return advised


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


def surviving_steps(completions: list[tuple[int, float]], start: float, end: float) -> int:
    """How many steps the job kept that it completed in ``[start, end]``: ``completions`` are ``(global
    step, wall time)`` in the order written, over every launch; a step lost to a kill and trained again
    after a reload counts once, at its last completion (the one that survived)."""
    last: dict[int, float] = {}
    for step, wall in completions:
        last[step] = wall
    return sum(1 for wall in last.values() if start <= wall <= end)


class CheckpointRestartJob:
    """The same pipeline under torchrun on the live machines (a machine holds one pipeline: 2 ranks, 2
    stages), checkpointing every Young/Daly interval (``benchmarks/_young_daly.py``) and resuming from the
    newest checkpoint at each launch. Losing a machine stops every rank of the job (SIGKILL, whole
    machines, by PID) and relaunches it on the survivors: the steps since the last checkpoint are lost. A
    replacement machine grows the job: a checkpoint now, a clean exit, a relaunch on all (nothing lost)."""

    def __init__(self, net: Any, out: Path, train: list[str], steps_file: Path) -> None:
        self.net, self.out, self.train, self.steps_file = net, out, train, steps_file
        self.hosts = {f"m{i}": host for i, host in enumerate(net.hosts)}  # the plan's names, live ones
        self.procs: list[subprocess.Popen[str]] = []
        self.launches = 0
        self.lines_at_launch = 0

    def steps_written(self) -> list[str]:
        return self.steps_file.read_text().splitlines() if self.steps_file.exists() else []

    def launch(self) -> None:
        from tests.process import launch_env

        hosts = list(self.hosts.values())
        self.lines_at_launch = len(self.steps_written())
        for node_rank, host in enumerate(hosts):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(hosts)),
                   "--node-rank", str(node_rank), "--nproc-per-node", "2", "--master-addr", hosts[0].address,
                   "--master-port", str(29500 + self.launches), *self.train]
            with (self.out / f"launch{self.launches}_h{host.index}.log").open("w") as log:
                env = launch_env({"GLOO_SOCKET_IFNAME": host.interface})
                self.procs.append(self.net.popen(host, cmd, env=env, stdout=log))
        self.launches += 1

    def training(self) -> bool:
        """Whether the current launch has completed a step (it is past start-up and the reload)."""
        return len(self.steps_written()) > self.lines_at_launch

    def stop(self, lost: Any = None) -> None:
        """Every process of the job's machines SIGKILLed (``lost`` with them, taken off the job)."""
        hosts = list(self.hosts.values()) + ([lost] if lost is not None else [])
        self.net.kill_hosts(hosts)
        for proc in self.procs:
            proc.wait(timeout=30)
        self.procs = []

    def drain(self, timeout: float = 60.0) -> bool:
        """A checkpoint now and a clean exit; a launch still starting has trained nothing since the
        checkpoint it loads and is stopped at once. Returns whether it drained."""
        if not self.training():
            self.stop()
            return False
        from benchmarks._young_daly import request_drain

        request_drain(self.out, self.procs, timeout)
        self.stop()
        return True


def run_checkpoint_restart(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Checkpoint-restart (:class:`CheckpointRestartJob`) under the modes' trace segment, on the same
    machines. Progress is what survives: a step counts at its last completion (one completed, lost to a
    kill and trained again counts once, when it was trained again), as the committed steps of the modes
    do. The window starts at the first launch's step ``WARMUP_STEPS`` of bamboo_nodes.py, as theirs."""
    from benchmarks.bamboo_nodes import MACHINES, SCRIPT, global_batch
    from benchmarks.bamboo_nodes import WARMUP_STEPS as WINDOW_AFTER
    from benchmarks.bamboo_preemption import FULL, TRACE, make_plan
    from tests.netns import Network

    plan = make_plan(REPO / TRACE, *FULL["segment_ms"], FULL["compression"], args.seed, units=MACHINES)
    batch = global_batch(2)
    steps_file = out / "steps.txt"
    mtbf_s = plan.window_s / max(plan.removals, 1)
    train = [str(SCRIPT), "--out", str(out / "job"), "--stages", "2",
             "--steps", str(CHECKPOINT_RESTART_STEPS), "--batch-size", str(batch), "--recovery", "peers",
             "--step-times", str(steps_file), "--young-daly", str(out), "--mtbf-s", f"{mtbf_s:.6f}"]
    restarts: list[dict[str, Any]] = []
    with Network(MACHINES) as net:
        job = CheckpointRestartJob(net, out, train, steps_file)
        job.launch()
        deadline = time.monotonic() + args.timeout
        while len(job.steps_written()) < WINDOW_AFTER:
            if time.monotonic() > deadline or all(p.poll() is not None for p in job.procs):
                raise RuntimeError(f"checkpoint-restart: no step {WINDOW_AFTER}; see {out}/launch0_h*.log")
            time.sleep(0.02)
        start = time.time()
        try:
            for t, kind, node in plan.events:
                time.sleep(max(0.0, start + t - time.time()))
                at = time.time()
                if kind == "remove":
                    job.stop(lost=job.hosts.pop(node))
                    drained = False
                else:
                    job.hosts[node] = net.add_host()
                    drained = job.drain()
                job.launch()
                restarts.append({"t_s": at - start, "why": "kill" if kind == "remove" else "grow",
                                 "drained": drained, "lines_before": job.lines_at_launch,
                                 "machines": len(job.hosts)})
                print(f"[modes] checkpoint-restart t={at - start:6.2f}s {kind} {node}: relaunched on "
                      f"{len(job.hosts)} machine(s)", flush=True)
            time.sleep(max(0.0, start + plan.window_s - time.time()))
        finally:
            job.stop()
    rows = [line.split() for line in job.steps_written()]
    done = surviving_steps([(int(step), float(wall)) for step, wall in rows], start, start + plan.window_s)
    ends = [r["lines_before"] for r in restarts[1:]] + [len(rows)]
    for restart, end in zip(restarts, ends, strict=True):
        # from the event to the next step the job made (by this launch or, when it was stopped before its
        # first step, a later one), and to this launch's own first step (None: it never made one)
        at = start + restart["t_s"]
        after = [float(w) for _, w in rows[restart["lines_before"]:] if float(w) > at]
        restart["to_next_step_s"] = (after[0] - at) if after else float("nan")
        own = rows[restart["lines_before"]:end]
        restart["launch_to_first_step_s"] = (float(own[0][1]) - at) if own else None
    interval = json.loads((out / "interval.json").read_text()) if (out / "interval.json").exists() else {}
    return {"segment_samples_per_s": done * batch / plan.window_s, "steps_in_segment": done,
            "restarts": restarts, "launches": job.launches, "work": str(out),
            "checkpoint_interval_s": interval.get("interval_s"), "checkpoint_s": interval.get("checkpoint_s")}


def summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per mode: medians over its runs, every failover, and whether every run was exact."""
    out = {}
    for mode, results in runs.items():
        failovers = [f for r in results for f in r["failover_s"]]
        out[mode] = {
            "full_layout_step_s": median([r["full_layout_step_s"] for r in results]),
            "segment_samples_per_s": median([r["segment_samples_per_s"] for r in results]),
            "replay_predicted_samples_per_s": median([r.get("replay_predicted_samples_per_s", math.nan)
                                                      for r in results]),
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


def last_line(modes: dict[str, dict[str, Any]], no_fault_tolerance_step_s: float = float("nan"),
              checkpoint_restart_samples_per_s: float = float("nan")) -> str:
    rates = {m: s["segment_samples_per_s"] for m, s in modes.items()}
    best_vs_cr = max(rates.values()) / checkpoint_restart_samples_per_s
    worst_failover = max((s["failover_median_s"] for s in modes.values()), default=float("nan"))
    exact = all(s["exact"] for s in modes.values())
    peers, replica = (modes[m]["full_layout_step_s"] / no_fault_tolerance_step_s
                      for m in ("peers", "replica"))
    return (f"peers_overhead={peers:.3f} replica_overhead={replica:.3f} "
            f"peers_vs_replica={rates['peers'] / rates['replica']:.3f} "
            f"best_vs_checkpoint_restart={best_vs_cr:.3f} "
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
    parser.add_argument("--no-checkpoint-restart", action="store_true",
                        help="leave checkpoint-restart out (best_vs_checkpoint_restart prints nan)")
    parser.add_argument("--out", type=Path, default=None, help="keep every run's files here")
    parser.add_argument("--replay-kept", type=Path, default=None, metavar="DIR",
                        help="run nothing: replay the runs an earlier --out DIR kept with the replay's model "
                             "as it is now (print the advice and its JSON)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.replay_kept is not None:
        replay_kept(args.replay_kept)
        return
    with tempfile.TemporaryDirectory(prefix="bamboo-modes-") as tmp:
        root = args.out or Path(tmp)
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
        baselines: list[dict[str, Any]] = []
        restarts: list[dict[str, Any]] = []
        for round_ in range(args.rounds):
            if args.baseline_steps:
                out = root / f"round{round_}-no-fault-tolerance"
                out.mkdir(parents=True, exist_ok=True)
                baselines.append(run_without_fault_tolerance(args, out))
                print(f"[modes] round {round_} no fault tolerance: step {baselines[-1]['step_s']:.3f} s",
                      flush=True)
            if not args.no_checkpoint_restart:
                out = root / f"round{round_}-checkpoint-restart"
                out.mkdir(parents=True, exist_ok=True)
                restarts.append(cr := run_checkpoint_restart(args, out))
                firsts = [r["launch_to_first_step_s"] for r in cr["restarts"]]
                firsts = [None if f is None else round(f, 2) for f in firsts]
                print(f"[modes] round {round_} checkpoint-restart: {cr['segment_samples_per_s']:.1f} "
                      f"samples/s under the segment, each relaunch's first step after {firsts} s (None: "
                      "stopped by the next event first)", flush=True)
            order = MODES[round_ % len(MODES):] + MODES[:round_ % len(MODES)]
            for mode in order:
                out = root / f"round{round_}-{mode}"
                out.mkdir(parents=True, exist_ok=True)
                result = run_mode(mode, args, out)
                runs[mode].append(result)
                print(f"[modes] round {round_} {mode}: full-layout step {result['full_layout_step_s']:.3f} "
                      f"s, {result['segment_samples_per_s']:.1f} samples/s under the segment (replayed: "
                      f"{result.get('replay_predicted_samples_per_s', math.nan):.1f}), failovers "
                      f"{[round(f, 2) for f in result['failover_s']]} s, exact {result['exact']}", flush=True)
        modes = summary(runs)
    advised = advice(modes)
    print_advice("the replay of each run's own segment with its own costs", advised)
    no_ft = median([b["step_s"] for b in baselines])
    for mode in modes.values():
        mode["step_vs_no_fault_tolerance"] = mode["full_layout_step_s"] / no_ft
    checkpoint_restart = median([r["segment_samples_per_s"] for r in restarts])
    print(json.dumps({"modes": modes, "runs": runs, "no_fault_tolerance": baselines,
                      "no_fault_tolerance_step_s": no_ft, "checkpoint_restart": restarts,
                      "checkpoint_restart_samples_per_s": checkpoint_restart, "advice": advised,
                      "rounds": args.rounds,
                      "steps": args.steps, "seed": args.seed}))
    print(last_line(modes, no_ft, checkpoint_restart))


if __name__ == "__main__":
    main()
