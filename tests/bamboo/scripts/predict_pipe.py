"""Worker script: train ``TinyLM`` a few steps, generate a sample from a callback, then ``trainer.predict``.

Run once with ``--strategy auto`` (one process: the reference) and with ``--strategy bamboo`` (all ranks
started together by the test). Every rank writes to ``--out``:

* ``predict_rank{r}.safetensors``: ``ids`` (the sample index of every predicted row, in order) and
  ``logits`` (what ``trainer.predict`` returned on this rank, concatenated);
* ``sample_rank{r}.safetensors``: the greedily generated tokens and the last step's logits, from a callback
  at the end of training that runs the whole model with ``lightning_bamboo.strategy.full_forward``;
* ``sample_rank{r}.json``: the error texts of calling ``pl_module.pipeline(x)`` and ``pl_module(x)`` in that
  callback (``null`` where the call worked).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

from lightning_bamboo import BambooStrategy
from lightning_bamboo.strategy import full_forward
from tests.bamboo.tiny_lm import TinyLM, make_tokens

PROMPT = [[3, 1, 4]]
NEW_TOKENS = 4


class Sample(Callback):
    """At the end of training: greedy generation through the whole model, and the stage's own forward."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        pl_module.eval()
        idx = torch.tensor(PROMPT, device=pl_module.device)
        logits = torch.empty(0)
        for _ in range(NEW_TOKENS):
            logits = full_forward(pl_module, idx)[:, -1]
            idx = torch.cat([idx, logits.argmax(dim=-1, keepdim=True)], dim=1)
        errors: dict[str, str | None] = {}
        calls = (("pipeline", lambda: pl_module.pipeline(idx)), ("forward", lambda: pl_module(idx)))
        for name, call in calls:
            try:
                with torch.no_grad():
                    call()
                errors[name] = None
            except RuntimeError as error:
                errors[name] = str(error)
        pl_module.train()
        rank = trainer.global_rank
        tensors = {"tokens": idx.cpu(), "logits": logits.cpu()}
        save_file(tensors, str(self.out / f"sample_rank{rank}.safetensors"))
        (self.out / f"sample_rank{rank}.json").write_text(json.dumps(errors))


class Ids(Callback):
    """The sample indices of the predicted batches, in order."""

    def __init__(self) -> None:
        self.ids: list[torch.Tensor] = []

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.ids.append(batch[2].cpu())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategy", choices=["auto", "bamboo"], default="bamboo")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--pipelines", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4, help="per pipeline")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--predict-samples", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)

    seed_everything(0)
    model = TinyLM()
    ids, targets, _ = make_tokens(args.steps * args.batch_size * args.pipelines)
    batch_size = args.batch_size * args.pipelines  # the global batch (Bamboo splits it over the pipelines)
    # the samples in a fixed shuffled order (both strategies train the DataLoader's order)
    permutation = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))
    ids, targets = ids[permutation], targets[permutation]
    if args.strategy == "auto":
        strategy: BambooStrategy | str = "auto"
        devices = 1
    else:
        strategy = BambooStrategy(num_stages=args.stages, num_microbatches=args.microbatches, timeout=180)
        devices = args.stages * args.pipelines
    train = DataLoader(TensorDataset(ids, targets), batch_size=batch_size, shuffle=False)
    ids_callback = Ids()
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[Sample(args.out), ids_callback],
    )
    trainer.fit(model, train_dataloaders=train)

    predict_ids, predict_targets, predict_index = make_tokens(args.predict_samples, seed=99)
    predict = DataLoader(
        TensorDataset(predict_ids, predict_targets, predict_index), batch_size=args.batch_size, shuffle=False
    )
    predictions = trainer.predict(model, dataloaders=predict)
    assert predictions is not None
    save_file(
        {"ids": torch.cat(ids_callback.ids), "logits": torch.cat([p.cpu() for p in predictions])},  # type: ignore[misc]
        str(args.out / f"predict_rank{trainer.global_rank}.safetensors"),
    )


if __name__ == "__main__":
    main()
