"""A callback that prints what a byte-level language model writes after a fixed prompt while it trains.

It runs the whole model through :func:`lightning_bamboo.strategy.full_forward`: under ``strategy="bamboo"``
a stage holds only its own layers (calling ``pl_module(idx)`` there raises), so the forward goes through
every stage of the pipeline, a collective call that every rank makes, as Lightning runs callback hooks on
every rank; under any other strategy it is the module's body itself. Every rank of a pipeline gets the same
logits and draws from an identically seeded generator, so every rank continues the prompt the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from typing_extensions import override

from lightning_bamboo.strategy import full_forward


@dataclass(frozen=True)
class Sample:
    """One generated continuation: the global step it was drawn at, all token ids (prompt first), the text."""

    step: int
    tokens: list[int]
    text: str


class TextSample(Callback):
    """Every ``every_n_steps`` optimizer steps and at the end of each training epoch, continue ``prompt`` by
    ``max_new_tokens`` tokens and print the text (global rank 0); the samples are kept in ``samples``.

    Tokens are bytes (the 256-value vocabulary of :mod:`recipes.components.text`): the prompt is its UTF-8
    encoding and the output is decoded as UTF-8 (invalid sequences replaced).

    Args:
        prompt: the text every sample continues.
        max_new_tokens: tokens generated per sample.
        every_n_steps: sample after every this many optimizer steps; 0 samples only at epoch ends.
        top_k: ``None``: greedy (the most likely token); ``k``: draw among the ``k`` most likely tokens.
        temperature: divides the logits before a top-k draw.
        seed: seed of the callback's own ``torch.Generator``, re-seeded before every sample, so a sample
            depends on the weights only (not on the training's random state, which it leaves untouched).
    """

    def __init__(
        self,
        prompt: str = "def ",
        max_new_tokens: int = 48,
        every_n_steps: int = 0,
        top_k: int | None = None,
        temperature: float = 1.0,
        seed: int = 0,
    ) -> None:
        if not prompt:
            raise ValueError("TextSample: prompt must be a non-empty string, got ''")
        if max_new_tokens < 1:
            raise ValueError(f"TextSample: max_new_tokens must be >= 1, got {max_new_tokens}")
        if every_n_steps < 0:
            raise ValueError(
                f"TextSample: every_n_steps must be >= 0 (0: at epoch ends only), got {every_n_steps}"
            )
        if top_k is not None and top_k < 1:
            raise ValueError(f"TextSample: top_k must be None (greedy) or >= 1, got {top_k}")
        if temperature <= 0:
            raise ValueError(f"TextSample: temperature must be positive, got {temperature}")
        self.prompt, self.max_new_tokens, self.every_n_steps = prompt, max_new_tokens, every_n_steps
        self.top_k, self.temperature, self.seed = top_k, temperature, seed
        self.samples: list[Sample] = []

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: object,
                           batch: object, batch_idx: int) -> None:
        if self.every_n_steps and trainer.global_step % self.every_n_steps == 0:
            self._sample(trainer, pl_module)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._sample(trainer, pl_module)

    def _sample(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        if step == 0 or (self.samples and self.samples[-1].step == step):
            return  # nothing trained yet, or already sampled at this step (accumulation, epoch end)
        tokens = self.generate(pl_module)
        sample = Sample(step, tokens, bytes(tokens).decode("utf-8", errors="replace"))
        self.samples.append(sample)
        pl_module.print(f"[sample step {step}] {sample.text!r}")

    def generate(self, pl_module: pl.LightningModule) -> list[int]:
        """Continue the prompt through the whole model in eval mode (no dropout); the module's mode is put
        back afterwards. Under Bamboo, every rank of the pipeline must call this together."""
        context = pl_module.hparams.get("block_size")  # longest input the model takes (GPT's position table)
        generator = torch.Generator().manual_seed(self.seed)
        idx = torch.tensor([list(self.prompt.encode("utf-8"))], device=pl_module.device)  # (1, T) int64
        was_training = pl_module.training
        pl_module.eval()
        try:
            for _ in range(self.max_new_tokens):
                window = idx if context is None else idx[:, -int(context):]
                logits = full_forward(pl_module, window)[:, -1].detach().to("cpu", torch.float64)  # (1, V)
                idx = torch.cat([idx, self._pick(logits, generator).to(idx.device)], dim=1)
        finally:
            pl_module.train(was_training)
        return idx[0].tolist()

    def _pick(self, logits: Tensor, generator: torch.Generator) -> Tensor:
        """The next token id (1, 1) from the last position's logits (1, V): argmax, or a top-k draw."""
        if self.top_k is None:
            return logits.argmax(dim=-1, keepdim=True)
        values, indices = torch.topk(logits / self.temperature, min(self.top_k, logits.size(-1)), dim=-1)
        choice = torch.multinomial(torch.softmax(values, dim=-1), 1, generator=generator)  # (1, 1) into top-k
        return indices.gather(-1, choice)
