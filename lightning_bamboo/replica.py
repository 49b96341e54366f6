"""Bamboo's redundant copy of the successor stage: its layers AND its optimizer state, kept exactly current.

Every rank holds a replica of stage ``(s + 1) % num_stages``. After each optimizer step, the successor sends
the (averaged, clipped) gradients it just applied to its predecessor (one flat buffer per dtype), with its
buffers (BatchNorm statistics), which parameters had a gradient (the others are skipped, as the
successor's optimizer skipped them) and its optimizer's numeric hyper-parameters (as a scheduler set them
for this step; a float64 vector, no pickling), and the predecessor applies them with the user's own
optimizer built over the replica (same class and param groups). At setup every parameter, frozen ones
included, and every buffer of the successor is copied to the replica. Starting from the same parameters,
the same gradients through the same optimizer code give the same parameters and the same optimizer state
bit for bit (on the same kind of device), so a takeover needs no transfer at all.

The update overlaps the next step: :meth:`ReplicaSync.step` only *posts* the exchange (non-blocking send
to the predecessor, receive from the successor) and records the hyper-parameters of this step; the
transfer runs while the rank starts its next step, and the received gradients are applied when the replica
is next needed. The replica is exactly current (parameters and optimizer state equal the successor's after
its latest optimizer step):

* before any forward of the replica (a forward pre-hook applies a pending update: the first ``FR`` of the
  next step, or a takeover),
* whenever it is read through :attr:`ReplicaSync.replica` or :attr:`ReplicaSync.optimizer`,
* after :meth:`ReplicaSync.flush`, and before the next :meth:`ReplicaSync.step` posts a new exchange.

Only the module object held elsewhere (``BambooStrategy.replica``), read directly between an optimizer
step and the next replica forward, can be one update behind; call :meth:`flush` first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_bamboo import p2p
from lightning_bamboo.groups import BambooGroups


class ReplicaSync:
    """Keeps ``replica`` (a copy of the successor stage) and ``optimizer`` equal to the successor's.

    Args:
        stage: this rank's own stage, whose gradients are sent to the predecessor.
        replica: this rank's copy of the successor stage (same parameter order as the successor's stage).
        optimizer: the optimizer over ``replica``'s parameters, same class and param-group settings as the
            successor's.
        groups: this rank's place in the layout (gives the predecessor and successor ranks).
        device: the device gradients travel on (the strategy's ``root_device``).
    """

    def __init__(
        self,
        stage: nn.Module,
        replica: nn.Module,
        optimizer: Optimizer,
        groups: BambooGroups,
        device: torch.device,
    ) -> None:
        self.stage = stage
        self._replica = replica
        self._optimizer = optimizer
        self.groups = groups
        self.device = device
        self._pending: _PendingUpdate | None = None
        # Kept from step to step, made at the first exchange: the flat buffers (one per dtype), views of the
        # send buffers shaped like this stage's trainable parameters then buffers (gradients are copied into
        # them), views of the receive buffers shaped like the replica's (they become its ``.grad``), and the
        # receive buffer of the float64 values. Building the views costs about as much as copying the
        # gradients, so they are built once.
        self._send_flats: list[Tensor] | None = None
        self._send_views: list[Tensor] = []
        self._receive_flats: list[Tensor] | None = None
        self._receive_views: list[Tensor] = []
        self._meta_in: Tensor | None = None
        # any forward of the replica (FR, a takeover) first applies the update still in flight
        self._hook = replica.register_forward_pre_hook(lambda module, args: self.flush())

    @property
    def replica(self) -> nn.Module:
        """The replica, with any update in flight applied first."""
        self.flush()
        return self._replica

    @property
    def optimizer(self) -> Optimizer:
        """The replica's optimizer, with any update in flight applied first."""
        self.flush()
        return self._optimizer

    @property
    def pending(self) -> bool:
        """Whether an exchange has been posted whose gradients are not applied yet."""
        return self._pending is not None

    def _own_params(self) -> list[nn.Parameter]:
        return [p for p in self.stage.parameters() if p.requires_grad]

    def _replica_params(self) -> list[nn.Parameter]:
        return [p for p in self._replica.parameters() if p.requires_grad]

    def sync_parameters(self) -> None:
        """Make the replica's parameters (frozen ones too) and buffers equal to the successor's (blocking).

        Called at setup: a rank's own copy of its successor's layers may have been initialised differently
        (no common seed), and frozen parameters and buffers (BatchNorm statistics) never travel with the
        gradients.
        """
        self.flush()
        with torch.no_grad():
            own = _flatten(_state_tensors(self.stage), self.device)
            targets = _state_tensors(self._replica)
            incoming = _empty_flats(targets, self.device)
            works = self._post(own, incoming, p2p.Tag.REPLICA_PARAM)
            for work in works:
                work.wait()
            _unflatten(incoming, targets)

    def step(self, main_optimizer: Optimizer) -> None:
        """Post this stage's gradients to the predecessor and the receive of the successor's (non-blocking).

        Call right after ``main_optimizer.step()`` (gradients are still in ``.grad``; they are copied into a
        flat send buffer here, so they may be zeroed right after). The param-group hyper-parameters of
        ``main_optimizer`` (learning rate set by a scheduler, ...) are recorded now, as they were for this
        step, sent with the gradients and given to the predecessor's replica optimizer when they are
        applied, so schedulers need no replica of their own. The gradients are applied by :meth:`flush`
        (see the module docstring for when that happens).
        """
        self.flush()  # exchanges are applied in order: the previous one first
        own_params = self._own_params()
        # with the gradients go: the stage's buffers (BatchNorm statistics), which gradient a parameter has,
        # and this stage's optimizer hyper-parameters, which are the ones the replica must step with
        buffers = list(self.stage.buffers())
        meta = [float(p.grad is not None) for p in own_params] + encode_hyperparameters(main_optimizer)
        # the flat buffers are kept from step to step (no fresh 2 x model-size allocation per step): the
        # previous exchange is applied (flush above), so neither is in use any more
        if self._send_flats is None:
            self._send_flats = _empty_flats([*own_params, *buffers], self.device)
            self._send_views = _views(self._send_flats, [*own_params, *buffers])
        with torch.no_grad():
            for view, source in zip(self._send_views, [*(p.grad for p in own_params), *buffers], strict=True):
                if source is None:
                    view.zero_()  # no gradient: its flag says so, the values are not used
                else:
                    view.copy_(source)
        own = [*self._send_flats, torch.tensor([len(meta), *meta], dtype=torch.float64, device=self.device)]
        if self._receive_flats is None or self._meta_in is None:
            replica_tensors = [*self._replica_params(), *self._replica.buffers()]
            self._receive_flats = _empty_flats(replica_tensors, self.device)
            self._receive_views = _views(self._receive_flats, replica_tensors)
            # the successor's count: its has-gradient flags and hyper-parameters, behind the count itself
            expected = len(self._replica_params()) + len(encode_hyperparameters(self._optimizer))
            self._meta_in = torch.empty(expected + 1, dtype=torch.float64, device=self.device)
        incoming = [*self._receive_flats, self._meta_in]
        self._pending = _PendingUpdate(self._post(own, incoming, p2p.Tag.REPLICA_GRAD), incoming, sent=own)

    def exchange(self, main_optimizer: Optimizer) -> None:
        """The blocking form of :meth:`step`, for a step that commits in two phases (elastic Bamboo).

        Call *before* ``main_optimizer.step()``, once the step's gradients are final but before clipping: the
        gradients, has-gradient flags, buffers and hyper-parameters (as they will be for this step) go to the
        predecessor, and this returns when the successor's have arrived. Nothing is applied yet:
        :meth:`flush` applies them once the step is committed, :meth:`discard` drops them if it aborts.
        """
        self.step(main_optimizer)
        assert self._pending is not None
        for work in self._pending.works:
            work.wait()
        self._pending.works = []

    def discard(self) -> None:
        """Drop the received update without applying it (the step it belongs to was aborted)."""
        self._pending = None

    def close(self) -> None:
        """Detach from the replica module (a new layout builds a new :class:`ReplicaSync`)."""
        self._pending = None
        self._hook.remove()

    def flush(self, before_step: Callable[[list[Tensor | None]], None] | None = None) -> None:
        """Wait for the exchange in flight (if any) and apply the successor's gradients to the replica.

        ``before_step`` gets the replica's gradients, installed, right before its optimizer steps (elastic
        Bamboo clips them there with the plan the step agreed on).
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        # the forward pre-hook runs this inside the engine's FR (inference mode): the optimizer's state must
        # be created and updated as normal tensors, usable outside inference mode (a takeover trains it)
        with torch.inference_mode(False):
            self._apply(pending, before_step)

    def _apply(
        self, pending: _PendingUpdate, before_step: Callable[[list[Tensor | None]], None] | None
    ) -> None:
        for work in pending.works:
            work.wait()
        replica_params = self._replica_params()
        meta = pending.incoming[-1]
        with torch.no_grad():
            # the gradients are used where they were received: ``.grad`` becomes a view of the flat buffer
            # (a copy only if the replica lives on another device); buffers are copied
            buffers = list(self._replica.buffers())
            views = self._receive_views  # of the flat buffers in ``pending.incoming``
            for p, view in zip(replica_params, views):
                if view.device == p.device:
                    p.grad = view
                else:
                    p.grad = view.to(p.device, copy=True)
            for buffer, view in zip(buffers, views[len(replica_params) :]):
                buffer.copy_(view)
        values = meta.tolist()
        if int(values[0]) != len(values) - 1:
            raise RuntimeError(
                f"the successor sent {int(values[0])} optimizer values but the replica expects "
                f"{len(values) - 1}: configure_optimizers must build the same param groups and settings for "
                "a stage and for its replica"
            )
        has_grad, hyperparameters = values[1 : 1 + len(replica_params)], values[1 + len(replica_params) :]
        for p, flag in zip(replica_params, has_grad):
            # no gradient: the successor's optimizer skipped it (no weight decay, no momentum); so does this
            if not flag:
                p.grad = None
        decode_hyperparameters(self._optimizer, hyperparameters)
        if before_step is not None:
            before_step([p.grad for p in replica_params])
        device_type = replica_params[0].device.type if replica_params else "cpu"
        with torch.autocast(device_type, enabled=False):  # the successor stepped outside autocast too
            self._optimizer.step()
        # no zero_grad: the next exchange overwrites every gradient (set to views of its buffer again)

    def _post(self, outgoing: list[Tensor], incoming: list[Tensor], tag: p2p.Tag) -> list[Any]:
        """Post the send of ``outgoing`` (flat buckets) to the predecessor and the receive of the
        successor's into ``incoming``; return the works.

        Both are posted in one batch (:func:`p2p.post_batch`) on every rank, so the ring (two ranks: each
        other's predecessor and successor) cannot deadlock, on gloo or NCCL.
        """
        ops = [p2p.isend_op(flat, self.groups.predecessor_rank, tag) for flat in outgoing]
        ops += [p2p.irecv_op(flat, self.groups.successor_rank, tag) for flat in incoming]
        return p2p.post_batch(ops)


@dataclass
class _PendingUpdate:
    """A posted gradient exchange whose gradients are not applied to the replica yet."""

    works: list[Any]
    incoming: list[Tensor]
    """Flat gradient-and-buffer buckets, then the float64 values (has-gradient flags, hyper-parameters)."""
    sent: list[Tensor]
    """The send buffers, alive until the exchange is waited on."""


def set_hyperparameters(target: Optimizer, hyperparameters: list[dict[str, Any]]) -> None:
    """Give ``target``'s param groups the recorded settings (one dict per group, ``params`` excluded)."""
    if len(hyperparameters) != len(target.param_groups):
        raise RuntimeError(
            f"replica optimizer has {len(target.param_groups)} param groups but the stage's optimizer has "
            f"{len(hyperparameters)}; configure_optimizers must build the same groups for every stage"
        )
    for values, group in zip(hyperparameters, target.param_groups):
        group.update(values)


def _numeric_settings(optimizer: Optimizer) -> list[tuple[dict[str, Any], str, Any]]:
    """``(group, key, value)`` of every numeric hyper-parameter, in a fixed order (groups, sorted keys).

    Numbers, booleans, tuples of numbers (Adam's ``betas``) and tensors (a tensor learning rate) count;
    ``None`` and strings are left alone (they are the same on both sides: same ``configure_optimizers``).
    """
    settings = []
    for group in optimizer.param_groups:
        for key in sorted(k for k in group if k != "params"):
            value = group[key]
            if isinstance(value, (bool, int, float, Tensor)) or (
                isinstance(value, (tuple, list)) and all(isinstance(v, (bool, int, float)) for v in value)
            ):
                settings.append((group, key, value))
    return settings


def encode_hyperparameters(optimizer: Optimizer) -> list[float]:
    """The optimizer's numeric hyper-parameters as floats (exact: a Python float is a float64)."""
    values: list[float] = []
    for _, _, value in _numeric_settings(optimizer):
        if isinstance(value, Tensor):
            values += [float(v) for v in value.detach().reshape(-1).tolist()]
        elif isinstance(value, (tuple, list)):
            values += [float(v) for v in value]
        else:
            values.append(float(value))
    return values


def decode_hyperparameters(optimizer: Optimizer, values: list[float]) -> None:
    """Set ``optimizer``'s numeric hyper-parameters from :func:`encode_hyperparameters` of another one.

    Raises:
        RuntimeError: when the count does not match this optimizer's settings.
    """
    settings = _numeric_settings(optimizer)
    sizes = [
        v.numel() if isinstance(v, Tensor) else len(v) if isinstance(v, (tuple, list)) else 1
        for _, _, v in settings
    ]
    if sum(sizes) != len(values):
        raise RuntimeError(
            f"the successor's optimizer has {len(values)} hyper-parameter values but the replica's has "
            f"{sum(sizes)}; configure_optimizers must build the same param groups for a stage and its replica"
        )
    offset = 0
    for (group, key, old), size in zip(settings, sizes):
        chunk = values[offset : offset + size]
        offset += size
        if isinstance(old, Tensor):
            group[key] = torch.tensor(chunk, dtype=old.dtype, device=old.device).reshape(old.shape)
        elif isinstance(old, (tuple, list)):
            group[key] = type(old)(type(o)(v) for o, v in zip(old, chunk))
        else:
            group[key] = type(old)(chunk[0])


def _state_tensors(module: nn.Module) -> list[Tensor]:
    """Every parameter (trainable or frozen) and every buffer, in registration order."""
    return [p.data for p in module.parameters()] + list(module.buffers())


def _by_dtype(tensors: Iterable[Tensor]) -> list[list[Tensor]]:
    buckets: dict[torch.dtype, list[Tensor]] = {}
    for tensor in tensors:
        buckets.setdefault(tensor.dtype, []).append(tensor)
    return list(buckets.values())


def _flatten(tensors: list[Tensor], device: torch.device) -> list[Tensor]:
    """One flat tensor per dtype (:func:`_by_dtype` order)."""
    return [torch.cat([t.reshape(-1).to(device) for t in bucket]) for bucket in _by_dtype(tensors)]


def _empty_flats(tensors: list[Tensor], device: torch.device) -> list[Tensor]:
    """Uninitialised flat buffers (one per dtype) the size of :func:`_flatten` of ``tensors``."""
    return [
        torch.empty(sum(t.numel() for t in bucket), dtype=bucket[0].dtype, device=device)
        for bucket in _by_dtype(tensors)
    ]


def _views(flats: list[Tensor], targets: list[Tensor]) -> list[Tensor]:
    """Views of ``flats`` (one per dtype, :func:`_by_dtype` order) shaped like each of ``targets``, in the
    order of ``targets``."""
    offsets: dict[torch.dtype, int] = {}
    by_dtype = {bucket[0].dtype: flat for bucket, flat in zip(_by_dtype(targets), flats, strict=True)}
    views = []
    for target in targets:
        start = offsets.get(target.dtype, 0)
        views.append(by_dtype[target.dtype][start : start + target.numel()].view_as(target))
        offsets[target.dtype] = start + target.numel()
    return views


def _unflatten(flats: list[Tensor], targets: list[Tensor]) -> None:
    """Copy flat buckets (one per dtype, in :func:`_by_dtype` order) back into ``targets``."""
    for bucket, flat in zip(_by_dtype(targets), flats):
        offset = 0
        for target in bucket:
            target.copy_(flat[offset : offset + target.numel()].view_as(target))
            offset += target.numel()
