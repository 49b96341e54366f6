"""The one seam between the strategy and the user's LightningModule: :class:`StageBody`.

Under Bamboo the user's pipeline body (an ``nn.Sequential``) is replaced once, at setup, by a
:class:`StageBody` the strategy owns, in the spirit of Lightning's ``configure_model``: the strategy owns
what replaces the body. Everything that differs between a pipelined process and a single one is then a
state of that object, never a write into the module:

* which layers this process holds (its stage; a generation changes the seam's children, not the module);
* whether the user's step methods are being *replayed* with the loss the schedule computed
  (:meth:`StageBody.replaying`): the body returns a stand-in only ``pipeline_loss`` accepts
  (:class:`ReplayedOutputs`), ``pipeline_inputs`` returns the batch and ``pipeline_loss`` returns that
  loss, so ``self.log(...)`` in ``training_step`` runs once with the pipeline's loss and nothing is
  recomputed;
* whether ``predict_step`` is being replayed with the pipeline's outputs (:meth:`StageBody.predicting`).

The module's two pipeline hooks are wrapped in the same place and at the same time (:meth:`StageBody.attach`,
once per ``setup``; :meth:`StageBody.detach` at ``teardown`` removes the wrappers). The body itself stays the
seam after ``fit`` (holding this process's stage, as before: a later ``trainer.test`` or
``trainer.save_checkpoint`` with the same Trainer uses the layers where they are).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from lightning_bamboo.contract import REQUIRED_HOOKS, StageSequential, outside_call_message


class _Hook:
    """The user's ``pipeline_inputs`` or ``pipeline_loss`` as the seam presents it: the user's own method,
    except while the seam replays a step (then ``replayed`` answers)."""

    def __init__(self, seam: StageBody, user: Callable[..., Any], replayed: Callable[..., Any]) -> None:
        self.seam = seam
        self.user = user
        self.replayed = replayed

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.seam.replayed_loss is not None:
            return self.replayed(*args, **kwargs)
        return self.user(*args, **kwargs)


class StageBody(StageSequential):
    """What the strategy installs in place of the user's pipeline body (see the module docstring).

    Its children are the layers this process holds, named by their index in the whole body (so the
    module's ``state_dict`` keys are the single-process ones, ``pipeline.3.weight``), indexed like the whole
    body (:class:`~lightning_bamboo.contract.StageSequential`).
    """

    _bamboo_stage = True
    """A second strategy given this module refuses it: the body is one stage, not the whole."""

    def __init__(self, owner: str, attr: str, layers: Mapping[int, nn.Module], body_length: int) -> None:
        super().__init__(OrderedDict(), body_length)
        self.owner = owner
        self.attr = attr
        self.replayed_loss: Tensor | None = None
        self._predicted: tuple[Any, Any] | None = None
        self._saved_hooks: dict[str, Any] = {}
        self._user_inputs: Callable[[Any], Any] | None = None  # the module's own pipeline_inputs
        self._replayed_batch: Any = None  # what the replayed pipeline_inputs last returned (the batch)
        self.hold(layers, guarded=False)

    # ------------------------------------------------------------------ the layers it holds
    def hold(self, layers: Mapping[int, nn.Module], guarded: bool = True) -> StageBody:
        """Hold ``layers`` (index in the body -> layer) from now on; returns the seam.

        ``guarded``: a forward outside the engine's own execution raises, naming what to call instead
        (:func:`~lightning_bamboo.contract.outside_call_message`): it would run one stage, never the whole.
        """
        self._modules.clear()
        for index in sorted(layers):
            self._modules[str(index)] = layers[index]
        held = sorted(layers)
        self.outside_call_error = (
            outside_call_message(self.owner, self.attr, range(held[0], held[-1] + 1), self.body_length)
            if guarded and held
            else None
        )
        return self

    @contextmanager
    def presenting(self, body: nn.Module) -> Iterator[None]:
        """Within the block the seam's children are ``body``'s (a replica's layers, or every layer), so the
        user's ``configure_optimizers`` builds its optimizer over them; the stage's afterwards."""
        if body is self:
            yield
            return
        saved: dict[str, Any] = dict(self._modules)
        self._modules.clear()
        self._modules.update({name: layer for name, layer in body._modules.items() if layer is not None})
        try:
            yield
        finally:
            self._modules.clear()
            self._modules.update(saved)

    # ------------------------------------------------------------------ installed once per setup
    def attach(self, module: LightningModule) -> None:
        """Install the seam as ``module``'s body and wrap its two pipeline hooks (idempotent)."""
        if module._modules.get(self.attr) is not self:
            setattr(module, self.attr, self)
        if self._saved_hooks:
            return
        replayed: dict[str, Callable[..., Any]] = {
            "pipeline_inputs": self._replayed_inputs,
            "pipeline_loss": self._replayed_loss,
        }
        self._user_inputs = module.pipeline_inputs  # type: ignore[assignment]
        for hook in REQUIRED_HOOKS:
            self._saved_hooks[hook] = module.__dict__.get(hook)
            module.__dict__[hook] = _Hook(self, getattr(module, hook), replayed[hook])

    def detach(self, module: LightningModule) -> None:
        """Give ``module`` its own hooks back (the body stays the seam, holding this process's stage)."""
        for hook, saved in self._saved_hooks.items():
            if saved is None:
                module.__dict__.pop(hook, None)
            else:
                module.__dict__[hook] = saved
        self._saved_hooks = {}

    # ------------------------------------------------------------------ replays
    @contextmanager
    def replaying(self, loss: Tensor) -> Iterator[None]:
        """Within the block the body returns a :class:`ReplayedOutputs`, ``pipeline_inputs`` the batch and
        ``pipeline_loss`` ``loss`` (the schedule's), so the user's step method logs the pipeline's loss and
        computes nothing. The body still holds the stage's layers: ``self.parameters()`` in the step sees
        them (and :func:`~lightning_bamboo.contract.check_replayed_loss` a term added from them)."""
        self.replayed_loss = loss
        try:
            yield
        finally:
            self.replayed_loss, self._replayed_batch = None, None

    @contextmanager
    def predicting(self, inputs: Any, outputs: Any) -> Iterator[None]:
        """Within the block the body returns ``outputs`` (the whole body's, on every rank of the pipeline)
        for ``inputs`` (the batch's ``pipeline_inputs``) and refuses any other input, so the user's
        ``predict_step`` (or its forward) gets the pipeline's outputs."""
        self._predicted = (inputs, outputs)
        try:
            yield
        finally:
            self._predicted = None

    def _replayed_inputs(self, batch: Any) -> Any:
        self._replayed_batch = batch
        return batch

    def real_inputs(self, inputs: Any) -> Any:
        """``inputs`` as the body takes them: in a replayed step ``self.pipeline_inputs(batch)`` returned the
        batch itself (nothing is recomputed there), so ``full_forward`` called with it gets the module's own
        ``pipeline_inputs(batch)``."""
        replayed = self.replayed_loss is not None and inputs is self._replayed_batch
        if replayed and self._user_inputs is not None:
            return self._user_inputs(inputs)
        return inputs

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """Within the block no replay is in force (the body and the hooks are the real ones): ``full_forward``
        called from a replayed ``validation_step`` runs the whole body."""
        saved = self.replayed_loss, self._predicted
        self.replayed_loss, self._predicted = None, None
        try:
            yield
        finally:
            self.replayed_loss, self._predicted = saved

    def _replayed_loss(self, outputs: Any, batch: Any) -> Tensor:
        assert self.replayed_loss is not None
        return self.replayed_loss

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """A replay answers without ``nn.Module``'s call machinery, so hooks the user registered on the body
        (forward hooks on the stage) see the engine's forwards only, as they would see the body's own."""
        if self.replayed_loss is None and self._predicted is None:
            return super().__call__(*args, **kwargs)
        return self._replayed_forward(*args, **kwargs)

    def _replayed_forward(self, input: Any) -> Any:
        if self.replayed_loss is not None:
            return ReplayedOutputs(self.owner, self.attr)
        assert self._predicted is not None
        inputs, outputs = self._predicted
        if _same(input, inputs):
            return outputs
        raise ValueError(
            f"{self.owner}.predict_step called the pipeline body on something other than "
            "pipeline_inputs(batch); under BambooStrategy predict runs the whole body once over the "
            "batch's pipeline_inputs(batch) and predict_step gets those outputs. Call the body on "
            "pipeline_inputs(batch) only, or run another input through trainer.strategy.full_forward(inputs)"
        )


class ReplayedOutputs:
    """What the body returns while a training/validation/test step is replayed: a stand-in that
    ``pipeline_loss`` accepts (it answers the pipeline's loss) and that refuses every other use, naming what
    to write instead. The outputs live on the pipeline's last stage, micro-batch by micro-batch; returning
    the input (or anything tensor-like) would let ``accuracy(self.pipeline(x), y)`` compute garbage."""

    def __init__(self, owner: str, attr: str) -> None:
        object.__setattr__(self, "_message", (
            f"{owner}.{attr}(...) was used for something other than {owner}.pipeline_loss(...) in a "
            "training/validation/test step under BambooStrategy: the step method is replayed with the loss "
            "the pipeline schedule computed, and the body's outputs exist only on the last stage, so here "
            f"{attr}(...) stands for its outputs only as pipeline_loss's argument. For the outputs "
            "themselves (accuracy, metrics) call lightning_bamboo.strategy.full_forward(self, "
            "self.pipeline_inputs(batch)): the whole body's outputs on every rank of the pipeline, without "
            "a graph, under any strategy (in validation_step/test_step; every rank runs them)"
        ))

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(object.__getattribute__(self, "_message"))

    def __getattr__(self, name: str) -> Any:
        raise TypeError(object.__getattribute__(self, "_message"))

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        outputs = next(a for a in [*args, *(kwargs or {}).values()] if isinstance(a, ReplayedOutputs))
        outputs._refuse()

    __getitem__ = __iter__ = __len__ = __bool__ = __float__ = __array__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _refuse
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __matmul__ = __rmatmul__ = __neg__ = _refuse  # type: ignore[assignment]
    __hash__ = object.__hash__


def _same(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are the same body input (tensors equal in dtype, shape and values; same structure)."""
    if a is b:
        return True
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b.to(a.device)))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return list(a) == list(b) and all(_same(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return False
