"""Point-to-point tensor transport between pipeline stages, with no pickling: tags, shape headers, batches.

A receiver must allocate its buffer before the data arrives. Activations are described by a fixed-size
int64 header ``[dtype code, ndim, d0, ..., d7]``; the engine sends one only for the first activation of
each micro-batch shape and caches it (:mod:`lightning_bamboo.pipeline.transfers`). Gradients flowing
backwards have
the shape of the activation the receiver sent earlier, so they travel bare.

Each kind of traffic has its own tag, so with gloo activations, gradients and replica synchronisation never
match the wrong receive. Exchanges in which two ranks send to each other at the same moment (the replica
ring) are posted as one :func:`post_batch` (``batch_isend_irecv``), the form NCCL needs for that.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

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


def isend_op(tensor: Tensor, peer: int, tag: Tag) -> dist.P2POp:
    """A send of ``tensor`` to global rank ``peer``, to be posted with :func:`post_batch`."""
    return dist.P2POp(dist.isend, tensor.detach().contiguous(), peer, tag=int(tag))


def irecv_op(buffer: Tensor, peer: int, tag: Tag) -> dist.P2POp:
    """A receive into ``buffer`` from global rank ``peer``, to be posted with :func:`post_batch`."""
    return dist.P2POp(dist.irecv, buffer, peer, tag=int(tag))


def post_batch(ops: list[dist.P2POp]) -> list[Any]:
    """Post all ``ops`` together (``batch_isend_irecv``) and return their works, not waited on.

    Posting the sends and receives between two ranks as one batch is what keeps NCCL from deadlocking when
    both send to each other at the same time; the caller waits on the works when it needs the data.
    """
    return dist.batch_isend_irecv(ops) if ops else []
