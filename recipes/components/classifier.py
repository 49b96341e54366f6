"""A small MLP classifier: the model of the baseline recipe, trained with Lightning's default strategy."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.nn import functional as F


class MLPClassifier(pl.LightningModule):
    """Two-layer perceptron over feature vectors.

    Args:
        in_features: width of each input vector.
        hidden_features: width of the hidden layer.
        num_classes: number of output classes.
        lr: Adam learning rate.
    """

    def __init__(self, in_features: int, hidden_features: int, num_classes: int, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(in_features, hidden_features),  # (B, F) -> (B, H)
            nn.ReLU(),
            nn.Linear(hidden_features, num_classes),  # (B, H) -> (B, K)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def _step(self, batch: tuple[Tensor, Tensor], stage: str) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        acc = (logits.argmax(dim=-1) == y).float().mean()
        self.log(f"{stage}_loss", loss, prog_bar=True)
        self.log(f"{stage}_acc", acc, prog_bar=stage != "train")
        return loss

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._step(batch, "test")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams["lr"])
