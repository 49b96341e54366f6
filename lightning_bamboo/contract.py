"""What a LightningModule must provide to be pipelined, and how its own step methods run under Bamboo.

The contract (the same class also trains under ``strategy="auto"``):

* an ``nn.Sequential`` pipeline body (attribute ``pipeline`` by default, or the module's only
  ``nn.Sequential`` child) holding every trainable parameter, each element taking and returning one tensor;
* ``pipeline_inputs(batch) -> Tensor``: the input of the body's first layer;
* ``pipeline_loss(outputs, batch) -> Tensor``: the scalar loss from the body's output;
* ``training_step`` / ``validation_step`` that compute the loss as
  ``self.pipeline_loss(self.pipeline(self.pipeline_inputs(batch)), batch)`` and log it.

Under Bamboo the strategy computes the loss with the pipeline schedule and then *replays* the user's step
method with :func:`replay_step`: for the duration of that call ``pipeline_inputs`` returns the batch
unchanged, the body returns it unchanged and ``pipeline_loss`` returns the loss the schedule computed. So
``self.log(...)`` calls in the step run once per step on every rank, with the pipeline's loss, and nothing
is recomputed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch import LightningModule
from torch import Tensor, nn

REQUIRED_HOOKS = ("pipeline_inputs", "pipeline_loss")


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


def sub_sequential(body: nn.Sequential, layers: range) -> nn.Sequential:
    """``body[layers]`` as a Sequential that keeps the layers' original names (``"3"``, ``"4"``).

    So a stage's ``state_dict`` keys are the single-process ones (``pipeline.3.weight``).
    """
    return nn.Sequential(OrderedDict((str(i), body[i]) for i in layers))


class _Passthrough(nn.Module):
    """Stands in for the pipeline body during a replay: returns its input."""

    def forward(self, x: Any) -> Any:
        return x


@contextmanager
def replay_step(module: LightningModule, attr: str, loss: Tensor) -> Iterator[None]:
    """Within the block, the module's pipeline hooks return ``loss`` instead of computing anything.

    Args:
        module: the user's LightningModule.
        attr: attribute name of its pipeline body.
        loss: the loss the pipeline schedule computed for this step.
    """
    body = module._modules[attr]
    saved = {hook: module.__dict__.get(hook) for hook in REQUIRED_HOOKS}
    module._modules[attr] = _Passthrough()
    module.__dict__["pipeline_inputs"] = lambda batch: batch
    module.__dict__["pipeline_loss"] = lambda outputs, batch: loss
    try:
        yield
    finally:
        module._modules[attr] = body
        for hook, value in saved.items():
            if value is None:
                module.__dict__.pop(hook, None)
            else:
                module.__dict__[hook] = value
