"""Every private name of Lightning and torch the Bamboo runtime relies on, in one place.

Lightning has no public way for a strategy to do these few things (build the user's optimizers over another
set of layers, leave ``fit`` early with teardown run, start Lightning's own script launcher on several nodes,
be a launcher, give a resumed loader its state when Lightning did not, take the trainer's checkpoint dict
without its collective save, read the row a training step logs) and torch none to abort a process
group's pending work. ``tests/bamboo/test_private_api.py``
imports and exercises each, so a Lightning or torch version that changes one fails there, loudly, instead of
deep inside a failover.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from lightning.fabric.strategies import _StrategyRegistry as StrategyRegistry
from lightning.fabric.utilities.apply_func import convert_tensors_to_scalars
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.fabric.utilities.distributed import _sync_ddp_if_available as sync_ddp_if_available
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device
from lightning.pytorch import Trainer
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers as init_optimizers
from lightning.pytorch.loops import _FitLoop
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher as SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.launcher import _Launcher as Launcher
from lightning.pytorch.utilities.data import _update_dataloader as update_dataloader
from lightning.pytorch.utilities.exceptions import _TunerExitException as LeaveFit
from torch.distributed.checkpoint import StorageReader, StorageWriter, state_dict_loader, state_dict_saver
from torch.utils.data import Sampler

if TYPE_CHECKING:
    import lightning.pytorch as pl

FIT_LOOP_BATCH_PROGRESS = "epoch_loop.batch_progress"
FIT_LOOP_OPTIM_PROGRESS = "epoch_loop.automatic_optimization.optim_progress"
FIT_LOOP_EPOCH_STATE = "epoch_loop.state_dict"
"""Keys of ``trainer.fit_loop.state_dict()`` a joiner's progress rewinds (:mod:`.progress`)."""


def abort_process_group() -> None:
    """Abort the default process group's pending work, so peers blocked on this member fail now."""
    dist.distributed_c10d._abort_process_group()


def dump_checkpoint(trainer: Trainer) -> dict[str, Any]:
    """What ``trainer.save_checkpoint`` writes (model, optimizers, loops, callbacks, schedulers), as a dict.

    ``save_checkpoint`` also runs the strategy's collective save and a barrier; the checkpoint a stopping job
    writes (:mod:`lightning_bamboo.checkpoint.stop`) meets the other workers through the job's store instead.
    """
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def step_log_metrics(trainer: Trainer) -> dict[str, Any]:
    """The metrics Lightning logs at a training step's end, as scalars (computed on every rank; only rank
    0's loggers take them): what a member that becomes rank 0 logs for a step the old one did not
    (:mod:`lightning_bamboo.runtime.rank_zero`)."""
    return convert_tensors_to_scalars(trainer._logger_connector.metrics["log"])


def save_single_process(state_dict: dict[str, Any], writer: StorageWriter) -> None:
    """``torch.distributed.checkpoint.save`` of this process's own checkpoint (no process group, no
    collective). The public ``save``/``async_save`` warn "torch.distributed is disabled ... assuming the
    intent is to save in a single process" every time, even with ``no_dist=True`` (torch 2.13); that is the
    intent here, so the function they call is called directly, with ``no_dist=True``."""
    state_dict_saver._save_state_dict(state_dict, writer, no_dist=True)


def load_single_process(state_dict: dict[str, Any], reader: StorageReader) -> None:
    """``torch.distributed.checkpoint.load`` in one process, without its warning (see
    :func:`save_single_process`)."""
    state_dict_loader._load_state_dict(state_dict, reader, no_dist=True)


def wrapped_sampler(sampler: DistributedSamplerWrapper) -> Sampler:
    """The user's sampler inside the ``DistributedSamplerWrapper`` Lightning put around it."""
    return sampler.dataset._sampler


def train_loader_source(trainer: pl.Trainer) -> object:
    """What the training loaders come from: ``fit(train_dataloaders=...)``'s value, or the module/datamodule
    whose ``train_dataloader()`` Lightning calls."""
    return trainer.fit_loop._data_source.instance


def restore_loader_states(fit_loop: _FitLoop) -> bool:
    """Give the training loaders the states of the checkpoint being resumed if Lightning has not; True if so.

    Lightning hands them over when it builds the loaders (``setup_data``), but when something asked for
    ``trainer.estimated_stepping_batches`` before the checkpoint was restored (a ``configure_optimizers`` that
    sizes its LR schedule by it), the loaders were built earlier and the states are dropped: a mid-epoch
    resume then starts the epoch again (Lightning #20550). Call before the first batch is fetched
    (``on_train_start``): the fetcher's iterator is made again so that it starts at the restored position.
    """
    pending = fit_loop.restarting and fit_loop._combined_loader_states_to_load
    if not pending or fit_loop._combined_loader is None:
        return False
    fit_loop._load_combined_loader_states()
    if fit_loop._data_fetcher is not None:
        iter(fit_loop._data_fetcher)
    return True


__all__ = [
    "FIT_LOOP_BATCH_PROGRESS",
    "FIT_LOOP_EPOCH_STATE",
    "FIT_LOOP_OPTIM_PROGRESS",
    "DistributedSamplerWrapper",
    "Launcher",
    "LeaveFit",
    "StrategyRegistry",
    "SubprocessScriptLauncher",
    "abort_process_group",
    "dump_checkpoint",
    "init_optimizers",
    "load_single_process",
    "optimizers_to_device",
    "restore_loader_states",
    "save_single_process",
    "step_log_metrics",
    "sync_ddp_if_available",
    "train_loader_source",
    "update_dataloader",
    "wrapped_sampler",
]
