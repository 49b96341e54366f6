"""The module contract: finding the body, checking the hooks, and replaying a step with a given loss."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn

from lightning_bamboo._lightning.seam import StageBody
from lightning_bamboo.contract import (
    check_contract,
    check_replayed_loss,
    check_stage_parameters,
    find_pipeline_body,
    sub_sequential,
)
from tests.bamboo.pipe_mlp import PipeMLP, make_data


def install_seam(model: LightningModule) -> StageBody:
    """The seam the strategy installs at setup, holding every layer (one process, one stage)."""
    body = model.pipeline
    seam = StageBody(type(model).__name__, "pipeline", dict(enumerate(body)), len(body))
    seam.attach(model)
    return seam


class NoBody(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)


class TwoBodies(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(2, 2))
        self.decoder = nn.Sequential(nn.Linear(2, 2))


class OneBodyNoHooks(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(2, 2), nn.Tanh())


class ParamOutside(PipeMLP):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))


def test_finds_pipeline_attribute() -> None:
    model = PipeMLP()
    assert find_pipeline_body(model, None) == ("pipeline", model.pipeline)


def test_finds_single_sequential_child() -> None:
    model = OneBodyNoHooks()
    assert find_pipeline_body(model, None) == ("trunk", model.trunk)


def test_no_body_error_names_the_module_and_the_fix() -> None:
    match = r"nn.Sequential pipeline body .* found none on NoBody.*pipeline_attr"
    with pytest.raises(TypeError, match=match):
        find_pipeline_body(NoBody(), None)


def test_several_bodies_error_lists_them() -> None:
    with pytest.raises(TypeError, match=r"several nn.Sequential children \(encoder, decoder\)"):
        find_pipeline_body(TwoBodies(), None)


def test_explicit_attribute_must_be_sequential() -> None:
    match = r"NoBody.layer is Linear, expected nn.Sequential \(pipeline_attr='layer'\)"
    with pytest.raises(TypeError, match=match):
        find_pipeline_body(NoBody(), "layer")
    assert find_pipeline_body(TwoBodies(), "decoder")[0] == "decoder"


def test_missing_hooks_are_named() -> None:
    model = OneBodyNoHooks()
    with pytest.raises(TypeError, match=r"OneBodyNoHooks to define pipeline_inputs and pipeline_loss"):
        check_contract(model, "trunk", model.trunk)


def test_parameters_outside_the_body_are_named() -> None:
    model = ParamOutside()
    with pytest.raises(TypeError, match=r"parameters live outside it: scale"):
        check_contract(model, "pipeline", model.pipeline)


def test_sub_sequential_keeps_original_names() -> None:
    model = PipeMLP()
    stage = sub_sequential(model.pipeline, range(2, 5))
    assert list(stage.state_dict()) == ["2.weight", "2.bias", "4.weight", "4.bias"]
    x = torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(stage(x), model.pipeline[4](model.pipeline[3](model.pipeline[2](x))))


def test_replay_returns_the_given_loss_and_writes_nothing_into_the_module() -> None:
    model = PipeMLP()
    layers = list(model.pipeline)
    x, y = make_data(4)
    expected = model.pipeline_loss(model.pipeline(model.pipeline_inputs((x, y))), (x, y))
    logged: dict[str, torch.Tensor] = {}
    model.log = lambda name, value, **kwargs: logged.__setitem__(name, value)  # type: ignore[method-assign]
    seam = install_seam(model)
    assert model.pipeline is seam and list(model.pipeline) == layers
    assert list(model.state_dict()) == [f"pipeline.{i}.{n}" for i in (0, 2, 4, 6) for n in ("weight", "bias")]
    installed = dict(model.__dict__)
    loss = torch.tensor(0.125, dtype=torch.float64)
    with seam.replaying(loss):
        assert model.__dict__ == installed and model.pipeline is seam
        returned = model.training_step((x, y), 0)
    assert returned is loss
    assert logged["train_loss"] is loss
    assert model.__dict__ == installed and model.pipeline is seam
    # outside a replay the seam and the hooks are the user's computation
    real = model.pipeline_loss(model.pipeline(model.pipeline_inputs((x, y))), (x, y))
    assert real.requires_grad and real.item() != pytest.approx(0.125)
    torch.testing.assert_close(real, expected)
    seam.detach(model)  # teardown: the user's own hooks, nothing of the seam's left in __dict__
    assert "pipeline_loss" not in model.__dict__ and "pipeline_inputs" not in model.__dict__
    assert model.pipeline_loss.__func__ is PipeMLP.pipeline_loss  # type: ignore[attr-defined]


def test_the_seam_holds_a_generations_layers_and_presents_others_temporarily() -> None:
    model = PipeMLP()  # L T L T L T L
    layers = dict(enumerate(model.pipeline))
    seam = install_seam(model)
    seam.hold({i: layers[i] for i in (3, 4, 5, 6)})
    assert model.pipeline is seam and next(iter(model.state_dict())) == "pipeline.4.weight"
    assert model.pipeline[-1] is layers[6] and list(model.pipeline[0].parameters()) == []
    with pytest.raises(RuntimeError,
                       match=r"PipeMLP.pipeline holds only this process's stage .* \(layers 3-6 of 7\)"):
        model.pipeline(torch.zeros(1, 8, dtype=torch.float64))
    replica = sub_sequential(layers, range(0, 3))
    with seam.presenting(replica):
        assert [n for n, _ in model.named_parameters()] == ["pipeline.0.weight", "pipeline.0.bias",
                                                           "pipeline.2.weight", "pipeline.2.bias"]
    assert list(seam._modules) == ["3", "4", "5", "6"]


def test_stage_indexes_layers_like_the_whole_body() -> None:
    """``self.pipeline[-1]`` in configure_optimizers must be the head on every stage, not the stage's last
    layer (which would silently get the head's param group): layers of other stages have no parameters."""
    model = PipeMLP()  # L T L T L T L
    first, last = sub_sequential(model.pipeline, range(0, 3)), sub_sequential(model.pipeline, range(3, 7))
    assert last[-1] is model.pipeline[6] and last[3] is model.pipeline[3] and first[0] is model.pipeline[0]
    assert list(first[-1].parameters()) == [] and list(last[0].parameters()) == []
    assert [list(s) for s in (first[1:], last[1:])] == [list(model.pipeline[1:3]), list(model.pipeline[3:])]
    assert len(first) == 3 and list(first) == list(model.pipeline[:3])  # iteration/forward: its own layers
    with pytest.raises(RuntimeError, match=r"layer 6 of the pipeline body lives on another stage; "
                       r"this process holds \[0, 1, 2\]"):
        first[-1](torch.zeros(1, 8))
    with pytest.raises(AttributeError, match=r"'weight': layer 0 of the pipeline body lives on another"):
        last[0].weight  # noqa: B018
    with pytest.raises(IndexError, match=r"index 7 is out of range: the body has 7 layers"):
        first[7]


def test_stage_without_trainable_parameters_is_refused() -> None:
    model = PipeMLP()  # L T L T L T L
    model.pipeline[0].requires_grad_(False)
    check_stage_parameters(model, "pipeline", model.pipeline, [range(0, 3), range(3, 7)])
    with pytest.raises(TypeError, match=r"stage 0 of PipeMLP.pipeline \(layers 0-1: Linear, Tanh\) holds no "
                       r"trainable parameter"):
        check_stage_parameters(model, "pipeline", model.pipeline, [range(0, 2), range(2, 7)])
    with pytest.raises(TypeError, match=r"stage 1 of PipeMLP.pipeline \(layers 3-3: Tanh\) holds no"):
        check_stage_parameters(model, "pipeline", model.pipeline, [range(0, 3), range(3, 4), range(4, 7)])


def test_stage_boundary_values() -> None:
    """A tensor or a tuple/list/dict of tensors crosses a stage boundary; anything else is refused by name."""
    from lightning_bamboo.pipeline.engine import _boundary_output, _model_input

    class Pair(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, str]:
            return x, "mask"

    stage = sub_sequential(nn.Sequential(nn.Linear(2, 2), Pair(), nn.Identity()), range(0, 2))
    output = torch.zeros(1)
    assert _boundary_output(output, stage, 0) is output
    pair = (output, torch.ones(1, dtype=torch.bool))
    assert _boundary_output(pair, stage, 0) is pair
    match = (r"stage 0 \(layers 0: Linear, 1: Pair\) returned a value that cannot be sent to the next stage: "
             r"got a tuple holding Tensor, str: a stage boundary carries one tensor, or a non-empty tuple, "
             r"list or dict \(str keys\) of tensors, one level deep")
    with pytest.raises(TypeError, match=match):
        _boundary_output(stage(torch.zeros(1, 2)), stage, 0)
    assert _model_input(output) is output
    inputs = {"ids": output, "mask": output}
    assert _model_input(inputs) is inputs
    with pytest.raises(TypeError, match=r"pipeline_inputs\(batch\) returned a value the body's first layer "
                       r"cannot take across stages: got a dict holding Tensor, dict"):
        _model_input({"ids": output, "more": {"mask": output}})



def test_training_step_must_return_the_pipeline_loss() -> None:
    """An extra term added in training_step is never back-propagated under bamboo: refused, not ignored."""

    class Regularized(PipeMLP):
        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            loss = self.pipeline_loss(self.pipeline(self.pipeline_inputs(batch)), batch)
            return loss + 0.5 * sum(p.square().sum() for p in self.parameters())

    model, loss = Regularized(), torch.tensor(0.125, dtype=torch.float64)
    with install_seam(model).replaying(loss):
        returned = model.training_step(make_data(4), 0)
    match = (r"Regularized.training_step returned the loss [0-9.]+, but the pipeline's loss is 0.125: under "
             r"BambooStrategy the pipeline schedule back-propagates pipeline_loss only")
    with pytest.raises(ValueError, match=match):
        check_replayed_loss(model, returned, loss)
    for same in (loss, {"loss": loss}, loss.float(), None):  # the loss itself, cast, or a skipped step
        check_replayed_loss(model, same, loss)
