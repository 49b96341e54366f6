"""Does the preflight advisor's validation hold? The probe on the GPT recipe, run after run, with and without
a stall of the job injected among its steps.

    python benchmarks/bamboo_advise.py                 # 4 runs each: steady, and one 400 ms stall
    python benchmarks/bamboo_advise.py --runs 8 --stall-ms 600

Each run trains the GPT recipe (2 stages x 1 pipeline, redundancy on, two CPU processes through Lightning's
launcher) with ``AdvisorProbe`` in the configuration of docs/bamboo-advise.md ("Validation": 3 warm-up steps,
20 measured steps, 20 with the replica forwards off and 19 validation steps taking turns step by step, a
checkpoint every 6 of each), then runs ``python -m lightning_bamboo.advise`` on its costs file and reads
``sim_error`` from its last line. A stalled run sleeps ``--stall-ms`` in every rank at the start of one step
drawn at random among the probe's steps (what a scheduler stall or a noisy neighbour does to a shared
machine: it lands in the measured steps or in the window). Steady and stalled runs alternate.

Beside each ``sim_error`` (the probe's: a step is the median of 5 means of consecutive steps, a save the
median save) the one plain means would give (rank 0's mean step, the window's whole wall time), so that what
the robust estimate buys is measured in the same runs. The last line is exactly
``sim_error_median=<e> stalled_sim_error_median=<e> plain_stalled_sim_error_median=<e> within_0.10=<k>/<n>``
(``k`` of the ``n`` runs with ``sim_error <= 0.10``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

REPO = Path(__file__).resolve().parents[1]
WARMUP, EVERY = 3, 6


class Stall(Callback):
    """Sleep ``seconds`` at the start of optimizer step ``step`` (1-based) on every rank: the job stalls."""

    def __init__(self, step: int, seconds: float) -> None:
        self.step, self.seconds = step, seconds

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step + 1 == self.step:
            time.sleep(self.seconds)
            self.step = -1  # once (gradient accumulation would start the same step again)


def run_once(work: Path, steps: int, stall_step: int | None, stall_s: float) -> dict[str, Any]:
    """Train with the probe (``steps`` measured steps, as many without FR, ``steps - 1`` validation steps up
    to the last measured one, and 3 more), run the advisor; the costs file and its sim_error."""
    costs = work / "costs.json"
    max_steps = WARMUP + 3 * steps + 2
    command = [
        sys.executable, "-m", "recipes.train", "experiment=bamboo_gpt", f"trainer.max_steps={max_steps}",
        "trainer.limit_val_batches=0", "trainer.logger=false", "trainer.enable_checkpointing=false",
        f"hydra.run.dir={work / 'run'}",
        "+trainer.callbacks.advisor._target_=lightning_bamboo.advise.AdvisorProbe",
        f"+trainer.callbacks.advisor.path={costs}", f"+trainer.callbacks.advisor.steps={steps}",
        f"+trainer.callbacks.advisor.warmup_steps={WARMUP}",
        f"+trainer.callbacks.advisor.checkpoint_every={EVERY}", "+trainer.callbacks.advisor.block_steps=1",
    ]
    if stall_step is not None:
        command += ["+trainer.callbacks.stall._target_=benchmarks.bamboo_advise.Stall",
                    f"+trainer.callbacks.stall.step={stall_step}",
                    f"+trainer.callbacks.stall.seconds={stall_s}"]
    subprocess.run(command, cwd=REPO, check=True, timeout=600, capture_output=True)
    advice = subprocess.run([sys.executable, "-m", "lightning_bamboo.advise", "--costs", str(costs)],
                            cwd=REPO, check=True, timeout=120, capture_output=True, text=True)
    last = advice.stdout.strip().splitlines()[-1]
    return {"data": json.loads(costs.read_text()), "sim_error": float(last.rsplit("sim_error=", 1)[1])}


def plain_sim_error(data: dict[str, Any], work: Path) -> float:
    """The validation with plain means: rank 0's mean measured step and the window's whole wall time."""
    from lightning_bamboo.simulate import load_costs, validate

    plain = json.loads(json.dumps(data))
    layout = next(iter(plain["probe"]))
    step = statistics.fmean(plain["probe"][layout]["step_s_each_rank0"])
    plain["costs"]["step_s"] = plain["costs"]["step_s_by_layout"][layout] = step
    live = plain["live"]["bamboo"]
    live["wall_s"], live["samples_per_s"] = live["wall_s_total"], live["samples_per_s_total"]
    live["checkpoint_interval_s"] = EVERY * step  # as the probe sets it, from the plain step
    path = work / "plain.json"
    path.write_text(json.dumps(plain))
    return validate(load_costs(path)).sim_error


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=4, help="runs of each kind (steady, stalled)")
    parser.add_argument("--stall-ms", type=float, default=400.0)
    parser.add_argument("--steps", type=int, default=20, help="measured steps (the probe's steps=)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, default=None, help="keep each run's files under this folder")
    args = parser.parse_args()
    if args.runs < 1 or args.stall_ms <= 0 or args.steps < 5:
        parser.error(f"--runs must be >= 1, --stall-ms > 0 and --steps >= 5, got {args.runs}, "
                     f"{args.stall_ms} and {args.steps}")
    draw = random.Random(args.seed)
    rows: dict[str, list[tuple[float, float]]] = {"steady": [], "stalled": []}
    print(f"{'run':>4} {'kind':<8} {'stall at step':>13} {'load':>5} {'sim_error':>10} {'plain':>7}")
    with tempfile.TemporaryDirectory(prefix="bamboo-advise-") as scratch:
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            scratch = str(args.keep)
        for i in range(args.runs):
            for kind in ("steady", "stalled"):
                work = Path(scratch) / f"{kind}{i}"
                work.mkdir()
                # a step of the probe's: the measured, without-FR and validation steps after the warm-up
                step = draw.randint(WARMUP + 1, WARMUP + 3 * args.steps - 1) if kind == "stalled" else None
                load = float(Path("/proc/loadavg").read_text().split()[0])
                result = run_once(work, args.steps, step, args.stall_ms / 1000)
                plain = plain_sim_error(result["data"], work)
                rows[kind].append((result["sim_error"], plain))
                print(f"{i:>4} {kind:<8} {step or '-':>13} {load:>5.2f} {result['sim_error']:>10.3f} "
                      f"{plain:>7.3f}", flush=True)
    errors = [e for kind in rows for e, _ in rows[kind]]
    within = sum(e <= 0.10 for e in errors)
    print(f"sim_error_median={statistics.median(e for e, _ in rows['steady']):.3f} "
          f"stalled_sim_error_median={statistics.median(e for e, _ in rows['stalled']):.3f} "
          f"plain_stalled_sim_error_median={statistics.median(p for _, p in rows['stalled']):.3f} "
          f"within_0.10={within}/{len(errors)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
