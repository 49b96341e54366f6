"""Tied weights across layers of the pipeline body (a GPT's LM head sharing the token embedding's weight).

In one process a tied parameter is one tensor: every use adds its gradient into it and the optimizer steps it
once. A pipeline puts the uses on different processes, so, as DeepSpeed's ``TiedLayerSpec`` and Megatron's
embedding group do, each process holding a use keeps its own copy, and before the optimizer step the copies'
gradients are summed over the processes holding a use (and averaged over the pipelines, replacing the
data-parallel average for that parameter). Every copy then takes the same step from the same state, so the
copies stay equal bit for bit and the run equals the single-process one.

The runtime treats layers as independent units (they move between members, are loaded from checkpoints,
become replicas), so at setup the body is *untied* (every use but the first gets its own copy) and the tie is
restored wherever several uses meet in one module set: a member's own stages (the optimizer then holds the
parameter once) and, separately, its replica (it mirrors its successor's stages exactly). A member's own
copy and its replica's copy are never one tensor: the replica's optimizer must not step the member's weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from lightning_bamboo.elastic.reshard import LayerState
from lightning_bamboo.pipeline.engine import average_gradients


@dataclass(frozen=True)
class Tie:
    """One parameter used by several layers: ``(layer index, parameter name within the layer)`` per use, in
    layer order. The first use names the parameter (as ``named_parameters`` of the whole body does)."""

    uses: tuple[tuple[int, str], ...]

    @property
    def layers(self) -> set[int]:
        return {layer for layer, _ in self.uses}

    def describe(self, attr: str) -> str:
        return " = ".join(f"{attr}.{layer}.{name}" for layer, name in self.uses)


def find_ties(body: Sequence[nn.Module]) -> list[Tie]:
    """The parameters used by more than one layer of ``body`` (a tie inside one layer moves with it)."""
    uses: dict[int, list[tuple[int, str]]] = {}
    for index, layer in enumerate(body):
        for name, param in layer.named_parameters():
            uses.setdefault(id(param), []).append((index, name))
    return [Tie(tuple(found)) for found in uses.values() if len({layer for layer, _ in found}) > 1]


def aliases(ties: Iterable[Tie], attr: str) -> dict[str, str]:
    """``body parameter name -> the name of its tie's first use`` for every later use (``pipeline.5.weight ->
    pipeline.0.weight``): the name a single-process model's ``named_parameters`` and optimizer know it by."""
    return {
        f"{attr}.{layer}.{name}": f"{attr}.{tie.uses[0][0]}.{tie.uses[0][1]}"
        for tie in ties
        for layer, name in tie.uses[1:]
    }


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    prefix, _, leaf = name.rpartition(".")
    return (module.get_submodule(prefix) if prefix else module), leaf


def _get(module: nn.Module, name: str) -> nn.Parameter:
    owner, leaf = _owner(module, name)
    return owner._parameters[leaf]  # type: ignore[return-value]


def _set(module: nn.Module, name: str, param: nn.Parameter) -> None:
    owner, leaf = _owner(module, name)
    setattr(owner, leaf, param)


def untie(layers: Mapping[int, LayerState], ties: Iterable[Tie]) -> None:
    """Give every use of each tie among ``layers`` its own parameter (and its own copy of the optimizer
    state), so the layers can move, be released or become a replica one by one."""
    for found in ties:
        seen: set[int] = set()
        for layer, name in found.uses:
            if layer not in layers:
                continue
            held = layers[layer]
            param = _get(held.module, name)
            if id(param) not in seen:
                seen.add(id(param))
                continue
            copy = nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)
            _set(held.module, name, copy)
            seen.add(id(copy))
            if name in held.state:
                held.state[name] = {
                    key: value.clone() if isinstance(value, Tensor) else value
                    for key, value in held.state[name].items()
                }


def tie(layers: Mapping[int, nn.Module], ties: Iterable[Tie]) -> None:
    """Make the uses of each tie among ``layers`` (one module set: a member's stages, or its replica) one
    parameter again: the first present use's (the copies are equal)."""
    for found in ties:
        present = [(layer, name) for layer, name in found.uses if layer in layers]
        if len(present) < 2:
            continue
        first = _get(layers[present[0][0]], present[0][1])
        for layer, name in present[1:]:
            _set(layers[layer], name, first)


def untie_module(body: Sequence[nn.Module], ties: Iterable[Tie]) -> None:
    """:func:`untie` for a body's layers as built (no optimizer state yet)."""
    untie({index: LayerState(layer) for index, layer in enumerate(body)}, ties)


@dataclass
class TiedGradient:
    """One tie's gradient reduction on this member: ``param`` is its copy (``None``: it holds no use),
    ``group`` the members holding a use in any pipeline (``None``: nothing to reduce), ``counted``: whether
    this copy counts in the pipeline's gradient norm (one copy per pipeline does)."""

    param: nn.Parameter | None
    group: Any
    counted: bool

    def reduce(self, num_pipelines: int) -> None:
        """Sum the copies' gradients over the group, divided by the pipelines (a pipeline's copies hold one
        sample share's parts; the pipelines' shares are averaged, as the data-parallel average does)."""
        if self.param is None or self.group is None or not self.param.requires_grad:
            return
        average_gradients([self.param], self.group, num_pipelines)


def tied_gradients(
    ties: Sequence[Tie],
    own_layers: Mapping[int, nn.Module],
    holders: Sequence[tuple[int, int, set[int]]],
    me: int,
    timeout: Any,
) -> list[TiedGradient]:
    """Each tie's reduction; creates its group (collective: every rank of the generation calls this with the
    same ``holders``).

    Args:
        ties: the body's ties.
        own_layers: this member's own layers (its stages), already tied.
        holders: ``(rank, pipeline, own layers)`` of every member of the generation.
        me: this member's rank.
        timeout: the groups' collective timeout.
    """
    out: list[TiedGradient] = []
    num_pipelines = len({pipeline for _, pipeline, _ in holders})
    for found in ties:
        ranks = sorted(rank for rank, _, layers in holders if layers & found.layers)
        group = None
        if len(ranks) > 1 or num_pipelines > 1:
            group = dist.new_group(ranks, timeout=timeout)
        present = [(layer, name) for layer, name in found.uses if layer in own_layers]
        param = _get(own_layers[present[0][0]], present[0][1]) if present else None
        my_pipeline = next(pipeline for rank, pipeline, _ in holders if rank == me)
        in_pipeline = [(min(layers & found.layers), rank) for rank, pipeline, layers in holders
                       if pipeline == my_pipeline and layers & found.layers]
        counted = bool(present) and min(in_pipeline)[1] == me
        out.append(TiedGradient(param, group if me in ranks else None, counted))
    return out


def tied_parameter_ids(gradients: Iterable[TiedGradient]) -> set[int]:
    return {id(g.param) for g in gradients if g.param is not None}


def uncounted_parameter_ids(gradients: Iterable[TiedGradient]) -> set[int]:
    """Copies another member of the pipeline counts in the gradient norm."""
    return {id(g.param) for g in gradients if g.param is not None and not g.counted}

