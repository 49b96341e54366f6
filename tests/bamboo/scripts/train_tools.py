"""Worker script: Lightning's tools around training under ``strategy="auto"`` or Bamboo (2 stages).

``--tool lr-find``: ``Tuner(trainer).lr_find`` on ``PlainSgd`` (no scheduler of its own, so lr_find's
scheduler is the first to add ``initial_lr`` to the optimizer), then ``fit`` with the suggested learning
rate. Rank ``r`` writes ``<out>/rank{r}.json`` (the suggestion and the recorded losses) and
``<out>/rank{r}.safetensors`` (``own/<name>`` for its stage, ``replica/<name>`` for its replica, after the
fit).
``--tool swa``: ``fit`` with ``StochasticWeightAveraging``; the error, if any, goes to ``<out>/error.txt``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.tuner import Tuner
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_bamboo import BambooStrategy
from tests.bamboo.pipe_mlp import PipeMLP, make_data


class PlainSgd(PipeMLP):
    """``PipeMLP`` with SGD + momentum and no scheduler (lr_find brings its own)."""

    @override
    def configure_optimizers(self):  # type: ignore[override]
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategy", choices=["auto", "bamboo"], default="bamboo")
    parser.add_argument("--tool", choices=["lr-find", "swa"], required=True)
    parser.add_argument("--lr-steps", type=int, default=30)
    parser.add_argument("--fit-steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    seed_everything(0)
    model = PlainSgd(pairs=2, lr=0.01)
    x, y = make_data(4 * args.lr_steps)
    data = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)
    if args.strategy == "bamboo":
        strategy: BambooStrategy | str = BambooStrategy(num_stages=2, num_microbatches=2, timeout=180)
        # every stage reads the whole dataset (one pipeline): no sampler shuffling, same order as auto
    else:
        strategy = "auto"
    common = dict(
        accelerator="cpu",
        devices=2 if args.strategy == "bamboo" else 1,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
        default_root_dir=str(args.out),
    )
    if args.tool == "swa":
        trainer = Trainer(max_steps=2, callbacks=[StochasticWeightAveraging(swa_lrs=0.01)], **common)
        try:
            trainer.fit(model, train_dataloaders=data)
        except ValueError as err:
            (args.out / f"error_rank{trainer.global_rank}.txt").write_text(str(err))
        return
    trainer = Trainer(max_steps=args.fit_steps, **common)
    finder = Tuner(trainer).lr_find(
        model, train_dataloaders=data, min_lr=1e-4, max_lr=1.0, num_training=args.lr_steps,
        early_stop_threshold=None,
    )
    assert finder is not None
    suggestion = finder.suggestion()
    rank = trainer.global_rank
    result = {"suggestion": suggestion, "lr": model.lr, "loss": finder.results["loss"]}
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    trainer.fit(model, train_dataloaders=data)
    tensors = {f"own/{n}": p.detach().clone() for n, p in model.named_parameters()}
    if isinstance(trainer.strategy, BambooStrategy) and trainer.strategy.replica_sync is not None:
        for n, p in trainer.strategy.replica_sync.replica.named_parameters():
            tensors[f"replica/pipeline.{n}"] = p.detach().clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(args.out / f"rank{rank}.safetensors"))


if __name__ == "__main__":
    main()
