"""Broadcast of small plain values (paths, numbers, flags) as JSON bytes in a uint8 tensor.

Lightning broadcasts checkpoint directories and log paths through ``Strategy.broadcast``. DDP does that with
``broadcast_object_list``, which pickles; here only JSON-representable values are accepted, so nothing that
crosses a process boundary is ever unpickled.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

_PATH_KEY = "__bamboo_path__"


def _encode(obj: Any) -> Any:
    if isinstance(obj, Path):
        return {_PATH_KEY: str(obj)}
    if isinstance(obj, (list, tuple)):
        return [_encode(item) for item in obj]
    if isinstance(obj, dict):
        if not all(isinstance(key, str) for key in obj):
            raise TypeError(
                f"BambooStrategy.broadcast supports dicts with str keys only, got keys {list(obj)}"
            )
        return {key: _encode(value) for key, value in obj.items()}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(
        f"BambooStrategy.broadcast sends JSON values only (None, bool, int, float, str, Path, lists and "
        f"dicts of them) so nothing is unpickled; got {type(obj).__name__}"
    )


def _decode(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {_PATH_KEY}:
            return Path(obj[_PATH_KEY])
        return {key: _decode(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_decode(item) for item in obj]
    return obj


def broadcast_json(obj: Any, src: int, device: torch.device, group: Any = None) -> Any:
    """Broadcast ``obj`` from global rank ``src`` to every rank of ``group`` (collective)."""
    rank = dist.get_rank()
    payload = json.dumps(_encode(obj)).encode("utf-8") if rank == src else b""
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(length, src, group=group)
    buffer = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    if rank == src:
        buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(buffer, src, group=group)
    return _decode(json.loads(bytes(buffer.cpu().tolist()).decode("utf-8")))
