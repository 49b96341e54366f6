"""The README's main command: train each shipped strategy briefly on this machine's CPU.

Each run is the real recipe entry point in its own process (``python -m recipes.train experiment=...``), as a
user would launch it, so multi-process strategies start their own workers through Lightning's launcher.
"""

from __future__ import annotations

import os
import subprocess
import sys

from recipes.paths import CONFIG_DIR, REPO_ROOT

# (experiment, extra overrides, what the run shows)
DEMO_RUNS: list[tuple[str, list[str], str]] = [
    ("bamboo_gpt_tied", ["trainer.max_steps=30"],
     "Bamboo: a tiny GPT (LM head tied to the token embedding) as a 2-stage pipeline with redundant layers, "
     "2 CPU processes; a callback prints a sample through the whole pipeline every 10 steps"),
    ("bamboo_gpt_elastic", ["trainer.max_steps=30"],
     "Elastic Bamboo: the same GPT on 4 workers (2 stages x 2 pipelines); worker 3 is SIGKILLed at step 10 "
     "and its predecessor takes its stage over inside the same fit"),
    ("dorylus_gcn_powerlaw", ["trainer.max_epochs=30"],
     "Dorylus: GCN on a generated power-law graph, 2 graph servers, local executor pool"),
]

ELASTIC = {"bamboo_gpt_elastic": "3:10:forward"}
"""Runs started by ``python -m lightning_bamboo.launch``, with the worker fault they inject."""


def main() -> int:
    for experiment, overrides, what in DEMO_RUNS:
        if not (CONFIG_DIR / "experiment" / f"{experiment}.yaml").exists():
            raise FileNotFoundError(f"demo recipe {experiment!r} is missing from {CONFIG_DIR / 'experiment'}")
        print(f"\n=== demo: {experiment} — {what} ===", flush=True)
        cmd = [sys.executable, "-m", "recipes.train", f"experiment={experiment}", *overrides]
        env = None
        if experiment in ELASTIC:
            # the supervisor starts the workers; the fault injection SIGKILLs one of them mid-step
            cmd = [sys.executable, "-m", "lightning_bamboo.launch", "--nproc", "4", *cmd[1:]]
            env = {**os.environ, "BAMBOO_FAULT": ELASTIC[experiment]}
            print(f"$ BAMBOO_FAULT={ELASTIC[experiment]} " + " ".join(cmd[1:]), flush=True)
        else:
            print("$ " + " ".join(cmd[1:]), flush=True)
        result = subprocess.run(cmd, cwd=REPO_ROOT, env=env)
        if result.returncode != 0:
            print(f"demo: {experiment} failed with exit code {result.returncode}", file=sys.stderr)
            return result.returncode
    print("\ndemo: all runs finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
