"""Bamboo's redundant copy of the successor stage: its layers AND its optimizer state, kept exactly current.

Every rank holds a replica of stage ``(s + 1) % num_stages``. After each optimizer step, the successor sends
the (averaged, clipped) gradients it just applied to its predecessor (one flat buffer per dtype), and the
predecessor applies them with the user's own optimizer built over the replica (same class, param groups
and hyper-parameters). Starting from the same parameters, the same gradients through the same optimizer
code give the same parameters and the same optimizer state bit for bit (on the same kind of device), so a
takeover needs no transfer at all.

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

from collections.abc import Iterable
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
        """Make the replica's parameters equal to the successor's current ones (at setup; blocking)."""
        self.flush()
        with torch.no_grad():
            own = _flatten([p.detach() for p in self._own_params()], self.device)
            targets = [p.data for p in self._replica_params()]
            works, incoming = self._post(own, targets, p2p.Tag.REPLICA_PARAM)
            for work in works:
                work.wait()
            _unflatten(incoming, targets)

    def step(self, main_optimizer: Optimizer) -> None:
        """Post this stage's gradients to the predecessor and the receive of the successor's (non-blocking).

        Call right after ``main_optimizer.step()`` (gradients are still in ``.grad``; they are copied into a
        flat send buffer here, so they may be zeroed right after). The param-group hyper-parameters of
        ``main_optimizer`` (learning rate set by a scheduler, ...) are recorded now, as they were for this
        step, and given to the replica's optimizer when the gradients are applied, so schedulers need no
        replica of their own. The gradients are applied by :meth:`flush` (see the module docstring for
        when that happens).
        """
        self.flush()  # exchanges are applied in order: the previous one first
        own = _flatten([_grad_or_zeros(p) for p in self._own_params()], self.device)
        replica_params = self._replica_params()
        for p in replica_params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        targets = [p.grad for p in replica_params]
        works, incoming = self._post(own, targets, p2p.Tag.REPLICA_GRAD)  # type: ignore[arg-type]
        hyperparameters = [
            {key: _snapshot(value) for key, value in group.items() if key != "params"}
            for group in main_optimizer.param_groups
        ]
        self._pending = _PendingUpdate(works, incoming, hyperparameters, sent=own)

    def flush(self) -> None:
        """Wait for the exchange in flight (if any) and apply the successor's gradients to the replica."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        for work in pending.works:
            work.wait()
        replica_params = self._replica_params()
        _unflatten(pending.incoming, [p.grad for p in replica_params])  # type: ignore[misc]
        set_hyperparameters(self._optimizer, pending.hyperparameters)
        device_type = replica_params[0].device.type if replica_params else "cpu"
        with torch.autocast(device_type, enabled=False):  # the successor stepped outside autocast too
            self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=False)

    def _post(self, outgoing: list[Tensor], targets: list[Tensor], tag: p2p.Tag) -> tuple[list, list[Tensor]]:
        """Post the send of ``outgoing`` (flat buckets) to the predecessor and the receive of the
        successor's buckets shaped like ``targets``; return the works and the receive buffers.

        Both are posted in one batch (:func:`p2p.post_batch`) on every rank, so the ring (two ranks: each
        other's predecessor and successor) cannot deadlock, on gloo or NCCL.
        """
        incoming = [
            torch.empty(sum(t.numel() for t in bucket), dtype=bucket[0].dtype, device=self.device)
            for bucket in _by_dtype(targets)
        ]
        ops = [p2p.isend_op(flat, self.groups.predecessor_rank, tag) for flat in outgoing]
        ops += [p2p.irecv_op(flat, self.groups.successor_rank, tag) for flat in incoming]
        return p2p.post_batch(ops), incoming


@dataclass
class _PendingUpdate:
    """A posted gradient exchange whose gradients are not applied to the replica yet."""

    works: list[Any]
    incoming: list[Tensor]
    hyperparameters: list[dict[str, Any]]
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


def _snapshot(value: Any) -> Any:
    """A hyper-parameter's value now (a tensor learning rate may be changed in place by a scheduler)."""
    return value.detach().clone() if isinstance(value, Tensor) else value


def _grad_or_zeros(p: Tensor) -> Tensor:
    return p.grad.detach() if p.grad is not None else torch.zeros_like(p)


def _by_dtype(tensors: Iterable[Tensor]) -> list[list[Tensor]]:
    buckets: dict[torch.dtype, list[Tensor]] = {}
    for tensor in tensors:
        buckets.setdefault(tensor.dtype, []).append(tensor)
    return list(buckets.values())


def _flatten(tensors: list[Tensor], device: torch.device) -> list[Tensor]:
    return [torch.cat([t.reshape(-1).to(device) for t in bucket]) for bucket in _by_dtype(tensors)]


def _unflatten(flats: list[Tensor], targets: list[Tensor]) -> None:
    """Copy flat buckets (one per dtype, in :func:`_by_dtype` order) back into ``targets``."""
    for bucket, flat in zip(_by_dtype(targets), flats):
        offset = 0
        for target in bucket:
            target.copy_(flat[offset : offset + target.numel()].view_as(target))
            offset += target.numel()
