"""Runs one rank's part of a pipeline schedule: forwards, backwards and redundant forwards of micro-batches.

The engine walks the schedule slot by slot (``schedule[stage][t]``, ``None`` = bubble):

* ``F`` (stage s, micro-batch i): stage 0 builds its input with ``inputs_fn(micro-batch)``, any other stage
  uses the activation received from stage s-1; runs the stage; the last stage computes ``loss_fn(output,
  micro-batch) / num_microbatches``, the others send the output to stage s+1.
* ``B``: the last stage back-propagates its scaled loss, the others back-propagate the output gradient
  received from stage s+1; every stage but the first sends its input gradient to stage s-1.
* ``FR``: runs the replica of the successor stage on this rank's own output of micro-batch i (the last rank
  runs its replica of stage 0 on the micro-batch input) without building a graph, and keeps the result in
  :attr:`PipelineEngine.redundant_outputs` for a takeover (Bamboo's eager forward redundancy).
* ``BR`` only appears in schedules rewritten after a failure; this engine refuses it with a clear error.

After each slot, the tensors that cross to the neighbours are exchanged: both ends know from the schedule
which messages cross that boundary, so all of them are posted at once (``batch_isend_irecv``) — first the
activation headers (dtype and shape, so the receiver can allocate), then activations and gradients.
After the last slot, gradients of the stage are averaged over the data-parallel stage group and the mean
loss of the step is broadcast from the last stage to every rank of the pipeline.

Standalone use (benchmarks), on every rank after ``init_process_group``::

    groups = BambooGroups.create(layout, rank)
    engine = PipelineEngine(stage_module, groups, schedule, inputs_fn=..., loss_fn=..., device=device)
    loss = engine.run_step(split_microbatches(batch, num_microbatches))
    optimizer.step(); replica.step(optimizer); optimizer.zero_grad()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_bamboo import p2p
from lightning_bamboo.groups import BambooGroups
from lightning_bamboo.schedule import Action, ActionKind, Schedule, rank_program

InputsFn = Callable[[Any], Tensor]
LossFn = Callable[[Tensor, Any], Tensor]


class PipelineEngine:
    """Executes this rank's actions of a schedule over the micro-batches of one step.

    Args:
        stage: this rank's layers (a module taking and returning one tensor).
        groups: this rank's place in the layout and its process groups.
        schedule: the full schedule (``rank in pipeline -> actions``); this rank runs
            ``rank_program(schedule, groups.stage)``.
        inputs_fn: ``micro-batch -> input tensor of stage 0`` (the LightningModule's ``pipeline_inputs``);
            called on the first stage, and on the last stage for the forward of its stage-0 replica.
        loss_fn: ``(output of the last stage, micro-batch) -> scalar loss`` (``pipeline_loss``); called on
            the last stage only.
        device: where received activations are allocated (the strategy's ``root_device``).
        replica: the replica of the successor stage, needed when the schedule contains ``FR`` actions.
        replica_device: device the replica lives on (``device`` or CPU); its inputs are moved there and its
            outputs are kept there.
    """

    def __init__(
        self,
        stage: nn.Module,
        groups: BambooGroups,
        schedule: Schedule,
        *,
        inputs_fn: InputsFn,
        loss_fn: LossFn,
        device: torch.device,
        replica: nn.Module | None = None,
        replica_device: torch.device | None = None,
    ) -> None:
        self.stage = stage
        self.groups = groups
        self.schedule = schedule
        self.program: list[Action] = rank_program(schedule, groups.stage)
        self.inputs_fn = inputs_fn
        self.loss_fn = loss_fn
        self.device = device
        self.replica = replica
        self.replica_device = replica_device or device
        self.redundant_outputs: dict[int, Tensor] = {}
        """Outputs of the last step's ``FR`` actions, by micro-batch (kept for a takeover)."""
        has_fr = any(action.kind is ActionKind.FORWARD_REDUNDANT for action in self.program)
        if has_fr and replica is None:
            raise ValueError(
                f"the schedule gives stage {groups.stage} forward-redundant (FR) actions "
                "but no replica was given"
            )
        num_mb = {action.microbatch for program in schedule.values() for action in program if action}
        self.num_microbatches = len(num_mb)

    def run_step(self, microbatches: Sequence[Any]) -> Tensor:
        """Forward and backward of every micro-batch; leaves averaged gradients in the stage's ``.grad``.

        Args:
            microbatches: the step's micro-batches (the same on every stage of a pipeline); their count must
                match the schedule's.

        Returns:
            The pipeline's mean loss over the micro-batches, as a float64 scalar on ``device``, on every rank.
        """
        self._check_count(microbatches)
        self.redundant_outputs = {}
        step = _StepState(count=len(microbatches))
        self._run_slots(self.schedule, microbatches, step, train=True)
        self._average_gradients()
        return self._broadcast_loss(step.losses)

    @torch.no_grad()
    def run_forward(self, microbatches: Sequence[Any]) -> Tensor:
        """Forward-only pass of every micro-batch (validation); the mean loss on every rank."""
        if not microbatches:
            raise ValueError("run_forward needs at least one micro-batch")
        step = _StepState(count=len(microbatches))
        schedule = forward_only_schedule(self.groups.num_stages, len(microbatches))
        self._run_slots(schedule, microbatches, step, train=False)
        return self._broadcast_loss(step.losses)

    def _check_count(self, microbatches: Sequence[Any]) -> None:
        if len(microbatches) != self.num_microbatches:
            raise ValueError(
                f"the schedule has {self.num_microbatches} micro-batches but run_step got {len(microbatches)}"
            )

    def _run_slots(
        self, schedule: Schedule, microbatches: Sequence[Any], step: _StepState, train: bool
    ) -> None:
        """Run the schedule slot by slot; after each slot, exchange what crosses to the neighbours.

        Both ends of every message derive it from the same schedule (``F`` of stage s in slot t sends to
        s+1; ``B`` of stage s sends to s-1), so each boundary's sends and receives are posted together with
        ``batch_isend_irecv``: no ordering between neighbours can deadlock, on gloo or NCCL alike.
        """
        row = schedule[self.groups.stage]
        for t, action in enumerate(row):
            if action is not None:
                self._execute(action, microbatches, step, train)
            self._exchange(schedule, t, step)

    def _execute(self, action: Action, microbatches: Sequence[Any], step: _StepState, train: bool) -> None:
        mb = action.microbatch
        last = self.groups.is_last_stage
        if action.kind is ActionKind.FORWARD:
            if self.groups.is_first_stage:
                x = self.inputs_fn(microbatches[mb])
            else:
                x = step.received.pop(mb)
                if train and x.is_floating_point():
                    x.requires_grad_(True)
            y = self.stage(x)
            if last:
                loss = self.loss_fn(y, microbatches[mb])
                step.losses.append(loss.detach())
                if train:
                    step.outputs[mb] = loss / step.count
            else:
                step.to_send_activation = y.detach()
                if train:
                    step.outputs[mb] = y
                    if self.replica is not None:
                        step.kept_for_fr[mb] = y.detach()
            if train:
                step.inputs[mb] = x
        elif action.kind is ActionKind.BACKWARD:
            out = step.outputs.pop(mb)
            if last:
                out.backward()
            else:
                torch.autograd.backward(out, step.grads.pop(mb))
            x = step.inputs.pop(mb)
            if not self.groups.is_first_stage:
                if x.grad is None:
                    raise RuntimeError(
                        f"stage {self.groups.stage} produced no gradient for its input of "
                        f"micro-batch {mb}: the stage's output does not depend on its input"
                    )
                step.to_send_gradient = x.grad
        elif action.kind is ActionKind.FORWARD_REDUNDANT:
            self._forward_redundant(mb, microbatches[mb], step.kept_for_fr)
        else:
            raise NotImplementedError(
                f"action {action} (backward redundancy) only runs after a failover remap; "
                "this engine runs the failure-free schedule"
            )

    def _exchange(self, schedule: Schedule, t: int, step: _StepState) -> None:
        stage, last = self.groups.stage, self.groups.num_stages - 1
        mine = schedule[stage][t]
        before = schedule[stage - 1][t] if stage > 0 else None
        after = schedule[stage + 1][t] if stage < last else None
        send_activation = mine is not None and mine.kind is ActionKind.FORWARD and stage < last
        recv_activation = before is not None and before.kind is ActionKind.FORWARD
        send_gradient = mine is not None and mine.kind is ActionKind.BACKWARD and stage > 0
        recv_gradient = after is not None and after.kind is ActionKind.BACKWARD
        if not (send_activation or recv_activation or send_gradient or recv_gradient):
            return
        next_rank = self.groups.rank_of_stage(stage + 1) if stage < last else -1
        prev_rank = self.groups.rank_of_stage(stage - 1) if stage > 0 else -1
        # round 1: activation headers (the receiver allocates from them)
        headers: list[dist.P2POp] = []
        header_in = torch.empty(p2p.HEADER_LEN, dtype=torch.int64, device=self.device)
        if send_activation:
            assert step.to_send_activation is not None
            headers.append(
                p2p.isend_op(p2p.encode_header(step.to_send_activation), next_rank, p2p.Tag.HEADER)
            )
        if recv_activation:
            headers.append(p2p.irecv_op(header_in, prev_rank, p2p.Tag.HEADER))
        p2p.run_batch(headers)
        # round 2: activations forward, gradients backward
        payloads: list[dist.P2POp] = []
        if send_activation:
            payloads.append(p2p.isend_op(step.to_send_activation, next_rank, p2p.Tag.ACTIVATION))
            step.to_send_activation = None
        if recv_activation:
            assert before is not None
            dtype, shape = p2p.decode_header(header_in.cpu())
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
            step.received[before.microbatch] = buffer
            payloads.append(p2p.irecv_op(buffer, prev_rank, p2p.Tag.ACTIVATION))
        if send_gradient:
            assert step.to_send_gradient is not None
            payloads.append(p2p.isend_op(step.to_send_gradient, prev_rank, p2p.Tag.GRADIENT))
            step.to_send_gradient = None
        if recv_gradient:
            assert after is not None
            grad = torch.empty_like(step.outputs[after.microbatch])
            step.grads[after.microbatch] = grad
            payloads.append(p2p.irecv_op(grad, next_rank, p2p.Tag.GRADIENT))
        p2p.run_batch(payloads)

    @torch.no_grad()
    def _forward_redundant(self, mb: int, microbatch: Any, kept_for_fr: dict[int, Tensor]) -> None:
        assert self.replica is not None
        x = self.inputs_fn(microbatch) if self.groups.is_last_stage else kept_for_fr.pop(mb)
        self.redundant_outputs[mb] = self.replica(x.to(self.replica_device)).detach()

    def _average_gradients(self) -> None:
        """Mean of the stage's gradients over the pipelines (one flat all-reduce per dtype)."""
        group = self.groups.stage_group
        num_pipelines = self.groups.layout.num_pipelines
        if num_pipelines == 1:
            return
        params = [p for p in self.stage.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for bucket in _by_dtype([p.grad for p in params]):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=group)
            flat /= num_pipelines
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def _broadcast_loss(self, losses: list[Tensor]) -> Tensor:
        if self.groups.is_last_stage:
            loss = torch.stack([value.to(torch.float64) for value in losses]).mean().to(self.device)
        else:
            loss = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.groups.num_stages > 1:
            dist.broadcast(loss, src=self.groups.last_stage_rank, group=self.groups.pipeline_group)
        return loss


@dataclass
class _StepState:
    """Tensors alive during one step, by micro-batch."""

    count: int
    inputs: dict[int, Tensor] = field(default_factory=dict)
    outputs: dict[int, Tensor] = field(default_factory=dict)
    received: dict[int, Tensor] = field(default_factory=dict)
    grads: dict[int, Tensor] = field(default_factory=dict)
    kept_for_fr: dict[int, Tensor] = field(default_factory=dict)
    losses: list[Tensor] = field(default_factory=list)
    to_send_activation: Tensor | None = None
    to_send_gradient: Tensor | None = None


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


def _by_dtype(tensors: list[Tensor]) -> list[list[Tensor]]:
    buckets: dict[torch.dtype, list[Tensor]] = {}
    for tensor in tensors:
        buckets.setdefault(tensor.dtype, []).append(tensor)
    return list(buckets.values())
