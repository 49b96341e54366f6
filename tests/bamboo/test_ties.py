"""Tied weights across layers (:mod:`lightning_bamboo.pipeline.ties`), in one process: which uses are found,
the body untied into one copy per use, and a member's sum over the uses it holds. The multi-process exactness
against ``strategy="auto"`` is in ``test_elastic_user_model.py`` (and rejoin, fallback, checkpoints)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_bamboo.pipeline.ties import (
    Tie,
    TiedGradient,
    aliases,
    find_ties,
    first_use_groups,
    regroup_tied_copies,
    tied_gradients,
    uncounted_parameter_ids,
    untie,
)
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


def test_untie_gives_each_later_use_an_equal_copy() -> None:
    model = Tied()
    shared = model.pipeline[0].weight
    untie(model.pipeline, find_ties(model.pipeline))
    assert model.pipeline[0].weight is shared and model.pipeline[4].weight is not shared
    assert torch.equal(model.pipeline[4].weight, shared) and model.pipeline[4].weight.requires_grad
    assert find_ties(model.pipeline) == []


def test_a_member_holding_every_use_sums_them_in_use_order_into_each_copy() -> None:
    """One member, both uses (a single stage, or stages fused after a failover): each copy's gradient is
    use 0's + use 1's, the auto model's gradient of the one tied parameter; the norm counts use 0's copy."""
    torch.manual_seed(0)
    model = Tied()
    reference = Tied()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 8, dtype=torch.float64)
    reference.pipeline(x).sum().backward()
    ties = find_ties(model.pipeline)
    untie(model.pipeline, ties)
    model.pipeline(x).sum().backward()
    layers = dict(enumerate(model.pipeline))
    (gradient,) = tied_gradients(ties, layers, [(0, 0, set(layers))], me=0, timeout=None)
    assert gradient.group is None and gradient.sources == [0, 0]
    gradient.reduce()
    first, second = model.pipeline[0].weight, model.pipeline[4].weight
    assert torch.equal(first.grad, reference.pipeline[0].weight.grad)
    assert torch.equal(second.grad, first.grad) and second.grad is not first.grad  # clipped in place each
    assert uncounted_parameter_ids([gradient]) == {id(second)}


def test_uses_without_gradients_leave_none() -> None:
    copies = [nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))]
    gradient = TiedGradient(copies, sources=[0, 0], group=None)
    gradient.reduce()
    assert all(copy.grad is None for copy in copies)
    copies[1].grad = torch.full((2,), 3.0)
    gradient.reduce()
    assert all(torch.equal(copy.grad, torch.full((2,), 3.0)) for copy in copies)


def test_a_member_holding_no_use_counts_none_and_one_holding_a_later_use_counts_none() -> None:
    later = nn.Parameter(torch.ones(2))
    assert uncounted_parameter_ids([TiedGradient([None, later], sources=[0, 1], group=None)]) == {id(later)}
    assert uncounted_parameter_ids([TiedGradient([None, None], sources=[0, 1], group=None)]) == set()


def test_a_later_copy_joins_the_group_auto_gives_its_first_use() -> None:
    """Name-based groups over the whole tied model list the weight once, as ``pipeline.0.weight`` (group 1
    here); a stage's copy ``pipeline.4.weight``, put in group 0 by its name or left out, is moved to group 1;
    a tie whose first use is in no group leaves its copies out too."""
    ties = [Tie(((0, "weight"), (4, "weight")))]
    whole = [["pipeline.4.bias"], ["pipeline.0.weight", "pipeline.0.bias"]]
    placement = first_use_groups(ties, "pipeline", whole)
    assert placement == {"pipeline.4.weight": 1}
    copy, bias = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    named = [("pipeline.4.weight", copy), ("pipeline.4.bias", bias)]
    for groups in ([{"params": [copy, bias]}, {"params": []}], [{"params": [bias]}, {"params": []}]):
        optimizer = torch.optim.SGD(groups, lr=0.1)
        regroup_tied_copies(optimizer, named, placement)
        assert [g["params"] for g in optimizer.param_groups] == [[bias], [copy]]
    optimizer = torch.optim.SGD([{"params": [copy, bias]}], lr=0.1)
    regroup_tied_copies(optimizer, named, first_use_groups(ties, "pipeline", [["pipeline.4.bias"]]))
    assert optimizer.param_groups[0]["params"] == [bias]


def test_a_moved_copy_keeps_its_new_group_in_module_order() -> None:
    """The copy goes before the first parameter of its new group that follows it in the module (a failover's
    refill orders groups that way, and the gradient norm sums in group order); a copy already in its group
    is not touched."""
    first, copy, last = (nn.Parameter(torch.ones(1)) for _ in range(3))
    named = [("pipeline.0.bias", first), ("pipeline.4.weight", copy), ("pipeline.4.bias", last)]
    optimizer = torch.optim.SGD([{"params": [copy]}, {"params": [first, last]}], lr=0.1)
    regroup_tied_copies(optimizer, named, {"pipeline.4.weight": 1})
    assert [g["params"] for g in optimizer.param_groups] == [[], [first, copy, last]]
    optimizer = torch.optim.SGD([{"params": [last, copy]}], lr=0.1)
    regroup_tied_copies(optimizer, named, {"pipeline.4.weight": 0})
    assert optimizer.param_groups[0]["params"] == [last, copy]
