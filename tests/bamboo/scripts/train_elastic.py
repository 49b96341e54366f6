"""Worker script of the elastic tests: train ``PipeMLP`` and write each member's final stages.

``--strategy elastic`` runs under ``python -m lightning_bamboo.launch``; every member that finishes writes
``<out>/final_member{m}.safetensors`` with ``own/<param>`` and ``own_opt/<param>/<key>`` of the stages it
owns at the end, and ``<out>/failovers_member{m}.json`` (the ownership maps it went through).
``--strategy auto`` is the uninterrupted single-process reference (the same DataLoader, trained in the same
order: ``--shuffle``, ``--epochs``, ``--no-distributed-sampler`` set it up); it writes
``<out>/final_reference.safetensors`` in the same format.

``--batch-norm MODE`` is ``BambooStrategy(batch_norm=MODE)``; ``--record-buffers`` writes each member's
buffers after every training batch to ``<out>/buffers/member{m}_step{k}.safetensors`` (``reference_step{k}``
under ``auto``).
``--order sequential`` trains the samples in the order ``make_data`` generates them (default ``permuted``: a
fixed permutation of them, the order most exactness tests were written for).
``--save-ckpt PATH`` saves ``trainer.save_checkpoint(PATH)`` after ``fit`` (a Bamboo folder, or auto's file).
``--ledger PATH`` adds a :class:`~lightning_bamboo.ledger.BambooLedger` writing there.
``--events`` adds a :class:`~lightning_bamboo.callbacks.BambooEventLog`: each member's Bamboo events in
``<out>/events/events-member{m}.jsonl``.
``--aws-endpoints U0,U1,..`` gives member ``m`` its own (fake) IMDSv2 ``U<m>`` polled by ``BambooNotices``
(an announced departure drains it); members record their Bamboo hook calls and metrics in
``<out>/events_member{m}.json`` (see ``tests/bamboo/drain_callbacks.py``). A member that left writes no
``final_*`` file.
``--after-fit``: right after ``fit`` the script writes ``<out>/after_fit_<name>.json`` (its rank,
``is_global_zero``, world size, global step), then runs ``trainer.test`` on the validation data and
``trainer.save_checkpoint(<out>/after_fit_ckpt)`` (both collective) and adds the test loss to that file: what
a user's "after training, rank 0 saves the result" code does. A drained member never gets there.
``--young-daly DIR``: checkpoint-restart's checkpoints (``benchmarks/_young_daly.py``: every Young/Daly
interval for ``--mtbf-s``, and on ``DIR/drain``), and ``fit`` resumes from the newest complete one in
``DIR/ckpt`` (``benchmarks/bamboo_modes.py`` relaunches the job with it under torchrun).
``--csv``: a ``CSVLogger`` under ``<out>/logs`` logging every step, and Lightning's progress bar; each member
that ends training writes ``<out>/bar_member{m}.json`` (whether its bar is shown, the batch it shows).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import signal
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

from lightning_bamboo.checkpoint.sharded import named_optimizer_state
from lightning_bamboo.strategy import BambooStrategy
from lightning_bamboo.testing import PhaseFaults
from tests.bamboo.module_writes import ModuleWrites
from tests.bamboo.pipe_mlp import make_data
from tests.bamboo.pipe_variants import VARIANTS


class ValLosses(Callback):
    """The logged ``val_loss`` of each validation run (what Lightning saw), kept for the final file."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.full: list[float] = []

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self.losses.append(float(trainer.callback_metrics["val_loss"]))
            if "val_full_mse" in trainer.callback_metrics:  # a metric on full_forward's outputs
                self.full.append(float(trainer.callback_metrics["val_full_mse"]))


class RecordBuffers(Callback):
    """After every training batch: this member's buffers (its stages' BatchNorm statistics) and the logged
    ``train_loss`` (``logged/train_loss``) in ``<out>/buffers/<who>_step<global step>.safetensors`` (written
    then renamed: the test reads them)."""

    def __init__(self, out: Path, who: str) -> None:
        self.folder, self.who = out / "buffers", who

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: object) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{self.who}_step{trainer.global_step}.safetensors"
        tensors = {name: b.detach().clone().contiguous() for name, b in pl_module.named_buffers()}
        if "train_loss" in trainer.callback_metrics:  # as logged (sync_dist=True: reduced over the job)
            tensors["logged/train_loss"] = trainer.callback_metrics["train_loss"].detach().clone().reshape(1)
        save_file(tensors, str(path.with_suffix(".tmp")))
        path.with_suffix(".tmp").rename(path)


class StepTimes(Callback):
    """Appends ``<global step> <wall time>`` to ``path`` at every step end of global rank 0 (a benchmark's
    clock where no agent writes commits: a run under torchrun)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: Trainer, *args: object) -> None:
        if trainer.is_global_zero:
            with self.path.open("a") as f:
                f.write(f"{trainer.global_step} {time.time():.6f}\n")


class RecordBar(Callback):
    """At the end of training: whether this member's progress bar is shown and the batch it shows."""

    def __init__(self, out: Path, member: int) -> None:
        self.out, self.member = out, member

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        bar = trainer.progress_bar_callback
        record: dict[str, object] = {"enabled": bar is not None and bar.is_enabled}
        if isinstance(bar, RichProgressBar) and bar.is_enabled:
            record["n"] = int(bar.train_progress_bar.completed)
        elif isinstance(bar, TQDMProgressBar) and bar.is_enabled:
            record["n"] = int(bar.train_progress_bar.n)
        (self.out / f"bar_member{self.member}.json").write_text(json.dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategy", choices=["auto", "elastic"], default="elastic")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="GLOBAL batch size")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="adam")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="mlp", help="model (pipe_variants.py)")
    parser.add_argument("--dtype", default="float64", help="the model's parameter dtype as built")
    parser.add_argument("--precision", default=None, help="Trainer(precision=...)")
    parser.add_argument("--no-redundancy", action="store_true")
    parser.add_argument("--recovery", choices=["replica", "replica+forward", "peers"], default=None,
                        help="BambooStrategy(recovery=...); default: 'replica+forward' ('peers' with "
                             "--no-redundancy)")
    parser.add_argument("--aws-endpoints", default="", help="comma-separated IMDS URL per member ('' = none)")
    parser.add_argument("--wait-notice", default="", help="MEMBER:STEP: that member waits for its notice")
    parser.add_argument("--checkpoint-every", type=int, default=None, help="fallback checkpoints")
    parser.add_argument("--validate", type=int, default=0, help="validate every N steps (2 batches)")
    parser.add_argument("--clip", type=float, default=None, help="Trainer(gradient_clip_val=...)")
    parser.add_argument("--clip-algorithm", choices=["norm", "value"], default="norm")
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument(
        "--hold", default="", help="MEMBER:STEP:sigterm|release|file[,...] (signal_callbacks)"
    )
    parser.add_argument("--raise-at", default="", help="MEMBER:STEP: its loss raises there")
    parser.add_argument("--accumulate", type=int, default=1, help="Trainer(accumulate_grad_batches=...)")
    parser.add_argument("--backend", default=None, help="BambooStrategy(process_group_backend=...)")
    parser.add_argument("--ledger", type=Path, default=None, help="a BambooLedger file")
    parser.add_argument("--step-times", type=Path, default=None, help="rank 0 appends 'step time' lines")
    parser.add_argument("--events", action="store_true", help="a BambooEventLog writing to <out>/events")
    parser.add_argument("--resume", type=Path, default=None, help="fit(ckpt_path=...)")
    parser.add_argument("--young-daly", type=Path, default=None, help="checkpoint-restart (see above)")
    parser.add_argument("--mtbf-s", type=float, default=0.0, help="--young-daly: the trace's MTBF (s)")
    parser.add_argument("--csv", action="store_true", help="a CSVLogger and the progress bar (see above)")
    parser.add_argument("--after-fit", action="store_true", help="record the rank, test, save (see above)")
    parser.add_argument("--shuffle", choices=["no", "yes", "generator"], default="no",
                        help="the training DataLoader's shuffle= (generator: True, a seeded generator)")
    parser.add_argument("--no-distributed-sampler", action="store_true", help="use_distributed_sampler=False")
    parser.add_argument("--epochs", type=int, default=1, help="the steps make this many epochs")
    parser.add_argument("--save-ckpt", type=Path, default=None, help="save_checkpoint after fit")
    parser.add_argument("--batch-norm", choices=["broadcast", "deferred"], default="broadcast",
                        help="BambooStrategy(batch_norm=...)")
    parser.add_argument("--record-buffers", action="store_true", help="buffers after every batch")
    parser.add_argument("--order", choices=["permuted", "sequential"], default="permuted",
                        help="the dataset's sample order: a fixed permutation, or as generated")
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 <pid>: every thread's stack
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)

    seed_everything(0)
    if args.raise_at:
        from tests.bamboo.signal_callbacks import UserBugMLP

        bug_member, bug_step = map(int, args.raise_at.split(":"))
        model = UserBugMLP(bug_member, bug_step, pairs=args.pairs, optimizer=args.optimizer, dtype=args.dtype)
    else:
        model = VARIANTS[args.variant](pairs=args.pairs, optimizer=args.optimizer, dtype=args.dtype)
    data = getattr(model, "make_data", make_data)  # a model on other inputs (token ids) brings its own
    x, y = data(args.steps * args.accumulate * args.batch_size // args.epochs)
    # the samples in a fixed shuffled order (the one these tests were written for; both strategies train the
    # DataLoader's order, lightning_bamboo.runtime.data_order)
    if args.order == "permuted":
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
        x, y = x[order], y[order]
    generator = torch.Generator().manual_seed(7) if args.shuffle == "generator" else None
    train = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=args.shuffle != "no",
                       generator=generator)
    vx, vy = data(2 * args.batch_size, seed=99)
    val = DataLoader(TensorDataset(vx, vy), batch_size=args.batch_size, shuffle=False)
    if args.strategy == "elastic":
        strategy: BambooStrategy | str = BambooStrategy(
            num_stages=args.stages,
            num_microbatches=args.microbatches,
            recovery=args.recovery or ("peers" if args.no_redundancy else "replica+forward"),
            timeout=20,
            process_group_backend=args.backend,
            checkpoint_every_n_steps=args.checkpoint_every,
            checkpoint_dir=args.checkpoint_dir,
            batch_norm=args.batch_norm,
        )
    else:
        strategy = "auto"

    callbacks = []
    if args.aws_endpoints and isinstance(strategy, BambooStrategy):
        from tests.bamboo.drain_callbacks import notice_callbacks

        endpoints = args.aws_endpoints.split(",")
        callbacks = notice_callbacks(args.out, strategy.member, endpoints, args.wait_notice)
    if isinstance(strategy, BambooStrategy):
        from tests.bamboo.signal_callbacks import SignalTarget

        holds = [h.split(":") for h in args.hold.split(",") if h]
        mine = [(int(step), until) for member, step, until in holds if int(member) == strategy.member]
        callbacks.append(SignalTarget(args.out, strategy.member, mine))
    if args.events and isinstance(strategy, BambooStrategy) and not args.aws_endpoints:  # those log already
        from lightning_bamboo.callbacks import BambooEventLog

        callbacks.append(BambooEventLog(args.out / "events"))
    if args.ledger is not None:
        from lightning_bamboo.ledger import BambooLedger

        callbacks.append(BambooLedger(args.ledger))
    if args.step_times is not None:
        callbacks.append(StepTimes(args.step_times))
    if args.young_daly is not None:
        from benchmarks._young_daly import YoungDalyCheckpoint, latest_checkpoint

        callbacks.append(YoungDalyCheckpoint(args.young_daly, args.mtbf_s))
        args.resume = latest_checkpoint(args.young_daly / "ckpt") or args.resume
    if args.record_buffers:
        who = f"member{strategy.member}" if isinstance(strategy, BambooStrategy) else "reference"
        callbacks.append(RecordBuffers(args.out, who))
    val_losses = ValLosses()
    logger: CSVLogger | bool = False
    if args.csv:
        logger = CSVLogger(args.out, name="logs")
        if isinstance(strategy, BambooStrategy):
            callbacks.append(RecordBar(args.out, strategy.member))

    def module_file(trainer: Trainer) -> Path:  # what ModuleWrites saw, per member
        return args.out / f"module_member{getattr(trainer.strategy, 'member', 0)}.json"

    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=args.steps,
        max_epochs=args.epochs,
        use_distributed_sampler=not args.no_distributed_sampler,
        precision=args.precision,
        gradient_clip_val=args.clip,
        gradient_clip_algorithm=args.clip_algorithm,
        accumulate_grad_batches=args.accumulate,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=args.csv,
        enable_model_summary=False,
        num_sanity_val_steps=2 if args.validate else 0,  # Lightning's default sanity check, when validating
        limit_val_batches=2 if args.validate else 0,
        val_check_interval=args.validate or None,
        callbacks=[*callbacks, val_losses, PhaseFaults.from_env(), ModuleWrites(module_file)],
    )
    trainer.fit(model, train_dataloaders=train, val_dataloaders=val if args.validate else None,
                ckpt_path=args.resume)
    who = f"member{strategy.member}" if isinstance(strategy, BambooStrategy) else "reference"
    if args.after_fit:
        after = {"rank": trainer.global_rank, "is_global_zero": trainer.is_global_zero,
                 "world_size": trainer.world_size, "global_step": trainer.global_step}
        (args.out / f"after_fit_{who}.json").write_text(json.dumps(after))
        after["test_loss"] = trainer.test(model, dataloaders=val, verbose=False)[0]["test_loss"]
        trainer.save_checkpoint(args.out / "after_fit_ckpt")
        (args.out / f"after_fit_{who}.json").write_text(json.dumps(after))
    if args.save_ckpt is not None:
        trainer.save_checkpoint(args.save_ckpt)
    # every name of a tied parameter (remove_duplicate=False), so each member's copy meets the reference's
    params = list(model.named_parameters(remove_duplicate=False))
    tensors = {f"own/{name}": p.detach().clone() for name, p in params}
    tensors.update({f"own_buffer/{name}": b.detach().clone() for name, b in model.named_buffers()})
    named_optimizer_state(model, trainer.optimizers[0])  # refuses a non-tensor state value
    state = trainer.optimizers[0].state
    for name, p in params:
        for key, value in state.get(p, {}).items():
            if value is not None:
                tensors[f"own_opt/{name}/{key}"] = value.detach().clone().reshape(-1)
    tensors["global_step"] = torch.tensor([trainer.global_step], dtype=torch.int64)
    if args.validate:
        tensors["val_losses"] = torch.tensor(val_losses.losses, dtype=torch.float64)
        if val_losses.full:
            tensors["val_full_mse"] = torch.tensor(val_losses.full, dtype=torch.float64)
    if isinstance(strategy, BambooStrategy):
        (args.out / f"failovers_{who}.json").write_text(
            json.dumps([[old.to_json(), new.to_json()] for old, new in strategy.failovers])
        )
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(args.out / f"final_{who}.safetensors"))


if __name__ == "__main__":
    main()
