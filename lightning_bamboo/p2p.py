"""Point-to-point tensor transport between pipeline stages, with no pickling.

Activations change shape with the micro-batch, so every activation is preceded by a fixed-size int64
header ``[dtype code, ndim, d0, ..., d7]`` that tells the receiver what buffer to allocate. Gradients
flowing backwards have the shape of the activation the receiver sent earlier, so they travel bare.

Sends are non-blocking (``isend``) and their handles are returned: a rank never blocks on a send, so the
F/B order of a 1F1B schedule cannot deadlock two neighbours that send to each other at the same time.
Each kind of traffic has its own tag so that, with gloo, activations, gradients and replica
synchronisation between the same two ranks never match the wrong receive.
"""

from __future__ import annotations

from enum import IntEnum

import torch
import torch.distributed as dist
from torch import Tensor

MAX_DIMS = 8
"""Largest activation rank the header can describe."""

HEADER_LEN = 2 + MAX_DIMS

_DTYPES: tuple[torch.dtype, ...] = (
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
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}


class Tag(IntEnum):
    """Message tags, one per kind of traffic between two ranks."""

    HEADER = 1
    ACTIVATION = 2
    GRADIENT = 3
    REPLICA_GRAD = 4
    REPLICA_PARAM = 5


def dtype_code(dtype: torch.dtype) -> int:
    """Integer code of ``dtype`` for the header.

    Raises:
        TypeError: for a dtype the header cannot describe.
    """
    if dtype not in _DTYPE_CODE:
        raise TypeError(
            f"cannot send a tensor of dtype {dtype} between stages; supported: {list(_DTYPE_CODE)}"
        )
    return _DTYPE_CODE[dtype]


def encode_header(tensor: Tensor) -> Tensor:
    """The int64 header describing ``tensor``'s dtype and shape (on the tensor's device)."""
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"activation has {tensor.dim()} dims; at most {MAX_DIMS} can travel between stages")
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = dtype_code(tensor.dtype)
    header[1] = tensor.dim()
    header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return header.to(tensor.device)


def decode_header(header: Tensor) -> tuple[torch.dtype, tuple[int, ...]]:
    """Inverse of :func:`encode_header`."""
    values = header.tolist()
    code, ndim = int(values[0]), int(values[1])
    if not 0 <= code < len(_DTYPES) or not 0 <= ndim <= MAX_DIMS:
        raise RuntimeError(f"corrupt activation header {values}: dtype code {code}, ndim {ndim}")
    return _DTYPES[code], tuple(int(d) for d in values[2 : 2 + ndim])


def send_activation(tensor: Tensor, dst: int) -> list[_Keep]:
    """Start sending ``tensor`` (header first) to global rank ``dst``; returns the pending sends."""
    payload = tensor.detach().contiguous()
    header = encode_header(payload)
    return [
        _Keep(dist.isend(header, dst, tag=Tag.HEADER), (header,)),
        _Keep(dist.isend(payload, dst, tag=Tag.ACTIVATION), (payload,)),
    ]


def recv_activation(src: int, device: torch.device) -> Tensor:
    """Receive a tensor sent by :func:`send_activation` from global rank ``src`` (blocking)."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
    dist.recv(header, src, tag=Tag.HEADER)
    dtype, shape = decode_header(header.cpu())
    payload = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(payload, src, tag=Tag.ACTIVATION)
    return payload


def send_tensor(tensor: Tensor, dst: int, tag: Tag) -> _Keep:
    """Start sending a tensor whose shape the receiver already knows."""
    payload = tensor.detach().contiguous()
    return _Keep(dist.isend(payload, dst, tag=tag), (payload,))


def recv_tensor(buffer: Tensor, src: int, tag: Tag) -> Tensor:
    """Receive into ``buffer`` (blocking) and return it."""
    dist.recv(buffer, src, tag=tag)
    return buffer


class _Keep:
    """A pending send plus the tensors it reads, so they are not freed before the send completes."""

    def __init__(self, work: dist.Work, tensors: tuple[Tensor, ...]) -> None:
        self.work = work
        self.tensors = tensors

    def wait(self) -> None:
        self.work.wait()
        self.tensors = ()


def wait_all(pending: list[_Keep]) -> None:
    """Wait for every pending send and clear the list."""
    for item in pending:
        item.wait()
    pending.clear()
