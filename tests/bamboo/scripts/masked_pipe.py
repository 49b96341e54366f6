"""Worker script: train ``MaskedPipe`` (stage boundaries carry a tuple or a dict) and snapshot every step.

Every rank writes ``<out>/step{k}_rank{r}.safetensors`` after each step: ``own/<param>`` (its stage; the
whole model under ``auto``), and under Bamboo ``fwd/{mb}/{i}`` (tensor ``i`` of this stage's F output of
micro-batch ``mb``) and ``fr/{mb}/{i}`` (its replica's FR output), and ``predict_rank{r}.safetensors``
with ``trainer.predict``'s outputs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

from lightning_bamboo import BambooStrategy
from tests.bamboo.masked_pipe import MaskedPipe, make_masked_data


def flat(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        value = [value]
    items = value.values() if isinstance(value, dict) else value
    return [t.detach().contiguous().cpu() for t in items]


class Snapshot(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.forwards: list[Any] = []

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if isinstance(trainer.strategy, BambooStrategy):
            pl_module.pipeline.register_forward_hook(lambda module, args, out: self.forwards.append(out))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.forwards.clear()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        tensors = {f"own/{name}": p.detach().clone() for name, p in pl_module.named_parameters()}
        strategy = trainer.strategy
        if isinstance(strategy, BambooStrategy):
            assert strategy.engine is not None
            for mb, value in enumerate(self.forwards):
                tensors |= {f"fwd/{mb}/{i}": t for i, t in enumerate(flat(value))}
            for mb, value in strategy.engine.redundant_outputs.items():
                tensors |= {f"fr/{mb}/{i}": t for i, t in enumerate(flat(value))}
        save_file(tensors, str(self.out / f"step{trainer.global_step}_rank{trainer.global_rank}.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategy", choices=["auto", "bamboo"], default="bamboo")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    seed_everything(0)
    model = MaskedPipe()
    x, mask, y = make_masked_data(args.steps * args.batch_size)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))  # a fixed shuffled order
    x, mask, y = x[order], mask[order], y[order]
    if args.strategy == "auto":
        strategy: BambooStrategy | str = "auto"
    else:
        strategy = BambooStrategy(num_stages=args.stages, num_microbatches=2, timeout=180,
                                  recovery="replica+forward")  # the tests check every FR output
    trainer = Trainer(
        accelerator="cpu",
        devices=args.stages if args.strategy == "bamboo" else 1,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[Snapshot(args.out)],
    )
    trainer.fit(model, DataLoader(TensorDataset(x, mask, y), batch_size=args.batch_size, shuffle=False))
    px, pmask, py = make_masked_data(8, seed=5)
    predictions = trainer.predict(model, DataLoader(TensorDataset(px, pmask, py), batch_size=4))
    assert predictions is not None
    save_file(
        {"outputs": torch.cat([p.cpu() for p in predictions])},  # type: ignore[misc]
        str(args.out / f"predict_rank{trainer.global_rank}.safetensors"),
    )


if __name__ == "__main__":
    main()
