"""The private Lightning and torch names the runtime relies on (``lightning_bamboo._lightning.private``) still
exist and behave as it expects: a version that changes one fails here, not inside a failover."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn

from lightning_bamboo._lightning import private as _private


class _TwoGroups(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(2, 2), nn.Linear(2, 1)

    def configure_optimizers(self):  # type: ignore[override]
        groups = [{"params": self.body.parameters()}, {"params": self.head.parameters(), "lr": 0.01}]
        return torch.optim.SGD(groups, lr=0.1)


def test_init_optimizers_builds_the_users_optimizers_over_the_module() -> None:
    module = _TwoGroups()
    module.trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    optimizers, schedulers = _private.init_optimizers(module)
    assert len(optimizers) == 1 and isinstance(optimizers[0], torch.optim.Optimizer)
    assert {id(p) for g in optimizers[0].param_groups for p in g["params"]} == {
        id(p) for p in module.parameters()
    }
    assert [g["lr"] for g in optimizers[0].param_groups] == [0.1, 0.01]
    assert isinstance(schedulers, list)


def test_optimizers_to_device_and_launcher_signatures() -> None:
    optimizer = torch.optim.Adam(nn.Linear(2, 2).parameters())
    _private.optimizers_to_device([optimizer], torch.device("cpu"))
    launcher_params = inspect.signature(_private.SubprocessScriptLauncher.__init__).parameters
    assert list(launcher_params)[1:4] == ["cluster_environment", "num_processes", "num_nodes"]
    assert {"launch", "kill", "is_interactive_compatible"} <= set(dir(_private.Launcher))
    assert callable(getattr(_private.StrategyRegistry, "register", None))


def test_leaving_fit_early_runs_teardown_and_ends_fit_quietly(tmp_path) -> None:
    """Raising LeaveFit from a hook ends ``fit`` without an error (the departed member's exit)."""
    torn_down = []

    class Leaves(BoringModel):
        def training_step(self, batch, batch_idx):  # type: ignore[override]
            if batch_idx == 1:
                raise _private.LeaveFit
            return super().training_step(batch, batch_idx)

        def teardown(self, stage: str) -> None:
            torn_down.append(stage)

    trainer = Trainer(default_root_dir=tmp_path, max_steps=5, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(Leaves())
    assert trainer.global_step == 1 and torn_down == ["fit"]


def test_fit_loop_state_keys_the_joiners_progress_rewinds(tmp_path) -> None:
    trainer = Trainer(default_root_dir=tmp_path, max_steps=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(BoringModel())
    state = trainer.fit_loop.state_dict()
    keys = (_private.FIT_LOOP_BATCH_PROGRESS, _private.FIT_LOOP_OPTIM_PROGRESS, _private.FIT_LOOP_EPOCH_STATE)
    for key in keys:
        assert key in state, f"fit_loop.state_dict() has no {key!r}: {sorted(state)}"


def test_sync_ddp_without_a_process_group_returns_the_tensor() -> None:
    tensor = torch.tensor([1.0, 2.0])
    assert torch.equal(_private.sync_ddp_if_available(tensor, None, reduce_op="mean"), tensor)


def test_abort_process_group_exists() -> None:
    assert callable(getattr(torch.distributed.distributed_c10d, "_abort_process_group", None))


class _Counting:
    """A stateful iterable of 10 batches (Lightning saves and loads its position): batch i is all i."""

    def __init__(self) -> None:
        self.start = self.position = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        for i in range(self.start, 10):
            self.position = i + 1
            yield torch.full((1, 32), float(i))
        self.start = 0

    def __len__(self) -> int:
        return 10

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.start = state["position"]


class _SizesItsSchedule(BoringModel):
    def configure_optimizers(self):  # type: ignore[override]
        assert self.trainer.estimated_stepping_batches == self.trainer.max_steps  # builds the loaders early
        return super().configure_optimizers()


class _Seen(Callback):
    def __init__(self, restore: bool) -> None:
        self.restore, self.batches, self.restored = restore, [], None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.restore:
            self.restored = _private.restore_loader_states(trainer.fit_loop)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.batches.append(int(batch[0, 0]))


def test_restore_loader_states_after_an_early_estimate(tmp_path: Path) -> None:
    """Lightning drops a resumed loader's state when ``estimated_stepping_batches`` built the loaders before
    the restore (#20550): the epoch starts again. ``restore_loader_states`` hands it over before the first
    fetch. If Lightning fixes this, the plain resume goes on at batch 3 and this test says so."""
    def trainer(max_steps: int, seen: _Seen) -> Trainer:
        # max_epochs set: with max_epochs=-1 the estimate is max_steps and builds no loader
        return Trainer(accelerator="cpu", max_steps=max_steps, max_epochs=5, logger=False,
                       enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                       callbacks=[seen])

    first = trainer(3, _Seen(restore=False))
    first.fit(_SizesItsSchedule(), train_dataloaders=_Counting())
    checkpoint = tmp_path / "step3.ckpt"
    first.save_checkpoint(checkpoint)
    plain, fixed = _Seen(restore=False), _Seen(restore=True)
    trainer(6, plain).fit(_SizesItsSchedule(), train_dataloaders=_Counting(), ckpt_path=checkpoint)
    assert plain.batches == [0, 1, 2], "Lightning now restores the state itself: drop the workaround"
    trainer(6, fixed).fit(_SizesItsSchedule(), train_dataloaders=_Counting(), ckpt_path=checkpoint)
    assert fixed.restored is True and fixed.batches == [3, 4, 5]


def test_dump_checkpoint_and_step_log_metrics_inside_a_step(tmp_path) -> None:
    """Inside a training step: the trainer's checkpoint dict (what the stop checkpoint writes, its loop in
    flight) and the row Lightning logged at the last step's end (what a new rank 0 logs)."""
    seen: dict[str, object] = {}

    class Probe(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[override]
            if batch_idx == 2:
                seen["checkpoint"] = _private.dump_checkpoint(trainer)
                seen["row"] = _private.step_log_metrics(trainer)

    class Logs(BoringModel):
        def training_step(self, batch, batch_idx):  # type: ignore[override]
            out = super().training_step(batch, batch_idx)
            self.log("seen_batch", float(batch_idx))
            return out

    from lightning.pytorch.loggers import CSVLogger

    trainer = Trainer(default_root_dir=tmp_path, max_steps=3, logger=CSVLogger(tmp_path), log_every_n_steps=1,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      accelerator="cpu", callbacks=[Probe()])
    trainer.fit(Logs())
    checkpoint = seen["checkpoint"]
    assert isinstance(checkpoint, dict) and {"state_dict", "optimizer_states", "loops"} <= set(checkpoint)
    assert _private.FIT_LOOP_BATCH_PROGRESS in checkpoint["loops"]["fit_loop"]
    assert seen["row"] == {"seen_batch": 1.0}  # batch 1's row, as its step logged it


def test_the_training_loaders_source_and_lightnings_sampler_rebuild() -> None:
    """``train_loader_source`` is ``fit``'s loader; ``update_dataloader`` rebuilds a loader around another
    sampler (keeping batch size and generator); ``wrapped_sampler`` is the sampler inside Lightning's
    ``DistributedSamplerWrapper``."""
    from torch.utils.data import DataLoader, SequentialSampler

    loader = DataLoader(torch.randn(8, 32), batch_size=4, shuffle=True,  # type: ignore[arg-type]
                        generator=torch.Generator().manual_seed(1))
    sources: list[object] = []

    class Source(Callback):
        def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
            sources.append(_private.train_loader_source(trainer))

    Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[Source()]).fit(
        BoringModel(), train_dataloaders=loader
    )
    assert sources == [loader]
    sequential = SequentialSampler(loader.dataset)
    rebuilt = _private.update_dataloader(loader, sequential)
    assert rebuilt.sampler is sequential and rebuilt.batch_size == 4 and rebuilt.generator is loader.generator
    wrapper = _private.DistributedSamplerWrapper(sequential, num_replicas=1, rank=0)
    assert _private.wrapped_sampler(wrapper) is sequential


def test_single_process_checkpoint_save_and_load_say_nothing(tmp_path: Path) -> None:
    """``save_single_process``/``load_single_process`` round-trip a DCP checkpoint without a process group and
    without torch's "torch.distributed is disabled" warning (an error here)."""
    import warnings

    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="torch.distributed is disabled")
        _private.save_single_process({"w": torch.arange(3.0)}, FileSystemWriter(str(tmp_path)))
        loaded = {"w": torch.zeros(3)}
        _private.load_single_process(loaded, FileSystemReader(str(tmp_path)))
    assert torch.equal(loaded["w"], torch.arange(3.0))
