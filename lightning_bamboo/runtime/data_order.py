"""The training data in the order the user's ``DataLoader`` gives it under ``strategy="auto"``.

Why this module: every Bamboo member loads the global batch and rank 0's is broadcast
(:mod:`lightning_bamboo.step.broadcast`), so the members' loaders must agree on one order, and a member
that takes over as rank 0 mid-epoch must continue it. Two things stood in the way of that order being the
user's:

* With Lightning's default ``use_distributed_sampler=True``, Lightning replaces a distributed strategy's
  training sampler by a ``DistributedSampler`` that always shuffles (seeded by ``seed_everything``), whatever
  the ``DataLoader``'s ``shuffle`` was, as under DDP. :func:`written_sampler` finds the sampler the user wrote
  and the loader is rebuilt around it.
* A ``RandomSampler`` without a generator (``DataLoader(shuffle=True)``) draws a seed from the process's
  global generator at the start of every epoch; each Bamboo worker's global generator is its own (the
  strategy reseeds it at setup, keyed random streams leave it alone), and an unseeded script differs per
  process. :class:`AutoOrderSampler` draws that seed from a copy of the global generator as it was when
  ``fit`` started (one copy, agreed through the store), exactly as ``auto`` draws it: per epoch, the
  loader's base seed (``DataLoader._get_shared_seed``) and then the sampler's seed.

A ``RandomSampler`` with its own generator (``DataLoader(shuffle=True, generator=g)``), a
``SequentialSampler`` and any other sampler are used as written: every member builds them the same way.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler, SequentialSampler

from lightning_bamboo._lightning import private as _private


def written_sampler(loader: DataLoader, source: object) -> Sampler | None:
    """The sampler the user's ``DataLoader`` had where Lightning replaced it for a distributed strategy;
    ``None`` where Lightning did not, or where the loader came from a ``train_dataloader()`` hook and
    Lightning's ``DistributedSampler`` replaced a ``RandomSampler``/``SequentialSampler`` (the original is not
    kept anywhere then).

    ``source``: what the training loaders come from (``fit(train_dataloaders=...)``'s loaders, or a module).
    """
    sampler = loader.sampler
    if isinstance(sampler, _private.DistributedSamplerWrapper):
        return _private.wrapped_sampler(sampler)
    if type(sampler) is not DistributedSampler:
        return None
    for original in _loaders(source):
        plain = isinstance(original.sampler, (RandomSampler, SequentialSampler))
        if original.dataset is loader.dataset and plain:
            return original.sampler
    return None


def _loaders(source: object) -> list[DataLoader]:
    """The ``DataLoader`` objects of ``fit(train_dataloaders=...)``'s value (a loader or a collection)."""
    if isinstance(source, DataLoader):
        return [source]
    if isinstance(source, CombinedLoader):
        return [loader for part in source.flattened for loader in _loaders(part)]
    if isinstance(source, Mapping):
        return [loader for part in source.values() for loader in _loaders(part)]
    if isinstance(source, (list, tuple)):
        return [loader for part in source for loader in _loaders(part)]
    return []


class AutoOrderSampler(RandomSampler):
    """``RandomSampler``'s order as ``strategy="auto"`` draws it, the same on every member.

    ``auto`` creates a new iterator each epoch; its ``DataLoader`` first draws a base seed for worker
    processes and then the ``RandomSampler`` a seed for its permutation, both from the global generator
    (one 64-bit draw each). Here both come from ``rng_state`` (the global generator's state when ``fit``
    started): epoch ``e`` uses draw ``2e + 1``. So the order equals ``auto``'s in every epoch when nothing
    else in the process draws from the global generator during training (no dropout or random augmentation
    in the main process, ``num_workers``-independent); ``auto``'s later epochs depend on such draws, which
    a pipeline cannot reproduce: a ``DataLoader(generator=...)`` is equal in every epoch regardless. The
    order of an epoch depends only on the epoch (``set_epoch``), so a member taking over mid-epoch, a
    joiner and a resumed run continue it.
    """

    def __init__(self, written: RandomSampler, rng_state: Tensor, persistent_workers: bool = False) -> None:
        super().__init__(written.data_source, written.replacement, written._num_samples)
        self.rng_state = rng_state
        self.draws_per_epoch = 1 if persistent_workers else 2  # a persistent iterator: one base seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def seed(self) -> int:
        """The seed ``auto``'s ``RandomSampler`` draws at the start of this epoch."""
        source = torch.Generator()
        source.set_state(self.rng_state)
        for _ in range(1 + self.epoch * self.draws_per_epoch):  # the draws before it (base seeds included)
            torch.empty((), dtype=torch.int64).random_(generator=source)
        return int(torch.empty((), dtype=torch.int64).random_(generator=source).item())

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator()
        generator.manual_seed(self.seed())
        order = RandomSampler(self.data_source, self.replacement, self._num_samples, generator=generator)
        yield from order


def in_written_order(loader: DataLoader, source: object, agreed_rng_state: Any) -> DataLoader:
    """``loader`` (the training loader as Lightning prepared it) in the order ``auto`` would train it in.

    ``agreed_rng_state()``: the global generator's state at the start of ``fit``, the same on every member
    (called only when a ``RandomSampler`` without generator needs it).
    """
    written = written_sampler(loader, source)
    if written is None and type(loader.sampler) is DistributedSampler and not _loaders(source):
        rank_zero_warn(
            "BambooStrategy: the training DataLoader comes from a train_dataloader() hook and Lightning "
            "(use_distributed_sampler=True) replaced its sampler by a DistributedSampler that shuffles "
            f"(seed {loader.sampler.seed}, reshuffled every epoch) whatever the DataLoader's shuffle=, "
            "as under DDP; Bamboo cannot see the sampler you wrote there. To train in the DataLoader's "
            "own order, as strategy='auto' does, pass Trainer(use_distributed_sampler=False) or the "
            "loader to fit()"
        )
    sampler = written if written is not None else loader.sampler
    if type(sampler) is RandomSampler and sampler.generator is None:
        sampler = AutoOrderSampler(sampler, agreed_rng_state(), loader.persistent_workers)
    if sampler is loader.sampler:
        return loader
    return _private.update_dataloader(loader, sampler)


class AutoBatches:
    """The batches of dataset indices a one-process run (``strategy="auto"``) trains ``loader`` on, epoch by
    epoch, worked out from its sampler and the generators' states as ``fit`` found them (take them before
    ``fit`` iterates the loader: a callback's ``setup``). For a record of the run
    (:class:`~lightning_bamboo.ledger.BambooLedger`), not for loading: a plain ``DataLoader`` does not say
    which indices a batch came from.

    Raises:
        TypeError: the loader has no ``batch_size`` (a custom batch sampler), so its batches are unknown.
    """

    def __init__(self, loader: DataLoader, rng_state: Tensor, generator_state: Tensor | None) -> None:
        if loader.batch_size is None:
            raise TypeError(
                "BambooLedger under a one-process strategy needs a DataLoader with a batch_size (its batches "
                f"are cut from the sampler's order); this one has the batch sampler {loader.batch_sampler!r}"
            )
        self.loader = loader
        self.rng_state = rng_state
        self.generator_state = generator_state
        self._epoch: int | None = None
        self._order: list[int] = []

    def batch(self, epoch: int, index: int) -> list[int]:
        """The indices of batch ``index`` of ``epoch``."""
        if epoch != self._epoch:
            self._epoch, self._order = epoch, self._epoch_order(epoch)
        size = self.loader.batch_size
        assert size is not None
        return self._order[index * size : (index + 1) * size]

    def _epoch_order(self, epoch: int) -> list[int]:
        sampler, loader = self.loader.sampler, self.loader
        if type(sampler) is RandomSampler and sampler.generator is None:
            auto = AutoOrderSampler(sampler, self.rng_state, loader.persistent_workers)
            auto.set_epoch(epoch)
            return list(auto)
        if type(sampler) is RandomSampler and self.generator_state is not None:
            generator = torch.Generator()
            generator.set_state(self.generator_state)
            order: list[int] = []
            for e in range(epoch + 1):  # as the loader drew them: base seed (shared generator), permutation
                if loader.generator is sampler.generator and (e == 0 or not loader.persistent_workers):
                    torch.empty((), dtype=torch.int64).random_(generator=generator)
                again = RandomSampler(sampler.data_source, sampler.replacement, sampler._num_samples,
                                      generator=generator)
                # as many as a batch loop takes: its last ask for more would draw one more permutation
                order = list(itertools.islice(again, len(again)))
            return order
        return [int(i) for i in sampler]
