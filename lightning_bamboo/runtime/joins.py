"""A worker joining a running job, as a part of the membership runtime: the committing member adopts the
supervisor's proposal (:func:`lightning_bamboo.protocol.join.claim`), the lowest continuing member writes the
trainer's progress for the joiners, and a joiner registers, waits for a generation listing it, forms it and
positions its trainer (:mod:`lightning_bamboo.step.progress`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from lightning_bamboo.layout.ownership import OwnershipMap
from lightning_bamboo.protocol import join as joining
from lightning_bamboo.protocol import store as ms
from lightning_bamboo.step import progress as trainer_progress

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_bamboo.runtime.formation import Formation
    from lightning_bamboo.runtime.generation import Generation
    from lightning_bamboo.runtime.lightning_side import LightningSide


class Joins:
    """Joins of one member (see the module docstring); ``store`` returns the job's store once connected (it
    holds no step session: a joiner's step is :meth:`join`'s result, the others' is passed in)."""

    def __init__(self, gen: Generation, formation: Formation, lightning: LightningSide,
                 store: Callable[[], dist.Store | None]) -> None:
        self._gen, self._formation, self._lightning, self._store = gen, formation, lightning, store

    def claim(self, step: int) -> bool:
        """Called by the member committing ``step``: adopt the launcher's join proposal after it, unless the
        next step starts an epoch (no mid-epoch position to give a joiner) or there is no next step."""
        store, owners = self._store(), self._gen.owners
        assert store is not None and owners is not None
        trainer = self._lightning.module().trainer
        if trainer.accumulate_grad_batches != 1:
            return False  # a joiner could not run the step's earlier batches again: joins wait (documented)
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            return False
        if trainer.max_steps != -1 and trainer.global_step + 1 >= trainer.max_steps:
            return False
        return joining.claim(store, owners.generation, step)

    def send_progress(self, old: OwnershipMap, new: OwnershipMap, step: int) -> None:
        """The lowest continuing member writes the trainer's progress (``step`` steps committed) for the
        members joining in ``new``."""
        store = self._store()
        assert store is not None
        joiners = set(new.members()) - set(old.members())
        staying = sorted(set(old.members()) & set(new.members()))
        if not joiners or not staying or self._gen.member != staying[0]:
            return
        trainer = self._lightning.module().trainer
        snap = trainer_progress.snapshot(trainer, self._lightning.optimizer(), step)
        store.set(f"gen{new.generation}/progress", trainer_progress.to_json(snap))

    def join(self, trainer: pl.Trainer, begin: Callable[[OwnershipMap], None], formed: Callable[[int], None],
             skip: Any) -> int:
        """A joiner: register, wait for a generation listing this member, form it (``begin`` its process
        group, ``formed`` when done), position the trainer and ``skip`` (its batch sampler) in the epoch.
        Returns the job's committed step count, where the joiner's step session starts."""
        store, member = self._store(), self._gen.member
        assert store is not None
        joining.register(store, member)
        owners = joining.wait_for_membership(store, member)
        start = time.monotonic()
        begin(owners)
        self._formation.global_microbatches = int(store.get(ms.GLOBAL_MICROBATCHES).decode())
        optimizer = self._lightning.optimizer()
        self._formation.form(self._gen, member, store, self._lightning.module(), optimizer, holdings={})
        progress = json.loads(store.get(f"gen{owners.generation}/progress"))
        trainer_progress.restore_optimizer(trainer, optimizer, progress)
        trainer_progress.restore_loop(trainer, progress)
        step = int(progress["step"])
        if skip is None:
            raise RuntimeError("Bamboo: the joiner's training DataLoader was not prepared to skip batches")
        skip.skip = int(progress["skip"])
        formed(owners.generation)
        print(
            f"[bamboo] member {member} joined generation {owners.generation} at step {step} "
            f"(global step {progress['global_step']}, epoch {progress['epoch']}, batch {skip.skip}; "
            f"{time.monotonic() - start:.2f}s to form)\n{owners.format()}",
            flush=True,
        )
        return step
