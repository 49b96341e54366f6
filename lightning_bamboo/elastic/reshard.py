"""Move layers (parameters, buffers and optimizer state) between the members of a new generation.

Layers are the unit (``pipeline.3`` of the body), since a generation may give a member several stages, or
the replica of a different stage. Every member says in the store which layers it holds (all held copies
are exactly current: own stages, replicas and data-parallel copies are equal after every commit); each
layer a member needs and lacks comes from the lowest member holding it, in one global order
``(layer, destination)``, with blocking ``send``/``recv`` of the new generation's process group. A layer
travels as raw tensors; its description (names, dtypes, shapes, the optimizer state's non-tensor values
and param-group index) goes through the store as JSON, so nothing is unpickled.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lbd_common import codec
from lightning_bamboo.elastic.ownership import FallbackNeeded


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


def install(optimizer: Optimizer, layers: list[tuple[int, LayerState]], groups: Optimizer) -> None:
    """Make ``optimizer`` hold exactly these layers' parameters and their state, in place.

    The optimizer object stays the same (Lightning, its schedulers and the user hold it) and its param groups
    keep their hyper-parameters. Which group each parameter joins is matched by the parameter itself:
    ``groups`` is the user's ``configure_optimizers`` run over a body holding these layers, so a parameter
    is in the group (or left out) exactly as the user's code puts it on any layout.
    """
    if len(groups.param_groups) != len(optimizer.param_groups):
        raise RuntimeError(
            f"configure_optimizers built {len(groups.param_groups)} param groups for this member's new "
            f"layers but {len(optimizer.param_groups)} for its stage at setup; it must build the same groups "
            "for any set of layers (a group may be empty)"
        )
    where = {id(p): index for index, group in enumerate(groups.param_groups) for p in group["params"]}
    params: list[list[nn.Parameter]] = [[] for _ in optimizer.param_groups]
    state: dict[Tensor, dict[str, Any]] = {}
    for _, held in layers:
        for name, p in held.module.named_parameters():
            if id(p) not in where:
                continue
            params[where[id(p)]].append(p)
            if name in held.state:
                state[p] = held.state[name]
    for group, group_params in zip(optimizer.param_groups, params):
        group["params"] = group_params
    optimizer.state.clear()
    optimizer.state.update(state)


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


_WHERE = "to another member or a checkpoint"
_WHAT = "layer description"


def spec_of(entry: list[Any]) -> codec.Spec:
    """The spec of a tensor of a :func:`describe` description (its entry ends with ``dtype, shape``).

    Raises:
        lbd_common.codec.MalformedHeader: the entry names no allowed dtype or no valid shape.
    """
    return codec.Spec.from_json(entry[-2:], _WHAT)


class Resharder:
    """Moves layers between the members of one generation (see the module docstring).

    Args:
        store: the job's store (holdings and layer descriptions are exchanged through it).
        generation: the generation being formed (its process group is the default group).
        me: this member.
        rank_of: member -> rank in the generation's process group.
        template: layer index -> a module of that layer's structure (on the meta device, or stale) that a
            received layer is materialised into.
        device: where received tensors go.
    """

    def __init__(
        self,
        store: dist.Store,
        generation: int,
        me: int,
        rank_of: Callable[[int], int],
        template: Callable[[int], nn.Module],
        device: torch.device,
    ) -> None:
        self.store = store
        self.generation = generation
        self.me = me
        self.rank_of = rank_of
        self.template = template
        self.device = device

    def run(self, held: dict[int, LayerState], needs: dict[int, list[int]]) -> dict[int, LayerState]:
        """Give every member the layers ``needs`` lists for it; return what this member holds afterwards.

        Raises:
            FallbackNeeded: a needed layer is held by no member of the generation.
        """
        g = self.generation
        self.store.set(f"g{g}/holds/{self.me}", json.dumps(sorted(held)))
        holds = {m: set(json.loads(self.store.get(f"g{g}/holds/{m}"))) for m in sorted(needs)}
        plan: list[tuple[int, int, int]] = []
        for member in sorted(needs):
            for layer in needs[member]:
                if layer in holds[member]:
                    continue
                sources = sorted(m for m in holds if layer in holds[m])
                if not sources:
                    raise FallbackNeeded(f"generation {g}: no member holds layer {layer} any more")
                plan.append((layer, member, sources[0]))
        plan.sort()
        out = dict(held)
        for layer, dst, src in plan:
            if src == self.me:
                desc, tensors = describe(held[layer])
                self.store.set(f"g{g}/desc/{layer}/{dst}", json.dumps(desc))
                for tensor in tensors:
                    dist.send(tensor.contiguous().reshape(-1), self.rank_of(dst))
            elif dst == self.me:
                desc = codec.parse_json(self.store.get(f"g{g}/desc/{layer}/{dst}"), _WHAT)
                out[layer] = self._receive(layer, src, desc)
        return out

    def _receive(self, layer: int, src: int, desc: dict[str, Any]) -> LayerState:
        src_rank = self.rank_of(src)

        def fetch(dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
            flat = torch.empty(math.prod(shape), dtype=dtype, device=self.device)
            dist.recv(flat, src_rank)
            return flat.view(shape)

        return materialize(self.template(layer), desc, fetch, self.device)


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
