"""The README's example as a user runs it: ``python train_plain.py OUT`` with ``devices=4`` and no launcher.

The script's process supervises 4 workers (2 stages x 2 pipelines); each worker that finishes writes
``OUT/done_member{m}.json`` with its global step. Arguments: ``OUT STEPS [DELAY [DEVICES [csv]]]``: DELAY
seconds of sleep per step (a test has time to kill a worker mid-fit), DEVICES workers (4), and ``csv`` logs
every step through a ``CSVLogger`` under OUT.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.nn import functional as F

from lightning_bamboo.strategy import BambooStrategy


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.pipeline = nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(6)),
                                      nn.Linear(32, 1))

    def pipeline_inputs(self, batch):
        return batch[0]

    def pipeline_loss(self, outputs, batch):
        return F.mse_loss(outputs, batch[1])

    def training_step(self, batch, batch_idx):
        time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 0.0)
        loss = self.pipeline_loss(self.pipeline(self.pipeline_inputs(batch)), batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main() -> None:
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    devices = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    logger = CSVLogger(out, name="logs") if len(sys.argv) > 5 and sys.argv[5] == "csv" else False
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32 * steps, 32), torch.randn(32 * steps, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=32, drop_last=True)
    # the registered name, as the README writes it: the elastic runtime with its defaults
    trainer = pl.Trainer(accelerator="cpu", devices=devices, max_steps=steps, strategy="bamboo",
                         logger=logger, log_every_n_steps=1, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regressor(), loader)
    strategy = trainer.strategy
    assert isinstance(strategy, BambooStrategy)
    (out / f"done_member{strategy.member}.json").write_text(json.dumps({"global_step": trainer.global_step}))


if __name__ == "__main__":
    main()
