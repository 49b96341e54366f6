"""Worker script: train ``PipeMLP`` for a few steps and write per-step snapshots as safetensors.

Launched once by a test; with ``--strategy bamboo`` Lightning's launcher re-runs it for the other ranks.
Every rank writes ``<out>/step{k}_rank{r}.safetensors`` after each optimizer step (and replica sync) with:
``own/<param name>`` and ``own_opt/<param name>/<state key>`` for its stage (the whole model under
``auto``), ``replica/...`` and ``replica_opt/...`` for its replica of the successor stage, and ``loss``
(the step's loss as returned by training_step) plus ``logged`` (``train_loss`` from callback_metrics).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, TensorDataset

import lightning_bamboo
from lightning_bamboo import BambooStrategy
from lightning_bamboo.checkpoint.sharded import named_optimizer_state
from tests.bamboo.module_writes import ModuleWrites
from tests.bamboo.pipe_mlp import make_data
from tests.bamboo.pipe_variants import VARIANTS, RankNoise, WithState


class Snapshot(Callback):
    """Write this rank's stage, replica and optimizer states at train start and after every step."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.forwards: list[torch.Tensor] = []  # this stage's F outputs of the current step, in order

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx) -> None:
        self.forwards.clear()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if isinstance(trainer.strategy, BambooStrategy):  # the module now holds this rank's stage
            pl_module.pipeline.register_forward_hook(
                lambda module, args, out: self.forwards.append(out.detach())
            )
        # after a resume: exactly what was loaded, before any step
        save_file(states(trainer, pl_module), str(self.out / f"start_rank{trainer.global_rank}.safetensors"))

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx
    ) -> None:
        tensors = states(trainer, pl_module)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        tensors["loss"] = loss.detach().to(torch.float64).reshape(1).cpu()
        tensors["logged"] = trainer.callback_metrics["train_loss"].detach().to(torch.float64).reshape(1).cpu()
        tensors["lr"] = torch.tensor([trainer.optimizers[0].param_groups[0]["lr"]], dtype=torch.float64)
        names = {id(p): name for name, p in pl_module.named_parameters()}
        for group in trainer.optimizers[0].param_groups:  # each parameter's learning rate, by name
            for p in group["params"]:
                tensors[f"lr/{names[id(p)]}"] = torch.tensor([float(group["lr"])], dtype=torch.float64)
        strategy = trainer.strategy
        if isinstance(strategy, BambooStrategy):
            assert strategy.engine is not None
            for mb, value in enumerate(self.forwards):
                tensors[f"fwd/{mb}"] = value.contiguous().cpu()
            for mb, value in strategy.engine.redundant_outputs.items():
                tensors[f"fr/{mb}"] = value.contiguous().cpu()
        save_file(tensors, str(self.out / f"step{trainer.global_step}_rank{trainer.global_rank}.safetensors"))


class ForwardRedundancyOff(Callback):
    """Train the given steps (1-based) without the replica forwards, the others with them (every rank)."""

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx) -> None:
        trainer.strategy.set_forward_redundancy(trainer.global_step + 1 not in self.steps)


def _named(prefix: str, module: nn.Module, optimizer: Optimizer, name_prefix: str = "") -> dict[str, Tensor]:
    """Parameters and optimizer state under every name of each parameter (a tied one under each use's)."""
    named_optimizer_state(module, optimizer)  # refuses non-tensor state
    tensors: dict[str, Tensor] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        tensors[f"{prefix}/{name_prefix}{name}"] = p.detach().clone()
        for key, value in optimizer.state.get(p, {}).items():
            if value is not None:
                tensors[f"{prefix}_opt/{name_prefix}{name}/{key}"] = value.detach().clone()
    return tensors


def states(trainer: Trainer, pl_module: LightningModule) -> dict[str, torch.Tensor]:
    """Own stage and replica: parameters and optimizer state, by parameter name."""
    tensors = _named("own", pl_module, trainer.optimizers[0])
    for name, b in pl_module.named_buffers():
        tensors[f"own_buf/{name}"] = b.detach().clone()
    strategy = trainer.strategy
    if isinstance(strategy, BambooStrategy) and strategy.replica_sync is not None:
        replica, replica_opt = strategy.replica_sync.replica, strategy.replica_sync.optimizer
        tensors.update(_named("replica", replica, replica_opt, "pipeline."))
        for name, b in replica.named_buffers():
            tensors[f"replica_buf/pipeline.{name}"] = b.detach().clone()
    return {k: v.contiguous().cpu() for k, v in tensors.items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None, help="required unless --cases")
    parser.add_argument("--strategy", choices=["auto", "bamboo"], default="bamboo")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument(
        "--pipelines", type=int, default=1, help="data-parallel pipelines the data is sized for"
    )
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4, help="per-pipeline batch size")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    parser.add_argument("--no-redundancy", action="store_true")
    parser.add_argument("--replica-device", default="same")
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--validate", action="store_true")
    parser.add_argument("--save-ckpt", type=Path, default=None)
    parser.add_argument("--resume", type=Path, default=None)
    parser.add_argument("--max-epochs", type=int, default=1)
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="ModelCheckpoint every step, top 2")
    parser.add_argument("--dtype", default="float64", help="parameter and data dtype")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="mlp", help="model (pipe_variants.py)")
    parser.add_argument("--data", choices=["plain", "rank-noise"], default="plain")
    parser.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    parser.add_argument("--extra-samples", type=int, default=0, help="samples beyond whole batches")
    parser.add_argument("--per-rank-state", action="store_true", help="frozen params/buffers drawn per rank")
    parser.add_argument("--fr-off-steps", type=int, nargs="*", default=[],
                        help="steps (1-based) trained without the replica forwards (FR)")
    parser.add_argument(
        "--cases", type=Path, default=None,
        help="JSON file {name: [argument, ...]}: run each case (these arguments, --out included) in turn, "
        "in this one launch; every case of a bamboo launch uses the same --devices",
    )
    return parser.parse_args(argv)


def main() -> None:
    """One case from the command line, or every case of ``--cases`` one after another (imports and, under
    bamboo, the launch of the other ranks paid once: the test starts every rank, ``tests.process.run_ranks``,
    or, run alone, Lightning's popen launcher starts them with the first Trainer)."""
    args = parse_args()
    if args.cases is None:
        if args.out is None:
            raise SystemExit("train_pipe.py: --out (or --cases) is required")
        train(args)
        return
    cases = json.loads(args.cases.read_text())
    for name, argv in cases.items():
        print(f"train_pipe: case {name}", flush=True)
        train(parse_args(argv))


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)

    seed_everything(0)
    model = VARIANTS[args.variant](pairs=args.pairs, optimizer=args.optimizer, dtype=args.dtype)
    if args.per_rank_state:
        assert isinstance(model, WithState)
        model.perturb_state(seed=int(os.environ.get("LOCAL_RANK", "0")))  # unseeded init, per rank
    batches = args.steps * args.accumulate
    num_samples = batches * args.batch_size * args.pipelines + args.extra_samples
    x, y = make_data(num_samples, dtype=getattr(torch, args.dtype))
    dataset = TensorDataset(x, y)
    # the global batch (Bamboo splits it over the pipelines)
    batch_size = args.batch_size * args.pipelines
    # the samples in a fixed shuffled order (the one these tests were written for; both strategies train
    # the DataLoader's order, lightning_bamboo.runtime.data_order)
    permutation = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0))
    dataset = TensorDataset(x[permutation], y[permutation])
    if args.data == "rank-noise":
        dataset = RankNoise(*dataset.tensors)
    train = DataLoader(dataset, batch_size=batch_size, shuffle=False)
    val = DataLoader(dataset, batch_size=batch_size, shuffle=False) if args.validate else None

    if args.strategy == "bamboo":
        strategy = BambooStrategy(
            num_stages=args.stages,
            num_microbatches=args.microbatches,
            recovery="peers" if args.no_redundancy else "replica+forward",
            replica_device=args.replica_device,
            timeout=180,  # rendezvous + collectives: 4 ranks importing torch on 2 busy cores can take >60 s
        )
    else:
        strategy = "auto"
    checkpointing = []
    if args.checkpoint_dir is not None:
        checkpointing.append(
            ModelCheckpoint(
                dirpath=args.checkpoint_dir,
                monitor="train_loss",
                save_top_k=2,
                save_last=True,
                every_n_train_steps=1,
            )
        )
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices if args.strategy == "bamboo" else 1,
        strategy=strategy,
        max_steps=args.steps + (1 if args.extra_samples else 0),
        max_epochs=args.max_epochs,
        precision=args.precision,
        logger=False,
        enable_checkpointing=args.checkpoint_dir is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1.0 if args.validate else 0,
        gradient_clip_val=args.clip,
        accumulate_grad_batches=args.accumulate,
        callbacks=[Snapshot(args.out), ModuleWrites(lambda t: args.out / f"module_rank{t.global_rank}.json"),
                   *checkpointing,
                   *([ForwardRedundancyOff(set(args.fr_off_steps))] if args.fr_off_steps else [])],
    )
    trainer.fit(model, train_dataloaders=train, val_dataloaders=val, ckpt_path=args.resume)
    after = [sorted(model.__dict__), id(model.pipeline)]  # teardown gave the module its own hooks back
    (args.out / f"module_after_fit_rank{trainer.global_rank}.json").write_text(json.dumps(after))
    if args.validate:
        metrics = trainer.validate(model, dataloaders=val, verbose=False)
        if trainer.global_rank == 0:
            (args.out / "validate.json").write_text(json.dumps(metrics))
    if args.save_ckpt is not None:
        trainer.save_checkpoint(args.save_ckpt)
    assert lightning_bamboo.BambooStrategy is BambooStrategy


if __name__ == "__main__":
    main()
