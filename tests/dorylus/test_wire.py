"""The wire format: round trips, zero-copy decoding, and clear errors on bad payloads."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from lightning_dorylus import wire


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "f32": rng.standard_normal((7, 5)).astype(np.float32),
        "f64_transposed": rng.standard_normal((4, 6)).T,  # non-contiguous
        "f16": rng.standard_normal(3).astype(np.float16),
        "i32": np.arange(5, dtype=np.int32),
        "i64_big_endian": np.arange(4, dtype=">i8"),
        "mask": np.array([True, False, True]),
        "u8": np.arange(9, dtype=np.uint8).reshape(3, 3),
        "strided": np.arange(20.0)[::3],
        "empty_rows": np.zeros((0, 5), np.float32),
        "scalar": np.array(2.5),
    }


def test_round_trip_all_dtypes_and_layouts() -> None:
    arrays = _arrays()
    header = {"op": "apply_vertex.forward", "attrs": {"activation": "relu"}, "interval": 3}
    payload = wire.encode(header, arrays)
    assert payload[:4] == wire.MAGIC
    got_header, got = wire.decode(payload)
    assert got_header == header
    assert list(got) == list(arrays)
    for name, arr in arrays.items():
        assert got[name].dtype == arr.dtype.newbyteorder("="), name
        assert got[name].shape == arr.shape, name
        np.testing.assert_array_equal(got[name], arr)


def test_empty_and_trailing_zero_size_arrays() -> None:
    assert wire.decode(wire.encode({}, {})) == ({}, {})
    _, got = wire.decode(wire.encode({"k": 1}, {"a": np.ones(3), "z": np.zeros((4, 0), np.float32)}))
    assert got["z"].shape == (4, 0) and got["z"].dtype == np.float32
    np.testing.assert_array_equal(got["a"], np.ones(3))


def test_layout_is_aligned_and_decoding_is_zero_copy() -> None:
    payload = bytearray(wire.encode({}, {"a": np.ones(3, np.float32), "b": np.arange(10, dtype=np.int64)}))
    header_len, total_len = wire.read_prefix(payload)
    meta = json.loads(payload[wire.PREFIX_SIZE:wire.PREFIX_SIZE + header_len])
    assert [e["offset"] % wire.ALIGNMENT for e in meta["arrays"]] == [0, 0]
    assert total_len == len(payload)
    _, got = wire.decode(payload)
    assert got["b"].flags.writeable and not got["b"].flags.owndata
    got["b"][0] = 42  # a view: writes land in the payload buffer
    assert wire.decode(payload)[1]["b"][0] == 42


def test_encoded_size_is_exact_and_lambda_limit_helpers() -> None:
    arrays = _arrays()
    header = {"op": "x", "interval": 12}
    assert wire.encoded_size(header, arrays) == len(wire.encode(header, arrays))
    specs = {k: wire.ArraySpec(v.shape, v.dtype.newbyteorder("=").name) for k, v in arrays.items()}
    assert wire.encoded_size(header, specs) == len(wire.encode(header, arrays))
    assert wire.base64_size(3) == 4 and wire.base64_size(4) == 8
    limit = wire.LAMBDA_SYNC_PAYLOAD_LIMIT
    assert wire.fits_payload_limit(limit, base64=False)
    assert not wire.fits_payload_limit(limit, base64=True)
    assert wire.fits_payload_limit(limit * 3 // 4, base64=True)


def test_encode_frames_concatenate_to_encode() -> None:
    arrays = _arrays()
    total, frames = wire.encode_frames({"a": [1, 2]}, arrays)
    joined = b"".join(bytes(f) for f in frames)
    assert len(joined) == total and joined == wire.encode({"a": [1, 2]}, arrays)


def test_disallowed_dtype_and_bad_header_are_named() -> None:
    with pytest.raises(wire.WireError, match=r"array 'c' has dtype complex128 which is not allowed.*float32"):
        wire.encode({}, {"c": np.ones(2, np.complex128)})
    with pytest.raises(wire.WireError, match=r"array 'o' has dtype object"):
        wire.encode({}, {"o": np.array([object()])})
    with pytest.raises(wire.WireError, match="header is not JSON-serializable"):
        wire.encode({"f": object()}, {})
    with pytest.raises(wire.WireError, match=r"array 'l' must be a numpy.ndarray, got list"):
        wire.encode({}, {"l": [1, 2]})  # type: ignore[dict-item]


def test_truncated_and_corrupt_payloads_raise_clear_errors() -> None:
    payload = wire.encode({"op": "x"}, {"a": np.arange(100, dtype=np.float64)})
    with pytest.raises(wire.WireError, match=r"truncated payload: prefix says \d+ bytes, got 900"):
        wire.decode(payload[:900])
    with pytest.raises(wire.WireError, match="shorter than the 24-byte prefix"):
        wire.decode(payload[:10])
    with pytest.raises(wire.WireError, match=r"bad magic b'XXXX'"):
        wire.decode(b"XXXX" + payload[4:])
    with pytest.raises(wire.WireError, match="unsupported wire version 9"):
        wire.decode(payload[:4] + struct.pack("<H", 9) + payload[6:])
    with pytest.raises(wire.WireError, match="corrupt header"):
        header_len, _ = wire.read_prefix(payload)
        wire.decode(payload[:24] + b"{" * header_len + payload[24 + header_len:])


def _with_meta(payload: bytes, edit) -> bytes:
    """Rewrite the JSON header (keeping its length, padding with spaces) to forge a corrupt payload."""
    header_len, _ = wire.read_prefix(payload)
    meta = json.loads(payload[24:24 + header_len])
    meta["header"].pop("pad")  # room for the edit
    edit(meta)
    raw = json.dumps(meta, separators=(",", ":")).encode()
    assert len(raw) <= header_len
    return payload[:24] + raw.ljust(header_len) + payload[24 + header_len:]


def test_forged_shapes_dtypes_and_offsets_are_rejected() -> None:
    payload = wire.encode({"pad": "x" * 32}, {"a": np.zeros((10, 10), np.float32)})

    def grow(meta):
        meta["arrays"][0]["shape"] = [1000, 10]

    with pytest.raises(wire.WireError, match=r"array 'a' with shape \[1000, 10\] and dtype float32 needs"):
        wire.decode(_with_meta(payload, grow))

    def bad_dtype(meta):
        meta["arrays"][0]["dtype"] = "O"

    with pytest.raises(wire.WireError, match=r"array 'a' has dtype 'O' which is not allowed"):
        wire.decode(_with_meta(payload, bad_dtype))

    def negative(meta):
        meta["arrays"][0]["shape"] = [-1, 10]

    with pytest.raises(wire.WireError, match=r"array 'a' has invalid shape \[-1, 10\]"):
        wire.decode(_with_meta(payload, negative))

    def misaligned(meta):
        meta["arrays"][0]["offset"] = 3

    with pytest.raises(wire.WireError, match=r"array 'a' has invalid offset 3"):
        wire.decode(_with_meta(payload, misaligned))
