"""What an announced departure costs: a notice drains one worker of the elastic GPT recipe mid-training.

    python benchmarks/bamboo_drain.py                    # 2 workers (2 stages), drain rank 1 at step 10
    python benchmarks/bamboo_drain.py --nproc 4 --steps 30 --drain-step 15

Runs ``python -m lightning_bamboo.launch --nproc N -m recipes.train experiment=bamboo_gpt_elastic_spot``
with the fault injector's drain (``recipes/conf/notices/fault_demo.yaml``: a notice to global rank
``--rank`` at ``--drain-step``). The notice goes the way of a cloud warning: ``BambooNotices`` flags it, the
warned member announces its departure, the launcher publishes the generation without it, and the survivors go
on (docs/bamboo-notices.md). The survivors' ``bamboo_drain`` line is read back. Its figures: ``drain_s``
(boundary where the drain began -> next committed step), ``step_s`` (median failure-free step, commit to
commit), ``reform_s`` (boundary -> new generation formed), ``notice_s`` (notice seen -> boundary).

The last line printed is ``drain_s=<s> step_s=<s> drain_vs_step=<drain_s/step_s> reform_s=<s> notice_s=<s>``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINE = re.compile(
    r"bamboo_drain members=\S+ step=(\d+) notice_s=(\S+) reform_s=(\S+) drain_s=(\S+) step_s=(\S+)"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="workers (a multiple of the recipe's 2 stages)")
    parser.add_argument("--steps", type=int, default=20, help="training steps")
    parser.add_argument("--drain-step", type=int, default=10, help="step at which the notice is raised")
    parser.add_argument("--rank", type=int, default=1, help="global rank given the notice")
    parser.add_argument("--timeout", type=float, default=900, help="seconds before the run is killed")
    args = parser.parse_args(argv)
    if not 0 < args.drain_step < args.steps - 1:
        parser.error(
            f"--drain-step must be in 1..{args.steps - 2} (a step follows the drain), got {args.drain_step}"
        )
    with tempfile.TemporaryDirectory(prefix="bamboo-drain-") as run_dir:
        cmd = [
            sys.executable,
            "-m",
            "lightning_bamboo.launch",
            "--nproc",
            str(args.nproc),
            "-m",
            "recipes.train",
            "experiment=bamboo_gpt_elastic_spot",
            "notices@trainer.callbacks.notices=fault_demo",
            f"trainer.callbacks.notices.faults=[{{rank:{args.rank},at_step:{args.drain_step},action:drain}}]",
            f"trainer.max_steps={args.steps}",
            f"hydra.run.dir={run_dir}",
            "+trainer.enable_progress_bar=false",
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    out = proc.stdout + proc.stderr
    match = LINE.search(out)
    if proc.returncode != 0 or match is None:
        print(out[-4000:], file=sys.stderr)
        print(
            f"the run exited with {proc.returncode} and printed {'a' if match else 'no'} bamboo_drain line",
            file=sys.stderr,
        )
        return 1
    step, notice_s, reform_s, drain_s, step_s = (float(g) for g in match.groups())
    print(f"drained after step {int(step)} of {args.steps} ({args.nproc} workers): {match.group(0)}")
    print(
        f"drain_s={drain_s:.3f} step_s={step_s:.3f} drain_vs_step={drain_s / step_s:.2f} "
        f"reform_s={reform_s:.3f} notice_s={notice_s:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
