"""Epoch time of the package's models under ``strategy="auto"`` with the default thread counts vs one thread.

Issue 32 saw GCN/GAT 5-17x slower with the default threads (torch's OpenMP pool and numpy's OpenBLAS, one
thread per core each) than with one thread, on a loaded machine. This measures it: Cora (``data/``), the
whole graph in one process, ``--epochs`` epochs per run, the median epoch after the first; the modes run
interleaved, ``--rounds`` times each, every run a fresh process (thread counts are fixed at start-up), and
the load average is printed beside each run, because a busy machine is what this is about. Modes:
``default`` (no thread variable), ``one`` (``OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1``), ``torch1`` (torch
one thread, OpenBLAS default) and ``blas1`` (OpenBLAS one thread, torch default).

    nice -n 5 python benchmarks/dorylus_auto_threads.py [--models gcn,gat] [--rounds 3] [--epochs 15]
    python benchmarks/dorylus_auto_threads.py --run gcn 15     (one run, in this process's environment)

Recorded figures: docs/dorylus.md, "Threads under strategy='auto'".
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = {
    "default": {},
    "one": {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
    "torch1": {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": str(os.cpu_count() or 1)},
    "blas1": {"OPENBLAS_NUM_THREADS": "1"},
}
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def run(model_name: str, epochs: int, cache_dir: str) -> None:
    """One fit of ``model_name`` on Cora under ``strategy="auto"``; prints the median epoch seconds."""
    import torch
    import torch_geometric.transforms as T
    from lightning.pytorch import Callback, Trainer, seed_everything

    from lightning_dorylus import GAT, GCN
    from lightning_dorylus.data import DorylusDataModule, load_planetoid

    class EpochTimes(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_epoch_start(self, *args: object) -> None:
            self.start = time.perf_counter()

        def on_train_epoch_end(self, *args: object) -> None:
            self.times.append(time.perf_counter() - self.start)

    seed_everything(0, verbose=False)
    datamodule = DorylusDataModule(load_planetoid(REPO / "data" / "planetoid", "Cora"), cache_dir=cache_dir,
                                   transform=T.NormalizeFeatures())
    f, c = datamodule.num_features, datamodule.num_classes
    gat = {"heads": 8, "out_heads": 1, "dropout": 0.6, "lr": 0.005}  # the Cora recipe's GAT
    model = GCN(f, 16, c) if model_name == "gcn" else GAT(f, 8, c, **gat)
    times = EpochTimes()
    trainer = Trainer(accelerator="cpu", devices=1, strategy="auto", max_epochs=epochs, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      limit_val_batches=0, num_sanity_val_steps=0, callbacks=[times])
    trainer.fit(model, datamodule=datamodule)
    print(f"RESULT torch_threads={torch.get_num_threads()} epoch_s={statistics.median(times.times[1:]):.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gcn,gat")
    parser.add_argument("--modes", default="default,one")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--run", nargs=2, metavar=("MODEL", "EPOCHS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        if args.run:
            run(args.run[0], int(args.run[1]), cache)
            return
        results: dict[tuple[str, str], list[float]] = {}
        for round_ in range(args.rounds):
            for model in args.models.split(","):
                for mode in args.modes.split(","):
                    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS} | MODES[mode]
                    env["XDG_CACHE_HOME"] = cache
                    command = [sys.executable, __file__, "--run", model, str(args.epochs)]
                    out = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True,
                                         check=True).stdout
                    seconds = float(out.rsplit("epoch_s=", 1)[1].split()[0])
                    results.setdefault((model, mode), []).append(seconds)
                    load = os.getloadavg()[0]
                    print(f"round {round_} {model} {mode}: {seconds:.3f} s/epoch (load {load:.1f})",
                          flush=True)
    for (model, mode), seconds in results.items():
        print(f"{model} {mode}: median {statistics.median(seconds):.3f} s/epoch over {len(seconds)} runs")


if __name__ == "__main__":
    main()
