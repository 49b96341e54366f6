"""One layer's state (parameters, buffers, optimizer state) and its description: what a checkpoint stores and
what moves between members.

A layer (``pipeline.3`` of the body) is described by JSON (names, :mod:`lbd_common.codec` specs, the
optimizer state's non-tensor values) beside its tensors in one fixed order, so a reader holding a template of
the layer (on the meta device, or stale) can rebuild it without unpickling anything, from a peer
(:mod:`lightning_bamboo.runtime.reshard`) or from a checkpoint (:mod:`lightning_bamboo.checkpoint.periodic`).
Below both: the elastic runtime imports the checkpoint floor, never the other way round.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lbd_common import codec

_WHERE = "to another member or a checkpoint"
_WHAT = "layer description"


@dataclass
class LayerState:
    """One layer of the body as this member holds it: the module and its parameters' optimizer state."""

    module: nn.Module
    state: dict[str, dict[str, Any]] = field(default_factory=dict)
    """``parameter name within the layer -> optimizer state`` (empty before the first step)."""


def gather(layers: dict[int, nn.Module], optimizer: Optimizer | None) -> dict[int, LayerState]:
    """The states of ``layers`` whose parameters ``optimizer`` holds (``None``: no optimizer yet)."""
    out: dict[int, LayerState] = {}
    for layer, module in layers.items():
        held = LayerState(module)
        for name, p in module.named_parameters():
            if optimizer is not None and p in optimizer.state and optimizer.state[p]:
                held.state[name] = optimizer.state[p]
        out[layer] = held
    return out


def describe(held: LayerState) -> tuple[dict[str, Any], list[Tensor]]:
    """A layer's JSON description and its tensors, in the order they are sent.

    Each tensor is described by ``[..., dtype, shape]`` (:class:`lbd_common.codec.Spec`'s JSON; descriptions
    written before the codec name dtypes ``"torch.float32"``, which :func:`materialize` still reads).

    Raises:
        TypeError: a tensor's dtype cannot travel (:data:`lbd_common.codec.DTYPES`).
    """
    tensors: list[Tensor] = []
    desc: dict[str, Any] = {"params": [], "buffers": [], "state": []}
    for name, p in held.module.named_parameters():
        desc["params"].append([name, *codec.Spec.of(p, _WHERE).to_json()])
        tensors.append(p.detach())
    for name, b in held.module.named_buffers():
        desc["buffers"].append([name, *codec.Spec.of(b, _WHERE).to_json()])
        tensors.append(b.detach())
    for name, values in held.state.items():
        for key, value in values.items():
            if isinstance(value, Tensor):
                desc["state"].append([name, key, "tensor", *codec.Spec.of(value, _WHERE).to_json()])
                tensors.append(value.detach())
            else:
                desc["state"].append([name, key, "value", json.dumps(value)])
    return desc, tensors


def spec_of(entry: list[Any]) -> codec.Spec:
    """The spec of a tensor of a :func:`describe` description (its entry ends with ``dtype, shape``).

    Raises:
        lbd_common.codec.MalformedHeader: the entry names no allowed dtype or no valid shape.
    """
    return codec.Spec.from_json(entry[-2:], _WHAT)


def materialize(
    module: nn.Module,
    desc: dict[str, Any],
    fetch: Callable[[torch.dtype, tuple[int, ...]], Tensor],
    device: torch.device,
) -> LayerState:
    """Fill ``module`` (a template, possibly on the meta device) from a :func:`describe` description.

    ``fetch(dtype, shape)`` returns the next tensor in :func:`describe`'s order (received from a peer, or read
    from a checkpoint).
    """
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    if any(t.is_meta for t in [*params.values(), *buffers.values()]):
        module.to_empty(device=device)
        params = dict(module.named_parameters())
        buffers = dict(module.named_buffers())
    with torch.no_grad():
        for entry in desc["params"]:
            spec = spec_of(entry)
            param = params[entry[0]]
            param.data = fetch(spec.dtype, spec.shape).to(device=device, dtype=param.dtype)
        for entry in desc["buffers"]:
            spec = spec_of(entry)
            buffers[entry[0]].data = fetch(spec.dtype, spec.shape).to(device)
    state: dict[str, dict[str, Any]] = {}
    for entry in desc["state"]:
        name, key, kind = entry[0], entry[1], entry[2]
        if kind == "tensor":
            spec = spec_of(entry)
            state.setdefault(name, {})[key] = fetch(spec.dtype, spec.shape).to(device)
        else:
            state.setdefault(name, {})[key] = codec.parse_json(entry[3], _WHAT)
    return LayerState(module, state)
