"""Worker script: train ``PipeMLP`` under ``BambooStrategy`` with ``BambooNotices`` polling an AWS endpoint.

Rank ``--notice-rank`` polls the (fake) IMDSv2 at ``--aws``; the others poll nothing. Every rank writes
``step{k}_rank{r}.safetensors`` (its stage's parameters) after each step and ``events_rank{r}.json`` (the
Bamboo events it saw, in order) at the end; rank 0 adds ``metrics.json`` (the ``bamboo/*`` metrics) and
``summary.json`` (the last global step). With ``--ref-out`` the same launch first trains the uninterrupted
reference there (nothing polled), then the run: one launch instead of two (the imports, the popen launch and
the process group are what a launch costs).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

from lightning_bamboo import BambooStrategy
from lightning_bamboo.callbacks import BambooCallback, BambooMetrics, BambooNotices
from tests.bamboo.pipe_mlp import PipeMLP, make_data


class Record(BambooCallback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.events: list[dict[str, Any]] = []

    def on_preemption_notice(self, trainer, pl_module, notice, **info):  # type: ignore[no-untyped-def]
        self.events.append({"event": "notice", "step": trainer.global_step, **notice.to_dict()})

    def on_fallback(self, trainer, pl_module, checkpoint_path, **info):  # type: ignore[no-untyped-def]
        self.events.append({"event": "fallback", "step": trainer.global_step, "path": checkpoint_path})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        params = {name: p.detach().clone() for name, p in pl_module.named_parameters()}
        save_file(params, str(self.out / f"step{trainer.global_step}_rank{trainer.global_rank}.safetensors"))
        time.sleep(self.pause)

    def on_train_end(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        rank = trainer.global_rank
        (self.out / f"events_rank{rank}.json").write_text(json.dumps(self.events))
        if rank == 0:
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("bamboo/")}
            (self.out / "metrics.json").write_text(json.dumps(metrics))
            (self.out / "summary.json").write_text(json.dumps({"global_step": trainer.global_step}))

    pause = 0.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ref-out", type=Path, default=None, help="train the reference here first")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--aws", default=None, help="fake IMDS base URL polled by --notice-rank")
    parser.add_argument("--notice-rank", type=int, default=1)
    parser.add_argument("--pause", type=float, default=0.2, help="seconds each step boundary waits")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.ref_out is not None:
        train(args.ref_out, args.steps, None, args.notice_rank, 0.0)  # no notice to wait for: no pause
    train(args.out, args.steps, args.aws, args.notice_rank, args.pause)


def train(out: Path, steps: int, aws_url: str | None, notice_rank: int, pause: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # one node: local rank == global rank

    seed_everything(0)
    model: LightningModule = PipeMLP(pairs=2, optimizer="adam")
    x, y = make_data(steps * 4)
    train = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)
    aws = None
    if aws_url is not None and rank == notice_rank:
        aws = {"enabled": True, "endpoint": aws_url, "poll_interval_s": 0.05, "timeout_s": 2.0}
    record = Record(out)
    record.pause = pause
    callbacks: list[Callback] = [
        record, BambooNotices(aws=aws, checkpoint_dir=out / "drain"), BambooMetrics()
    ]
    trainer = Trainer(
        accelerator="cpu", devices=2, max_steps=steps, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        strategy=BambooStrategy(num_stages=2, num_microbatches=2, timeout=60), callbacks=callbacks,
    )
    trainer.fit(model, train_dataloaders=train)


if __name__ == "__main__":
    main()
