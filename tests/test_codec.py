"""``lbd_common.codec``: every allowed dtype and shape (empty and 0-dim included) comes back bit for bit, and
anything the encoder could not have written is refused with an error naming the boundary."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lbd_common import codec

SHAPES = [(), (0,), (3,), (2, 0, 4), (2, 3), (1, 2, 1, 3, 1, 2, 1, 2)]


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Values that use every bit pattern class of ``dtype`` (negative, fractional, NaN for floats)."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype == torch.bool:
        return (torch.rand(n, generator=g) > 0.5).reshape(shape)
    if dtype.is_floating_point:
        values = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
        if n:
            values[0] = float("nan")
        return values.reshape(shape)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (n,), generator=g, dtype=torch.int64).to(dtype).reshape(shape)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equal (NaN equals NaN), same dtype and shape."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


@pytest.mark.parametrize("dtype", codec.DTYPES, ids=str)
@pytest.mark.parametrize("align", [1, 16])
def test_pack_unpack_round_trips_every_dtype_and_shape(dtype: torch.dtype, align: int) -> None:
    tensors = [_sample(dtype, shape, seed) for seed, shape in enumerate(SHAPES)]
    tensors.append(_sample(dtype, (4, 6), 9)[:, ::2])  # not contiguous: sent as its values
    buffer = codec.pack(tensors, align)
    assert buffer.dtype == torch.uint8
    specs = [codec.Spec.of(t) for t in tensors]
    got = codec.unpack(buffer, specs, align)
    assert all(_same(a, b) for a, b in zip(got, tensors, strict=True))
    if align > 1:
        assert all(offset % align == 0 for offset, _ in codec.spans(specs, align)[0])
        assert buffer.numel() % align == 0
    assert all(t.data_ptr() % t.element_size() == 0 for t in got)  # own, aligned storage


@pytest.mark.parametrize("dtype", codec.DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_specs_round_trip_as_json_and_as_fixed_header(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = torch.zeros(shape, dtype=dtype)
    spec = codec.Spec.of(tensor)
    assert codec.Spec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    header = codec.encode_spec(tensor)
    assert header.dtype == torch.int64 and header.shape == (codec.SPEC_LEN,)
    assert codec.decode_spec(header) == spec
    assert codec.dtype_from_code(codec.dtype_code(dtype)) == dtype
    assert codec.dtype_of("torch." + codec.dtype_name(dtype)) == dtype  # as older checkpoints name them


def test_json_headers_round_trip_through_uint8_tensors() -> None:
    value = {"tree": [1, 2.5, None, True, "x", {"nested": [[]]}], "nan": float("nan")}
    data = codec.json_bytes(value)
    got = codec.parse_json(codec.bytes_tensor(data))
    assert math.isnan(got.pop("nan")) and got == {k: v for k, v in value.items() if k != "nan"}
    assert codec.parse_json(codec.bytes_tensor(codec.json_bytes([]))) == []
    assert codec.bytes_tensor(b"").numel() == 0


def test_by_dtype_keeps_first_appearance_order() -> None:
    a, b, c = torch.zeros(1), torch.zeros(1, dtype=torch.int64), torch.ones(2)
    d = torch.zeros((), dtype=torch.int64)
    buckets = codec.by_dtype([a, b, c, d])
    assert [[id(t) for t in bucket] for bucket in buckets] == [[id(a), id(c)], [id(b), id(d)]]


def test_a_dtype_outside_the_allow_list_is_refused_where_it_would_be_sent() -> None:
    for dtype in (torch.complex64, torch.float8_e4m3fn, torch.quint8):
        with pytest.raises(TypeError, match=rf"cannot send a tensor of dtype {dtype} between stages"):
            codec.dtype_name(dtype, "between stages")
    with pytest.raises(TypeError, match="complex64"):
        codec.Spec.of(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match="complex64"):
        codec.encode_spec(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"9 dims cannot go between processes: at most 8"):
        codec.encode_spec(torch.zeros([1] * 9))
    assert not codec.allowed(torch.complex128) and codec.allowed(torch.bfloat16)


@pytest.mark.parametrize(
    "name", ["nn", "Tensor", "__class__", "complex64", "float", "", 5, None, ["float32"]], ids=repr
)
def test_a_header_naming_no_allowed_dtype_is_refused(name: object) -> None:
    with pytest.raises(codec.MalformedHeader, match=r"corrupt layer description: unknown dtype"):
        codec.dtype_of(name, "layer description")


@pytest.mark.parametrize(
    "shape", [[-1], [2.0], ["3"], [True], 3, None, [1] * (codec.MAX_JSON_DIMS + 1), {"0": 1}], ids=repr
)
def test_a_malformed_shape_is_refused(shape: object) -> None:
    with pytest.raises(codec.MalformedHeader, match=r"corrupt batch header: shape .* is not a list"):
        codec.Spec.from_json(["float32", shape], "batch header")


@pytest.mark.parametrize("value", [["float32"], "float32", None, ["float32", [1], 3]], ids=repr)
def test_a_spec_that_is_not_a_pair_is_refused(value: object) -> None:
    with pytest.raises(codec.MalformedHeader, match=r"corrupt header: expected \[dtype, shape\]"):
        codec.Spec.from_json(value)


@pytest.mark.parametrize(
    "values",
    [
        [99, 1, 2, 0, 0, 0, 0, 0, 0, 0],  # no such dtype code
        [-1, 1, 2, 0, 0, 0, 0, 0, 0, 0],
        [0, 9, 1, 1, 1, 1, 1, 1, 1, 1],  # more dims than the header holds
        [0, 2, 3, -4, 0, 0, 0, 0, 0, 0],  # a negative size
        [0, 1, 3],  # too short
    ],
    ids=str,
)
def test_a_malformed_fixed_header_is_refused(values: list[int]) -> None:
    with pytest.raises(codec.MalformedHeader, match=r"corrupt activation header"):
        codec.decode_spec(torch.tensor(values), "activation header")


def test_an_over_long_or_non_json_header_is_refused_before_allocation() -> None:
    with pytest.raises(codec.MalformedHeader, match=r"corrupt broadcast: a JSON header of -1 bytes"):
        codec.check_header_length(-1, "broadcast")
    with pytest.raises(codec.MalformedHeader, match=rf"at most {codec.MAX_HEADER_BYTES} are accepted"):
        codec.check_header_length(codec.MAX_HEADER_BYTES + 1, "broadcast")
    with pytest.raises(ValueError, match="at most"):
        codec.json_bytes("x" * codec.MAX_HEADER_BYTES)
    with pytest.raises(codec.MalformedHeader, match=r"corrupt boundary layout: not JSON"):
        codec.parse_json(b"\xff\xfe", "boundary layout")
    with pytest.raises(codec.MalformedHeader, match=r"corrupt header: not JSON"):
        codec.parse_json(b'{"a": ', "header")
    with pytest.raises(codec.MalformedHeader, match=r"corrupt header: not JSON"):
        codec.parse_json(b"[" * 100_000 + b"]" * 100_000)  # nesting past Python's recursion limit
    with pytest.raises(TypeError):
        codec.json_bytes(object())


def test_a_buffer_that_does_not_match_its_specs_is_refused() -> None:
    specs = [codec.Spec(torch.float32, (2, 3)), codec.Spec(torch.int64, ())]
    buffer = codec.pack([torch.zeros(2, 3), torch.tensor(7)])
    with pytest.raises(codec.MalformedHeader, match=r"corrupt stage boundary: the header describes 32 bytes"):
        codec.unpack(buffer[:-1], specs, what="stage boundary")
    with pytest.raises(codec.MalformedHeader, match=r"corrupt batch: a float32 tensor of shape \[2, 3\]"):
        codec.take(buffer[:10], 0, specs[0], "batch")
    # the error is both a RuntimeError (as the collectives' errors) and a ValueError (bad input)
    assert issubclass(codec.MalformedHeader, RuntimeError) and issubclass(codec.MalformedHeader, ValueError)
