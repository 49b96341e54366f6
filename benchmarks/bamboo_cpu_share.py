"""Where the CPU of a failure-free Bamboo step goes: every process's CPU seconds per committed step.

    sudo python benchmarks/bamboo_cpu_share.py [--rounds 3] [--steps 600] [--out DIR]

Each round runs, interleaved, the failure-free multi-machine job (``benchmarks/bamboo_nodes.py --recovery
peers --no-trace``: 3 network-namespace machines, 2 workers each, their agents and etcd) and the same pipeline
without fault tolerance (``bamboo_modes.run_without_fault_tolerance``: torchrun, fixed ranks). A sampler
thread reads every process's CPU time (``/proc/<pid>/stat``: user + system) twice a second; over the middle of
each run (from a fifth of its steps to a tenth before its end: no start-up, no shutdown) the CPU each kind
of process spent is divided by the steps committed meanwhile.

Why CPU and not only the step: on a machine where these processes share few cores the step is set by the
CPU the whole job spends per step, so the wall-clock overhead moves with whatever else runs, by as much as
any piece of the fault tolerance (``benchmarks/results/bamboo-elastic-history.md``, "What the rest of the
overhead is"). CPU seconds per step are what each process costs, whatever the machine does meanwhile; on
machines with cores to spare for the agents and etcd only the trainers' own share is on the step's critical
path.

Kinds: ``trainer`` (the training processes, started by the agents' preload servers or by torchrun),
``agent`` (``lightning_bamboo.launch``), ``torchrun``, ``etcd``, ``bench`` (this benchmark and
``bamboo_nodes.py``: the commit watch), ``other`` (the rest of the machine). The line before the last is
JSON (per run); the last line: ``ft_cpu_per_step_s=<median, peers> no_ft_cpu_per_step_s=<median, torchrun>
cpu_ratio=<the two's ratio> trainer_cpu_ratio=<the trainers' alone> step_ratio=<wall step, peers / no fault
tolerance>``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # bamboo_modes's torchrun run and the test suite's namespaces (tests.netns)
NODES = REPO / "benchmarks" / "bamboo_nodes.py"
TICKS = os.sysconf("SC_CLK_TCK")
#: A process's CPU time per pid, with its kind: what one sample of the machine holds.
Snapshot = dict[int, tuple[str, float]]


def kind_of(cmdline: str) -> str:
    """The kind of process a command line belongs to (see the module docstring)."""
    program = cmdline.split(" ", 1)[0]
    if os.path.basename(program) == "etcd":
        return "etcd"
    if "lightning_bamboo.launch" in cmdline:
        return "agent"
    if "torch.distributed.run" in cmdline:
        return "torchrun"
    if "train_elastic.py" in cmdline or "lbd_common.preload" in cmdline:
        return "trainer"  # a preload server forks the agents' workers: they keep its command line
    if "bamboo_nodes.py" in cmdline or "bamboo_cpu_share.py" in cmdline:
        return "bench"
    return "other"


def snapshot(proc: Path = Path("/proc")) -> Snapshot:
    """Every process's kind and CPU seconds (user + system) now."""
    out: Snapshot = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
        out[int(entry.name)] = (kind_of(cmdline.strip()), (int(fields[11]) + int(fields[12])) / TICKS)
    return out


def cpu_between(samples: Sequence[tuple[float, Snapshot]], start: float, end: float) -> dict[str, float]:
    """CPU seconds per kind spent from the first sample at or after ``start`` to the last at or before
    ``end``: a process present in both counts its difference, one started in between all of its time."""
    first = next(snap for t, snap in samples if t >= start)
    last = [snap for t, snap in samples if t <= end][-1]
    spent: dict[str, float] = {}
    for pid, (kind, cpu) in last.items():
        before = first[pid][1] if pid in first else 0.0
        spent[kind] = spent.get(kind, 0.0) + cpu - before
    return spent


class Sampler(threading.Thread):
    """Samples the machine every ``interval`` seconds (wall clock, ``time.time``) until stopped."""

    def __init__(self, interval: float = 0.5, take: Callable[[], Snapshot] = snapshot) -> None:
        super().__init__(name="cpu-sampler", daemon=True)
        self.interval, self.take = interval, take
        self.samples: list[tuple[float, Snapshot]] = []
        self._stopping = threading.Event()

    def run(self) -> None:
        while not self._stopping.is_set():
            self.samples.append((time.time(), self.take()))
            self._stopping.wait(self.interval)

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=10)


def per_step(samples: Sequence[tuple[float, Snapshot]], step_times: Sequence[float]) -> dict[str, object]:
    """CPU per committed step over the middle of a run (steps ``n/5`` to ``n - n/10``), per kind."""
    lo, hi = len(step_times) // 5, len(step_times) - len(step_times) // 10 - 1
    steps = hi - lo
    if steps < 10:
        raise ValueError(f"{len(step_times)} steps: too few to measure (run more --steps)")
    spent = cpu_between(samples, step_times[lo], step_times[hi])
    return {"steps": steps, "step_s": (step_times[hi] - step_times[lo]) / steps,
            "cpu_per_step_s": {kind: spent[kind] / steps for kind in sorted(spent)},
            "cpu_total_per_step_s": sum(spent.values()) / steps}


def run_peers(out: Path, steps: int, timeout: float) -> list[float]:
    """The failure-free job on 3 machines; its commit times (wall clock)."""
    with (out / "bench.log").open("w") as log:
        command = [sys.executable, str(NODES), "--recovery", "peers", "--steps", str(steps), "--no-trace",
                   "--out", str(out), "--timeout", str(timeout)]
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                       timeout=timeout + 120)
    commits = json.loads((out / "commits.json").read_text())["commits"]  # [step, time.monotonic(), gen]
    offset = time.time() - time.monotonic()
    return [when + offset for _, when, _ in commits]


def run_no_fault_tolerance(out: Path, steps: int, timeout: float) -> list[float]:
    """The same pipeline under torchrun; rank 0's step times (wall clock)."""
    from benchmarks import bamboo_modes

    bamboo_modes.run_without_fault_tolerance(argparse.Namespace(baseline_steps=steps, timeout=timeout), out)
    return [float(line.split()[1]) for line in (out / "steps.txt").read_text().splitlines()]


def summary(rows: Sequence[dict[str, object]]) -> str:
    """The last line from the runs' rows (medians per kind of run)."""
    def median(kind: str, pick: Callable[[dict[str, object]], float]) -> float:
        values = [pick(r) for r in rows if r["run"] == kind]
        return statistics.median(values) if values else float("nan")

    def trainer(row: dict[str, object]) -> float:
        return float(row["cpu_per_step_s"].get("trainer", 0.0))  # type: ignore[union-attr]

    def total(row: dict[str, object]) -> float:
        return float(row["cpu_total_per_step_s"])  # type: ignore[arg-type]

    def step(row: dict[str, object]) -> float:
        return float(row["step_s"])  # type: ignore[arg-type]

    ft, no_ft = median("peers", total), median("no_ft", total)
    ratio = ft / no_ft if no_ft else float("nan")
    trainers = median("peers", trainer) / median("no_ft", trainer)
    steps = median("peers", step) / median("no_ft", step)
    return (f"ft_cpu_per_step_s={ft:.4f} no_ft_cpu_per_step_s={no_ft:.4f} cpu_ratio={ratio:.3f} "
            f"trainer_cpu_ratio={trainers:.3f} step_ratio={steps:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each, interleaved")
    parser.add_argument("--steps", type=int, default=600, help="steps per run")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    parser.add_argument("--out", type=Path, default=None, help="keep every run's files here")
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 100:
        parser.error(f"--rounds must be >= 1 and --steps >= 100, got {args.rounds} and {args.steps}")
    work = args.out or Path(tempfile.mkdtemp(prefix="bamboo-cpu-"))
    sampler = Sampler()
    sampler.start()
    rows: list[dict[str, object]] = []
    try:
        for round_ in range(args.rounds):
            order = [("peers", run_peers), ("no_ft", run_no_fault_tolerance)]
            for kind, run in order if round_ % 2 == 0 else order[::-1]:
                out = work / f"round{round_}-{kind}"
                out.mkdir(parents=True, exist_ok=True)
                times = run(out, args.steps, args.timeout)
                time.sleep(1.0)  # a sample after the run's window
                row = {"round": round_, "run": kind, **per_step(sampler.samples, times)}
                rows.append(row)
                print(f"[cpu] round {round_} {kind}: step {row['step_s']:.4f} s, CPU per step "
                      f"{row['cpu_total_per_step_s']:.4f} s {row['cpu_per_step_s']}", flush=True)
    finally:
        sampler.stop()
    print(json.dumps({"runs": rows, "rounds": args.rounds, "steps": args.steps}), flush=True)
    print(summary(rows))


if __name__ == "__main__":
    main()
