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
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lbd_common import codec
from lightning_bamboo.checkpoint.layers import LayerState, describe, gather, materialize
from lightning_bamboo.layout.ownership import FallbackNeeded
from lightning_bamboo.protocol import store as ms

__all__ = ["LayerState", "Resharder", "gather", "install"]
"""``LayerState`` and ``gather`` live in :mod:`lightning_bamboo.checkpoint.layers`; named here too for the
modules that import them from here."""


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
        holds = {m: set(json.loads(ms.wait_for_key(self.store, f"g{g}/holds/{m}", g))) for m in sorted(needs)}
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
                desc = codec.parse_json(ms.wait_for_key(self.store, f"g{g}/desc/{layer}/{dst}", g),
                                       "layer description")
                out[layer] = self._receive(layer, src, desc)
        return out

    def _receive(self, layer: int, src: int, desc: dict[str, Any]) -> LayerState:
        src_rank = self.rank_of(src)

        def fetch(dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
            flat = torch.empty(math.prod(shape), dtype=dtype, device=self.device)
            dist.recv(flat, src_rank)
            return flat.view(shape)

        return materialize(self.template(layer), desc, fetch, self.device)


