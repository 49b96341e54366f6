"""A model whose stage boundaries carry more than the hidden state: a tuple ``(hidden, mask)`` and a dict
``{"h", "mask", "scale", "skip"}`` (a bool mask, a float tensor without grad, two tensors with grad), for
the tests of structured boundaries (``test_boundaries.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from typing_extensions import override

WIDTH = 8
Boundary = tuple[Tensor, Tensor] | dict[str, Tensor]


class MaskedLinear(nn.Module):
    """``tanh(linear(h))`` masked: takes and returns ``(h, mask)``, or the dict (scaled by its ``scale``)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, value: Boundary) -> Boundary:
        if isinstance(value, dict):
            return {**value, "h": torch.tanh(self.linear(value["h"])) * value["scale"]}
        h, mask = value
        return torch.tanh(self.linear(h)) * mask, mask


class ToDict(nn.Module):
    """``(h, mask)`` -> ``{"h", "mask", "scale" (float, no grad), "skip" (float, grad)}``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, value: tuple[Tensor, Tensor]) -> dict[str, Tensor]:
        h, mask = value
        out = torch.tanh(self.linear(h)) * mask
        return {"h": out, "mask": mask, "scale": 0.5 + mask.to(h.dtype), "skip": 2 * h}


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, 1)

    def forward(self, value: dict[str, Tensor]) -> Tensor:
        h = value["h"] * value["mask"]
        return self.linear(h) + 0.1 * value["skip"].sum(dim=1, keepdim=True)


class MaskedPipe(LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.pipeline = nn.Sequential(MaskedLinear(), MaskedLinear(), ToDict(), MaskedLinear(), Head()).to(
            torch.float64
        )
        self.lr = lr

    def pipeline_inputs(self, batch: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        return batch[0], batch[1]

    def pipeline_loss(self, outputs: Tensor, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        return F.mse_loss(outputs, batch[2])

    @override
    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.pipeline_loss(self.pipeline(self.pipeline_inputs(batch)), batch)
        self.log("train_loss", loss)
        return loss

    @override
    def predict_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.pipeline(self.pipeline_inputs(batch))

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def make_masked_data(num_samples: int, seed: int = 77) -> tuple[Tensor, Tensor, Tensor]:
    """``(x, bool mask, target)``."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, WIDTH, generator=generator, dtype=torch.float64)
    mask = torch.rand(num_samples, WIDTH, generator=generator) > 0.3
    return x, mask, torch.sin((x * mask).sum(dim=1, keepdim=True))
