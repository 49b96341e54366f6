"""The step session: the pipeline's side of a training step, as one object with its own state.

It holds the step in progress: the committed step count, the *window* (the batches since the last optimizer
step, more than one with ``accumulate_grad_batches``) and the buffers as they were when it began, the
schedule's gradients held aside for Lightning's ``backward``, and the step's clipping plan. It runs a batch
through the schedule (rank 0's batch agreed, this pipeline's share of it), exchanges replica gradients,
agrees on clipping before the commit and applies it after, and undoes or replays the window when a lost
peer cut the step (the two-phase commit itself is
:class:`~lightning_bamboo.protocol.commit.StepCommit`). Around every step it runs the one retry loop
(:meth:`StepSession.retrying`): the membership and its transitions decide what a lost peer means and return
it (roll forward, a :class:`Reform` to run, an error to raise), and the loop acts on it.

It reads the current :class:`~lightning_bamboo.runtime.generation.Generation` (the one object the membership
re-forms in place) and the :class:`~lightning_bamboo.runtime.formation.Formation` (layers, shares); of
Lightning it needs the trainer and the precision plugin, passed as callables.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from lightning_bamboo.contract import check_replayed_loss
from lightning_bamboo.pipeline.buffers import StageBuffers, stage_modules, stage_sources
from lightning_bamboo.pipeline.microbatch import batch_size_of, join_microbatches, split_microbatches
from lightning_bamboo.pipeline.ties import uncounted_parameter_ids
from lightning_bamboo.protocol.commit import COMMIT, COMMIT_JOIN
from lightning_bamboo.schedule import Action, ActionKind
from lightning_bamboo.step.broadcast import broadcast_batch
from lightning_bamboo.step.clipping import ClipPlan, apply_clipping, plan_clipping

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import Precision

    from lightning_bamboo._lightning.seam import StageBody
    from lightning_bamboo.layout.ownership import OwnershipMap
    from lightning_bamboo.runtime.events import Events
    from lightning_bamboo.runtime.formation import Formation
    from lightning_bamboo.runtime.generation import Generation

T = TypeVar("T")
_COMMITTED = (COMMIT, COMMIT_JOIN)


@dataclass(frozen=True)
class Reform:
    """A pending re-form: what the retry loop runs before its next attempt when a lost peer cut one (or at a
    step boundary, for a join or a drain). ``old`` is the generation it leaves, ``since``
    (``time.monotonic()``) when training stopped counting (the event's ``seconds_lost``); ``evaluation``:
    formed in training mode from inside validation or test; ``drain``: an announced departure's."""

    old: OwnershipMap
    since: float
    evaluation: bool = False
    drain: bool = False


class Members(Protocol):
    """What the retry loop asks of the membership
    (:class:`~lightning_bamboo.runtime.membership.Membership`): it decides and returns."""

    def attempt(self) -> AbstractContextManager[None]: ...
    def generation_ended(self, err: BaseException, step: int) -> bool: ...
    def vote(self, step: int, prepare: bool) -> str: ...


class Transitions(Protocol):
    """What the retry loop asks when a generation ends
    (:class:`~lightning_bamboo.runtime.transitions.Transitions`): the re-form to run, and running it."""

    def aborted(self, session: StepSession, since: float) -> Reform: ...
    def evaluation_cut(self, step: int, what: str, since: float) -> Reform: ...
    def form(self, session: StepSession, reform: Reform) -> None: ...
    def committed(self, outcome: str, lost_since: float | None) -> None: ...


class Retry(Exception):
    """Raised by an attempt inside :meth:`StepSession.retrying` whose step a lost peer aborted without an
    error on this member (it read ``abort`` from the commit): like a lost peer's error, but known."""


class StepSession:
    """The step in progress of one member (see the module docstring)."""

    def __init__(self, gen: Generation, formation: Formation, events: Events,
                 trainer: Callable[[], pl.Trainer], precision: Callable[[], Precision],
                 device: Callable[[], torch.device], batch_norm: str = "broadcast") -> None:
        self._gen, self._formation, self._events = gen, formation, events
        self.buffers = StageBuffers(batch_norm)  # one value of every buffer across the pipelines
        self._trainer, self._precision, self._device = trainer, precision, device
        self.step = 0  # committed steps: keys checkpoints, commits and random numbers
        self.in_step = 0  # the step Lightning's optimizer_step is in (a fallback re-runs the earlier ones)
        self.window: list[tuple[int, Any]] = []  # (batch_idx, batch) since the last step: accumulation
        self.window_done = 0  # of those, how many have their gradients accumulated
        self.window_buffers: list[tuple[Tensor, Tensor]] = []  # buffers as they were when the window began
        self.stashed_grads: list[Tensor | None] | None = None
        self.clip_plan: ClipPlan | None = None
        self.members: Members | None = None  # the membership and its transitions, once built; they are
        self.transitions: Transitions | None = None  # called and return (the session is passed, not held)

    # ------------------------------------------------------------------ the one retry loop
    def retrying(
        self,
        attempt: Callable[[], T],
        lost: Callable[[BaseException, float], T | Reform] | None = None,
        reform: Reform | None = None,
    ) -> T:
        """Run ``attempt`` until it returns: the one retry loop. When a lost peer cuts it (its error, or
        :class:`Retry`), ``lost(err, since)`` returns the :class:`Reform` to run before the attempt runs
        again (``since``: when the attempt began), or the value to return instead (a step the others
        committed is rolled forward); by default the step is undone (:meth:`Transitions.aborted`). A pending
        re-form (``reform``, or one a loss made) runs first, inside the loop: a peer lost while it forms
        ends that generation too, and the newest one is formed instead. Any other error is raised. Training,
        optimizer and evaluation steps and the re-forms at step boundaries all run here."""
        members, transitions = self.members, self.transitions
        assert members is not None and transitions is not None
        while True:
            since = time.monotonic()
            try:
                if reform is not None:
                    with members.attempt():  # the backend's deadline backstop (release.AbortBackends)
                        transitions.form(self, reform)
                    reform = None
                with members.attempt():
                    return attempt()
            except Exception as err:
                if not isinstance(err, Retry) and not members.generation_ended(err, self.step):
                    raise
                if reform is not None:
                    continue  # lost while forming: the same re-form, to the newest generation
                outcome = transitions.aborted(self, since) if lost is None else lost(err, since)
                if not isinstance(outcome, Reform):
                    return outcome
                reform = outcome

    def form(self, reform: Reform | None) -> None:
        """Run ``reform`` (a join or a drain at a step boundary) in the retry loop; ``None``: nothing."""
        if reform is not None:
            self.retrying(lambda: None, reform=reform)

    # ------------------------------------------------------------------ the steps
    def train(self, module: pl.LightningModule, args: tuple, kwargs: dict[str, Any],
              record: Callable[[int, int, Any], None]) -> Any:
        """``training_step``: rank 0's batch, this pipeline's share through the schedule, the user's
        ``training_step`` replayed with the loss; a peer lost mid-schedule: the next generation, and the batch
        again. ``record(step, batch_idx, batch)`` keeps the batch for a fallback's re-run."""
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)

        def attempt() -> Any:
            batch, call_args, call_kwargs = self.agreed_batch(args, kwargs)
            if self.window:
                self.window[-1] = (batch_idx, batch)
            record(self.step, batch_idx, batch)
            loss = self.run_schedule(self.share(batch))
            with _seam_of(self._formation).replaying(loss):
                output = module.training_step(*call_args, **call_kwargs)
            check_replayed_loss(module, output, loss)
            return output

        return self.retrying(attempt)

    def two_phase(self, optimizer: Optimizer, closure: Callable[[], Any],
                  lightning_step: Callable[[Callable[[], Any]], Any]) -> Any:
        """The two-phase step: exchange replica gradients and agree on clipping, prepare, then commit (apply
        with ``lightning_step``, Lightning's optimizer step, and the replica's) or abort. A lost peer: the
        next generation and the step again, or a roll-forward when the others committed."""
        members, transitions, result = self.members, self.transitions, []
        assert members is not None and transitions is not None

        def attempt() -> tuple[str, float | None]:
            result[:] = [closure()]
            self.phase("exchange")
            self.exchange(optimizer)
            outcome = members.vote(self.step, True)
            self.phase("prepared")
            if outcome not in _COMMITTED:
                raise Retry(outcome)  # a peer was lost while this member waited for the outcome
            return outcome, None

        def lost(err: BaseException, since: float) -> tuple[str, float | None] | Reform:
            outcome = err.args[0] if isinstance(err, Retry) else members.vote(self.step, False)
            if outcome in _COMMITTED:
                return outcome, since  # the others committed: roll forward
            # the batch in flight runs again in ``closure``; the window's earlier ones in the re-form
            self.window_done = max(self.window_done - 1, 0)
            return transitions.aborted(self, since)

        outcome, lost_since = self.retrying(attempt, lost)
        self.phase("commit")
        output = lightning_step(lambda: result[0])
        self.update_replica()
        self.phase("applied")
        self.committed()
        transitions.committed(outcome, lost_since)
        return output

    def evaluate(self, args: tuple, kwargs: dict[str, Any], context: Callable[[], Any],
                 what: str) -> tuple[Tensor, tuple, dict]:
        """A validation/test batch forward through the pipeline: the loss and the agreed hook arguments. A
        peer lost mid-batch: the next generation, and the batch again (evaluation changes no state) in a
        fresh ``context()`` (the precision's step context)."""
        transitions, agreed = self.transitions, []
        assert transitions is not None

        def attempt() -> Tensor:
            self.phase("validate")
            assert self._gen.engine is not None
            batch, *agreed[:] = self.agreed_batch(args, kwargs)
            num = math.gcd(batch_size_of(batch), self._formation.num_microbatches)
            with context():
                return self._gen.engine.run_forward(split_microbatches(batch, num))

        def lost(err: BaseException, since: float) -> Reform:
            return transitions.evaluation_cut(self.step, what, since)

        loss = self.retrying(attempt, lost)
        return loss, agreed[0], agreed[1]

    def predict(self, module: pl.LightningModule, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Forward-only pipeline over the batch; replays ``predict_step`` with the whole body's outputs."""
        batch, args, kwargs = self.agreed_batch(args, kwargs, per_pipeline=True)
        num = math.gcd(batch_size_of(batch), self._formation.num_microbatches)
        with self._precision().predict_step_context():
            outputs = self._outputs(split_microbatches(batch, num), None)
            with _seam_of(self._formation).predicting(module.pipeline_inputs(batch), outputs):  # type: ignore[operator]
                return module.predict_step(*args, **kwargs)

    def full_forward(self, inputs: Any) -> Any:
        """The whole pipeline body's output for ``inputs`` (the body's input, as ``pipeline_inputs`` returns
        it), on every rank of this rank's pipeline: a forward-only schedule through all stages, no graph.

        For callbacks that need the whole model (printing a sample, greedy generation): calling the module's
        body on one stage raises, as it holds that stage's layers only. Collective over the pipeline: every
        rank of the pipeline must call it (Lightning runs callback hooks on every rank); stage 0's
        ``inputs`` are used and sent to the others. The module's train/eval mode applies (call
        ``pl_module.eval()`` first for dropout-free outputs, as under any strategy).

        Raises:
            RuntimeError: before the strategy is set up (no stages yet).
        """
        view = self._gen.view
        if self._formation.seam is not None:
            inputs = self._formation.seam.real_inputs(inputs)  # a replayed step's pipeline_inputs(batch)
        if self._gen.engine is None or view is None:
            raise RuntimeError(
                "BambooStrategy.full_forward needs the pipeline, which exists once fit/validate/test/predict "
                "has set the strategy up; call it from a LightningModule or callback hook"
            )
        if view.num_positions > 1:
            src = view.rank_of_position(0)
            inputs = broadcast_batch(inputs, src, self._device(), group=view.pipeline_group)
        num = math.gcd(batch_size_of(inputs), self._formation.num_microbatches)
        # also inside a replayed validation/test step: the body runs for real here
        with _seam_of(self._formation).suspended(), self._precision().forward_context():
            return self._outputs(split_microbatches(inputs, num), lambda value: value)

    def _outputs(self, microbatches: list[Any], inputs_fn: Callable[[Any], Any] | None) -> Any:
        """Run the body over ``microbatches`` (forward only); the joined outputs, on every pipeline rank."""
        engine, view = self._gen.engine, self._gen.view
        assert engine is not None and view is not None
        outputs = engine.run_outputs(microbatches, inputs_fn)
        joined = join_microbatches(outputs) if outputs is not None else None
        if view.num_positions == 1:
            return joined
        return broadcast_batch(joined, view.last_rank, self._device(), group=view.pipeline_group)

    def set_forward_redundancy(self, enabled: bool) -> None:
        """Run the following steps with (``True``, the default) or without (``False``) the eager redundant
        forwards (``FR``), e.g. to measure what they cost (``AdvisorProbe``); remembered across re-forms.

        Only the engine's schedule changes: the replica is still held, stepped and exchanged with its
        successor after every step, so a failover recovers as before, and ``FR`` outputs never enter a
        gradient, so training is exactly the same. The schedule is collective: call this on every rank of
        the job at the same step boundary (e.g. in a Callback's ``on_train_batch_start`` of the same step),
        never during a step.

        Raises:
            TypeError: ``enabled`` is not a bool.
            ValueError: ``enabled=True`` on a job without redundancy (it holds no replica to run).
        """
        self._formation.set_forward_redundancy(enabled, self._gen, self._gen.member)

    # ------------------------------------------------------------------ phases
    def phase(self, phase: str, **payload: Any) -> None:
        """``on_step_phase`` at a point of the two-phase step (:class:`~.runtime.events.Events`)."""
        self._events.phase(phase, self.step, self._gen.member, **payload)

    def before_action(self, action: Action) -> None:
        """The engine's hook: the ``forward`` phase before each forward action."""
        if action.kind is ActionKind.FORWARD:
            self.phase("forward", microbatch=action.microbatch)

    # ------------------------------------------------------------------ a batch
    def begin_batch(self, batch_idx: int, batch: Any) -> None:
        """Remember a batch of the step in progress: a failover mid-step runs it again."""
        if not self.window:
            self.window_buffers = self.buffer_snapshot()
        self.window.append((batch_idx, batch))

    def agreed_batch(
        self, args: tuple, kwargs: dict[str, Any], per_pipeline: bool = False
    ) -> tuple[Any, tuple, dict[str, Any]]:
        """Every member uses rank 0's batch (``per_pipeline``: its pipeline's first stage's): random
        augmentation or masking in a dataset can draw differently on each process, and stage 0's inputs must
        meet the same labels on the last stage (sent as raw buffers,
        :func:`~lightning_bamboo.step.broadcast.broadcast_batch`)."""
        batch = args[0] if args else kwargs["batch"]
        view = self._gen.view
        if per_pipeline and view is not None and view.num_positions > 1:
            src = view.rank_of_position(0)
            batch = broadcast_batch(batch, src, self._device(), group=view.pipeline_group)
        elif not per_pipeline and dist.is_initialized() and dist.get_world_size() > 1:
            batch = broadcast_batch(batch, 0, self._device())
        if args:
            return batch, (batch, *args[1:]), kwargs
        return batch, args, {**kwargs, "batch": batch}

    def share(self, batch: Any) -> list[Any]:
        """This pipeline's micro-batches of the global ``batch``: its share of the job's fixed split into
        global micro-batches (the same micro-batches, and so the same dropout masks, however many pipelines
        share the batch)."""
        assert self._gen.owners is not None
        share = self._formation.microbatch_share(self._gen.owners, self._gen.member)
        return split_microbatches(batch, self._formation.global_microbatches)[share.start : share.stop]

    def run_schedule(self, microbatches: list[Any], position: int | None = None) -> Tensor:
        """The schedule's forwards and backwards; its gradients are held in ``stashed_grads`` (Lightning
        zeroes gradients after ``training_step`` and before ``backward``), earlier ones are left in place."""
        engine = self._gen.engine
        assert engine is not None
        params = self._gen.stage_params()
        earlier = [p.grad for p in params]  # accumulated by earlier batches (accumulate_grad_batches > 1)
        for p in params:
            p.grad = None
        gen, formation = self._gen, self._formation
        assert gen.owners is not None and gen.view is not None
        stages = stage_modules(formation.layers, formation.stage_layers, gen.view.own_stages)
        self.buffers.begin(stages, formation.global_microbatches)
        with self._precision().train_step_context():
            loss = engine.run_step(microbatches, step=self._forward_key_step(position))
        self.buffers.finish(stages, dict(gen.view.stage_groups),
                            stage_sources(gen.owners.pipelines, gen.owners.rank_of), gen.view.num_pipelines)
        self.stashed_grads = [p.grad for p in params]
        for p, grad in zip(params, earlier):
            p.grad = grad
        return loss

    def _forward_key_step(self, position: int | None = None) -> int:
        """The index keying a batch's forwards' random numbers (:mod:`.pipeline.keyed_rng`): the
        committed step count, times the batches of a step, plus the batch's ``position`` in the step (default:
        the batch in flight). A replayed or re-run batch draws the random numbers it drew first."""
        accumulate = self._trainer().accumulate_grad_batches
        position = max(len(self.window) - 1, 0) if position is None else position
        return self.step * accumulate + position

    def add_stashed_grads(self, done: bool = False) -> None:
        """Add the schedule's gradients to the stage's, divided by ``accumulate_grad_batches`` as Lightning
        divides the loss before its backward (``done``: Lightning's backward of a batch of the window)."""
        if self.stashed_grads is None:
            raise RuntimeError("BambooStrategy.backward called without a preceding pipelined training_step")
        accumulate = self._trainer().accumulate_grad_batches
        for p, grad in zip(self._gen.stage_params(), self.stashed_grads):
            if grad is None:
                continue
            if accumulate != 1:
                grad = grad / accumulate
            p.grad = grad if p.grad is None else p.grad + grad
        self.stashed_grads = None
        self.window_done += int(done)

    # ------------------------------------------------------------------ undo and replay
    def replay_window(self) -> None:
        """After a re-form inside a step of several batches: the gradients of the batches already done,
        computed again on the new layout (the step's batch in flight is run by the caller)."""
        if not self.window:
            return
        self.window_buffers = self.buffer_snapshot()
        for p in self._gen.stage_params():
            p.grad = None
        for position, (_, batch) in enumerate(self.window[: self.window_done]):
            self.run_schedule(self.share(batch), position)
            self.add_stashed_grads()

    def buffer_snapshot(self) -> list[tuple[Tensor, Tensor]]:
        """``(buffer, copy)`` of every buffer this member holds (stages and replica) at the step's start."""
        modules = [m for m in (self._gen.stage, self._gen.replica) if m is not None]
        unique = {id(b): b for m in modules for b in m.buffers()}
        return [(b, b.detach().clone()) for b in unique.values()]

    def undo(self) -> None:
        """Leave no trace of an aborted step: its forwards' buffer updates (BatchNorm statistics, on the
        stages and in the replica's FR) are undone and the successor's update received for it is dropped, so
        the re-run on the next generation starts from the state the survivors agree on."""
        with torch.no_grad():
            for buffer, saved in self.window_buffers:
                buffer.copy_(saved)
        if self._gen.replica_sync is not None:
            self._gen.replica_sync.discard()

    def restore_window_buffers(self) -> None:
        """Buffers back to the step's start before its batches run again (BatchNorm statistics once)."""
        if self.window_done:
            with torch.no_grad():
                for buffer, saved in self.window_buffers:
                    buffer.copy_(saved)

    def committed(self) -> None:
        self.step += 1
        self.window, self.window_done, self.window_buffers = [], 0, []

    # ------------------------------------------------------------------ replica and clipping
    def exchange(self, optimizer: Optimizer) -> None:
        """Send this member's stage gradients to its replica holder and receive its successor's (blocking,
        before the commit: after it, no communication may be needed to apply the step), then agree on the
        step's gradient clipping (the norm is a collective)."""
        if self._gen.replica_sync is not None:
            self._gen.replica_sync.exchange(optimizer)
        trainer = self._trainer()
        view = self._gen.view
        group = view.pipeline_group if view is not None and view.num_positions > 1 else None
        clip_val, algorithm = trainer.gradient_clip_val, trainer.gradient_clip_algorithm
        self.clip_plan = plan_clipping(self._norm_gradients(), clip_val, algorithm, group, self._device())

    def _norm_gradients(self) -> list[list[Tensor | None]]:
        """Per original stage, this member's gradients that count in its pipeline's norm (empty: a stage
        another member holds), so the norm is summed stage by stage on any layout (:func:`plan_clipping`).
        A tied copy counts once per pipeline."""
        uncounted = uncounted_parameter_ids(self._gen.tied)
        formation, owners = self._formation, self._gen.owners
        by_stage: list[list[Tensor | None]] = [[] for _ in range(formation.num_stages)]
        assert owners is not None
        for stage in owners.stages_of(self._gen.member):
            for layer in formation.stage_layers[stage]:
                params = formation.layers[layer].parameters()
                by_stage[stage].extend(p.grad for p in params if id(p) not in uncounted)
        return by_stage

    def clip(self, optimizer: Optimizer, clip_val: float) -> None:
        """Lightning's norm clipping, after the commit: the coefficient agreed before it (no collective)."""
        apply_clipping(self.clip_plan, [p.grad for g in optimizer.param_groups for p in g["params"]])

    def apply_stage_clipping(self) -> None:
        """The step's clipping on this member's stages (a fallback's re-run, outside Lightning's hooks)."""
        apply_clipping(self.clip_plan, [p.grad for p in self._gen.stage_params()])

    def update_replica(self) -> None:
        """Apply the successor's step, received before the commit, to the replica (clipped by the step's
        plan)."""
        sync = self._gen.replica_sync
        if sync is None:
            return
        sync.flush(before_step=lambda grads: apply_clipping(self.clip_plan, grads))
        sync.optimizer.zero_grad(set_to_none=True)  # its gradients are views of a receive buffer


def _seam_of(formation: Formation) -> StageBody:
    """The seam in the user's body's place (set when the body was prepared, before any step)."""
    assert formation.seam is not None
    return formation.seam
