"""Worker script: the Planetoid recipes (``experiment=dorylus_<model>_cora``) for several seeds, one launch.

Each seed runs exactly what ``python -m recipes.train experiment=dorylus_<model>_cora seed=<k>`` runs
(:func:`recipes.train.run`: the recipe's model, ``NormalizeFeatures``, METIS partitions, 200 epochs,
``ModelCheckpoint(monitor="val_acc")`` and ``trainer.test(ckpt_path="best")``), with the overrides below:
the inline executor (the tensor ops' results equal the local pool's: ``tests/dorylus/test_strategy.py``;
not with ``strategy=auto`` among the overrides: one process, no executor option) and no progress bar.
Models and seeds run one after another in the same processes (both graph servers started together by the
test, ``tests.process.run_ranks``, or by Lightning's popen launcher with the first Trainer when run alone;
the process group is reused, the imports are paid once).
Rank 0 writes ``cora.json``: per model its runs and mean (``{"models": {"gcn": {...}, ...}}``; with one
model, that model's summary at the top level too).

Usage: python cora_run.py OUT_DIR --model gcn|gat|gcn,gat [--seeds 5] [--first-seed 0] [--epochs 200]
[override ...]
The 5-seed figures of the docs: ``python benchmarks/cora_accuracy.py``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from lightning.pytorch.utilities.rank_zero import rank_zero_only

from recipes.compose import compose_recipe
from recipes.train import run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="gcn", help="gcn, gat or both comma-separated (gcn,gat)")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--first-seed", type=int, default=0, help="seeds first..first+seeds-1")
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("overrides", nargs="*", help="more recipe overrides, e.g. paths.data=/datasets")
    args = parser.parse_args()

    models = args.model.split(",")
    for model in models:
        if model not in ("gcn", "gat"):
            parser.error(f"--model {args.model!r}: expected gcn, gat or gcn,gat")

    summaries = {}
    for model in models:
        results = []
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            out = args.out / model / f"seed{seed}"
            cfg = compose_recipe(
                f"dorylus_{model}_cora",
                out,
                [
                    f"seed={seed}",
                    f"trainer.max_epochs={args.epochs}",
                    *([] if "strategy=auto" in args.overrides else ["strategy.executor=inline"]),
                    f"paths.cache={args.out / 'cache'}",
                    "++trainer.enable_progress_bar=false",
                    "++trainer.enable_model_summary=false",
                    *args.overrides,
                ],
            )
            start = time.perf_counter()
            metrics = run(cfg)
            seconds = time.perf_counter() - start
            results.append({"seed": seed, "test_acc": metrics["test_acc"], "seconds": seconds})
        accs = [r["test_acc"] for r in results]
        summaries[model] = {"model": model, "runs": results, "mean_test_acc": sum(accs) / len(accs)}
    if rank_zero_only.rank == 0:
        summary = {**(summaries[models[0]] if len(models) == 1 else {}), "models": summaries}
        (args.out / "cora.json").write_text(json.dumps(summary, indent=2))
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
