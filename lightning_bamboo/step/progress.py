"""The trainer's progress, sent as JSON to a worker that joins a running elastic job at step ``k``.

Why this module: a joining worker runs its own ``trainer.fit`` from the start, yet must run step ``k`` exactly
as the others do: same global step and epoch, same batch, same learning rate and scheduler counters. Its
layers and optimizer state come from peers (:mod:`lightning_bamboo.runtime.reshard`); everything else the fit
loop
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
import warnings
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch.optim import Optimizer
from torch.utils.data import DataLoader

from lightning_bamboo._lightning import private as _private

if TYPE_CHECKING:
    import lightning.pytorch as pl

_BATCH = _private.FIT_LOOP_BATCH_PROGRESS
_OPTIM = _private.FIT_LOOP_OPTIM_PROGRESS
_EPOCH_STATE = _private.FIT_LOOP_EPOCH_STATE


def snapshot(trainer: pl.Trainer, optimizer: Optimizer, step: int) -> dict[str, Any]:
    """The progress of a member inside ``optimizer_step`` of ``step``, before the closure ran.

    Raises:
        NotImplementedError: the step is the first batch of an epoch (no mid-epoch resume state before it).
        RuntimeError: the loop is not where a step boundary leaves it (e.g. gradient accumulation).
    """
    loop = copy.deepcopy(trainer.fit_loop.state_dict())
    batches = loop[_BATCH]
    if not in_flight(loop):
        raise RuntimeError(
            f"Bamboo: a worker can join only at a step boundary; the batch progress is {batches}"
        )
    done = batches["current"]["completed"]
    if done == 0:
        raise NotImplementedError(
            "Bamboo: a worker cannot join at the first batch of an epoch (the join is taken one step later)"
        )
    rewind_in_flight(loop)
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


def in_flight(loop: dict[str, Any]) -> bool:
    """Whether ``loop`` (a ``fit_loop.state_dict()``) is inside a batch that has not been processed yet (a
    member inside ``optimizer_step``, the closure run or not)."""
    batches = loop[_BATCH]
    return all(
        c["ready"] == c["started"] == c["processed"] + 1 == c["completed"] + 1
        for c in (batches["total"], batches["current"])
    )


def at_batch_end(loop: dict[str, Any]) -> bool:
    """Whether ``loop`` is where Lightning's ``on_train_batch_end`` leaves it (processed, not completed)."""
    batches = loop[_BATCH]
    return all(
        c["ready"] == c["started"] == c["processed"] == c["completed"] + 1
        for c in (batches["total"], batches["current"])
    )


def rewind_in_flight(loop: dict[str, Any]) -> None:
    """Rewind the batch in flight of ``loop`` (in place; :func:`in_flight` holds, past the epoch's first
    batch): the state a checkpoint saved in ``on_train_batch_end`` of the previous step has, which Lightning
    resumes mid-epoch from. The training loaders' saved positions are left alone (a joiner skips by
    ``skip``; :func:`rewind_loader_positions` for a checkpoint)."""
    batches = loop[_BATCH]
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


def rewind_loader_positions(loop: dict[str, Any]) -> None:
    """The saved position of every :class:`ResumableDataLoader` in ``loop`` back by the batch in flight (it
    was delivered, not trained on), so a checkpoint of that loop resumes at that batch."""
    for state in loop.get("state_dict", {}).get("combined_loader", []):
        if isinstance(state, dict) and "batches" in state and "epoch_length" in state:
            state["batches"] -= 1


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
    """A batch sampler that drops the first ``skip`` batches of its next iteration only (then passes through),
    and records which indices it hands out.

    ``len`` stays the epoch's: Lightning counts the skipped batches as fetched when it resumes mid-epoch.
    ``set_epoch`` reaches the wrapped batch sampler and its sampler (a ``DistributedSampler`` shuffles by
    epoch). ``skip_epoch`` (set by a checkpoint's :meth:`ResumableDataLoader.load_state_dict`): the skip
    applies only if the next iteration is that epoch of the sampler (a checkpoint taken at an epoch's end
    resumes at the next epoch's first batch); ``None``: the next iteration, whichever (a joiner).

    ``issued`` holds ``(position in the epoch, indices)`` of every batch handed out and not yet delivered by
    the ``DataLoader`` (worker processes run ahead of the training loop; the loader pops them in order).
    """

    def __init__(self, batch_sampler: Any, skip: int) -> None:
        if skip < 0:
            raise ValueError(f"skip must be >= 0, got {skip}")
        self.batch_sampler = batch_sampler
        self.sampler = getattr(batch_sampler, "sampler", None)
        self.skip = skip
        self.skip_epoch: int | None = None
        self.epoch: int | None = None  # the sampler's epoch of the current iteration, where it has one
        self.issued: deque[tuple[int, list[int]]] = deque()

    @property
    def batch_size(self) -> int | None:
        return getattr(self.batch_sampler, "batch_size", None)

    @property
    def drop_last(self) -> bool:
        return bool(getattr(self.batch_sampler, "drop_last", False))

    def set_epoch(self, epoch: int) -> None:
        for target in {id(o): o for o in (self.batch_sampler, self.sampler) if o is not None}.values():
            set_epoch = getattr(target, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        self.epoch = getattr(self.sampler, "epoch", None)
        skip, self.skip = self.skip, 0
        if skip and self.skip_epoch is not None and self.epoch is not None and self.epoch != self.skip_epoch:
            warnings.warn(
                f"Bamboo: the checkpoint's data position is batch {skip} of epoch {self.skip_epoch}, but the "
                f"loader starts epoch {self.epoch}; starting that epoch at its first batch",
                stacklevel=2,
            )
            skip = 0
        self.skip_epoch = None
        self.issued.clear()
        for index, batch in enumerate(self.batch_sampler):
            if index >= skip:
                self.issued.append((index, [int(i) for i in batch]))
                yield batch

    def __len__(self) -> int:
        return len(self.batch_sampler)


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` whose position in the epoch is checkpoint state (Lightning's stateful-loader hooks).

    Lightning saves ``state_dict()`` of every training loader that has one in the fit loop's checkpoint state
    (``FitLoop.on_save_checkpoint``) and gives it back to ``load_state_dict`` when it resumes, before the
    epoch's first batch is fetched. The position is the number of batches of the epoch this loader has
    delivered: Lightning fetches a sized loader's batches one at a time, so at any checkpoint (after a batch,
    after validation, at the epoch's end) that is the number of batches trained on. The skipped batches'
    indices are dropped before any sample is loaded.

    The position is kept in samples of the sampler's order as well (``batches x batch_size x
    num_replicas``), so a run resumed with another number of data-parallel pipelines (another
    ``DistributedSampler.num_replicas``) or per-pipeline batch size starts at the same sample, when that
    sample starts a batch there. ``last_indices``: the dataset indices of the batch delivered last (read by
    :class:`lightning_bamboo.ledger.BambooLedger`).
    """

    batch_sampler: SkipFirstBatches

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.batch_sampler, SkipFirstBatches):
            raise TypeError("ResumableDataLoader needs a SkipFirstBatches batch sampler: use resumable()")
        self.position = 0  # batches of the current epoch delivered (skipped ones included)
        self.last_indices: list[int] = []

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        issued = self.batch_sampler.issued
        for batch in super().__iter__():
            position, self.last_indices = issued.popleft()
            self.position = position + 1
            yield batch

    def _sharding(self) -> tuple[int, int]:
        """``(num_replicas, batch_size)`` of this loader (a ``DistributedSampler``'s, else one replica)."""
        replicas = int(getattr(self.batch_sampler.sampler, "num_replicas", 1))
        return replicas, int(self.batch_sampler.batch_size or 1)

    def state_dict(self) -> dict[str, Any]:
        replicas, batch_size = self._sharding()
        return {
            "epoch": self.batch_sampler.epoch,
            "batches": self.position,
            "batch_size": batch_size,
            "num_replicas": replicas,
            "dataset_size": len(self.dataset),  # type: ignore[arg-type]
            "epoch_length": len(self),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Start the next epoch at the saved position (nothing to skip when it was an epoch's end).

        Raises:
            ValueError: mid-epoch, the dataset's length changed, or the saved position does not start a batch
                under this loader's ``num_replicas x batch_size`` (with the arithmetic).
        """
        saved = int(state["batches"])
        if saved == 0 or saved >= int(state["epoch_length"]):  # an epoch's start or end: nothing to skip
            return
        size = len(self.dataset)  # type: ignore[arg-type]
        if state["dataset_size"] != size:
            raise ValueError(
                f"Bamboo: the checkpoint's training data position is in a dataset of {state['dataset_size']} "
                f"samples, the training DataLoader now has {size}; resume with the same dataset"
            )
        replicas, batch_size = self._sharding()
        sample = saved * int(state["batch_size"]) * int(state["num_replicas"])
        per_batch = batch_size * replicas
        if sample % per_batch:
            raise ValueError(
                f"Bamboo: the checkpoint stopped after {saved} batches of {state['batch_size']} samples x "
                f"{state['num_replicas']} pipelines = sample {sample} of the epoch, which does not start a "
                f"batch of {batch_size} x {replicas} pipelines ({sample} % {per_batch} = "
                f"{sample % per_batch}); resume with a global batch that divides it, or from an epoch's end"
            )
        self.batch_sampler.skip = sample // per_batch
        self.batch_sampler.skip_epoch = self.batch_sampler.epoch = state["epoch"]
        self.position = self.batch_sampler.skip


def skip_first_batches(dataloader: DataLoader, skip: int) -> ResumableDataLoader:
    """The same ``DataLoader`` whose next epoch starts at batch ``skip`` (indices skipped, no sample loaded),
    as a :class:`ResumableDataLoader`.

    Raises:
        TypeError: ``dataloader`` is not a plain ``torch.utils.data.DataLoader`` with a batch sampler (a
            subclass may take other constructor arguments, an iterable dataset has no indices to skip).
    """
    if not _positionable(dataloader):
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
    return ResumableDataLoader(
        dataloader.dataset, batch_sampler=SkipFirstBatches(dataloader.batch_sampler, skip), **kwargs
    )


def _positionable(dataloader: object) -> bool:
    return (
        type(dataloader) is DataLoader
        and dataloader.batch_sampler is not None
        and hasattr(dataloader.dataset, "__len__")
    )


def resumable(dataloader: object) -> object:
    """A training loader that resumes mid-epoch exactly (:class:`ResumableDataLoader`); one it cannot position
    (a ``DataLoader`` subclass, an iterable dataset, a loader already resumable) is returned unchanged, and
    Lightning warns when such a loader is resumed mid-epoch."""
    if not _positionable(dataloader):
        return dataloader
    return skip_first_batches(dataloader, 0)  # type: ignore[arg-type]


def drop_loader_position(checkpoint: dict[str, Any]) -> None:
    """Remove the training loader's position from a checkpoint's loop state (in place).

    For a checkpoint converted for one process (``consolidate_checkpoint(output=...)``): there the user's
    plain ``DataLoader`` has no state to load, and Lightning refuses a position it has no loader for ("The
    CombinedLoader has 0 stateful loaders, but found 1 states"); without it Lightning resumes as it does
    for plain loaders.
    """
    fit_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    fit_state.pop("combined_loader", None)
