"""RowBuffers lends a first layer's row buffers to requests and reuses only those the next rows can fill."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import torch

from lightning_dorylus.nn.row_buffers import RowBuffers


def _source(x: torch.Tensor) -> SimpleNamespace:
    return SimpleNamespace(graph=SimpleNamespace(partition=SimpleNamespace(x=x)))


def _answered() -> Future:
    future: Future = Future()
    future.set_result({"z": torch.zeros(1)})
    return future


def test_an_answered_host_buffer_is_reused_for_host_features_only() -> None:
    """A server on a GPU lends its requests host copies of rows it makes on the GPU: handing such a copy
    back as the ``out`` of the next rows failed the first CUDA run (``out ... device cpu; expected
    cuda:0``). The features stand on the ``meta`` device here, as a GPU's would: no CPU buffer is offered."""
    buffers = RowBuffers()
    rows = buffers.lend(torch.ones(4, 3))
    buffers.answered_by(_answered())
    assert buffers.take(_source(torch.empty(10, 3, device="meta")), (0, 4)) is None
    assert buffers.take(_source(torch.empty(10, 3)), (4, 8)) is rows
    assert buffers.take(_source(torch.empty(10, 3)), (0, 4)) is None  # taken once


def test_a_buffer_of_another_shape_dtype_or_an_unanswered_request_is_not_reused() -> None:
    buffers = RowBuffers()
    buffers.lend(torch.ones(4, 3))
    pending: Future = Future()
    buffers.answered_by(pending)
    x = torch.empty(10, 3)
    assert buffers.take(_source(x), (0, 4)) is None  # its request is not answered yet
    pending.set_result({"z": torch.zeros(1)})
    assert buffers.take(_source(x), (0, 5)) is None
    assert buffers.take(_source(x.double()), (0, 4)) is None
    assert buffers.take(_source(x), (0, 4)) is not None
