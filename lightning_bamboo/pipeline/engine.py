"""Runs one rank's part of a pipeline schedule: forwards, backwards and redundant forwards of micro-batches.

Each rank runs its own program (``rank_program(schedule, stage)``: its actions in slot order, bubbles
dropped) as fast as its inputs arrive; ranks do not move in lock-step:

* ``F`` (stage s, micro-batch i): stage 0 builds its input with ``inputs_fn(micro-batch)``, any other stage
  takes the activation received from stage s-1; runs the stage; the last stage computes ``loss_fn(output,
  micro-batch) / loss_divisor`` (the micro-batch count, unless the strategy shares a fixed split of the
  global batch unequally, see ``loss_divisor``), the others hand the output to stage s+1 (a non-blocking
  send).
* ``B``: the last stage back-propagates its scaled loss, the others take the output gradient received from
  stage s+1; every stage but the first hands its input gradient to stage s-1.
* ``FR``: runs the replica of the successor stage on a copy of this rank's own output of micro-batch i (the
  last rank runs its replica of stage 0 on the micro-batch input) without building a graph, and keeps the
  result in :attr:`PipelineEngine.redundant_outputs` for a takeover (Bamboo's eager forward redundancy).
  The copy keeps an in-place first layer of the successor from writing into the activation that is being
  sent and that this rank's backward still needs.

Communication: the schedule is lowered once (:func:`lightning_bamboo.schedule.lower_schedule`) to this
rank's program of compute actions and explicit ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B`` operations,
derived from which action produces and which consumes each tensor (so ``F``, ``B`` and ``FR`` share one
transfer pass). Both ends of a link list its operations in the same canonical order (the slot order),
so gloo and NCCL match them. A receive is posted right after the rank's previous operation, long before the
action that consumes it, which waits for it as late as possible; a send is posted right after the action
that produces its tensor and waited on at the end of the step, so transfers overlap compute
(:class:`lightning_bamboo.pipeline.transfers.StepTransfers` issues them). An activation's shape header travels
only with the first micro-batch of each shape; later steps reuse the cached shape. A stage may send a
tuple/list/dict of tensors (the hidden state and a mask): it travels packed as one message
(:class:`lightning_bamboo.pipeline.transfers.BoundaryLayout`), and gradients come back for its tensors that
require
grad.
After the last action, gradients of the stage are averaged over the data-parallel stage group and the mean
loss of the step is broadcast from the last stage to every rank of the pipeline.

Random numbers (dropout): in each ``F`` and ``FR`` of a training step, every layer draws from generators
keyed by (seed, step, global micro-batch, the layer's index in the body), restored afterwards
(:mod:`lightning_bamboo.pipeline.keyed_rng`), so an ``FR`` equals its successor's ``F`` bit for bit with
dropout on, and a step re-run after a failover, on a member that now runs several original stages fused,
or on fewer or more pipelines, draws what the uninterrupted run drew. The engine's micro-batch ``i`` is global
micro-batch ``first_microbatch + i``.

The engine reads its place in the layout from a :class:`~lightning_bamboo.layout.view.PipelineView` (a
function of the ownership map); its gradients are averaged by
:class:`~lightning_bamboo.pipeline.averaging.GradientAveraging` and its tuple/dict boundary values packed by
:class:`Boundaries` (this module).

Standalone use (benchmarks), on every rank after ``init_process_group``::

    view = BambooGroups.create(layout, rank)
    engine = PipelineEngine(stage_module, view, schedule, inputs_fn=..., loss_fn=..., device=device)
    loss = engine.run_step(split_microbatches(batch, num_microbatches))
    optimizer.step(); replica.step(optimizer); optimizer.zero_grad()
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_bamboo.contract import pipeline_execution
from lightning_bamboo.layout.view import PipelineView
from lightning_bamboo.pipeline.averaging import GradientAveraging, mean_loss
from lightning_bamboo.pipeline.keyed_rng import Forward, KeyedForward, run_seed
from lightning_bamboo.pipeline.ties import TiedGradient
from lightning_bamboo.pipeline.transfers import (
    BoundaryLayout,
    Kind,
    Packed,
    ShapeCache,
    StepTransfers,
    boundary_tensors,
    microbatch_signature,
)
from lightning_bamboo.schedule import Action, ActionKind, Schedule, rank_program
from lightning_bamboo.schedule.lowering import Comm, LoweredAction, lower_schedule

CONTIGUOUS = torch.contiguous_format
InputsFn = Callable[[Any], Tensor]
LossFn = Callable[[Tensor, Any], Tensor]


class PipelineEngine:
    """Executes this rank's actions of a schedule over the micro-batches of one step.

    Args:
        stage: this rank's layers (a module taking and returning one tensor, or a tuple/list/dict of them).
        view: this rank's place in its pipeline and its process groups
            (:class:`~lightning_bamboo.layout.view.PipelineView`).
        schedule: the full schedule (``position in pipeline -> actions``); this rank runs
            ``rank_program(schedule, view.position)``.
        inputs_fn: ``micro-batch -> input tensor of stage 0`` (the LightningModule's ``pipeline_inputs``);
            called on the first stage, and on the last stage for the forward of its stage-0 replica.
        loss_fn: ``(output of the last stage, micro-batch) -> scalar loss`` (``pipeline_loss``); called on
            the last stage only.
        device: where received activations are allocated (the strategy's ``root_device``).
        replica: the replica of the successor stage, needed when the schedule contains ``FR`` actions.
        replica_device: device the replica lives on (``device`` or CPU); its inputs are moved there and its
            outputs are kept there.
        keyed_rng: ``True`` (default): in every forward of a training step each layer draws its random
            numbers from generators keyed by (seed, step, global micro-batch, its index in the body),
            restored afterwards (:mod:`lightning_bamboo.pipeline.keyed_rng`; a stage that is not a
            ``StageSequential``
            is keyed as a whole by its stage index); ``False``: from the process's global generators, as
            they stand (``FR`` then draws other dropout masks than its successor's ``F``).
        seed: the seed of the keys; ``None``: ``seed_everything``'s (``PL_GLOBAL_SEED``), else 0.
        first_microbatch: the global index (in the step's global batch) of this pipeline's first
            micro-batch, keying its random numbers; ``None``: ``view.pipeline x the schedule's
            micro-batches`` (equal consecutive shares).
        loss_divisor: each micro-batch's loss is divided by it before its backward; ``None``: the
            schedule's micro-batch count. The gradients are then averaged over the pipelines, so a job whose
            ``P`` pipelines share ``G`` global micro-batches unequally passes ``G / P``: the result is the
            mean over the global batch whatever each pipeline's share.
        stage_params: this rank's parameters by ORIGINAL stage, each averaged over that stage's group
            (:class:`~lightning_bamboo.pipeline.averaging.GradientAveraging`); ``None``: all of ``stage``'s,
            for a position that runs one stage.
        tied: the tied parameters' gradient sums (:mod:`lightning_bamboo.pipeline.ties`), after the averages.
    """

    def __init__(
        self,
        stage: nn.Module,
        view: PipelineView,
        schedule: Schedule,
        *,
        inputs_fn: InputsFn,
        loss_fn: LossFn,
        device: torch.device,
        replica: nn.Module | None = None,
        replica_device: torch.device | None = None,
        keyed_rng: bool = True,
        seed: int | None = None,
        first_microbatch: int | None = None,
        loss_divisor: float | None = None,
        stage_params: Mapping[int, Sequence[nn.Parameter]] | None = None,
        tied: Sequence[TiedGradient] = (),
    ) -> None:
        self.stage = stage
        self.view = view
        self.schedule = schedule
        self.program: list[Action] = rank_program(schedule, view.position)
        self.inputs_fn = inputs_fn
        self.loss_fn = loss_fn
        self.device = device
        self.replica = replica
        self.replica_device = replica_device or device
        self.redundant_outputs: dict[int, Any] = {}
        """Outputs of the last step's ``FR`` actions, by micro-batch (kept for a takeover)."""
        self.shapes = ShapeCache()
        """Activation shapes learned from the headers of earlier steps (sent once per micro-batch shape)."""
        self.trace: list[tuple[str, float, float]] | None = None
        """Set to a list to record ``(event, start, end)`` (times of :attr:`clock`) of every action, receive
        wait and collective of the following steps; ``None`` (the default) records nothing."""
        self.before_action: Callable[[Action], None] | None = None
        """Called with each compute action of a step before it runs (the elastic runtime reports the phase of
        its step there); ``None`` (the default): nothing."""
        self.clock: Callable[[], float] = time.perf_counter
        """The clock of :attr:`trace`: wall time by default; ``time.thread_time`` records each event's CPU
        time instead (what ``benchmarks/bamboo_overhead.py --cpu-profile`` replays; it survives load)."""
        has_fr = any(action.kind is ActionKind.FORWARD_REDUNDANT for action in self.program)
        if has_fr and replica is None:
            raise ValueError(
                f"the schedule gives position {view.position} forward-redundant (FR) actions "
                "but no replica was given"
            )
        self._lowered: dict[int, tuple[Schedule, list[LoweredAction]]] = {}
        self._forward_only: dict[int, Schedule] = {}
        num_mb = {action.microbatch for program in schedule.values() for action in program if action}
        self.num_microbatches = len(num_mb)
        if first_microbatch is None:
            first_microbatch = view.pipeline * self.num_microbatches
        self.first_microbatch = first_microbatch
        """Global index of this pipeline's micro-batch 0 (the key of its random numbers)."""
        if loss_divisor is not None and not loss_divisor > 0:
            raise ValueError(f"loss_divisor must be a number > 0, got {loss_divisor!r}")
        self.loss_divisor = loss_divisor
        """What each micro-batch's training loss is divided by (``None``: the step's micro-batch count)."""
        self.rng_step = -1
        """The step whose keys the last (or current) ``run_step`` drew from."""
        self.keyed_stage: KeyedForward | None = None
        """The stage's forward under keyed random numbers (``None``: ``keyed_rng=False``)."""
        self.keyed_replica: KeyedForward | None = None
        if keyed_rng:
            seed = run_seed() if seed is None else seed
            self.keyed_stage = KeyedForward(stage, view.position, device, seed)
            if replica is not None:
                successor = (view.position + 1) % view.num_positions
                self.keyed_replica = KeyedForward(replica, successor, self.replica_device, seed)
        if stage_params is None:
            if len(view.own_stages) != 1:
                raise ValueError(
                    f"position {view.position} runs stages {list(view.own_stages)}: pass stage_params (each "
                    "stage's parameters are averaged over that stage's group)"
                )
            stage_params = {view.own_stages[0]: list(stage.parameters())}
        self.averaging = GradientAveraging(view, stage_params, tied)
        """Averages the gradients at the end of :meth:`run_step`."""
        self.boundaries = Boundaries(view.position, device)

    def run_step(self, microbatches: Sequence[Any], step: int | None = None) -> Tensor:
        """Forward and backward of every micro-batch; leaves averaged gradients in the stage's ``.grad``.

        Args:
            microbatches: the step's micro-batches (the same on every stage of a pipeline); their count must
                match the schedule's.
            step: the training step, part of the key of the forwards' random numbers: the same on every
                rank, and the same when a step is run again (the strategy passes its step count); ``None``:
                one more than the last ``run_step``'s (0 for the first).

        Returns:
            The pipeline's mean loss over the micro-batches, as a float64 scalar on ``device``, on every rank.
        """
        self._check_count(microbatches)
        self.rng_step = self.rng_step + 1 if step is None else step
        self.redundant_outputs = {}
        divisor = len(microbatches) if self.loss_divisor is None else self.loss_divisor
        state = _StepState(count=len(microbatches), divisor=divisor)
        self._run_program(self.schedule, microbatches, state, train=True)
        start = self.clock()
        self.averaging()
        loss = mean_loss(state.losses, self.view, self.device)
        if self.trace is not None:
            self.trace.append(("allreduce+loss", start, self.clock()))
        return loss

    @torch.no_grad()
    def run_forward(self, microbatches: Sequence[Any]) -> Tensor:
        """Forward-only pass of every micro-batch (validation); the mean loss on every rank."""
        step = self._forward_pass(microbatches, _StepState(count=len(microbatches)), "run_forward")
        return mean_loss(step.losses, self.view, self.device)

    @torch.no_grad()
    def run_outputs(
        self, microbatches: Sequence[Any], inputs_fn: InputsFn | None = None
    ) -> list[Tensor] | None:
        """Forward-only pass of every micro-batch without a loss (predict, generation).

        Args:
            microbatches: the micro-batches, the same on every stage of the pipeline.
            inputs_fn: what stage 0 feeds the body with; ``None``: the engine's ``inputs_fn``
                (``pipeline_inputs``); ``full_forward`` passes the identity (its micro-batches are body
                inputs).

        Returns:
            On the last stage, the body's output of every micro-batch, in order; ``None`` on other stages.
        """
        step = _StepState(count=len(microbatches), inputs_fn=inputs_fn, collect_outputs=True)
        self._forward_pass(microbatches, step, "run_outputs")
        if not self.view.is_last:
            return None
        return [step.collected[mb] for mb in range(len(microbatches))]

    def _forward_pass(self, microbatches: Sequence[Any], step: _StepState, caller: str) -> _StepState:
        if not microbatches:
            raise ValueError(f"{caller} needs at least one micro-batch")
        count = len(microbatches)
        schedule = self._forward_only.get(count)
        if schedule is None:
            schedule = self._forward_only[count] = forward_only_schedule(self.view.num_positions, count)
        self._run_program(schedule, microbatches, step, train=False)
        return step

    def _check_count(self, microbatches: Sequence[Any]) -> None:
        if len(microbatches) != self.num_microbatches:
            raise ValueError(
                f"the schedule has {self.num_microbatches} micro-batches but run_step got {len(microbatches)}"
            )

    def lowered(self, schedule: Schedule) -> list[LoweredAction]:
        """This rank's lowered program of ``schedule`` (compute + ``SEND``/``RECV``), computed once."""
        key = id(schedule)
        cached = self._lowered.get(key)
        if cached is None or cached[0] is not schedule:
            cached = (schedule, lower_schedule(schedule)[self.view.position])
            self._lowered[key] = cached
        return cached[1]

    def _run_program(
        self, schedule: Schedule, microbatches: Sequence[Any], step: _StepState, train: bool
    ) -> None:
        """Walk this rank's lowered program: compute actions, and the sends/receives placed between them."""
        # micro-batches fed through another inputs_fn (full_forward's body inputs) get shape keys of their
        # own: the same signature may give stage 0 another input than pipeline_inputs would
        mode: Any = train if step.inputs_fn is None else "body-inputs"
        keys = [(mode, microbatch_signature(microbatch)) for microbatch in microbatches]
        transfers = step.transfers = StepTransfers(
            self.view.position,
            self.view.rank_of_position,
            self.device,
            keys,
            self.shapes,
            # dense: the output may be a strided view (x.transpose(1, 2)); gloo receives into dense ones
            gradient_buffer=lambda mb: self.boundaries.gradient_buffer(step, mb),
            trace=self.trace,
            clock=self.clock,
        )
        trace, clock = self.trace, self.clock
        with pipeline_execution(self.stage):  # the stage's own forwards are allowed here, and only here
            for entry in self.lowered(schedule):
                if isinstance(entry, Comm):
                    key = (entry.kind.is_forward, entry.microbatch)
                    transfers.post(entry, step.produced.pop(key) if entry.kind.is_send else None)
                    continue
                start = clock()
                self._execute(entry, microbatches, step, train)
                if trace is not None:
                    name = f"{entry.kind.value}{entry.stage},{entry.microbatch}"
                    trace.append((name, start, clock()))
        start = clock()
        transfers.finish()
        step.produced.clear()  # outputs no other rank needs (a stage whose consumer is on this rank)
        if trace is not None:
            trace.append(("finish", start, clock()))

    def _execute(self, action: Action, microbatches: Sequence[Any], step: _StepState, train: bool) -> None:
        if self.before_action is not None:
            self.before_action(action)
        mb = action.microbatch
        last = self.view.is_last
        transfers = step.transfers
        assert transfers is not None
        if action.kind is ActionKind.FORWARD:
            with self._random(self.stage, self.keyed_stage, mb, train) as forward:
                if self.view.is_first:
                    x = _model_input((step.inputs_fn or self.inputs_fn)(microbatches[mb]))
                else:
                    x = transfers.take(Kind.ACTIVATION, mb)
                    layout = transfers.layout_in(mb)
                    if train:  # one tensor: if floating; a tuple/dict: the tensors the sender had grads for
                        flags = layout.grads if layout is not None else (x.is_floating_point(),)
                        for tensor, flag in zip(_tensors(x), flags, strict=True):
                            tensor.requires_grad_(flag)
                        if layout is not None:
                            step.input_layouts[mb] = layout
                # the stage runs on a copy of a received leaf: an in-place first layer (ReLU(inplace=True))
                # may not write into a leaf that requires grad
                y = _boundary_output(forward(_leaf_copies(x)), self.stage, self.view.position)
                loss = None if not last or step.collect_outputs else self.loss_fn(y, microbatches[mb])
            if last and step.collect_outputs:
                step.collected[mb] = y
            elif last:
                assert loss is not None
                step.losses.append(loss.detach())
                if train:
                    step.outputs[mb] = loss / step.divisor
            else:
                if train:
                    step.outputs[mb] = y
                    if self.replica is not None:
                        step.kept_for_fr[mb] = _map(y, Tensor.detach)
                step.produced[(True, mb)] = self.boundaries.packed(y, mb, step, train)
            if train:
                step.inputs[mb] = x
        elif action.kind is ActionKind.BACKWARD:
            out = step.outputs.pop(mb)
            if last:
                out.backward()
            else:
                grad = transfers.take(Kind.GRADIENT, mb)
                sent = step.output_layouts.pop(mb, None)
                if sent is None:
                    torch.autograd.backward(out, grad)
                else:  # the gradients of the tensors that require grad, packed in order
                    with_grad = [t for t, flag in zip(_tensors(out), sent.grads, strict=True) if flag]
                    torch.autograd.backward(with_grad, sent.unpack(grad, gradients=True))
            x = step.inputs.pop(mb)
            if not self.view.is_first:
                layout = step.input_layouts.pop(mb, None)
                step.produced[(False, mb)] = self.boundaries.input_gradient(x, layout, mb)
        else:  # ActionKind.FORWARD_REDUNDANT
            self._forward_redundant(mb, microbatches[mb], step.kept_for_fr)

    @torch.inference_mode()
    def _forward_redundant(self, mb: int, microbatch: Any, kept_for_fr: dict[int, Any]) -> None:
        # inference mode, not only no_grad: no version counters or view tracking either (about 14% less CPU
        # per FR here); the outputs are kept for a takeover only, never recorded by autograd
        assert self.replica is not None
        # keyed as the successor's F: stage 0's pipeline_inputs and the layers draw what they draw there
        with self._random(self.replica, self.keyed_replica, mb, True) as forward:
            x = _model_input(self.inputs_fn(microbatch)) if self.view.is_last else kept_for_fr.pop(mb)
            # a copy: ``x`` is this rank's own output (in flight to the successor, kept for its backward) or
            # the micro-batch, and the replica's first layer may work in place (ReLU(inplace=True))
            # laid out as the successor gets it (a received activation is dense; stage 0 takes inputs_fn's as
            # is): a strided output (x.transpose) would run other kernels here and round differently
            layout = torch.preserve_format if self.view.is_last else CONTIGUOUS
            out = forward(_map(x, lambda t: t.to(self.replica_device, copy=True, memory_format=layout)))
        successor = (self.view.position + 1) % self.view.num_positions
        self.redundant_outputs[mb] = _map(_boundary_output(out, self.replica, successor), Tensor.detach)

    def _random(
        self, module: nn.Module, keyed: KeyedForward | None, mb: int, train: bool
    ) -> AbstractContextManager[Forward]:
        """The forward of ``module`` for micro-batch ``mb``: keyed in training (see ``keyed_rng``); in
        evaluation, or with ``keyed_rng=False``, the module itself on the global generators."""
        if keyed is None or not train:
            return nullcontext(module)
        return keyed.keyed(self.rng_step, self.first_microbatch + mb)


class Boundaries:
    """The values crossing this position's boundaries in training: a tuple/list/dict output packed into one
    message (its layout kept for the gradients coming back), the buffer a gradient is received into, and
    the gradient of the received input to send back."""

    def __init__(self, position: int, device: torch.device) -> None:
        self.position = position
        self.device = device

    def packed(self, y: Any, mb: int, step: _StepState, train: bool) -> Tensor | Packed:
        """What goes to the next stage: the tensor, or a tuple/list/dict packed into one byte buffer."""
        if isinstance(y, Tensor):
            return y
        layout = BoundaryLayout.of(y, grads=train)
        if train:
            if not any(layout.grads):
                raise RuntimeError(
                    f"stage {self.position}'s output for micro-batch {mb} is a {layout.kind} with no "
                    "floating tensor that requires grad, so no gradient can flow back to this stage; pass "
                    "the hidden state on"
                )
            step.output_layouts[mb] = layout
        return Packed(layout.pack(_tensors(y)), layout)

    def gradient_buffer(self, step: _StepState, mb: int) -> Tensor:
        """Where the gradient of this rank's output of ``mb`` is received (dense, as gloo needs)."""
        layout = step.output_layouts.get(mb)
        if layout is not None:
            return torch.empty(layout.nbytes(gradients=True), dtype=torch.uint8, device=self.device)
        # dense: the output may be a strided view (x.transpose(1, 2)); gloo receives into dense ones
        return torch.empty_like(step.outputs[mb], memory_format=CONTIGUOUS)

    def input_gradient(self, x: Any, layout: BoundaryLayout | None, mb: int) -> Tensor:
        """The gradient of this stage's received input, to send back (packed for a tuple/list/dict)."""
        leaves = [x] if layout is None else [t for t, f in zip(_tensors(x), layout.grads, strict=True) if f]
        if all(leaf.grad is None for leaf in leaves):
            raise RuntimeError(
                f"stage {self.position} produced no gradient for its input of "
                f"micro-batch {mb}: the stage's output does not depend on its input"
            )
        if layout is None:
            return x.grad
        # a tensor the stage did not differentiate through (e.g. a float mask) gets a zero gradient
        grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]
        return layout.pack(grads, gradients=True)


@dataclass
class _StepState:
    """Tensors alive during one step, by micro-batch."""

    count: int
    divisor: float = 1
    """What each micro-batch's training loss is divided by (see ``PipelineEngine``'s ``loss_divisor``)."""
    inputs: dict[int, Any] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)
    kept_for_fr: dict[int, Any] = field(default_factory=dict)
    produced: dict[tuple[bool, int], Tensor | Packed] = field(default_factory=dict)
    """Tensors for another rank, by ``(activation?, micro-batch)``, until the program's SEND posts them."""
    losses: list[Tensor] = field(default_factory=list)
    transfers: StepTransfers | None = None
    inputs_fn: InputsFn | None = None
    """Stage 0's input of a micro-batch for this pass; ``None``: the engine's ``inputs_fn``."""
    collect_outputs: bool = False
    """Keep the last stage's outputs in :attr:`collected` instead of computing the loss (predict)."""
    collected: dict[int, Any] = field(default_factory=dict)
    output_layouts: dict[int, BoundaryLayout] = field(default_factory=dict)
    """Layouts of this rank's tuple/dict outputs sent in training, by micro-batch (for their gradients)."""
    input_layouts: dict[int, BoundaryLayout] = field(default_factory=dict)
    """Layouts of the tuple/dict inputs received in training, by micro-batch."""


def forward_only_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """Stage ``s`` runs ``F(s, i)`` in slot ``s + i``: the forward wave of evaluation."""
    length = num_microbatches + num_stages - 1
    schedule: Schedule = {}
    for stage in range(num_stages):
        row: list[Action | None] = [None] * length
        for mb in range(num_microbatches):
            row[stage + mb] = Action(stage, ActionKind.FORWARD, mb)
        schedule[stage] = row
    return schedule


def _model_input(value: Any) -> Any:
    """``pipeline_inputs``' result if it is a tensor or a tuple/list/dict of tensors; else the contract's
    error (not an AttributeError)."""
    if isinstance(value, Tensor):
        return value
    try:
        boundary_tensors(value)
    except TypeError as error:
        raise TypeError(
            f"pipeline_inputs(batch) returned a value the body's first layer cannot take across stages: "
            f"{error}"
        ) from None
    return value


def _boundary_output(output: Any, stage: nn.Module, index: int) -> Any:
    """``output`` if it can cross a stage boundary (a tensor, or a tuple/list/dict of tensors); else the
    contract's error naming the stage's layers (a stage's output is sent to the next process, and the last
    stage's is kept by its predecessor's replica)."""
    if isinstance(output, Tensor):
        return output
    try:
        boundary_tensors(output)
    except TypeError as error:
        layers = ", ".join(f"{name}: {type(layer).__name__}" for name, layer in stage.named_children())
        raise TypeError(
            f"stage {index} (layers {layers}) returned a value that cannot be sent to the next stage: "
            f"{error}. Return one tensor, or a tuple or dict of tensors (e.g. the hidden state and a mask)"
        ) from None
    return output


def _tensors(value: Any) -> list[Tensor]:
    """The tensors of a boundary value, in order."""
    return [value] if isinstance(value, Tensor) else boundary_tensors(value)[2]


def _map(value: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``fn`` applied to every tensor of a boundary value, keeping its structure."""
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        return {key: fn(item) for key, item in value.items()}
    return type(value)(fn(item) for item in value)


def _leaf_copies(x: Any) -> Any:
    """Copies of the received leaves that require grad, so an in-place first layer cannot write into them."""
    return _map(x, lambda t: t.clone() if t.requires_grad else t)
