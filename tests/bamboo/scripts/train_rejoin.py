"""Worker script of the rejoin tests: train ``PipeMLP`` on samples that carry their id, over two epochs.

``--strategy elastic`` runs under ``python -m lightning_bamboo.launch`` (or :mod:`rejoin_driver`); every
member that finishes writes ``<out>/final_member{m}.safetensors`` (``own/<param>``, ``own_opt/<param>/<key>``
of the stages it owns at the end, ``global_step``) and ``<out>/ids_member{m}.json``: ``[global_step,
[sample ids]]`` for each loss it computed as the last stage of its pipeline (the samples it consumed).
``--strategy auto`` is the uninterrupted single-process reference; it writes the same as ``reference``.
Both read the data through the same ``DistributedSampler(num_replicas=1, shuffle=True, seed=0)``, whose
order changes with the epoch (so a joiner must follow the epoch too).

``--hold-at S``: members wait at the start of step ``S`` until the launcher proposed a join for their
generation, so the test knows the join happens after step ``S`` whatever the machine's load.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from safetensors.torch import save_file
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_bamboo.checkpoint.sharded import named_optimizer_state
from lightning_bamboo.protocol import join as joining
from lightning_bamboo.strategy import BambooStrategy
from lightning_bamboo.testing import PhaseFaults
from tests.bamboo.pipe_mlp import PipeMLP, make_data
from tests.bamboo.pipe_variants import WithBatchNorm, WithDropout


class IdMLP(PipeMLP):
    """Records the ids of the samples whose loss this process computes."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen: list[tuple[int, list[int]]] = []

    def pipeline_loss(self, outputs: Tensor, batch: Any) -> Tensor:
        view = getattr(self.trainer.strategy, "view", None)
        if view is None or view.is_last:
            self.seen.append((self.trainer.global_step, batch[2].tolist()))
        return super().pipeline_loss(outputs, batch)


class IdDropoutMLP(IdMLP, WithDropout):
    """``IdMLP`` with ``WithDropout``'s body (Dropout(0.5) after every Tanh)."""


class IdBatchNormMLP(IdMLP, WithBatchNorm):
    """``IdMLP`` with ``WithBatchNorm``'s body (BatchNorm1d/2d, a residual block, dropout)."""


class HoldForJoin(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        strategy = trainer.strategy
        if trainer.global_step != self.step or not isinstance(strategy, BambooStrategy):
            return
        assert strategy.owners is not None
        deadline = time.monotonic() + 300
        while joining.proposal(strategy.store, strategy.owners.generation) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no join proposed for generation {strategy.owners.generation} in 300s")
            time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategy", choices=["auto", "elastic"], default="elastic")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="GLOBAL batch size")
    parser.add_argument("--batches-per-epoch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--hold-at", type=int, default=-1)
    parser.add_argument("--tied", action="store_true", help="layer 4's weight IS layer 0's")
    parser.add_argument("--dropout", action="store_true", help="WithDropout's body (not with --tied)")
    parser.add_argument("--backend", default=None, help="BambooStrategy(process_group_backend=...)")
    parser.add_argument("--recovery", choices=["replica", "replica+forward", "peers"], default=None,
                        help="BambooStrategy(recovery=...); default: the strategy's")
    parser.add_argument("--batchnorm", action="store_true",
                        help="WithBatchNorm's body, BambooStrategy(batch_norm='deferred')")
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)

    seed_everything(0)
    kind = IdBatchNormMLP if args.batchnorm else IdDropoutMLP if args.dropout else IdMLP
    model = kind(pairs=3, optimizer="adam")
    if args.tied:
        model.pipeline[4].weight = model.pipeline[0].weight
    count = args.batches_per_epoch * args.batch_size
    x, y = make_data(count)
    data = TensorDataset(x, y, torch.arange(count))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    train = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    strategy: BambooStrategy | str = "auto"
    if args.strategy == "elastic":
        strategy = BambooStrategy(
            num_stages=args.stages, num_microbatches=args.microbatches, timeout=20, recovery=args.recovery,
            process_group_backend=args.backend,
            batch_norm="deferred" if args.batchnorm else "broadcast",
        )
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[HoldForJoin(args.hold_at), PhaseFaults.from_env()],
    )
    trainer.fit(model, train_dataloaders=train)
    params = list(model.named_parameters(remove_duplicate=False))  # a tied weight under each use's name
    tensors = {f"own/{name}": p.detach().clone() for name, p in params}
    tensors.update({f"own_buffer/{name}": b.detach().clone() for name, b in model.named_buffers()})
    named_optimizer_state(model, trainer.optimizers[0])  # refuses a non-tensor state value
    for name, p in params:
        for key, value in trainer.optimizers[0].state.get(p, {}).items():
            tensors[f"own_opt/{name}/{key}"] = value.detach().clone().reshape(-1)
    tensors["global_step"] = torch.tensor([trainer.global_step], dtype=torch.int64)
    name = f"member{strategy.member}" if isinstance(strategy, BambooStrategy) else "reference"
    (args.out / f"ids_{name}.json").write_text(json.dumps(model.seen))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(args.out / f"final_{name}.safetensors"))


if __name__ == "__main__":
    main()
