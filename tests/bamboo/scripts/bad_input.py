"""A plain ``python bad_input.py KIND OUT`` (``Trainer(devices=2, strategy=BambooStrategy(num_stages=2))``)
whose module breaks the Bamboo contract in one way, for the supervisor's checks before any worker starts.

KIND: ``no-body`` (no ``nn.Sequential`` at all), ``few-layers`` (a body of one layer for 2 stages),
``outside`` (a trainable parameter outside the body), ``batch`` (a batch of 3 the 4 micro-batches cannot
split: only the workers see the loader), ``ok`` (nothing wrong; trains one step). Every process
that runs the script (the supervisor, and the workers if any were started) writes ``OUT/ran-<pid>``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from lightning_bamboo.strategy import BambooStrategy


class Model(pl.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        layers = [nn.Linear(4, 4)] if kind == "few-layers" else [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)]
        if kind == "no-body":
            self.layers = nn.ModuleList(layers)
        else:
            self.pipeline = nn.Sequential(*layers)
        if kind == "outside":
            self.scale = nn.Parameter(torch.ones(1))

    def pipeline_inputs(self, batch):
        return batch[0]

    def pipeline_loss(self, outputs, batch):
        return F.mse_loss(outputs.sum(-1, keepdim=True), batch[1])

    def training_step(self, batch, batch_idx):
        return self.pipeline_loss(self.pipeline(self.pipeline_inputs(batch)), batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    kind, out = sys.argv[1], Path(sys.argv[2])
    (out / f"ran-{os.getpid()}").write_text(kind)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=1, strategy=BambooStrategy(num_stages=2),
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    loader = torch.utils.data.DataLoader(data, batch_size=3 if kind == "batch" else 4, drop_last=True)
    trainer.fit(Model(kind), loader)


if __name__ == "__main__":
    main()
