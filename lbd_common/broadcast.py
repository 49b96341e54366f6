"""Broadcasts (and an all-gather) of small values that never pickle, for both strategies: JSON bytes in a
``uint8`` tensor, their length sent first, in the codec of every boundary (:mod:`lbd_common.codec`).

Lightning broadcasts checkpoint directories, log paths, flags and numbers through ``Strategy.broadcast``.
DDP does that with ``broadcast_object_list``, which pickles: a peer could make this process unpickle
anything. Here only JSON values (and, for :func:`broadcast_object`, tensors) cross, so nothing is unpickled.

Two flavours, one wire step (:func:`broadcast_bytes`):

* :func:`broadcast_json` (Bamboo): JSON values with ``Path`` anywhere inside (lists, str-keyed dicts); an
  object outside that raises ``TypeError`` on the source rank before anything is sent;
* :func:`broadcast_object` (Dorylus): one tensor (its dtype and shape as JSON, then its bytes), one path (the
  receiver's own path class kept) or one JSON value; anything else raises ``TypeError`` on *every* rank, so
  no peer waits for a broadcast that never comes.
"""

from __future__ import annotations

from pathlib import Path, PurePath
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lbd_common import codec

PATH_KEY = "__bamboo_path__"
"""How :func:`encode_json` marks a ``Path`` inside a JSON value (the name both ends of a job already use)."""

OBJECT_KINDS = ("tensor", "path", "json")
"""The kinds of value a :func:`broadcast_object` header describes."""


def encode_json(obj: Any, caller: str) -> Any:
    """``obj`` as a JSON value, each ``Path`` as ``{PATH_KEY: str}``; ``TypeError`` (naming ``caller``) for
    anything else: a non-str dict key, or an object that only pickle could carry."""
    if isinstance(obj, Path):
        return {PATH_KEY: str(obj)}
    if isinstance(obj, (list, tuple)):
        return [encode_json(item, caller) for item in obj]
    if isinstance(obj, dict):
        if not all(isinstance(key, str) for key in obj):
            raise TypeError(f"{caller} supports dicts with str keys only, got keys {list(obj)}")
        return {key: encode_json(value, caller) for key, value in obj.items()}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(
        f"{caller} sends JSON values only (None, bool, int, float, str, Path, lists and "
        f"dicts of them) so nothing is unpickled; got {type(obj).__name__}"
    )


def decode_json(obj: Any) -> Any:
    """The value :func:`encode_json` encoded (tuples come back as lists, as JSON has no tuple)."""
    if isinstance(obj, dict):
        if set(obj) == {PATH_KEY}:
            return Path(obj[PATH_KEY])
        return {key: decode_json(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [decode_json(item) for item in obj]
    return obj


def broadcast_bytes(payload: bytes, src: int, device: torch.device, group: Any, what: str) -> Tensor:
    """``src``'s ``payload`` on every rank of ``group`` as a ``uint8`` tensor (collective): its length first,
    checked against the codec's header limit, then the bytes. Other ranks pass ``b""``; an empty payload
    from ``src`` arrives as an empty tensor (how :func:`broadcast_object` says "cannot be sent")."""
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(length, src, group=group)
    size = codec.check_header_length(int(length.item()), what)
    if dist.get_rank() == src:
        buffer = codec.bytes_tensor(payload, device)
    else:
        buffer = torch.empty(size, dtype=torch.uint8, device=device)
    if size:
        dist.broadcast(buffer, src, group=group)
    return buffer


def broadcast_json(obj: Any, src: int, device: torch.device, group: Any = None, *, caller: str,
                   what: str = "broadcast") -> Any:
    """Broadcast ``obj`` (see :func:`encode_json`) from global rank ``src`` to every rank of ``group``."""
    payload = codec.json_bytes(encode_json(obj, caller), what) if dist.get_rank() == src else b""
    where = f"{what} from rank {src}"
    return decode_json(codec.parse_json(broadcast_bytes(payload, src, device, group, where), where))


def all_gather_json(obj: Any, device: torch.device, group: Any = None, *, caller: str) -> list[Any]:
    """Every rank's ``obj`` (see :func:`encode_json`) on every rank of ``group``, in rank order
    (collective): each as JSON bytes in a ``uint8`` tensor padded to the longest."""
    world = dist.get_world_size(group)
    payload = codec.json_bytes(encode_json(obj, caller), "all-gather")
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [
        codec.check_header_length(int(n.item()), f"all-gather from rank {r}") for r, n in enumerate(lengths)
    ]
    buffer = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    buffer[: len(payload)] = codec.bytes_tensor(payload, device)
    buffers = [torch.empty_like(buffer) for _ in range(world)]
    dist.all_gather(buffers, buffer, group=group)
    return [
        decode_json(codec.parse_json(b[:n], f"all-gather from rank {r}"))
        for r, (b, n) in enumerate(zip(buffers, sizes))
    ]


def encode_object(obj: Any, name: str) -> bytes:
    """The JSON header of ``obj`` for :func:`broadcast_object`; ``b""`` if it cannot be sent (not JSON, a
    tensor of a dtype outside the codec's allow-list, over the header limit), so every rank raises the same
    ``TypeError``."""
    try:
        if isinstance(obj, Tensor):
            dtype, shape = codec.Spec.of(obj, f"by {name}").to_json()
            meta = {"kind": "tensor", "dtype": dtype, "shape": shape}
        elif isinstance(obj, PurePath):
            meta = {"kind": "path", "value": str(obj)}
        else:
            meta = {"kind": "json", "value": obj}
        return codec.json_bytes(meta, name)
    except (TypeError, ValueError):
        return b""


def broadcast_object(obj: Any, src: int, device: torch.device, group: Any = None, *, name: str) -> Any:
    """``src``'s ``obj`` (a tensor, a path or a JSON value) on every rank of ``group`` (collective).

    A tensor arrives on ``device`` (the source's own is cloned there); a path in the class of the receiver's
    own ``obj`` if that is a path (else as ``str``). Raises ``TypeError`` on every rank for anything else.
    """
    rank = dist.get_rank()
    what = f"{name} from rank {src}"
    buffer = broadcast_bytes(encode_object(obj, name) if rank == src else b"", src, device, group, what)
    if buffer.numel() == 0:
        raise TypeError(
            f"{name} sends tensors and JSON-representable objects (no pickle); rank {src} tried to broadcast "
            f"an object of another type ({type(obj).__name__ if rank == src else 'see rank ' + str(src)})"
        )
    meta = codec.parse_json(buffer, what)
    if not isinstance(meta, dict) or meta.get("kind") not in OBJECT_KINDS:
        raise codec.MalformedHeader(f"corrupt {what}: {codec.shorten(meta)}")
    if meta["kind"] == "tensor":
        spec = codec.Spec.from_json([meta.get("dtype"), meta.get("shape")], what)
        out = (obj.detach().clone().to(device) if rank == src
               else torch.empty(spec.shape, dtype=spec.dtype, device=device))
        dist.broadcast(out, src, group=group)
        return out
    if meta["kind"] == "path":
        return type(obj)(meta["value"]) if isinstance(obj, PurePath) else meta["value"]
    return meta["value"]
