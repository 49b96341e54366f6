"""The training data in the DataLoader's own order under Bamboo (issue 28, item 4): ``shuffle=False`` is not
shuffled, ``shuffle=True`` draws ``strategy="auto"``'s permutation (one all members agree on), a seeded
``DataLoader(generator=...)`` is used as written, with Lightning's ``use_distributed_sampler`` either way;
across epochs and when rank 0 is lost mid-epoch. Multi-process runs compare final parameters (float64) with
the uninterrupted ``auto`` run of the same script and loader (an order off by one batch is ~5e-2 away)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler, TensorDataset

from lightning_bamboo.runtime.data_order import AutoOrderSampler, in_written_order, written_sampler
from tests.bamboo.conftest import _elastic_reference
from tests.bamboo.test_elastic import check_final, launched, run_elastic


class Recorder(LightningModule):
    """Records the sample indices of every training batch (the third tensor of the dataset)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.seen: list[int] = []

    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor:
        self.seen += batch[2].tolist()
        return self.layer(batch[0]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-iterators", "persistent-workers"])
def test_auto_order_sampler_draws_autos_permutations(persistent: bool) -> None:
    """``auto`` with ``shuffle=True`` and no generator trains 3 epochs in exactly the order the sampler gives
    from the global generator's state at the start of ``fit``, epoch by epoch (``set_epoch``)."""
    seed_everything(0)
    model = Recorder()
    data = TensorDataset(torch.randn(12, 2), torch.randn(12), torch.arange(12))
    loader = DataLoader(data, batch_size=4, shuffle=True, num_workers=int(persistent),
                        persistent_workers=persistent)
    state = torch.get_rng_state()
    Trainer(max_epochs=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False).fit(model, loader)
    sampler = AutoOrderSampler(RandomSampler(data), state, persistent)
    expected = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        expected += list(sampler)
    assert model.seen == expected
    assert model.seen[:12] != model.seen[12:24]  # a new permutation every epoch


def test_the_written_sampler_is_found_behind_lightnings() -> None:
    """Lightning's ``DistributedSampler`` (for a RandomSampler/SequentialSampler) hides the user's sampler:
    it is found in ``fit``'s loaders by dataset; a custom sampler is unwrapped from Lightning's
    ``DistributedSamplerWrapper``; a sampler Lightning left alone is nobody's business here."""
    data = TensorDataset(torch.arange(8))
    for shuffle in (False, True):
        written = DataLoader(data, batch_size=2, shuffle=shuffle)
        prepared = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=1, rank=0))
        assert written_sampler(prepared, written) is written.sampler
        assert written_sampler(prepared, {"a": [written]}) is written.sampler
    custom = SequentialSampler(range(8))
    wrapper = DistributedSamplerWrapper(custom, num_replicas=1, rank=0)
    wrapped = DataLoader(data, batch_size=2, sampler=wrapper)
    assert written_sampler(wrapped, None) is custom
    assert written_sampler(DataLoader(data, batch_size=2), None) is None


def test_a_loader_from_a_hook_keeps_lightnings_sampler_and_says_so() -> None:
    data = TensorDataset(torch.arange(8))
    lightnings = DistributedSampler(data, num_replicas=1, rank=0, seed=3)
    prepared = DataLoader(data, batch_size=2, sampler=lightnings)
    with pytest.warns(UserWarning, match="use_distributed_sampler=False"):
        assert in_written_order(prepared, Recorder(), torch.get_rng_state) is prepared


def test_an_unshuffled_loader_is_rebuilt_unshuffled_and_a_seeded_one_as_written() -> None:
    data = TensorDataset(torch.arange(8))
    prepared = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=1, rank=0))
    plain = in_written_order(prepared, DataLoader(data, batch_size=2), torch.get_rng_state)
    assert [int(i) for (batch,) in plain for i in batch] == list(range(8))
    seeded = DataLoader(data, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert in_written_order(seeded, seeded, torch.get_rng_state) is seeded


# ---------------------------------------------------------------------------------------------- end to end
SHUFFLED = ("--shuffle", "yes", "--epochs", "2")


@pytest.fixture(scope="module")
def unshuffled_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tensor]:
    return _elastic_reference(tmp_path_factory.mktemp("order-unshuffled"))


@pytest.fixture(scope="module")
def shuffled_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tensor]:
    return _elastic_reference(tmp_path_factory.mktemp("order-shuffled"), *SHUFFLED)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "sampler", [(), ("--no-distributed-sampler",)], ids=["lightning-sampler", "own-sampler"]
)
def test_unshuffled_loader_trains_unshuffled(
    tmp_path: Path, unshuffled_reference: dict[str, Tensor], sampler: tuple[str, ...]
) -> None:
    run_elastic(tmp_path, nproc=2, stages=2, extra_args=sampler)
    check_final(tmp_path, unshuffled_reference)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("sampler", "fault"),
    [((), ""), (("--no-distributed-sampler",), ""), ((), "0:4:forward")],
    ids=["lightning-sampler", "own-sampler", "rank0-lost-in-epoch-1"],
)
def test_shuffled_loader_draws_autos_permutation_every_epoch(
    tmp_path: Path, shuffled_reference: dict[str, Tensor], sampler: tuple[str, ...], fault: str
) -> None:
    """``seed_everything(0)`` + ``shuffle=True``, 2 epochs of 3 steps: auto's permutations in both epochs;
    member 0 (rank 0, whose batch is broadcast) SIGKILLed in the second epoch: member 1 goes on in order."""
    run_elastic(tmp_path, nproc=2, stages=2, fault=fault, extra_args=(*SHUFFLED, *sampler))
    assert launched(tmp_path).summary() == ([("failover", [0])] if fault else [])
    check_final(tmp_path, shuffled_reference)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_seeded_generator_loader_equals_auto(tmp_path: Path) -> None:
    """``DataLoader(shuffle=True, generator=torch.Generator().manual_seed(7))`` with Lightning's default
    ``use_distributed_sampler=True``: the loader's own sampler and generator, as under auto."""
    args = ("--shuffle", "generator", "--epochs", "2")
    reference = _elastic_reference(tmp_path / "auto", *args)
    run_elastic(tmp_path / "bamboo", nproc=2, stages=2, extra_args=args)
    check_final(tmp_path / "bamboo", reference)
