"""The training loader's position as checkpoint state (``progress.ResumableDataLoader``): no processes."""

from __future__ import annotations

import re

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_bamboo.step.progress import ResumableDataLoader, resumable


def _loader(
    size: int, batch_size: int, replicas: int = 1, rank: int = 0, epoch: int = 0
) -> ResumableDataLoader:
    data = TensorDataset(torch.arange(size))
    sampler = DistributedSampler(data, num_replicas=replicas, rank=rank, shuffle=True, seed=3)
    loader = resumable(DataLoader(data, batch_size=batch_size, sampler=sampler))
    assert isinstance(loader, ResumableDataLoader)
    loader.batch_sampler.sampler.set_epoch(epoch)  # what Lightning does before each epoch
    return loader


def _take(loader: ResumableDataLoader, batches: int) -> list[list[int]]:
    out = []
    for _, batch in zip(range(batches), loader):
        assert batch[0].tolist() == loader.last_indices  # the recorded indices are the delivered samples
        out.append(batch[0].tolist())
    return out


def test_resumed_loader_continues_where_the_checkpoint_stopped() -> None:
    """3 of 6 batches of epoch 1, state saved; a fresh loader loading it delivers exactly the other 3."""
    first = _loader(24, 4, epoch=1)
    seen = _take(first, 3)
    state = first.state_dict()
    assert state == {
        "epoch": 1, "batches": 3, "batch_size": 4, "num_replicas": 1, "dataset_size": 24, "epoch_length": 6
    }
    resumed = _loader(24, 4, epoch=1)
    resumed.load_state_dict(state)
    rest = [b[0].tolist() for b in resumed]
    assert sorted(i for b in seen + rest for i in b) == list(range(24))
    assert resumed.state_dict()["batches"] == 6
    # the skip was once: the next epoch is whole, in the sampler's order for that epoch
    resumed.batch_sampler.sampler.set_epoch(2)
    assert [b[0].tolist() for b in resumed] == [b[0].tolist() for b in _loader(24, 4, epoch=2)]


def test_state_at_an_epoch_end_or_of_another_epoch_skips_nothing() -> None:
    whole = _loader(12, 4)
    assert len(_take(whole, 10)) == 3
    resumed = _loader(16, 4, epoch=1)  # another dataset for the next epoch is fine
    resumed.load_state_dict(whole.state_dict())  # the epoch was done: resume at the next epoch's start
    assert len(list(resumed)) == 4
    part = _loader(12, 4)
    _take(part, 1)
    moved_on = _loader(12, 4, epoch=1)  # e.g. limit_train_batches ended epoch 0 early
    moved_on.load_state_dict(part.state_dict())
    with pytest.warns(UserWarning, match="batch 1 of epoch 0, but the loader starts epoch 1"):
        assert len(list(moved_on)) == 3


def test_position_carries_over_to_another_number_of_pipelines() -> None:
    """2 pipelines x 2 samples, 2 steps (DistributedSampler interleaves); resumed as 1 pipeline x 4: the
    union of what both runs read is every sample once."""
    shards = [_loader(16, 2, replicas=2, rank=r) for r in range(2)]
    seen = [i for s in shards for b in _take(s, 2) for i in b]
    resumed = _loader(16, 4, replicas=1)
    resumed.load_state_dict(shards[0].state_dict())
    rest = [i for b in resumed for i in b[0].tolist()]
    assert sorted(seen + rest) == list(range(16))
    odd = _loader(16, 3, replicas=1)
    expected = "sample 8 of the epoch, which does not start a batch of 3"
    with pytest.raises(ValueError, match=re.escape(expected)):
        odd.load_state_dict(shards[0].state_dict())


def test_other_dataset_is_refused_and_unpositionable_loaders_pass_through() -> None:
    loader = _loader(12, 4)
    _take(loader, 1)
    with pytest.raises(ValueError, match="dataset of 12 samples, the training DataLoader now has 8"):
        _loader(8, 4).load_state_dict(loader.state_dict())

    class Custom(DataLoader):
        pass

    custom = Custom(TensorDataset(torch.arange(4)), batch_size=2)
    assert resumable(custom) is custom
    assert resumable(loader) is loader  # already resumable


def test_workers_running_ahead_do_not_move_the_position() -> None:
    """With worker processes the sampler runs batches ahead; the position and indices follow delivery."""
    data = TensorDataset(torch.arange(20))
    loader = resumable(DataLoader(data, batch_size=2, num_workers=1, prefetch_factor=4))
    assert isinstance(loader, ResumableDataLoader)
    seen = _take(loader, 3)
    assert loader.state_dict()["batches"] == 3 and seen[-1] == loader.last_indices == [4, 5]


def test_a_stop_inside_a_step_checkpoints_the_previous_steps_batch_end(tmp_path) -> None:
    """``checkpoint.stop.trainer_checkpoint`` taken inside step 3 (its closure running) holds the loop state a
    checkpoint saved in ``on_train_batch_end`` of step 2 holds (what Lightning resumes mid-epoch from), the
    loader's position included; at a batch end it is taken as it is."""
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset

    from lightning_bamboo._lightning import private as _private
    from lightning_bamboo.checkpoint import stop

    seen: dict[str, dict] = {}

    class Probe(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[override]
            if batch_idx == 1:
                seen["batch_end"] = _private.dump_checkpoint(trainer)["loops"]["fit_loop"]
                at_end = stop.trainer_checkpoint(trainer)
                assert at_end is not None
                seen["taken_at_end"] = at_end["loops"]["fit_loop"]

        def on_before_backward(self, trainer, pl_module, loss) -> None:  # type: ignore[override]
            if trainer.global_step == 2:
                inside = stop.trainer_checkpoint(trainer)
                assert inside is not None
                seen["inside"] = inside["loops"]["fit_loop"]
            if trainer.global_step == 0:
                assert stop.trainer_checkpoint(trainer) is None  # the epoch's first batch: nothing to resume

    loader = resumable(DataLoader(RandomDataset(32, 16), batch_size=4))
    trainer = Trainer(default_root_dir=tmp_path, max_steps=4, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                      callbacks=[Probe()])
    trainer.fit(BoringModel(), loader)
    assert seen["inside"] == seen["batch_end"] == seen["taken_at_end"]
    assert seen["inside"]["state_dict"]["combined_loader"][0]["batches"] == 2
