"""Worker script of the ledger tests: ``PipeMLP`` under ``strategy="bamboo"`` with a ``BambooLedger``.

``--cases FILE`` (JSON ``{name: [argument, ...]}``) runs each case in turn in this one launch (the test starts
both ranks at once, ``tests.process.run_ranks``). ``--stages 1`` makes the 2 ranks 2 data-parallel pipelines
(each reads its shard of the ``DistributedSampler``). A case trains ``--epochs`` epochs of a shuffled
dataset (Lightning's ``DistributedSampler``, seed 0), or stops at ``--max-steps``; ``--checkpoint-every N``
keeps a checkpoint every N steps in ``--checkpoint-dir`` (``step=<k>.ckpt``); ``--resume`` resumes from one;
``--perturb-at K`` adds 1e-3 to stage 1's first weight before step K (a run that must differ from step K);
``--estimate``: ``configure_optimizers`` reads ``trainer.estimated_stepping_batches`` (as one sizing a
OneCycleLR does), which makes Lightning build the loaders before the checkpoint is restored
(Lightning #20550).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_bamboo import BambooStrategy
from lightning_bamboo.ledger import BambooLedger
from tests.bamboo.pipe_mlp import PipeMLP, make_data


class Perturb(Callback):
    """Before step ``step``: stage 1's first weight += 1e-3 (on the rank holding stage 1)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, i: int) -> None:
        if trainer.global_step == self.step and trainer.strategy.stage_index == 1:  # type: ignore[attr-defined]
            with torch.no_grad():
                next(pl_module.parameters()).add_(1e-3)


class SizesItsSchedule(PipeMLP):
    """``PipeMLP`` whose ``configure_optimizers`` asks for the run's number of optimizer steps first."""

    def configure_optimizers(self):  # type: ignore[no-untyped-def, override]
        assert self.trainer.estimated_stepping_batches > 0
        return super().configure_optimizers()


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ledger", type=Path, required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4, help="per pipeline")
    parser.add_argument("--stages", type=int, default=2, help="2: one pipeline of 2 stages; 1: 2 pipelines")
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument("--resume", type=Path, default=None)
    parser.add_argument("--perturb-at", type=int, default=-1)
    parser.add_argument("--estimate", action="store_true")
    return parser.parse_args(argv)


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    seed_everything(0)
    model = (SizesItsSchedule if args.estimate else PipeMLP)(optimizer="adam")
    x, y = make_data(args.samples)
    pipelines = 2 // args.stages  # the 2 ranks
    # the global batch: every member loads it, each pipeline trains on its share
    train_loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size * pipelines, shuffle=True)
    callbacks: list[Callback] = []
    if args.perturb_at >= 0:
        callbacks.append(Perturb(args.perturb_at))
    callbacks.append(BambooLedger(args.ledger))
    if args.checkpoint_every:
        callbacks.append(
            ModelCheckpoint(
                dirpath=args.checkpoint_dir, filename="{step}", every_n_train_steps=args.checkpoint_every,
                save_top_k=-1,
            )
        )
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=BambooStrategy(
            num_stages=args.stages, num_microbatches=2,
            recovery="replica+forward" if args.stages > 1 else "peers", timeout=180
        ),
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=bool(args.checkpoint_every),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    trainer.fit(model, train_dataloaders=train_loader, ckpt_path=args.resume)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=Path, required=True)
    cases = json.loads(parser.parse_args().cases.read_text())
    for name, argv in cases.items():
        print(f"train_ledger: case {name}", flush=True)
        train(parse_args(argv))


if __name__ == "__main__":
    main()
