"""What a LightningModule must provide to be pipelined, and how its own step methods run under Bamboo.

The contract (the same class also trains under ``strategy="auto"``):

* an ``nn.Sequential`` pipeline body (attribute ``pipeline`` by default, or the module's only
  ``nn.Sequential`` child) holding every trainable parameter, each element taking and returning one tensor
  (or, where a stage boundary may fall, a tuple/list/dict of tensors: the hidden state and a mask);
* ``pipeline_inputs(batch) -> Tensor``: the input of the body's first layer (also a tuple/dict);
* ``pipeline_loss(outputs, batch) -> Tensor``: the scalar loss from the body's output;
* ``training_step`` / ``validation_step`` that compute the loss as
  ``self.pipeline_loss(self.pipeline(self.pipeline_inputs(batch)), batch)`` and log it.

Under Bamboo the strategy computes the loss with the pipeline schedule and then *replays* the user's step
method through the body it installed in the module's place
(:class:`lightning_bamboo._lightning.seam.StageBody`): for
the duration of that call ``pipeline_inputs`` returns the batch unchanged, the body returns a stand-in that
only ``pipeline_loss`` accepts, and ``pipeline_loss`` returns the loss the schedule computed. So
``self.log(...)`` calls in the step run once per step on every rank, with the pipeline's loss, and nothing is
recomputed.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn

REQUIRED_HOOKS = ("pipeline_inputs", "pipeline_loss")


_STAGE_MARK = "_bamboo_stage"
"""Attribute set on a stage's Sequential, so a second strategy does not mistake it for the whole body."""


def find_pipeline_body(module: LightningModule, attr: str | None) -> tuple[str, nn.Sequential]:
    """Locate the module's ``nn.Sequential`` pipeline body.

    Args:
        module: the user's LightningModule.
        attr: attribute name of the body; ``None`` looks for ``pipeline`` and then for the single
            ``nn.Sequential`` child.

    Returns:
        ``(attribute name, body)``.

    Raises:
        TypeError: when the attribute is missing or not an ``nn.Sequential``, or no unique body is found.
    """
    name = type(module).__name__
    hint = (
        "BambooStrategy needs the LightningModule to own an nn.Sequential pipeline body (every element "
        "takes and returns one tensor) and to define pipeline_inputs(batch) and pipeline_loss(outputs, batch)"
    )
    if attr is not None:
        body = getattr(module, attr, None)
        if not isinstance(body, nn.Sequential):
            found = "nothing" if body is None else type(body).__name__
            raise TypeError(
                f"{hint}; {name}.{attr} is {found}, expected nn.Sequential (pipeline_attr={attr!r})"
            )
        return attr, body
    default = getattr(module, "pipeline", None)
    if isinstance(default, nn.Sequential):
        return "pipeline", default
    children = [(n, m) for n, m in module.named_children() if isinstance(m, nn.Sequential)]
    if len(children) == 1:
        return children[0]
    if not children:
        raise TypeError(f"{hint}; found none on {name}. Add one, or set BambooStrategy(pipeline_attr=...)")
    names = ", ".join(n for n, _ in children)
    raise TypeError(
        f"{hint}; {name} has several nn.Sequential children ({names}) and none is called 'pipeline'. "
        "Choose one with BambooStrategy(pipeline_attr=...)"
    )


def check_contract(module: LightningModule, attr: str, body: nn.Sequential) -> None:
    """Check the hooks exist and every trainable parameter lives in the body.

    Raises:
        TypeError: naming the missing hook or the parameters outside the body.
    """
    name = type(module).__name__
    missing = [hook for hook in REQUIRED_HOOKS if not callable(getattr(module, hook, None))]
    if missing:
        raise TypeError(
            f"BambooStrategy needs {name} to define {' and '.join(missing)}: "
            "pipeline_inputs(batch) -> Tensor feeds the first stage, "
            "pipeline_loss(outputs, batch) -> Tensor computes the loss on the last stage"
        )
    inside = {id(p) for p in body.parameters()}
    outside = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in inside]
    if outside:
        raise TypeError(
            f"BambooStrategy pipelines only {name}.{attr}, but these trainable parameters live outside it: "
            f"{', '.join(outside[:5])}{' ...' if len(outside) > 5 else ''}. Move them into the pipeline body"
        )
    if len(body) == 0:
        raise TypeError(f"{name}.{attr} is an empty nn.Sequential; nothing to pipeline")


def check_stage_parameters(
    module: LightningModule, attr: str, body: nn.Sequential, stages: Sequence[range]
) -> None:
    """Refuse a stage that holds no trainable parameter (all its layers parameter-free or frozen).

    Its process (and the predecessor building the replica's optimizer) would call ``configure_optimizers``
    over no parameters, which torch refuses with "optimizer got an empty parameter list", an error that
    names neither the stage nor the fix.

    Raises:
        TypeError: naming the stage, its layers and how to move the boundary.
    """
    for stage, layers in enumerate(stages):
        if not any(p.requires_grad for index in layers for p in body[index].parameters()):
            raise TypeError(
                f"stage {stage} of {type(module).__name__}.{attr} (layers {layers.start}-{layers.stop - 1}: "
                f"{', '.join(type(body[index]).__name__ for index in layers)}) holds no trainable parameter, "
                "so its optimizer would have nothing to optimize; every stage needs one. Pass "
                "BambooStrategy(layer_costs=...) so that each stage gets a layer with trainable parameters, "
                "or use fewer stages"
            )


def check_stage_split(
    module: LightningModule, attr: str, body: nn.Sequential, stages: Sequence[range]
) -> None:
    """What a split of ``body`` into ``stages`` must satisfy, whichever strategy made it: a trainable
    parameter on every stage (:func:`check_stage_parameters`; a parameter tied across stages is one,
    :mod:`lightning_bamboo.pipeline.ties`)."""
    check_stage_parameters(module, attr, body, stages)


def sub_sequential(
    body: nn.Sequential | Mapping[int, nn.Module], layers: Iterable[int]
) -> StageSequential:
    """``body[layers]`` as a Sequential that keeps the layers' original names (``"3"``, ``"4"``) and indices.

    So a stage's ``state_dict`` keys are the single-process ones (``pipeline.3.weight``), and
    ``stage[i]`` is layer ``i`` of the whole body (see :class:`StageSequential`). ``body``: the whole body,
    or every one of its layers by index (the elastic strategy's layers, some of them loaded from peers).
    """
    return StageSequential(OrderedDict((str(i), body[i]) for i in layers), len(body))


class LayerOnAnotherStage(nn.Module):
    """What ``stage[i]`` gives for a layer of the body that another process holds: no parameters, no forward.

    So ``configure_optimizers`` code such as ``self.pipeline[-1].parameters()`` (a param group for the head)
    picks exactly the head's parameters on every stage: none on a stage that does not hold the head.
    """

    def __init__(self, index: int, held: list[int]) -> None:
        super().__init__()
        self.index = index
        self.held = held

    def _where(self) -> str:
        index, held = self.__dict__.get("index"), self.__dict__.get("held")
        return f"layer {index} of the pipeline body lives on another stage; this process holds {held}"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(self._where())

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            raise AttributeError(f"{name!r}: {self._where()}") from None


class StageSequential(nn.Sequential):
    """The layers of one stage, indexed like the whole body: ``stage[i]`` is layer ``i`` of the body.

    A plain ``nn.Sequential`` of the stage's layers would index them from 0, so user code written for the
    whole body (``self.pipeline[-1]``: the head; ``self.pipeline[0]``: the embedding) would silently pick
    another layer of the stage, e.g. give stage 0's last layer the head's learning rate. Layers held by
    another stage come back as a :class:`LayerOnAnotherStage`; a slice keeps the layers of the range this
    stage holds. ``len`` and iteration are the stage's own layers (its forward runs them in order).
    """

    def __init__(self, layers: OrderedDict[str, nn.Module], body_length: int) -> None:
        super().__init__(layers)
        self.body_length = body_length
        self.outside_call_error: str | None = None
        """Set by a strategy that installs this stage into the user's module: a forward outside the
        engine's own execution (:func:`pipeline_execution`) raises ``RuntimeError`` with this text, since
        it would run one stage of the model, never the whole. ``None`` (standalone use): no check."""
        self._engine_depth = 0
        self.before_layer: Callable[[int], None] | None = None
        """Set by the engine for the length of one training forward
        (:mod:`lightning_bamboo.pipeline.keyed_rng`):
        called with each layer's index in the body just before that layer runs. ``None``: nothing."""

    def forward(self, input: Any) -> Any:
        if self.outside_call_error is not None and self._engine_depth == 0:
            raise RuntimeError(self.outside_call_error)
        before = self.before_layer
        if before is None:
            return super().forward(input)
        for name, layer in self._modules.items():
            before(int(name))
            input = layer(input)
        return input

    def __getitem__(self, idx: int | slice) -> nn.Module:  # type: ignore[override]
        if isinstance(idx, slice):
            held = [i for i in range(self.body_length)[idx] if str(i) in self._modules]
            layers = OrderedDict((str(i), self._modules[str(i)]) for i in held)
            part = StageSequential(layers, self.body_length)  # type: ignore[arg-type]
            part.outside_call_error = self.outside_call_error  # a slice is never run by the engine
            return part
        index = operator.index(idx)
        if not -self.body_length <= index < self.body_length:
            raise IndexError(f"index {index} is out of range: the body has {self.body_length} layers")
        index %= self.body_length
        layer = self._modules.get(str(index))
        if layer is None:
            return LayerOnAnotherStage(index, [int(name) for name in self._modules])
        return layer


@contextmanager
def pipeline_execution(stage: nn.Module) -> Iterator[None]:
    """Within the block, ``stage``'s forward runs even if it is guarded (``outside_call_error``).

    The engine enters it around its program, so the user's module is never patched per step, and a call
    of the stage from a callback (outside the block) is told what to call instead.
    """
    if not isinstance(stage, StageSequential):
        yield
        return
    stage._engine_depth += 1
    try:
        yield
    finally:
        stage._engine_depth -= 1


def outside_call_message(owner: str, attr: str, layers: range, body_length: int) -> str:
    """The error for a call of a stage's body outside the pipeline, naming what to call instead (``owner``:
    the LightningModule's class name)."""
    return (
        f"{owner}.{attr} holds only this process's stage of the pipeline body under "
        f"BambooStrategy (layers {layers.start}-{layers.stop - 1} of {body_length}); calling it outside the "
        "pipeline schedule (directly or through the module's forward) would run part of the model. To run "
        "the whole body from a callback call trainer.strategy.full_forward(inputs) on every rank of the "
        "pipeline (lightning_bamboo.strategy.full_forward(pl_module, inputs) works under any strategy), or "
        "use trainer.predict"
    )


def check_replayed_loss(module: LightningModule, returned: Any, loss: Tensor) -> None:
    """Refuse a replayed ``training_step`` that returned another loss than the pipeline's.

    Under Bamboo the gradients come from the schedule, which back-propagates ``pipeline_loss`` only: a
    ``training_step`` that adds a term (a regularizer), scales the loss, or calls the body on something
    other than ``pipeline_inputs(batch)`` would train differently from a single process, silently.

    Args:
        module: the user's LightningModule.
        returned: what its ``training_step`` returned during the replay (a tensor, a mapping with
            ``"loss"``, or ``None``: Lightning skips the step).
        loss: the loss the pipeline schedule computed.

    Raises:
        ValueError: with both values and what the contract expects.
    """
    value = returned.get("loss") if isinstance(returned, Mapping) else returned
    if value is None or value is loss:
        return
    shown = type(value).__name__
    if isinstance(value, Tensor) and value.numel() == 1:
        number = float(value.detach())
        tolerance = 4 * torch.finfo(value.dtype).eps if value.is_floating_point() else 0.0
        if abs(number - float(loss)) <= tolerance * max(abs(float(loss)), 1.0):
            return  # the pipeline's loss, cast or copied
        shown = f"{number:.6g}"
    raise ValueError(
        f"{type(module).__name__}.training_step returned the loss {shown}, but the pipeline's loss is "
        f"{float(loss):.6g}: under BambooStrategy the pipeline schedule back-propagates pipeline_loss only, "
        "so training_step must return self.pipeline_loss(self.pipeline(self.pipeline_inputs(batch)), batch) "
        "unchanged. Move any extra term (a regularizer, a scale) into pipeline_loss"
    )
