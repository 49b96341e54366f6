"""A tiny next-token model that follows the Bamboo contract (token ids in, logits out), for predict and
generation tests: its first layer takes int64 ids and its last returns logits, so one stage's forward
alone is never the model's (stage 0 gives hidden states, the last stage cannot take ids)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from typing_extensions import override

VOCAB = 16
LENGTH = 5


class TinyLM(LightningModule):
    """Embedding, two Linear + Tanh blocks, a Linear head; float64."""

    def __init__(self, width: int = 8, lr: float = 0.1) -> None:
        super().__init__()
        self.pipeline = nn.Sequential(
            nn.Embedding(VOCAB, width),
            nn.Linear(width, width),
            nn.Tanh(),
            nn.Linear(width, width),
            nn.Tanh(),
            nn.Linear(width, VOCAB),
        ).to(torch.float64)
        self.lr = lr

    def pipeline_inputs(self, batch: tuple[Tensor, ...]) -> Tensor:
        return batch[0]

    def pipeline_loss(self, outputs: Tensor, batch: tuple[Tensor, ...]) -> Tensor:
        return F.cross_entropy(outputs.reshape(-1, VOCAB), batch[1].reshape(-1))

    @override
    def forward(self, idx: Tensor) -> Tensor:
        return self.pipeline(idx)

    @override
    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor:
        loss = self.pipeline_loss(self(self.pipeline_inputs(batch)), batch)
        self.log("train_loss", loss)
        return loss

    @override
    def predict_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor:
        return self(self.pipeline_inputs(batch))

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def make_tokens(num_samples: int, seed: int = 4321) -> tuple[Tensor, Tensor, Tensor]:
    """``(ids, next ids, sample index)``: deterministic token sequences of ``LENGTH``."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (num_samples, LENGTH + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), torch.arange(num_samples)
