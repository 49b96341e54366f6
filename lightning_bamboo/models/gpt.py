"""A small GPT (nanoGPT-style) whose whole body is one ``nn.Sequential`` called ``pipeline``.

Written so that the same class trains under ``Trainer(strategy="auto")`` and under
``Trainer(strategy="bamboo")``: every element of ``pipeline`` takes one tensor and returns one tensor,
so a pipeline strategy can cut it into stages anywhere.

    embedding:  token ids (B, T) int64  -> (B, T, C)
    block x N:  (B, T, C)               -> (B, T, C)
    head:       (B, T, C)               -> logits (B, T, vocab_size)

With ``tie_embeddings=True`` (the default, as in nanoGPT and GPT-2) the head's projection weight *is* the
token embedding's weight: one ``nn.Parameter`` used by the first and the last element. Under
``strategy="auto"`` autograd sums both uses' gradients into it. Under Bamboo the two elements usually land
on different stages; the strategy then keeps one copy per stage and sums their gradients before the step
(docs/bamboo-porting-gpt2.md). ``tie_embeddings=False`` gives the head its own matrix
(``vocab_size * n_embd`` more parameters).

Example::

    model = GPT(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
    Trainer(strategy="bamboo", devices=2, accelerator="cpu").fit(model, datamodule)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import Tensor, nn
from typing_extensions import override

Batch = tuple[Tensor, Tensor]
"""(token ids (B, T) int64, next-token targets (B, T) int64)."""


class Embedding(nn.Module):
    """Token plus learned position embedding: the first element of the pipeline.

    Args:
        vocab_size: number of token ids.
        block_size: longest sequence the position table covers.
        n_embd: embedding width C.
        dropout: dropout probability after the sum.
    """

    def __init__(self, vocab_size: int, block_size: int, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)

    @override
    def forward(self, idx: Tensor) -> Tensor:
        _, t = idx.shape  # (B, T)
        if t > self.block_size:
            raise ValueError(f"sequence length ({t}) exceeds block_size ({self.block_size})")
        positions = torch.arange(t, device=idx.device)  # (T,)
        return self.drop(self.tok(idx) + self.pos(positions))  # (B, T, C)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention``.

    Args:
        n_embd: width C; must be divisible by ``n_head``.
        n_head: number of heads H.
        dropout: attention and residual dropout probability.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.resid_drop = nn.Dropout(dropout)

    @override
    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape  # (B, T, C)
        q, k, v = self.qkv(x).split(c, dim=2)  # 3 x (B, T, C)
        # (B, T, C) -> (B, H, T, C/H)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, H, T, C/H)
        y = y.transpose(1, 2).contiguous().view(b, t, c)  # (B, T, C)
        return self.resid_drop(self.proj(y))  # (B, T, C)


class MLP(nn.Module):
    """Position-wise feed-forward network, 4x wide with GELU.

    Args:
        n_embd: width C.
        dropout: output dropout probability.
    """

    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)
        self.drop = nn.Dropout(dropout)

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))  # (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``.

    Args:
        n_embd: width C.
        n_head: number of attention heads.
        dropout: dropout probability.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    @override
    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))  # (B, T, C)
        return x + self.mlp(self.ln2(x))  # (B, T, C)


class Head(nn.Module):
    """Final LayerNorm and the language-model projection: the last element of the pipeline.

    Args:
        n_embd: width C.
        vocab_size: number of output logits per position.
    """

    def __init__(self, n_embd: int, vocab_size: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(n_embd)
        self.lm = nn.Linear(n_embd, vocab_size, bias=False)

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.lm(self.ln(x))  # (B, T, vocab_size)


def build_pipeline(
    vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float = 0.0,
    tie_embeddings: bool = True,
) -> nn.Sequential:
    """Build the GPT body as ``[Embedding, Block x n_layer, Head]`` with nanoGPT's initialisation.

    ``tie_embeddings``: the head's weight is the token embedding's weight (one parameter, initialised once).
    Kept separate from :class:`GPT` so benchmarks can build the same layers without a LightningModule.
    """
    for name, value in (("vocab_size", vocab_size), ("block_size", block_size), ("n_layer", n_layer),
                        ("n_head", n_head), ("n_embd", n_embd)):
        if value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    if n_embd % n_head:
        raise ValueError(f"n_head ({n_head}) does not divide n_embd ({n_embd}): n_embd % n_head = "
                         f"{n_embd % n_head}, expected 0")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    pipeline = nn.Sequential(
        Embedding(vocab_size, block_size, n_embd, dropout),
        *(Block(n_embd, n_head, dropout) for _ in range(n_layer)),
        Head(n_embd, vocab_size),
    )
    if tie_embeddings:
        pipeline[-1].lm.weight = pipeline[0].tok.weight  # (vocab_size, n_embd) both; nanoGPT's weight tying
    for name, param in pipeline.named_parameters():  # a tied parameter is listed (and initialised) once
        if name.endswith("proj.weight"):
            # GPT-2: scale residual projections by 1/sqrt(2 * n_layer) so the residual stream stays O(1).
            nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))
        elif param.dim() == 2:
            nn.init.normal_(param, mean=0.0, std=0.02)
        elif name.endswith("bias") and "ln" not in name:
            nn.init.zeros_(param)
    return pipeline


def warmup_cosine(warmup: int, decay_steps: int, min_ratio: float = 0.1) -> Callable[[int], float]:
    """``LambdaLR`` factor: linear warm-up, then cosine down to ``min_ratio`` at ``decay_steps``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if step >= decay_steps:
            return min_ratio
        progress = (step - warmup) / max(1, decay_steps - warmup)
        return min_ratio + 0.5 * (1.0 - min_ratio) * (1.0 + math.cos(math.pi * progress))

    return factor


class GPT(LightningModule):
    """Decoder-only transformer language model exposing the Bamboo pipeline contract.

    ``pipeline`` is the whole network; ``pipeline_inputs`` picks what enters its first element and
    ``pipeline_loss`` turns what leaves its last element into the loss. ``training_step`` is just those
    three, so a pipeline strategy can run the same pieces stage by stage.

    Args:
        vocab_size: number of token ids (256 for byte-level text).
        block_size: context length T.
        n_layer: number of transformer blocks.
        n_head: attention heads per block; must divide ``n_embd``.
        n_embd: model width C.
        dropout: dropout probability (0.0 keeps runs deterministic).
        lr: peak learning rate of AdamW.
        weight_decay: AdamW weight decay, applied to matrices only (not biases, norms).
        warmup: linear warm-up steps.
        decay_steps: step at which cosine decay reaches 10% of ``lr``; ``None`` uses
            ``trainer.estimated_stepping_batches``.
        tie_embeddings: the LM head's weight is the token embedding's weight (nanoGPT, GPT-2); ``False``
            gives the head its own ``(vocab_size, n_embd)`` matrix.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup: int = 10,
        decay_steps: int | None = None,
        tie_embeddings: bool = True,
    ) -> None:
        super().__init__()
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        self.save_hyperparameters()
        self.pipeline = build_pipeline(
            vocab_size, block_size, n_layer, n_head, n_embd, dropout, tie_embeddings=tie_embeddings
        )

    @override
    def forward(self, idx: Tensor) -> Tensor:
        return self.pipeline(idx)  # (B, T, vocab_size)

    def pipeline_inputs(self, batch: Batch) -> Tensor:
        """Token ids that enter ``pipeline[0]``: (B, T) int64."""
        return batch[0]

    def pipeline_loss(self, logits: Tensor, batch: Batch) -> Tensor:
        """Mean next-token cross-entropy of ``logits`` (B, T, V) against ``batch[1]`` (B, T)."""
        targets = batch[1]
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    @override
    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss = self.pipeline_loss(self.pipeline(self.pipeline_inputs(batch)), batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss = self.pipeline_loss(self.pipeline(self.pipeline_inputs(batch)), batch)
        # Mean over data-parallel replicas (under Bamboo: over pipelines; its stages already agree).
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def optimizer_groups(self) -> list[dict[str, Any]]:
        """AdamW parameter groups: decay on matrices (dim >= 2), none on biases and norms.

        Always two groups, even when one is empty (a stage holding only the embedding has no biases): every
        pipeline stage then builds the same group structure, which Bamboo's replica optimizer relies on.
        """
        params = [p for p in self.parameters() if p.requires_grad]
        return [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": self.hparams["weight_decay"]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]

    @override
    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        decay_steps = self.hparams["decay_steps"]
        if decay_steps is None:
            estimated = self.trainer.estimated_stepping_batches
            if not math.isfinite(estimated):
                raise ValueError(
                    f"decay_steps is None and trainer.estimated_stepping_batches is {estimated}: "
                    "set GPT(decay_steps=...) or Trainer(max_steps=...)"
                )
            decay_steps = int(estimated)
        optimizer = torch.optim.AdamW(self.optimizer_groups(), lr=self.hparams["lr"], betas=(0.9, 0.95))
        factor = warmup_cosine(self.hparams["warmup"], decay_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
