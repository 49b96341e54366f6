"""One training process of ``benchmarks/bamboo_preemption.py`` (started by it, never by hand).

Both systems train the recipe ``experiment=bamboo_gpt_elastic`` (same model, same seed, same GLOBAL batch)
until the benchmark kills them; every completed step is appended to ``<run-dir>/steps-<name>.txt`` as
``global_step wall_time layout`` (one line, flushed), which is all the benchmark measures from.

* ``--system bamboo``: ``BambooStrategy`` under the benchmark's
  ``lightning_bamboo.control.supervisor.Supervisor``
  (failover inside the same ``fit``). The layout is the current ownership map's shape.
* ``--system checkpoint_restart``: the plain ``BambooStrategy`` without redundancy, ranks given by the
  benchmark through ``LOCAL_RANK``/``WORLD_SIZE`` (as torchrun would). It resumes from the last complete
  checkpoint in ``<run-dir>/ckpt`` and checkpoints every Young/Daly interval ``sqrt(2 * C * MTBF)``
  (``benchmarks/_young_daly.py``: ``C`` the median cost of its checkpoints so far, the first taken right
  after the warm-up steps of the first launch; ``--mtbf-s`` from the trace segment).
  ``<run-dir>/drain`` asks for a checkpoint now and a clean exit (a grow restart).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import hydra
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything

from benchmarks._young_daly import YoungDalyCheckpoint, latest_checkpoint
from lightning_bamboo.simulate.model import shape_key
from lightning_bamboo.strategy import BambooStrategy
from recipes.compose import compose_recipe

EXPERIMENT = "bamboo_gpt_elastic"
T_IMPORTED = time.time()


def process_start_time() -> float:
    """Wall time at which the OS created this process (``/proc/self/stat`` start ticks since boot, 10 ms),
    i.e. before the interpreter started and imported torch and Lightning."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))


def layout_of(strategy: BambooStrategy) -> str:
    """The layout a step ran on, keyed as the replay keys it (``2x2``; ``2+1`` for a fused pipeline)."""
    assert strategy.owners is not None
    return shape_key(strategy.owners)


class StepClock(Callback):
    """Appends ``global_step time layout`` for every completed step (the benchmark's only measurement)."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", buffering=1)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self.file.write(f"{trainer.global_step} {time.time():.6f} {layout_of(trainer.strategy)}\n")


class Phases(Callback):
    """Writes when this process reached each start-up phase (wall times) to ``phases-<name>.json``: ``exec``
    (the OS created the process), ``imported`` (torch, Lightning), ``setup`` (process group formed: rendezvous
    done), ``train_start`` (model built, checkpoint restored). The benchmark splits each relaunch with it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.times = {"exec": process_start_time(), "imported": T_IMPORTED}

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.times["setup"] = time.time()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.times["train_start"] = time.time()
        self.path.write_text(json.dumps(self.times))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--system", choices=["bamboo", "checkpoint_restart"], required=True)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--batch", type=int, required=True, help="GLOBAL batch (sequences per step)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--mtbf-s", type=float, default=0.0, help="checkpoint_restart: the segment's MTBF")
    parser.add_argument("--recovery", default=None, help="bamboo: BambooStrategy(recovery=...); default its")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. model.n_layer=4")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = compose_recipe(EXPERIMENT, args.run_dir / "hydra", args.overrides)
    seed_everything(int(cfg.seed))
    model = hydra.utils.instantiate(cfg.model)
    if args.system == "bamboo":
        name = f"member{os.environ['BAMBOO_MEMBER']}"
        batch = args.batch  # every member loads the global batch and takes its pipeline's share
        strategy: Any = BambooStrategy(
            num_stages=args.stages, num_microbatches=args.microbatches, timeout=float(cfg.strategy.timeout),
            recovery=args.recovery,
        )
        devices = 1
        callbacks: list[Callback] = []
        ckpt_path = None
    else:
        world = int(os.environ["WORLD_SIZE"])
        name = f"launch{os.environ['BENCH_LAUNCH']}-rank{os.environ['LOCAL_RANK']}"
        batch = args.batch  # the same runtime: every rank loads the global batch, each pipeline its share
        strategy = BambooStrategy(
            num_stages=args.stages, num_microbatches=args.microbatches, recovery="peers",
            timeout=float(cfg.strategy.timeout),
        )
        devices = world
        callbacks = [YoungDalyCheckpoint(args.run_dir, args.mtbf_s)]
        found = latest_checkpoint(args.run_dir / "ckpt")
        ckpt_path = str(found) if found is not None else None
    data = hydra.utils.instantiate(cfg.data, batch_size=batch)
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=1_000_000,
        max_epochs=-1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[StepClock(args.run_dir / f"steps-{name}.txt"),
                   Phases(args.run_dir / f"phases-{name}.json"), *callbacks],
    )
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)


if __name__ == "__main__":
    main()
