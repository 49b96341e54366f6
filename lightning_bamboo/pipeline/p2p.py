"""Point-to-point tensor transport between pipeline stages, with no pickling: tags, shape headers, batches.

A receiver must allocate its buffer before the data arrives. Activations are described by a fixed-size
int64 header ``[dtype code, ndim, d0, ..., d7]`` (:func:`lbd_common.codec.encode_spec`); the engine sends
one only for the first activation of each micro-batch shape and caches it
(:mod:`lightning_bamboo.pipeline.transfers`). Gradients flowing backwards have the shape of the activation
the receiver sent earlier, so they travel bare.

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

from lbd_common import codec

MAX_DIMS = codec.MAX_DIMS
"""Largest activation rank the header can describe."""

HEADER_LEN = codec.SPEC_LEN


class Tag(IntEnum):
    """Message tags, one per kind of traffic between two ranks."""

    HEADER = 1
    ACTIVATION = 2
    GRADIENT = 3
    REPLICA_GRAD = 4
    REPLICA_PARAM = 5


def dtype_code(dtype: torch.dtype) -> int:
    """Integer code of ``dtype`` for the header (:func:`lbd_common.codec.dtype_code`).

    Raises:
        TypeError: for a dtype the header cannot describe.
    """
    return codec.dtype_code(dtype, "between stages")


def encode_header(tensor: Tensor) -> Tensor:
    """The int64 header describing ``tensor``'s dtype and shape (on the tensor's device)."""
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"activation has {tensor.dim()} dims; at most {MAX_DIMS} can travel between stages")
    return codec.encode_spec(tensor, "between stages")


def decode_header(header: Tensor) -> tuple[torch.dtype, tuple[int, ...]]:
    """Inverse of :func:`encode_header`.

    Raises:
        lbd_common.codec.MalformedHeader: (a ``RuntimeError``) for a vector it did not write.
    """
    spec = codec.decode_spec(header, "activation header")
    return spec.dtype, spec.shape


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
