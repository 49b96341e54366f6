"""Tensors with a header, for every process boundary of both packages: nothing is unpickled.

Whatever crosses between processes (a broadcast, a stage boundary, the replica exchange, a layer moved to
another member, a checkpoint's layer description, Dorylus's broadcast and prediction gather) is a header
describing tensors (JSON, or a fixed-size int64 vector where the receiver must size a buffer before anything
else arrives) and the tensors' raw bytes. This module is the one place that turns dtypes and shapes into
header values and back, packs tensors into one ``uint8`` buffer and cuts them out again, and bounds what a
header may hold, so every boundary refuses the same malformed input with the same kind of error:

* dtypes come from an allow-list (:data:`DTYPES`): a header can name no other ``torch`` attribute;
* a JSON header is at most :data:`MAX_HEADER_BYTES` long, checked before a receiver allocates for it;
* shapes are lists of at most :data:`MAX_DIMS` non-negative ints, and a buffer must hold exactly the bytes its
  specs describe;
* anything else the encoder could not have written raises :class:`MalformedHeader`, naming the boundary.

The collectives themselves (``dist.broadcast``, ``isend``...) stay with each boundary: they differ in who
sends, when and over which group; what they send is written here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
"""The dtypes that may cross a boundary; a dtype's index here is its code in a fixed-size header."""

_BY_NAME = {str(dtype).removeprefix("torch."): dtype for dtype in DTYPES}
_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}

MAX_DIMS = 8
"""Most dimensions a fixed-size header (:func:`encode_spec`) describes; JSON specs allow as many."""
SPEC_LEN = 2 + MAX_DIMS
"""Length of :func:`encode_spec`'s vector: ``[dtype code, ndim, d0, ..., d7]``."""
MAX_JSON_DIMS = 64
"""Most dimensions a JSON-described tensor may have (torch's own limit)."""
MAX_HEADER_BYTES = 64 * 1024 * 1024
"""Longest JSON header accepted (real ones are bytes to kilobytes; a ledger's per-step report the most)."""


class MalformedHeader(RuntimeError, ValueError):
    """Input the encoder could not have written: an unknown dtype, a bad shape, an over-long or non-JSON
    header, a buffer of the wrong size. A ``RuntimeError`` (found at run time, like a failed collective) and
    a ``ValueError`` (the input is bad), so callers written against either keep catching it."""


# ---------------------------------------------------------------------------------------------- dtypes
def allowed(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` may cross a boundary."""
    return dtype in _CODE


def dtype_name(dtype: torch.dtype, where: str = "between processes") -> str:
    """``dtype``'s name in a JSON header (``"float32"``).

    Raises:
        TypeError: ``dtype`` is not in :data:`DTYPES`; the message says ``where`` it was to go.
    """
    if dtype not in _CODE:
        raise TypeError(f"cannot send a tensor of dtype {dtype} {where}; supported: {list(DTYPES)}")
    return str(dtype).removeprefix("torch.")


def dtype_of(name: Any, what: str = "header") -> torch.dtype:
    """The dtype a header names (``"float32"``, or ``"torch.float32"`` as older checkpoints wrote it).

    Raises:
        MalformedHeader: ``name`` is not the name of a dtype in :data:`DTYPES`.
    """
    dtype = _BY_NAME.get(name.removeprefix("torch.")) if isinstance(name, str) else None
    if dtype is None:
        raise MalformedHeader(
            f"corrupt {what}: unknown dtype {shorten(name)}; expected one of {list(_BY_NAME)}"
        )
    return dtype


def dtype_code(dtype: torch.dtype, where: str = "between processes") -> int:
    """``dtype``'s code in a fixed-size header. Raises ``TypeError`` as :func:`dtype_name` does."""
    dtype_name(dtype, where)
    return _CODE[dtype]


def dtype_from_code(code: int, what: str = "header") -> torch.dtype:
    """Inverse of :func:`dtype_code`. Raises :class:`MalformedHeader` for a code no dtype has."""
    if not (isinstance(code, int) and 0 <= code < len(DTYPES)):
        raise MalformedHeader(f"corrupt {what}: dtype code {code!r} (codes are 0..{len(DTYPES) - 1})")
    return DTYPES[code]


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


# ---------------------------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class Spec:
    """A tensor's dtype and shape: what a receiver needs to hold its bytes."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @staticmethod
    def of(tensor: Tensor, where: str = "between processes") -> Spec:
        """``tensor``'s spec. Raises ``TypeError`` for a dtype outside :data:`DTYPES`."""
        dtype_name(tensor.dtype, where)
        return Spec(tensor.dtype, tuple(tensor.shape))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    def to_json(self) -> list[Any]:
        """``[dtype name, shape]``."""
        return [dtype_name(self.dtype), list(self.shape)]

    @staticmethod
    def from_json(value: Any, what: str = "header") -> Spec:
        """Inverse of :meth:`to_json`. Raises :class:`MalformedHeader` for anything it did not write."""
        if not (isinstance(value, (list, tuple)) and len(value) == 2):
            raise MalformedHeader(f"corrupt {what}: expected [dtype, shape], got {shorten(value)}")
        return Spec(dtype_of(value[0], what), checked_shape(value[1], what))


def checked_shape(shape: Any, what: str = "header") -> tuple[int, ...]:
    """``shape`` as a tuple, if it is a list of at most :data:`MAX_JSON_DIMS` ints >= 0.

    Raises:
        MalformedHeader: otherwise (a float, a negative size, a string, too many dimensions).
    """
    if (
        not isinstance(shape, (list, tuple))
        or len(shape) > MAX_JSON_DIMS
        or not all(type(d) is int and d >= 0 for d in shape)
    ):
        raise MalformedHeader(
            f"corrupt {what}: shape {shorten(shape)} is not a list of at most {MAX_JSON_DIMS} ints >= 0"
        )
    return tuple(shape)


def encode_spec(tensor: Tensor, where: str = "between processes") -> Tensor:
    """The fixed-size int64 header ``[dtype code, ndim, d0, ..., d7]`` of ``tensor`` (on its device).

    Raises:
        TypeError: for a dtype outside :data:`DTYPES`.
        ValueError: for a tensor of more than :data:`MAX_DIMS` dimensions.
    """
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"a tensor of {tensor.dim()} dims cannot go {where}: at most {MAX_DIMS}")
    header = torch.zeros(SPEC_LEN, dtype=torch.int64)
    header[0] = dtype_code(tensor.dtype, where)
    header[1] = tensor.dim()
    header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return header.to(tensor.device)


def decode_spec(header: Tensor | Sequence[int], what: str = "header") -> Spec:
    """Inverse of :func:`encode_spec`. Raises :class:`MalformedHeader` for a vector it did not write."""
    values = [int(v) for v in (header.tolist() if isinstance(header, Tensor) else header)]
    if len(values) != SPEC_LEN or not 0 <= values[1] <= MAX_DIMS:
        raise MalformedHeader(f"corrupt {what} {values}: expected [dtype code, ndim <= {MAX_DIMS}, dims...]")
    shape = values[2 : 2 + values[1]]
    if any(d < 0 for d in shape):
        raise MalformedHeader(f"corrupt {what} {values}: negative size in shape {shape}")
    return Spec(dtype_from_code(values[0], f"{what} {values}"), tuple(shape))


# ---------------------------------------------------------------------------------------------- JSON
def json_bytes(value: Any, what: str = "header") -> bytes:
    """``value`` as compact UTF-8 JSON (``NaN``/``Infinity`` allowed: a broadcast metric may be one).

    Raises:
        TypeError: ``value`` is not JSON-representable.
        ValueError: the JSON is longer than :data:`MAX_HEADER_BYTES`.
    """
    data = json.dumps(value, separators=(",", ":")).encode("utf-8")
    check_header_length(len(data), what)
    return data


def check_header_length(length: int, what: str = "header") -> int:
    """``length`` if a JSON header of that many bytes is acceptable: check a received length with this
    before allocating its buffer.

    Raises:
        MalformedHeader: negative or over :data:`MAX_HEADER_BYTES`.
    """
    if not 0 <= length <= MAX_HEADER_BYTES:
        raise MalformedHeader(
            f"corrupt {what}: a JSON header of {length} bytes (at most {MAX_HEADER_BYTES} are accepted)"
        )
    return length


def parse_json(data: bytes | bytearray | memoryview | str | Tensor, what: str = "header") -> Any:
    """The value of a JSON header (bytes, text, or a ``uint8`` tensor holding them, on any device).

    Raises:
        MalformedHeader: too long, not UTF-8 or not JSON.
    """
    if isinstance(data, Tensor):
        data = tensor_bytes(data)
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    check_header_length(len(raw), what)
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise MalformedHeader(f"corrupt {what}: not JSON ({err})") from err


def bytes_tensor(data: bytes, device: torch.device | str = "cpu") -> Tensor:
    """``data`` as a ``uint8`` tensor on ``device`` (what a collective can carry)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data else torch.empty(
        0, dtype=torch.uint8, device=device
    )


def tensor_bytes(buffer: Tensor) -> bytes:
    """The bytes of a ``uint8`` tensor (on any device)."""
    return buffer.detach().cpu().numpy().tobytes()


# ---------------------------------------------------------------------------------------------- packing
def spans(specs: Sequence[Spec], align: int = 1) -> tuple[list[tuple[int, int]], int]:
    """``([(offset, nbytes) of each spec], total bytes)`` when each tensor starts at a multiple of ``align``
    and the total is padded to one."""
    out, offset = [], 0
    for spec in specs:
        size = spec.nbytes
        out.append((offset, size))
        offset += -(-size // align) * align
    return out, offset


def pack(
    tensors: Sequence[Tensor], align: int = 1, device: torch.device | str | None = None, zero: bool = True
) -> Tensor:
    """``tensors``' bytes in one ``uint8`` buffer (on ``device``, default the first tensor's), each starting
    at a multiple of ``align``; :func:`unpack` with their specs takes them out again. ``zero``: clear the
    padding (False leaves it uninitialised, for a buffer whose padding nobody reads)."""
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    layout, total = spans([Spec(t.dtype, tuple(t.shape)) for t in tensors], align)
    if align == 1 and tensors:
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
        torch.cat([_raw(t, device) for t in tensors], out=buffer)
        return buffer
    buffer = (torch.zeros if zero else torch.empty)(total, dtype=torch.uint8, device=device)
    for tensor, (offset, size) in zip(tensors, layout, strict=True):
        buffer[offset : offset + size] = _raw(tensor, device)
    return buffer


def _raw(tensor: Tensor, device: torch.device | str) -> Tensor:
    return tensor.detach().to(device).contiguous().reshape(-1).view(torch.uint8)


def take(buffer: Tensor, offset: int, spec: Spec, what: str = "message") -> Tensor:
    """The tensor of ``spec`` whose bytes start at ``offset`` of ``buffer``, in its own (aligned, dense)
    storage.

    Raises:
        MalformedHeader: the buffer ends before the tensor does.
    """
    end = offset + spec.nbytes
    if end > buffer.numel():
        raise MalformedHeader(
            f"corrupt {what}: a {dtype_name(spec.dtype)} tensor of shape {list(spec.shape)} needs bytes "
            f"{offset}:{end}, but the buffer has {buffer.numel()}"
        )
    return buffer[offset:end].clone().view(spec.dtype).reshape(spec.shape)


def unpack(buffer: Tensor, specs: Sequence[Spec], align: int = 1, what: str = "message") -> list[Tensor]:
    """The tensors :func:`pack` put in ``buffer``, described by ``specs``.

    Raises:
        MalformedHeader: ``buffer`` does not hold exactly the bytes ``specs`` describe.
    """
    layout, total = spans(specs, align)
    if buffer.numel() != total:
        raise MalformedHeader(
            f"corrupt {what}: the header describes {total} bytes of tensors, the buffer has {buffer.numel()}"
        )
    return [take(buffer, offset, spec, what) for spec, (offset, _) in zip(specs, layout)]


def by_dtype(tensors: Iterable[Tensor]) -> list[list[Tensor]]:
    """``tensors`` in buckets of one dtype each, buckets in order of first appearance (the flat buffers of a
    per-dtype collective: one ``cat`` and one message per bucket)."""
    buckets: dict[torch.dtype, list[Tensor]] = {}
    for tensor in tensors:
        buckets.setdefault(tensor.dtype, []).append(tensor)
    return list(buckets.values())


def shorten(value: Any, limit: int = 80) -> str:
    """``repr`` cut to ``limit`` characters: errors quote forged values, which may be huge."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
