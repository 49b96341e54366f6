"""Worker script: train the example ``GPT`` (float64) a few steps with two ``TextSample`` callbacks.

Run once with ``--strategy auto`` (one process: the reference) and with ``--strategy bamboo`` (all ranks
started together by the test). The callbacks continue the prompt after every step (greedy) and every second
step (top-k from a seeded generator) through the whole model; every rank writes ``samples_rank{r}.json``:
``{"greedy": [[step, tokens, text], ...], "top_k": [...]}``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from lightning.pytorch import Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

from lightning_bamboo import BambooStrategy
from lightning_bamboo.models import GPT
from recipes.components.sample_text import TextSample
from recipes.components.text import VOCAB_SIZE, TokenWindows, corpus_tokens

TINY = {"block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}
PROMPT = "def "


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategy", choices=["auto", "bamboo"], default="bamboo")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--pipelines", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4, help="per pipeline")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tie", choices=["tied", "untied"], required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)

    seed_everything(0)
    model = GPT(vocab_size=VOCAB_SIZE, **TINY, lr=3e-3, warmup=1, decay_steps=args.steps,
                tie_embeddings=args.tie == "tied").double()
    windows = TokenWindows(corpus_tokens(["textwrap"]), TINY["block_size"])
    batch_size = args.batch_size * args.pipelines  # the global batch (Bamboo splits it over the pipelines)
    pairs = [windows[i] for i in range(args.steps * batch_size)]
    ids, targets = torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])
    # the samples in a fixed shuffled order (both strategies train the DataLoader's order)
    permutation = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))
    ids, targets = ids[permutation], targets[permutation]
    if args.strategy == "auto":
        strategy: BambooStrategy | str = "auto"
        devices = 1
    else:
        strategy = BambooStrategy(num_stages=args.stages, num_microbatches=args.microbatches,
                                  recovery="replica+forward" if args.stages > 1 else "peers", timeout=180)
        devices = args.stages * args.pipelines
    train = DataLoader(TensorDataset(ids, targets), batch_size=batch_size, shuffle=False)
    greedy = TextSample(PROMPT, max_new_tokens=12, every_n_steps=1)
    top_k = TextSample(PROMPT, max_new_tokens=12, every_n_steps=2, top_k=5, temperature=0.8, seed=7)
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
        callbacks=[greedy, top_k],
    )
    trainer.fit(model, train_dataloaders=train)
    samples = {name: [[s.step, s.tokens, s.text] for s in callback.samples]
               for name, callback in (("greedy", greedy), ("top_k", top_k))}
    (args.out / f"samples_rank{trainer.global_rank}.json").write_text(json.dumps(samples))


if __name__ == "__main__":
    main()
