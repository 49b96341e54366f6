"""A small LightningModule that follows the Bamboo contract; shared by the tests and their worker scripts.

It trains unchanged under ``strategy="auto"`` (the reference) and ``strategy="bamboo"``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from typing_extensions import override


class PipeMLP(LightningModule):
    """``pairs`` x (Linear + Tanh) then a Linear head, all in one ``nn.Sequential`` called ``pipeline``."""

    def __init__(
        self, width: int = 8, pairs: int = 3, optimizer: str = "sgd", lr: float = 0.05, dtype: str = "float64"
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(pairs):
            layers += [nn.Linear(width, width), nn.Tanh()]
        layers.append(nn.Linear(width, 1))
        self.pipeline = nn.Sequential(*layers).to(getattr(torch, dtype))
        self.optimizer_name = optimizer
        self.lr = lr

    def pipeline_inputs(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        return batch[0]

    def pipeline_loss(self, outputs: Tensor, batch: tuple[Tensor, Tensor]) -> Tensor:
        return F.mse_loss(outputs, batch[1])

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.pipeline_loss(self.pipeline(self.pipeline_inputs(batch)), batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.pipeline_loss(self.pipeline(self.pipeline_inputs(batch)), batch)
        self.log("val_loss", loss)
        return loss

    @override
    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.pipeline_loss(self.pipeline(self.pipeline_inputs(batch)), batch)
        self.log("test_loss", loss)
        return loss

    @override
    def configure_optimizers(self):  # type: ignore[override]
        if self.optimizer_name == "adam":
            optimizer: torch.optim.Optimizer = torch.optim.Adam(
                self.parameters(), lr=self.lr, weight_decay=0.01
            )
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        # a per-step schedule, so the replica must follow the learning rate the scheduler sets
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def make_data(
    num_samples: int, width: int = 8, seed: int = 1234, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor]:
    """Deterministic regression data."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, width, generator=generator, dtype=torch.float64).to(dtype)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    return x, y
