"""The activation header and the JSON broadcast encoding: what crosses processes, without pickling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lbd_common.broadcast import decode_json, encode_json
from lightning_bamboo.pipeline.p2p import HEADER_LEN, decode_header, encode_header


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((4, 8), torch.float32), ((2, 3, 5), torch.bfloat16), ((7,), torch.int64), ((), torch.float64)],
)
def test_header_round_trip(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    header = encode_header(torch.zeros(shape, dtype=dtype))
    assert header.dtype == torch.int64 and header.shape == (HEADER_LEN,)
    assert decode_header(header) == (dtype, shape)


def test_header_rejects_unsupported() -> None:
    with pytest.raises(TypeError, match=r"cannot send a tensor of dtype torch.complex64"):
        encode_header(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"activation has 9 dims; at most 8"):
        encode_header(torch.zeros([1] * 9))
    with pytest.raises(RuntimeError, match=r"corrupt activation header"):
        decode_header(torch.full((HEADER_LEN,), 99, dtype=torch.int64))


def test_broadcast_encoding_round_trip() -> None:
    value = {"dir": Path("/tmp/ckpt"), "n": 3, "x": 0.5, "ok": True, "none": None, "names": ["a", "b"]}
    assert decode_json(encode_json(value, "BambooStrategy.broadcast")) == value


def test_broadcast_refuses_objects_that_would_need_pickle() -> None:
    with pytest.raises(TypeError, match=r"JSON values only .* got object"):
        encode_json(object(), "BambooStrategy.broadcast")


def test_batch_header_and_bytes_round_trip() -> None:
    """What broadcast_batch sends (JSON header + one uint8 buffer) rebuilds the batch, types included."""
    import json
    from collections import namedtuple

    from lightning_bamboo.step.broadcast import _describe, _rebuild

    Pair = namedtuple("Pair", ["x", "mask"])
    batch = {
        "pair": Pair(torch.randn(3, 2, dtype=torch.float64), torch.tensor([True, False, True])),
        "ids": [torch.arange(3), torch.tensor(7, dtype=torch.int32)],
        "meta": ("name", 3, 0.5, None),
        1: torch.randn(3, dtype=torch.bfloat16),
    }
    tensors: list[torch.Tensor] = []
    header = json.loads(json.dumps(_describe(batch, tensors)))  # what crosses the wire
    buffer = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])
    # the receiver's own batch, loaded with other random values, lends its container types
    local = {**batch, "pair": Pair(torch.zeros(3, 2), torch.zeros(3, dtype=torch.bool))}
    got = _rebuild(header, buffer, [0], local)
    assert isinstance(got["pair"], Pair) and list(got) == list(batch)
    assert got["meta"] == ("name", 3, 0.5, None)
    for key in ("pair", "ids"):
        for a, b in zip(got[key], batch[key]):
            assert a.dtype == b.dtype and torch.equal(a, b)
    assert torch.equal(got[1], batch[1])
    with pytest.raises(TypeError, match=r"nothing is pickled.*got object"):
        _describe({"x": object()}, [])
