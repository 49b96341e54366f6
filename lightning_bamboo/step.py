"""The parts of a training step that are the pipeline's: rank 0's batch agreed, this pipeline's share run
through the schedule with its gradients held aside for Lightning's ``backward``, the step's batches replayed
after a re-form, the replica exchange, the clipping plan and the commit vote (the step's Lightning hooks are
:class:`~lightning_bamboo.strategy.BambooStrategy`'s).

A mixin of :class:`~lightning_bamboo.strategy.BambooStrategy` over its state; not used on its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_bamboo.broadcast import broadcast_batch
from lightning_bamboo.clipping import apply_clipping, plan_clipping
from lightning_bamboo.contract import check_replayed_loss
from lightning_bamboo.elastic import commit as commit_protocol
from lightning_bamboo.pipeline.microbatch import (
    split_microbatches,
)
from lightning_bamboo.ties import uncounted_parameter_ids

if TYPE_CHECKING:
    pass



class PipelinedStep:
    """The pipeline's parts of a training step (see the module docstring)."""

    def _agreed_batch(
        self, args: tuple, kwargs: dict[str, Any], per_pipeline: bool = False
    ) -> tuple[Any, tuple, dict[str, Any]]:
        """Every member uses rank 0's batch (``per_pipeline``: its pipeline's first stage's): random
        augmentation or masking in a dataset can draw differently on each process, and stage 0's inputs must
        meet the same labels on the last stage (sent as raw buffers,
        :func:`~lightning_bamboo.broadcast.broadcast_batch`)."""
        batch = args[0] if args else kwargs["batch"]
        if per_pipeline and self.view is not None and self.view.num_positions > 1:
            src = self.view.rank_of_position(0)
            batch = broadcast_batch(batch, src, self.root_device, group=self.view.pipeline_group)
        elif not per_pipeline and self._world > 1 and dist.is_initialized():
            batch = broadcast_batch(batch, 0, self.root_device)
        if args:
            return batch, (batch, *args[1:]), kwargs
        return batch, args, {**kwargs, "batch": batch}

    def _share(self, batch: Any) -> list[Any]:
        """This pipeline's micro-batches of the global ``batch``: its share of the job's fixed split into
        global micro-batches (the same micro-batches, and so the same dropout masks, however many pipelines
        share the batch)."""
        share = self._microbatch_share()
        return split_microbatches(batch, self._global_microbatches)[share.start : share.stop]

    def _run_schedule_and_replay(self, microbatches: list[Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        """Run the schedule on ``microbatches`` (gradients held aside), then replay the training_step."""
        assert self.engine is not None and self.lightning_module is not None
        loss = self._run_schedule(microbatches)
        with self._stage_module.replaying(loss):
            output = self.lightning_module.training_step(*args, **kwargs)
        check_replayed_loss(self.lightning_module, output, loss)
        return output

    def _run_schedule(self, microbatches: list[Any], position: int | None = None) -> Tensor:
        """The schedule's forwards and backwards; its gradients are held in ``_stashed_grads`` (Lightning
        zeroes gradients after ``training_step`` and before ``backward``), earlier ones are left in place."""
        assert self.engine is not None
        params = self._stage_params()
        earlier = [p.grad for p in params]  # accumulated by earlier batches (accumulate_grad_batches > 1)
        for p in params:
            p.grad = None
        with self.precision_plugin.train_step_context():
            loss = self.engine.run_step(microbatches, step=self._forward_key_step(position))
        self._stashed_grads = [p.grad for p in params]
        for p, grad in zip(params, earlier):
            p.grad = grad
        return loss

    def _forward_key_step(self, position: int | None = None) -> int:
        """The index keying a batch's forwards' random numbers (:mod:`lightning_bamboo.keyed_rng`): the
        committed step count, times the batches of a step, plus the batch's ``position`` in the step (default:
        the batch in flight). A replayed or re-run batch draws the random numbers it drew first."""
        accumulate = self.lightning_module.trainer.accumulate_grad_batches if self.lightning_module else 1
        position = max(len(self._window) - 1, 0) if position is None else position
        return self._step * accumulate + position

    def _stage_params(self) -> list[nn.Parameter]:
        assert self._stage_module is not None
        return list(self._stage_module.parameters())

    def _add_stashed_grads(self) -> None:
        """Add the schedule's gradients to the stage's, divided by ``accumulate_grad_batches`` as Lightning
        divides the loss before its backward."""
        assert self.lightning_module is not None and self._stashed_grads is not None
        accumulate = self.lightning_module.trainer.accumulate_grad_batches
        for p, grad in zip(self._stage_params(), self._stashed_grads):
            if grad is None:
                continue
            if accumulate != 1:
                grad = grad / accumulate
            p.grad = grad if p.grad is None else p.grad + grad
        self._stashed_grads = None

    def _replay_window(self) -> None:
        """After a re-form inside a step of several batches: the gradients of the batches already done,
        computed again on the new layout (the step's batch in flight is run by the caller)."""
        for p in self._stage_params():
            p.grad = None
        for position, (_, batch) in enumerate(self._window[: self._window_done]):
            self._run_schedule(self._share(batch), position)
            self._add_stashed_grads()

    def _prepare_and_wait(self) -> str:
        """The two-phase commit's vote (a job with fixed membership has no one to wait for)."""
        if not self._elastic:
            return commit_protocol.COMMIT
        assert self._store is not None and self.owners is not None
        commit = commit_protocol.StepCommit(self._store, self.owners.generation, len(self.owners.members()))
        return commit.prepare_and_wait(self._step, self._claim_join)

    def _decide_abort(self) -> str:
        assert self._store is not None and self.owners is not None
        commit = commit_protocol.StepCommit(self._store, self.owners.generation, len(self.owners.members()))
        return commit.decide(self._step, commit_protocol.ABORT)

    def _committed(self, outcome: str, lost_since: float | None) -> None:
        self._step += 1
        self._window, self._window_done, self._window_buffers = [], 0, []
        report = self.drain_timer.committed()
        if report is not None:
            rank_zero_only(print)(report, flush=True)
        if lost_since is not None:
            self._lost_since = lost_since  # seconds_lost of the failover formed at the next boundary
        # a lost peer after the commit (rolled forward) or an adopted join: the next generation is formed at
        # the next step boundary (_join_at_boundary), where a joiner can be positioned
        self._join_adopted = outcome == commit_protocol.COMMIT_JOIN

    def _exchange_replica_gradients(self) -> None:
        """Send this member's stage gradients to its replica holder and receive its successor's (blocking,
        before the commit: after it, no communication may be needed to apply the step)."""
        if self.replica_sync is not None:
            self.replica_sync.exchange(self.optimizers[0])

    def _buffer_snapshot(self) -> list[tuple[Tensor, Tensor]]:
        """``(buffer, copy)`` of every buffer this member holds (stages and replica) at the step's start."""
        modules = [m for m in (self._stage_module, self.replica) if m is not None]
        unique = {id(b): b for m in modules for b in m.buffers()}
        return [(b, b.detach().clone()) for b in unique.values()]

    def _undo_step(self) -> None:
        """Leave no trace of an aborted step: its forwards' buffer updates (BatchNorm statistics, on the
        stages and in the replica's FR) are undone and the successor's update received for it is dropped, so
        the re-run on the next generation starts from the state the survivors agree on."""
        with torch.no_grad():
            for buffer, saved in self._window_buffers:
                buffer.copy_(saved)
        if self.replica_sync is not None:
            self.replica_sync.discard()

    def _plan_clipping(self) -> None:
        """Agree on the step's gradient clipping before the commit (the norm is a collective)."""
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        view = self.view
        group = view.pipeline_group if view is not None and view.num_positions > 1 else None
        clip_val, algorithm = trainer.gradient_clip_val, trainer.gradient_clip_algorithm
        self._clip_plan = plan_clipping(self._norm_gradients(), clip_val, algorithm, group, self.root_device)

    def _norm_gradients(self) -> list[list[Tensor | None]]:
        """Per original stage, this member's gradients that count in its pipeline's norm (empty: a stage
        another member holds), so the norm is summed stage by stage on any layout (:func:`plan_clipping`).
        A tied copy counts once per pipeline."""
        uncounted = uncounted_parameter_ids(self._tied)
        by_stage: list[list[Tensor | None]] = [[] for _ in range(self._num_stages)]
        if self.owners is None:
            by_stage[self.stage_index] = [p.grad for p in self._stage_params() if id(p) not in uncounted]
            return by_stage
        for stage in self.owners.stages_of(self.member):
            for layer in self._stage_layers[stage]:
                params = self._layers[layer].parameters()
                by_stage[stage].extend(p.grad for p in params if id(p) not in uncounted)
        return by_stage

    def _clip_grad_by_global_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        """Lightning's norm clipping, after the commit: the coefficient agreed before it (no collective)."""
        apply_clipping(self._clip_plan, [p.grad for g in optimizer.param_groups for p in g["params"]])

    def _update_replica(self, optimizer: Optimizer) -> None:
        """Apply the successor's step, received before the commit, to the replica (clipped by the step's
        plan)."""
        if self.replica_sync is None:
            return
        self.replica_sync.flush(before_step=lambda grads: apply_clipping(self._clip_plan, grads))
        self.replica_sync.optimizer.zero_grad(set_to_none=True)  # its gradients are views of a receive buffer
