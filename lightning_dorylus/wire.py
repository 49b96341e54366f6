"""Wire format for tensor-op requests and responses: a JSON header plus raw little-endian arrays.

Why not pickle: these bytes cross process boundaries today (local worker pool) and the network in
part 2 (AWS Lambda), so decoding must never execute anything. The format is deliberately tiny and
ships with the Lambda handler; this module imports only the standard library and numpy.

Byte layout (all integers little-endian; offsets are from the start of the payload)::

    0   4   magic            b"DRYW"
    4   2   version          u16, currently 1
    6   2   reserved         u16, 0
    8   4   header_len       u32, length of the UTF-8 JSON header
    12  4   reserved         u32, 0
    16  8   total_len        u64, length of the whole payload (detects truncation)
    24  header_len           JSON: {"header": {...caller's header...},
                                    "arrays": [{"name", "dtype", "shape", "offset"}, ...]}
    ...     zero padding to a multiple of ALIGNMENT (64)
    ...     array buffers, each starting at a multiple of ALIGNMENT, C order, little-endian

Decoding returns numpy views over the payload (no copy): pass a ``bytearray`` to get writable arrays.

Security model: a payload is untrusted input (a Lambda function or a worker process may be fed anything).
Decoding never executes code, and every malformed input raises :class:`WireError` naming what was wrong,
never another exception type: the prefix is checked (magic, version, reserved fields, lengths, the total
size against ``max_size`` -- default :data:`MAX_MESSAGE_SIZE` -- BEFORE a stream reader allocates a
buffer); the JSON header is bounded in bytes (:data:`MAX_HEADER_LEN`), nesting depth
(:data:`MAX_HEADER_DEPTH`, checked before ``json`` recurses) and integer digits
(:data:`MAX_INT_DIGITS`), with ``NaN``/``Infinity`` rejected; array entries must name an allowed dtype,
a shape of at most :data:`MAX_NDIM` non-negative ints whose byte size fits the payload, and the exact
offsets the encoder writes (arrays in order, aligned, not overlapping, the last one ending the payload).
The encoder applies the same limits, so whatever ``encode`` produces ``decode`` accepts.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"DRYW"
VERSION = 1
ALIGNMENT = 64
_PREFIX = struct.Struct("<4sHHIIQ")  # magic, version, reserved, header_len, reserved, total_len
PREFIX_SIZE = _PREFIX.size  # 24

#: dtypes allowed on the wire (names as numpy spells them).
ALLOWED_DTYPES: tuple[str, ...] = ("float16", "float32", "float64", "int32", "int64", "bool", "uint8")

#: AWS Lambda's synchronous-invocation payload limit (each way), in bytes.
LAMBDA_SYNC_PAYLOAD_LIMIT = 6 * 1024 * 1024

#: Default cap on a whole payload, in bytes (local workers carry intervals far over Lambda's 6 MB).
#: Functions taking ``max_size=None`` read this at call time, so a process may lower or raise it.
MAX_MESSAGE_SIZE = 2 * 1024**3
#: Cap on the JSON header, in bytes (real headers are a few hundred bytes; error messages are truncated).
MAX_HEADER_LEN = 1024 * 1024
#: Cap on JSON nesting (objects and arrays) in the header; the format itself needs 4 levels.
MAX_HEADER_DEPTH = 32
#: Cap on the digits of a JSON integer in the header (a u64 has 20).
MAX_INT_DIGITS = 24
#: Cap on an array's number of dimensions (numpy's own limit is 64).
MAX_NDIM = 32


class WireError(ValueError):
    """A payload is malformed, truncated, or uses something the format does not allow."""


@dataclass(frozen=True)
class ArraySpec:
    """Shape and dtype of an array, enough to plan an encoding without holding the data."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _wire_dtype(name: str, dtype: np.dtype) -> np.dtype:
    """The little-endian dtype used on the wire, or a clear error if ``dtype`` is not allowed."""
    if dtype.name not in ALLOWED_DTYPES:
        raise WireError(f"array {name!r} has dtype {dtype} which is not allowed on the wire; "
                        f"expected one of {list(ALLOWED_DTYPES)}")
    return dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype


@dataclass(frozen=True)
class _Plan:
    header_bytes: bytes
    data_start: int
    offsets: list[int]
    total_len: int


def _plan(header: Mapping[str, Any], specs: Sequence[tuple[str, tuple[int, ...], np.dtype]]) -> _Plan:
    entries: list[dict[str, Any]] = []
    offsets: list[int] = []
    # The JSON header's length depends on the offsets it lists; offsets are relative to the data
    # section, so compute those first and the absolute position after the header is known.
    rel = 0
    for name, shape, dtype in specs:
        offsets.append(rel)
        entries.append({"name": name, "dtype": dtype.name, "shape": list(shape), "offset": rel})
        rel = _align(rel + math.prod(shape) * dtype.itemsize)
    try:
        header_bytes = json.dumps({"header": dict(header), "arrays": entries},
                                  separators=(",", ":"), allow_nan=False).encode("utf-8")
    except (TypeError, ValueError, RecursionError) as err:
        raise WireError(f"header is not JSON-serializable: {err}") from err
    _parse_meta(header_bytes)  # the decoder's limits (size, depth, digits): encode only what decodes
    data_start = _align(PREFIX_SIZE + len(header_bytes))
    last_end = offsets[-1] + math.prod(specs[-1][1]) * specs[-1][2].itemsize if specs else 0
    return _Plan(header_bytes, data_start, offsets, data_start + last_end)


def _specs(arrays: Mapping[str, np.ndarray | ArraySpec]) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    specs = []
    for name, arr in arrays.items():
        if not isinstance(name, str):
            raise WireError(f"array names must be str, got {name!r}")
        if isinstance(arr, ArraySpec):
            shape, dtype = tuple(arr.shape), np.dtype(arr.dtype)
        elif isinstance(arr, np.ndarray):
            shape, dtype = arr.shape, arr.dtype
        else:
            raise WireError(f"array {name!r} must be a numpy.ndarray, got {type(arr).__name__}")
        specs.append((name, tuple(int(s) for s in shape), _wire_dtype(name, dtype)))
    return specs


def encoded_size(header: Mapping[str, Any], arrays: Mapping[str, np.ndarray | ArraySpec]) -> int:
    """Exact size in bytes of ``encode(header, arrays)``, computed without copying any data.

    Part 2 uses this to split an interval so that a request fits a Lambda payload.
    """
    return _plan(header, _specs(arrays)).total_len


def base64_size(nbytes: int) -> int:
    """Size of ``nbytes`` after base64 encoding (Lambda's JSON invoke payloads carry binary as base64)."""
    return 4 * ((nbytes + 2) // 3)


def fits_payload_limit(nbytes: int, limit: int = LAMBDA_SYNC_PAYLOAD_LIMIT, base64: bool = True) -> bool:
    """Whether an encoded payload of ``nbytes`` fits ``limit`` (after base64 when ``base64``)."""
    return (base64_size(nbytes) if base64 else nbytes) <= limit


def encode_frames(header: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> tuple[int, list[Any]]:
    """Encode as a list of buffers whose concatenation is the payload, without copying array data.

    Returns ``(total_len, frames)``. Frames are ``bytes`` (prefix, header, padding) and memoryviews of
    C-contiguous little-endian arrays, so a writer can stream them (e.g. into a pipe) with one copy.
    Non-contiguous or big-endian arrays are converted (that one copies).
    """
    specs = _specs(arrays)
    plan = _plan(header, specs)
    limit = MAX_MESSAGE_SIZE
    if plan.total_len > limit:
        raise WireError(f"payload of {plan.total_len} bytes exceeds the maximum message size {limit} "
                        f"(wire.MAX_MESSAGE_SIZE); send fewer rows per request")
    prefix = _PREFIX.pack(MAGIC, VERSION, 0, len(plan.header_bytes), 0, plan.total_len)
    frames: list[Any] = [prefix, plan.header_bytes]
    pos = PREFIX_SIZE + len(plan.header_bytes)
    for (name, _shape, dtype), rel in zip(specs, plan.offsets):
        target = plan.data_start + rel
        if target > pos:
            frames.append(bytes(target - pos))
            pos = target
        arr = np.ascontiguousarray(arrays[name], dtype=dtype)
        if arr.nbytes:
            frames.append(memoryview(arr.reshape(-1)).cast("B"))  # type: ignore[arg-type]
        pos += arr.nbytes
    if pos < plan.total_len:  # only when there are no arrays: pad the header to data_start
        frames.append(bytes(plan.total_len - pos))
    return plan.total_len, frames


def join_frames(total_len: int, frames: Sequence[Any]) -> bytes:
    """Concatenate ``encode_frames``' output into one ``bytes`` payload."""
    out = bytearray(total_len)
    pos = 0
    for frame in frames:
        n = memoryview(frame).nbytes
        out[pos:pos + n] = frame
        pos += n
    if pos != total_len:
        raise WireError(f"frames hold {pos} bytes but the payload should have {total_len}")
    return bytes(out)


def encode(header: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> bytes:
    """Encode a JSON-serializable ``header`` and named numpy ``arrays`` into one payload."""
    return join_frames(*encode_frames(header, arrays))


def read_prefix(prefix: bytes | bytearray | memoryview, max_size: int | None = None) -> tuple[int, int]:
    """Validate the fixed 24-byte prefix; return ``(header_len, total_len)``.

    Stream readers call this on the first bytes to learn how many more to read: it rejects a
    ``total_len`` over ``max_size`` (default :data:`MAX_MESSAGE_SIZE`), so a reader that allocates
    ``total_len`` bytes only after this call never allocates more than the cap.
    """
    if len(prefix) < PREFIX_SIZE:
        raise WireError(f"truncated payload: {len(prefix)} bytes is shorter than the "
                        f"{PREFIX_SIZE}-byte prefix")
    magic, version, reserved16, header_len, reserved32, total_len = _PREFIX.unpack_from(prefix, 0)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r}: expected {MAGIC!r} (not a Dorylus wire payload)")
    if version != VERSION:
        raise WireError(f"unsupported wire version {version}: this build reads version {VERSION}")
    if reserved16 or reserved32:
        raise WireError(f"corrupt prefix: reserved fields must be 0, got {reserved16} and {reserved32}")
    limit = MAX_MESSAGE_SIZE if max_size is None else max_size
    if total_len > limit:
        raise WireError(f"payload of {total_len} bytes (prefix total_len) exceeds the maximum message size "
                        f"{limit}")
    if header_len > MAX_HEADER_LEN:
        raise WireError(f"corrupt prefix: header_len ({header_len}) exceeds the {MAX_HEADER_LEN}-byte "
                        f"header limit")
    if PREFIX_SIZE + header_len > total_len:
        raise WireError(f"corrupt prefix: header_len ({header_len}) + {PREFIX_SIZE} exceeds "
                        f"total_len ({total_len})")
    if _align(PREFIX_SIZE + header_len) > total_len:
        raise WireError(f"corrupt prefix: total_len ({total_len}) is shorter than the aligned header end "
                        f"({_align(PREFIX_SIZE + header_len)})")
    return header_len, total_len


# A JSON string literal (the unrolled form, linear time): removed before counting brackets.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_DEPTH_STEP = np.zeros(256, np.int8)
_DEPTH_STEP[[ord("["), ord("{")]] = 1
_DEPTH_STEP[[ord("]"), ord("}")]] = -1


def _json_depth(raw: bytes) -> int:
    """Maximum nesting of objects/arrays in JSON text, without recursing (brackets in strings ignored)."""
    stripped = _JSON_STRING.sub(b"", raw)
    if not stripped:
        return 0
    steps = _DEPTH_STEP[np.frombuffer(stripped, np.uint8)].astype(np.int64)
    return int(np.cumsum(steps).max(initial=0))


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise WireError(f"corrupt header: an integer with {len(text.lstrip('-'))} digits exceeds the "
                        f"{MAX_INT_DIGITS}-digit limit")
    return int(text)


def _reject_constant(name: str) -> Any:
    raise WireError(f"corrupt header: {name} is not allowed (the encoder never writes it)")


def _parse_meta(raw: bytes) -> Any:
    """Parse the JSON header within the limits (size, depth, integer digits, no NaN/Infinity)."""
    if len(raw) > MAX_HEADER_LEN:
        raise WireError(f"corrupt header: {len(raw)} bytes exceeds the {MAX_HEADER_LEN}-byte header limit")
    depth = _json_depth(raw)
    if depth > MAX_HEADER_DEPTH:
        raise WireError(f"corrupt header: nesting depth {depth} exceeds the limit of {MAX_HEADER_DEPTH}")
    try:
        return json.loads(raw.decode("utf-8"), parse_int=_parse_int, parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WireError(f"corrupt header: {err}") from err
    except RecursionError as err:  # unreachable after the depth check; kept so nothing else escapes
        raise WireError(f"corrupt header: nested too deeply ({err})") from err


def _iter_entries(meta: Any) -> Iterator[tuple[str, np.dtype, tuple[int, ...], int]]:
    if not isinstance(meta, dict) or not isinstance(meta.get("header"), dict) \
            or not isinstance(meta.get("arrays"), list):
        raise WireError("corrupt header: expected a JSON object with 'header' (object) and 'arrays' (list)")
    seen: set[str] = set()
    for entry in meta["arrays"]:
        if not isinstance(entry, dict):
            raise WireError(f"corrupt array entry {_short(entry)}: expected an object")
        name, dtype, shape, offset = (entry.get(k) for k in ("name", "dtype", "shape", "offset"))
        if not isinstance(name, str) or name in seen:
            raise WireError(f"corrupt array entry: name {_short(name)} is not a str or is repeated")
        seen.add(name)
        if not isinstance(dtype, str) or dtype not in ALLOWED_DTYPES:
            raise WireError(f"array {name!r} has dtype {_short(dtype)} which is not allowed on the wire; "
                            f"expected one of {list(ALLOWED_DTYPES)}")
        if not isinstance(shape, list) or len(shape) > MAX_NDIM \
                or not all(type(s) is int and s >= 0 for s in shape):
            raise WireError(f"array {name!r} has invalid shape {_short(shape)}: expected a list of at most "
                            f"{MAX_NDIM} ints >= 0")
        if type(offset) is not int or offset < 0 or offset % ALIGNMENT:
            raise WireError(f"array {name!r} has invalid offset {_short(offset)}: expected an int >= 0, "
                            f"multiple of {ALIGNMENT}")
        yield name, np.dtype(dtype).newbyteorder("<"), tuple(shape), offset


def _short(value: Any, limit: int = 80) -> str:
    """``repr`` cut to ``limit`` characters: error messages quote forged values, which may be huge."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...'"


def decode(payload: bytes | bytearray | memoryview,
           max_size: int | None = None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Decode a payload into ``(header, arrays)``; arrays are zero-copy views over ``payload``.

    Raises:
        WireError: on anything but a payload ``encode`` could have written: a wrong magic/version, a
            truncated or oversized payload (over ``max_size``, default :data:`MAX_MESSAGE_SIZE`), a corrupt
            or over-limit header, a dtype outside ``ALLOWED_DTYPES``, an invalid shape, or array bytes
            that do not match the layout (out of range, misplaced, overlapping, or trailing bytes).
    """
    view = memoryview(payload).cast("B")
    header_len, total_len = read_prefix(view[:PREFIX_SIZE], max_size)
    if len(view) != total_len:
        raise WireError(f"truncated payload: prefix says {total_len} bytes, got {len(view)}")
    meta = _parse_meta(bytes(view[PREFIX_SIZE:PREFIX_SIZE + header_len]))
    data_start = _align(PREFIX_SIZE + header_len)
    arrays: dict[str, np.ndarray] = {}
    expected_offset, end = 0, data_start
    limit = MAX_MESSAGE_SIZE if max_size is None else max_size
    for name, dtype, shape, offset in _iter_entries(meta):
        # Zero-size arrays may declare huge dimensions; numpy still needs the other dims' product to fit.
        sized = math.prod(s for s in shape if s) * dtype.itemsize
        if sized > limit:
            raise WireError(f"array {name!r} has shape {_short(list(shape))}: its nonzero dimensions span "
                            f"{sized} bytes, more than the maximum message size {limit}")
        count = math.prod(shape)
        start = data_start + offset
        end = start + count * dtype.itemsize
        if end > total_len:
            raise WireError(f"array {name!r} with shape {list(shape)} and dtype {dtype.name} needs bytes "
                            f"{start}:{end} but the payload has {total_len} bytes")
        if offset != expected_offset:
            raise WireError(f"array {name!r} has offset {offset} but the layout puts it at {expected_offset} "
                            f"(arrays must follow each other in order, aligned to {ALIGNMENT})")
        expected_offset = _align(end - data_start)
        arr = np.frombuffer(view, dtype=dtype, count=count, offset=start).reshape(shape)
        arrays[name] = arr.astype(arr.dtype.newbyteorder("="), copy=False)
    if end != total_len:
        raise WireError(f"corrupt payload: the arrays end at byte {end} but total_len is {total_len}")
    return meta["header"], arrays
