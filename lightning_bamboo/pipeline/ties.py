"""Tied weights across layers of the pipeline body (a GPT's LM head sharing the token embedding's weight).

In one process a tied parameter is one tensor: every use adds its gradient into it and the optimizer steps it
once. A pipeline puts the uses on different processes, so, as DeepSpeed's ``TiedLayerSpec`` and Megatron's
embedding group do, every use keeps its own copy, and before the optimizer step each copy's gradient becomes
the sum over the uses. Every copy then takes the same step from the same state, so the copies stay equal bit
for bit and the run equals the single-process one.

At setup the body is *untied*: every use but the first gets its own copy, and copies are never merged again,
not even where several uses meet on one member (its stages after a failover, a single stage): the sum is
then formed the same way on any layout, so a run with failovers equals the uninterrupted one bit for bit (as
``python -m lightning_bamboo.verify`` checks). Per tie and step:

1. each use's copy is averaged over the pipelines with its stage's other parameters (the data-parallel
   average, the same groups and order on every layout);
2. within each pipeline, the member holding use ``u`` broadcasts that average to the other members holding
   a use, in use order, and every member adds them up in use order into each of its copies' gradient.

The cost: one broadcast of the tied tensor per use and step inside a pipeline, and a member holding two uses
holds two copies (and two optimizer states) of the tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer


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


def first_use_groups(
    ties: Iterable[Tie], attr: str, whole_groups: Sequence[Sequence[str]]
) -> dict[str, int | None]:
    """``later use's name -> the param group of its tie`` (``None``: in no group).

    ``whole_groups`` are the names in each param group of the user's ``configure_optimizers`` over the whole,
    still tied, model: the tied parameter is listed there once, under its first use's name, as under
    ``strategy="auto"``. A stage holding a later use sees its copy under the later name
    (``pipeline.5.lm_head.weight``), which a name-based grouping (``"embed" in name`` -> no weight decay) may
    put elsewhere; every copy must take the step the one parameter takes, so it goes where the first use is.
    """
    group_of = {name: index for index, names in enumerate(whole_groups) for name in names}
    return {later: group_of.get(first) for later, first in aliases(ties, attr).items()}


def regroup_tied_copies(
    optimizer: Optimizer, named: Iterable[tuple[str, nn.Parameter]], placement: Mapping[str, int | None]
) -> None:
    """Put each later use's copy into the group of ``optimizer`` (just built, no state yet) that ``placement``
    gives it (:func:`first_use_groups`), whatever group, or none, the user's code chose by its name.

    ``named``: ``(name, parameter)`` of the module the optimizer was built for (names as in the whole model).
    A copy already in its group stays where it is; a moved one goes before the first parameter of its new
    group that comes after it in the module, so a group in module order stays so (the order a failover's
    refill gives).
    """
    named = list(named)
    order = {id(param): index for index, (_, param) in enumerate(named)}
    where = {id(p): index for index, group in enumerate(optimizer.param_groups) for p in group["params"]}
    moved = {
        id(param): (param, placement[name])
        for name, param in named
        if name in placement and where.get(id(param)) != placement[name]
    }
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) not in moved]
    for param, target in moved.values():
        if target is not None:
            params = optimizer.param_groups[target]["params"]
            after = (k for k, p in enumerate(params) if order.get(id(p), -1) > order[id(param)])
            params.insert(next(after, len(params)), param)


def _parameter(module: nn.Module, name: str) -> nn.Parameter:
    prefix, _, leaf = name.rpartition(".")
    owner = module.get_submodule(prefix) if prefix else module
    return owner._parameters[leaf]  # type: ignore[return-value]


def untie(body: Sequence[nn.Module], ties: Iterable[Tie]) -> None:
    """Give every use of each tie its own parameter (an equal copy), so the layers can move, be loaded,
    become a replica and be stepped one by one."""
    for found in ties:
        for layer, name in found.uses[1:]:
            prefix, _, leaf = name.rpartition(".")
            owner = body[layer].get_submodule(prefix) if prefix else body[layer]
            param = owner._parameters[leaf]
            assert param is not None
            setattr(owner, leaf, nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad))


@dataclass
class TiedGradient:
    """One tie on this member: ``copies[u]`` its copy of use ``u`` (``None``: another member of its pipeline
    holds it), ``sources[u]`` the rank holding use ``u`` in this member's pipeline, ``group`` the members of
    the pipeline holding a use (``None``: this member holds them all, or none)."""

    copies: list[nn.Parameter | None]
    sources: list[int]
    group: Any

    @property
    def held(self) -> list[nn.Parameter]:
        return [copy for copy in self.copies if copy is not None]

    @property
    def uncounted(self) -> list[nn.Parameter]:
        """The copies the pipeline's gradient norm must skip: all but use 0's (the parameter counts once)."""
        return self.held[1:] if self.copies[0] is not None else self.held

    def reduce(self) -> None:
        """Each copy's gradient becomes the sum, in use order, of every use's (data-parallel averaged)
        gradient; a use without a gradient adds nothing, and with none at all the copies keep ``None``."""
        held = self.held
        if not held or not any(copy.requires_grad for copy in held):
            return
        total: Tensor | None = None
        for copy, source in zip(self.copies, self.sources):
            grad = copy.grad if copy is not None else None
            if self.group is not None:
                grad = self._broadcast(grad, source, template=held[0])
            if grad is not None:
                total = grad.clone() if total is None else total + grad
        for copy in held:
            copy.grad = None if total is None else total.clone()  # clipping scales each in place

    def _broadcast(self, grad: Tensor | None, source: int, template: nn.Parameter) -> Tensor | None:
        """``source``'s gradient of one use (with a has-gradient flag behind it) to the group."""
        flat = torch.zeros(template.numel() + 1, dtype=template.dtype, device=template.device)
        if grad is not None:
            flat[:-1] = grad.reshape(-1)
            flat[-1] = 1
        dist.broadcast(flat, source, group=self.group)
        return flat[:-1].view_as(template) if flat[-1].item() else None


def tied_gradients(
    ties: Sequence[Tie],
    own_layers: Mapping[int, nn.Module],
    holders: Sequence[tuple[int, int, set[int]]],
    me: int,
    timeout: Any,
) -> list[TiedGradient]:
    """This member's part of each tie, creating the pipelines' groups (collective: every rank of the
    generation calls it with the same ``holders``).

    Args:
        ties: the body's ties.
        own_layers: this member's own layers (its stages).
        holders: ``(rank, pipeline, own layers)`` of every member of the generation.
        me: this member's rank.
        timeout: the groups' collective timeout.
    """
    pipeline_of = {rank: pipeline for rank, pipeline, _ in holders}
    out: list[TiedGradient] = []
    for found in ties:
        mine = None
        for pipeline in sorted(set(pipeline_of.values())):
            members = [(rank, layers) for rank, p, layers in holders if p == pipeline]
            sources = [next(rank for rank, layers in members if layer in layers) for layer, _ in found.uses]
            ranks = sorted(set(sources))
            group = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
            if pipeline == pipeline_of[me]:
                copies = [
                    _parameter(own_layers[layer], name) if layer in own_layers else None
                    for layer, name in found.uses
                ]
                mine = TiedGradient(copies, sources, group if me in ranks else None)
        assert mine is not None
        out.append(mine)
    return out


def uncounted_parameter_ids(gradients: Iterable[TiedGradient]) -> set[int]:
    """Copies another copy of the same tie already counts in the pipeline's gradient norm."""
    return {id(copy) for gradient in gradients for copy in gradient.uncounted}
