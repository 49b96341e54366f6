"""Broadcasts (and an all-gather) that never pickle: small plain values as JSON bytes (the one implementation
both strategies share, :mod:`lbd_common.broadcast`), and batches as JSON header + raw bytes, both in the one
codec of every boundary (:mod:`lbd_common.codec`).

Lightning broadcasts checkpoint directories and log paths through ``Strategy.broadcast``. DDP does that with
``broadcast_object_list``, which pickles; here only JSON-representable values are accepted, so nothing that
crosses a process boundary is ever unpickled.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lbd_common import broadcast as common
from lbd_common import codec

_CALLER = "BambooStrategy.broadcast"
"""What a refused value's ``TypeError`` names."""


def broadcast_json(obj: Any, src: int, device: torch.device, group: Any = None) -> Any:
    """Broadcast ``obj`` from global rank ``src`` to every rank of ``group`` (collective;
    :func:`lbd_common.broadcast.broadcast_json`)."""
    return common.broadcast_json(obj, src, device, group, caller=_CALLER)


def all_gather_json(obj: Any, device: torch.device, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` (a JSON value) on every rank of ``group``, in rank order (collective;
    :func:`lbd_common.broadcast.all_gather_json`)."""
    return common.all_gather_json(obj, device, group, caller=_CALLER)


# ---------------------------------------------------------------------------------------------- batches
def broadcast_batch(batch: Any, src: int, device: torch.device, group: Any = None) -> Any:
    """``src``'s ``batch`` on every rank of ``group``: a JSON header of the structure, then one raw buffer.

    The stages of a pipeline each load a batch from the same sampler indices, but random augmentation or
    masking in a dataset or collate function can draw differently on each process; stage 0's inputs
    would then meet other labels on the last stage. So stage 0's batch is the one used: its structure
    (dicts, lists, tuples, namedtuples, JSON scalars) and each tensor's dtype and shape go as JSON, every
    tensor's bytes as one uint8 buffer; nothing is pickled. Containers are rebuilt with the types of the
    receiver's own batch where the structure matches (namedtuple and mapping classes), plain ones otherwise.

    Raises:
        TypeError: on the source rank, for a leaf that is neither a tensor nor a JSON scalar.
    """
    rank = dist.get_rank()
    tensors: list[Tensor] = []
    tree = broadcast_json(_describe(batch, tensors) if rank == src else None, src, device, group)
    if rank == src:
        buffer = codec.pack(tensors, device=device)
        dist.broadcast(buffer, src, group=group)
        return batch
    specs: list[codec.Spec] = []
    _specs(tree, specs)
    buffer = torch.empty(codec.spans(specs)[1], dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src, group=group)
    offset = [0]
    return _rebuild(tree, buffer, offset, batch)


def _describe(obj: Any, tensors: list[Tensor]) -> Any:
    if isinstance(obj, Tensor):
        tensors.append(obj)
        return {"t": codec.Spec.of(obj, "from stage 0 to the other stages").to_json()}
    if isinstance(obj, Mapping):
        if not all(isinstance(key, (str, int)) for key in obj):
            raise TypeError(f"a batch dict needs str or int keys to be sent between stages; got {list(obj)}")
        return {"d": [[key, _describe(value, tensors)] for key, value in obj.items()]}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return {"n": [_describe(value, tensors) for value in obj]}
    if isinstance(obj, (list, tuple)):
        return {"l" if isinstance(obj, list) else "u": [_describe(value, tensors) for value in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"s": obj}
    raise TypeError(
        "stage 0 sends its batch to the other stages as tensors plus JSON (nothing is pickled); a batch may "
        "hold tensors, dicts, lists, tuples, namedtuples and None/bool/int/float/str, got "
        f"{type(obj).__name__}"
    )


_KINDS = ("t", "d", "n", "l", "u", "s")
"""Node kinds of a batch tree: tensor, dict, namedtuple, list, tuple, JSON scalar."""


def _node(tree: Any) -> tuple[str, Any]:
    """``(kind, value)`` of one node of a :func:`_describe` tree. Raises ``MalformedHeader`` otherwise."""
    if not (isinstance(tree, dict) and len(tree) == 1) or next(iter(tree)) not in _KINDS:
        raise codec.MalformedHeader(
            f"corrupt batch header: node {codec.shorten(tree)} is not one of {_KINDS}"
        )
    kind, value = next(iter(tree.items()))
    if kind in ("n", "l", "u", "d") and not isinstance(value, list):
        raise codec.MalformedHeader(
            f"corrupt batch header: {kind!r} holds {codec.shorten(value)}, not a list"
        )
    if kind == "d" and not all(isinstance(item, list) and len(item) == 2 for item in value):
        raise codec.MalformedHeader(f"corrupt batch header: dict items {codec.shorten(value)}")
    return kind, value


def _specs(tree: Any, out: list[codec.Spec]) -> None:
    """The specs of the tensors of ``tree``, in the order they lie in the buffer (checks the whole tree
    before anything is allocated)."""
    kind, value = _node(tree)
    if kind == "t":
        out.append(codec.Spec.from_json(value, "batch header"))
    elif kind == "d":
        for _, sub in value:
            _specs(sub, out)
    elif kind in ("n", "l", "u"):
        for sub in value:
            _specs(sub, out)


def _rebuild(tree: dict[str, Any], buffer: Tensor, offset: list[int], local: Any) -> Any:
    """The batch described by ``tree``; ``local`` (this rank's own batch) lends its container types."""
    kind, value = _node(tree)
    if kind == "t":
        spec = codec.Spec.from_json(value, "batch header")
        chunk = codec.take(buffer, offset[0], spec, "batch")  # own storage: aligned for any dtype
        offset[0] += spec.nbytes
        return chunk
    if kind == "d":
        items = {key: _rebuild(sub, buffer, offset, _child(local, key)) for key, sub in value}
        if isinstance(local, Mapping) and list(local) == list(items):
            try:
                return type(local)(items)  # type: ignore[call-arg]
            except TypeError:
                return items
        return items
    if kind in ("n", "l", "u"):
        items = [_rebuild(sub, buffer, offset, _child(local, i)) for i, sub in enumerate(value)]
        namedtuple = isinstance(local, tuple) and hasattr(local, "_fields")
        if kind == "n" and namedtuple and len(local) == len(items):
            return type(local)(*items)
        return items if kind == "l" else tuple(items)
    return value


def _child(local: Any, key: Any) -> Any:
    try:
        return local[key]
    except (KeyError, IndexError, TypeError):
        return None
