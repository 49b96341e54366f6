"""Tied weights across layers (:mod:`lightning_bamboo.ties`), in one process: which uses are found, how the
runtime's layers are untied and tied again per module set, and that the optimizer holds a tied parameter once.
The multi-process exactness against ``strategy="auto"`` is in ``test_elastic_user_model.py``."""

from __future__ import annotations

import torch
from torch import nn

from lightning_bamboo.elastic.reshard import LayerState, gather, install
from lightning_bamboo.ties import Tie, aliases, find_ties, tie, untie, untie_module
from tests.bamboo.pipe_variants import Tied


def test_ties_between_layers_are_found_in_layer_order() -> None:
    model = Tied()
    assert find_ties(model.pipeline) == [Tie(((0, "weight"), (4, "weight")))]
    assert aliases(find_ties(model.pipeline), "pipeline") == {"pipeline.4.weight": "pipeline.0.weight"}


def test_a_tie_inside_one_layer_is_not_a_tie_between_layers() -> None:
    inner = nn.Linear(4, 4)
    inner.extra = nn.Linear(4, 4)
    inner.extra.weight = inner.weight
    assert find_ties(nn.Sequential(inner, nn.Linear(4, 4))) == []


def test_untie_gives_each_use_its_own_equal_copy_and_state() -> None:
    model = Tied()
    ties = find_ties(model.pipeline)
    shared = model.pipeline[0].weight
    state = {"exp_avg": torch.ones(8, 8), "step": 3}
    held = {i: LayerState(model.pipeline[i], {"weight": state}) for i in (0, 4)}
    untie(held, ties)
    assert model.pipeline[0].weight is shared and model.pipeline[4].weight is not shared
    assert torch.equal(model.pipeline[4].weight, shared)
    assert held[0].state["weight"] is state and held[4].state["weight"] is not state
    held[4].state["weight"]["exp_avg"].add_(1)  # an in-place optimizer update of one copy
    assert torch.equal(state["exp_avg"], torch.ones(8, 8))


def test_tie_within_a_module_set_and_one_optimizer_entry() -> None:
    model = Tied()
    ties = find_ties(model.pipeline)
    untie_module(model.pipeline, ties)
    own = {i: model.pipeline[i] for i in range(7)}
    tie(own, ties)
    assert model.pipeline[4].weight is model.pipeline[0].weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters())) == 7
    model.pipeline(torch.ones(2, 8, dtype=torch.float64)).sum().backward()
    optimizer.step()
    layers = sorted(own.items())
    install(optimizer, [(i, held) for i, held in gather(dict(layers), optimizer).items()], optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    assert len(params) == len({id(p) for p in params}) == 7


def test_tie_leaves_a_set_with_one_use_alone() -> None:
    model = Tied()
    ties = find_ties(model.pipeline)
    untie_module(model.pipeline, ties)
    copy = model.pipeline[4].weight
    tie({4: model.pipeline[4], 5: model.pipeline[5]}, ties)
    assert model.pipeline[4].weight is copy
