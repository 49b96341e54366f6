"""Gaussian blobs generated from a seed: labelled data that needs no download."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset, random_split


class BlobsDataModule(pl.LightningDataModule):
    """``num_classes`` Gaussian clusters in ``num_features`` dimensions, split 80/10/10.

    Args:
        num_samples: total number of points.
        num_features: dimension of each point.
        num_classes: number of clusters (labels).
        batch_size: batch size of every loader.
        seed: generator seed; the same seed gives the same data and split.
    """

    def __init__(
        self,
        num_samples: int = 2048,
        num_features: int = 16,
        num_classes: int = 4,
        batch_size: int = 64,
        seed: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (("num_samples", num_samples), ("num_features", num_features),
                            ("num_classes", num_classes), ("batch_size", batch_size)):
            if value < 1:
                raise ValueError(f"BlobsDataModule: {name} must be >= 1, got {value}")
        self.num_samples, self.num_features, self.num_classes = num_samples, num_features, num_classes
        self.batch_size, self.seed = batch_size, seed

    def setup(self, stage: str) -> None:
        gen = torch.Generator().manual_seed(self.seed)
        centers = torch.randn(self.num_classes, self.num_features, generator=gen) * 1.5  # (K, F)
        labels = torch.randint(self.num_classes, (self.num_samples,), generator=gen)  # (N,)
        points = centers[labels] + torch.randn(self.num_samples, self.num_features, generator=gen)  # (N, F)
        dataset = TensorDataset(points, labels)
        n_val = n_test = self.num_samples // 10
        sizes = [self.num_samples - n_val - n_test, n_val, n_test]
        self.train_set, self.val_set, self.test_set = random_split(dataset, sizes, generator=gen)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.batch_size)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(num_samples={self.num_samples}, num_features={self.num_features}, "
                f"num_classes={self.num_classes}, batch_size={self.batch_size}, seed={self.seed})")
