"""The trainer's progress, sent as JSON to a worker that joins a running elastic job at step ``k``.

Why this module: a joining worker runs its own ``trainer.fit`` from the start, yet must run step ``k`` exactly
as the others do: same global step and epoch, same batch, same learning rate and scheduler counters. Its
layers and optimizer state come from peers (:mod:`lightning_bamboo.reshard`); everything else the fit loop
holds comes from here:

* **The loop state.** Lightning knows how to resume mid-epoch from a checkpoint saved in
  ``on_train_batch_end``; a member (inside ``optimizer_step`` of step ``k``, before its closure) takes its
  live ``fit_loop.state_dict()`` and rewinds the counters of the batch in flight, which gives exactly that
  state for step ``k - 1``; the joiner loads it with ``fit_loop.load_state_dict`` before its loop runs.
* **The data position.** Lightning does not skip the batches of a plain ``DataLoader`` when it resumes
  mid-epoch (it counts them as fetched and reads the epoch from its first batch). The joiner's training
  ``DataLoader`` is rebuilt around a batch sampler that drops the epoch's first ``skip`` batches of indices
  once (:func:`skip_first_batches`), before any sample is loaded, so its next batch is the others' batch
  ``k``. Every elastic member reads the global batch (the sampler is not sharded), so this does not depend
  on the layout.
* **The optimizer's hyper-parameters and the LR schedulers** (their ``state_dict``; learning rates live in
  the optimizer's param groups, which the scheduler does not restore).

Only JSON crosses the process boundary (ints, floats, lists, strings): a value that is not JSON
(a scheduler holding a tensor, say) is refused with its key named, never pickled.
"""

from __future__ import annotations

import copy
import inspect
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch.optim import Optimizer
from torch.utils.data import DataLoader

if TYPE_CHECKING:
    import lightning.pytorch as pl

_BATCH = "epoch_loop.batch_progress"
_OPTIM = "epoch_loop.automatic_optimization.optim_progress"
_EPOCH_STATE = "epoch_loop.state_dict"


def snapshot(trainer: pl.Trainer, optimizer: Optimizer, step: int) -> dict[str, Any]:
    """The progress of a member inside ``optimizer_step`` of ``step``, before the closure ran.

    Raises:
        NotImplementedError: the step is the first batch of an epoch (no mid-epoch resume state before it).
        RuntimeError: the loop is not where a step boundary leaves it (e.g. gradient accumulation).
    """
    loop = copy.deepcopy(trainer.fit_loop.state_dict())
    batches = loop[_BATCH]
    for part in ("total", "current"):
        c = batches[part]
        if not (c["ready"] == c["started"] == c["processed"] + 1 == c["completed"] + 1):
            raise RuntimeError(
                f"Bamboo: a worker can join only at a step boundary; the batch progress is {batches}"
            )
    done = batches["current"]["completed"]
    if done == 0:
        raise NotImplementedError(
            "Bamboo: a worker cannot join at the first batch of an epoch (the join is taken one step later)"
        )
    # rewind the batch in flight: the state a checkpoint saved in on_train_batch_end of the previous step has
    for part in ("total", "current"):
        for key in ("ready", "started", "completed"):
            batches[part][key] -= 1
    batches["is_last_batch"] = False
    for part in ("total", "current"):
        loop[_OPTIM]["optimizer"]["step"][part]["ready"] -= 1
    loop[_EPOCH_STATE]["_batches_that_stepped"] -= 1
    # zero_grad ran once per step (twice for a replayed step): as many as completed steps at a batch end
    optim = loop[_OPTIM]["optimizer"]
    for part in ("total", "current"):
        done_steps = optim["step"][part]["completed"]
        optim["zero_grad"][part] = {"ready": done_steps, "started": done_steps, "completed": done_steps}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    progress = {
        "step": step,
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "skip": done,
        "loop": loop,
        "param_groups": groups,
        "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
    }
    _check_json(progress, "progress")
    return progress


def _check_json(value: Any, where: str) -> None:
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_json(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"Bamboo: {where} has a non-string key {key!r}; progress travels as JSON")
            _check_json(item, f"{where}.{key}")
        return
    raise TypeError(
        f"Bamboo: {where} is a {type(value).__name__}; a joining worker's progress travels as JSON "
        "(ints, floats, strings, lists, dicts) and is never pickled"
    )


def to_json(progress: dict[str, Any]) -> str:
    return json.dumps(progress)


def restore_loop(trainer: pl.Trainer, progress: dict[str, Any]) -> None:
    """Position the joiner's fit loop; called in ``on_train_start`` (before the first epoch starts and before
    the first batch is fetched), so the restart stage Lightning derived at the loop's reset is derived
    again from the loaded state."""
    trainer.fit_loop.load_state_dict(progress["loop"])
    trainer.fit_loop.update_restart_stage()


def restore_optimizer(trainer: pl.Trainer, optimizer: Optimizer, progress: dict[str, Any]) -> None:
    """Hyper-parameters of the param groups (learning rates) and the LR schedulers' state."""
    groups = progress["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise RuntimeError(
            f"Bamboo: the joining worker's optimizer has {len(optimizer.param_groups)} param groups, the "
            f"job's has {len(groups)}; configure_optimizers must build the same groups on every worker"
        )
    for group, values in zip(optimizer.param_groups, groups):
        for key, value in values.items():
            # JSON turns tuples (Adam's betas) into lists: keep the type the optimizer was built with
            group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
    configs = trainer.lr_scheduler_configs
    if len(configs) != len(progress["schedulers"]):
        raise RuntimeError(
            f"Bamboo: the joining worker has {len(configs)} LR schedulers, the job has "
            f"{len(progress['schedulers'])}"
        )
    for config, state in zip(configs, progress["schedulers"]):
        config.scheduler.load_state_dict(state)


class SkipFirstBatches:
    """A batch sampler that drops the first ``skip`` batches of its next iteration only (then passes through).

    ``len`` stays the epoch's: Lightning counts the skipped batches as fetched when it resumes mid-epoch.
    ``set_epoch`` reaches the wrapped batch sampler and its sampler (a ``DistributedSampler`` shuffles by
    epoch).
    """

    def __init__(self, batch_sampler: Any, skip: int) -> None:
        if skip < 0:
            raise ValueError(f"skip must be >= 0, got {skip}")
        self.batch_sampler = batch_sampler
        self.sampler = getattr(batch_sampler, "sampler", None)
        self.skip = skip

    def set_epoch(self, epoch: int) -> None:
        for target in {id(o): o for o in (self.batch_sampler, self.sampler) if o is not None}.values():
            set_epoch = getattr(target, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        for index, batch in enumerate(self.batch_sampler):
            if index >= skip:
                yield batch

    def __len__(self) -> int:
        return len(self.batch_sampler)


def skip_first_batches(dataloader: DataLoader, skip: int) -> DataLoader:
    """The same ``DataLoader`` whose next epoch starts at batch ``skip`` (indices skipped, no sample loaded).

    Raises:
        TypeError: ``dataloader`` is not a plain ``torch.utils.data.DataLoader`` with a batch sampler (a
            subclass may take other constructor arguments, an iterable dataset has no indices to skip).
    """
    if type(dataloader) is not DataLoader or dataloader.batch_sampler is None:
        raise TypeError(
            "Bamboo: a worker joining mid-epoch must skip the batches the job already trained on; that needs "
            "a plain torch.utils.data.DataLoader over a map-style dataset with a batch size, got "
            f"{type(dataloader).__name__}"
        )
    accepted = set(inspect.signature(DataLoader.__init__).parameters) - {
        "self",
        "dataset",
        "batch_size",
        "shuffle",
        "sampler",
        "batch_sampler",
        "drop_last",
    }
    kwargs = {name: getattr(dataloader, name) for name in accepted if hasattr(dataloader, name)}
    if not kwargs.get("num_workers"):
        kwargs.pop("prefetch_factor", None)  # only allowed with worker processes
    return DataLoader(
        dataloader.dataset, batch_sampler=SkipFirstBatches(dataloader.batch_sampler, skip), **kwargs
    )
