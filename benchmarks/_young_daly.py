"""Checkpoint-restart's checkpoints, as the benchmarks run it against Bamboo (``bamboo_preemption.py`` on one
machine's workers, ``bamboo_modes.py`` on network-namespace machines): every Young/Daly interval
``sqrt(2 * C * MTBF)``, and on a drain request (a grow restart loses nothing).

The first checkpoint, taken right after the warm-up steps of the first launch, measures the cost ``C``; every
later one measures it again, and the interval follows the median cost so far (a first save that pays one-time
costs would stretch the interval for the whole run). The interval and the costs are kept in
``<run-dir>/interval.json`` for later launches. Each checkpoint is
``<run-dir>/ckpt/step=<k>.ckpt`` (``trainer.save_checkpoint``), ``<run-dir>/ckpt/latest`` names the newest
complete one (an atomic rename), and ``<run-dir>/checkpoints.txt`` gets ``step wall_time cost`` per save.
``<run-dir>/drain`` asks for a checkpoint now and a clean end of ``fit``.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

WARMUP_STEPS = 2
DRAIN_FLAG = "drain"  # <run-dir>/drain: checkpoint now and end fit (request_drain)


class YoungDalyCheckpoint(Callback):
    """Checkpoint-restart's checkpoints: every Young/Daly interval, and on a drain request.

    Every rank must take the same decision at the same step: the flags (interval elapsed, drain requested)
    are max-all-reduced as one small tensor after each step, and so is each save's cost.
    """

    def __init__(self, run_dir: Path, mtbf_s: float) -> None:
        self.run_dir = run_dir
        self.mtbf_s = mtbf_s
        self.ckpt_dir = run_dir / "ckpt"
        self.interval_file = run_dir / "interval.json"
        kept = json.loads(self.interval_file.read_text()) if self.interval_file.exists() else {}
        self.interval_s: float | None = kept.get("interval_s")
        self.costs: list[float] = kept.get("costs", [])
        self.last = time.monotonic()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.last = time.monotonic()  # the interval counts training time, not start-up and reload

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        first = self.interval_s is None and trainer.global_step >= WARMUP_STEPS
        due = self.interval_s is not None and time.monotonic() - self.last >= self.interval_s
        drain = (self.run_dir / DRAIN_FLAG).exists()
        flags = torch.tensor([float(first or due), float(drain)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0] or flags[1]:
            self.costs.append(self._save(trainer))
            cost = statistics.median(self.costs)
            self.interval_s = math.sqrt(2.0 * cost * self.mtbf_s)
            if trainer.is_global_zero:
                tmp = self.interval_file.with_suffix(".tmp")
                tmp.write_text(json.dumps({"interval_s": self.interval_s, "checkpoint_s": cost,
                                           "costs": self.costs}))
                tmp.rename(self.interval_file)
        if flags[1]:
            trainer.should_stop = True

    def _save(self, trainer: Trainer) -> float:
        """Save, point ``latest`` at it (atomic rename), drop the older one; returns the cost (s)."""
        start = time.monotonic()
        path = self.ckpt_dir / f"step={trainer.global_step}.ckpt"
        trainer.save_checkpoint(path, weights_only=False)
        if trainer.is_global_zero:
            previous = latest_checkpoint(self.ckpt_dir)
            tmp = self.ckpt_dir / "latest.tmp"
            tmp.write_text(path.name)
            tmp.rename(self.ckpt_dir / "latest")
            if previous is not None and previous != path:
                shutil.rmtree(previous, ignore_errors=True)
        trainer.strategy.barrier()
        cost = torch.tensor([time.monotonic() - start])
        dist.all_reduce(cost, op=dist.ReduceOp.MAX)
        self.last = time.monotonic()
        if trainer.is_global_zero:
            with (self.run_dir / "checkpoints.txt").open("a") as f:
                f.write(f"{trainer.global_step} {time.time():.6f} {float(cost):.6f}\n")
        return float(cost)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    pointer = ckpt_dir / "latest"
    if not pointer.exists():
        return None
    path = ckpt_dir / pointer.read_text().strip()
    return path if path.exists() else None


def request_drain(run_dir: Path, procs: Sequence[subprocess.Popen[Any]], timeout: float) -> None:
    """Asks the job writing to ``run_dir`` to checkpoint now and end ``fit`` (the flag every rank's
    :class:`YoungDalyCheckpoint` reads after each step) and waits up to ``timeout`` seconds for ``procs`` to
    exit. The flag is removed before returning, so the next launch does not drain at its first step."""
    flag = run_dir / DRAIN_FLAG
    flag.write_text("1")
    try:
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        flag.unlink()
