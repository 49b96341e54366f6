"""``lightning_dorylus.reduce.all_reduce``: Lightning's ``_sync_ddp`` semantics without its barrier."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from lightning_dorylus import DorylusStrategy
from lightning_dorylus.reduce import all_reduce


@pytest.fixture
def one_process_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A gloo group of one process (in this process, removed afterwards); a barrier fails the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    def no_barrier(*args: object, **kwargs: object) -> None:
        raise AssertionError("all_reduce must not put a barrier before the reduction")

    monkeypatch.setattr(dist, "barrier", no_barrier)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("op", ["sum", "mean", "avg", "max", "min", None, dist.ReduceOp.SUM])
def test_reduces_in_place_and_returns_the_tensor(op: object) -> None:
    value = torch.tensor([1.5, -2.0])
    out = all_reduce(value, reduce_op=op)  # type: ignore[arg-type]
    assert out is value  # in place, as Lightning's sync_dist expects
    assert torch.equal(out, torch.tensor([1.5, -2.0]))  # one process: every reduction is the identity


@pytest.mark.usefixtures("one_process_group")
def test_mean_of_an_integer_tensor_keeps_its_dtype() -> None:
    value = torch.tensor([4, 6])
    assert all_reduce(value, reduce_op="mean").dtype == torch.int64


@pytest.mark.usefixtures("one_process_group")
def test_unknown_reduce_op_is_named() -> None:
    with pytest.raises(ValueError, match=r"reduce_op='median': expected 'sum', 'mean', 'avg', 'max', 'min'"):
        all_reduce(torch.ones(1), reduce_op="median")


@pytest.mark.parametrize("group", ["sum", "mean"])
def test_an_op_passed_as_the_group_is_refused_without_a_process_group(group: str) -> None:
    """``strategy.reduce(t, "sum")`` fails on one graph server too (no process group), naming the keyword."""
    message = rf"reduce\(tensor, '{group}'\).*process group.*write reduce\(tensor, reduce_op='{group}'\)"
    with pytest.raises(TypeError, match=message):
        DorylusStrategy().reduce(torch.ones(1), group)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=message):
        all_reduce(torch.ones(1), group)
