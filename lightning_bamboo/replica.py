"""Bamboo's redundant copy of the successor stage: its layers AND its optimizer state, kept exactly current.

Every rank holds a replica of stage ``(s + 1) % num_stages``. After each optimizer step, the successor sends
the (averaged, clipped) gradients it just applied to its predecessor (one flat buffer per dtype, posted in
one batch with the receive from its own successor), and the predecessor applies them with the user's own
optimizer built over the replica (same class, param groups and hyper-parameters). Starting from the
same parameters, the same gradients through the same optimizer code give the same parameters and the same
optimizer state bit for bit (on the same kind of device), so a takeover needs no transfer at all.
"""

from __future__ import annotations

from collections.abc import Iterable

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
        self.replica = replica
        self.optimizer = optimizer
        self.groups = groups
        self.device = device

    def _own_params(self) -> list[nn.Parameter]:
        return [p for p in self.stage.parameters() if p.requires_grad]

    def _replica_params(self) -> list[nn.Parameter]:
        return [p for p in self.replica.parameters() if p.requires_grad]

    def sync_parameters(self) -> None:
        """Make the replica's parameters equal to the successor's current ones (at setup)."""
        with torch.no_grad():
            own = _flatten([p.detach() for p in self._own_params()], self.device)
            self._exchange(own, [p.data for p in self._replica_params()], p2p.Tag.REPLICA_PARAM)

    def step(self, main_optimizer: Optimizer) -> None:
        """Send this stage's gradients to the predecessor and apply the successor's to the replica.

        Call right after ``main_optimizer.step()`` (gradients are still in ``.grad``). The replica's
        param-group hyper-parameters (learning rate set by a scheduler, ...) are copied from
        ``main_optimizer`` first, so schedulers need no replica of their own.
        """
        own = _flatten([_grad_or_zeros(p) for p in self._own_params()], self.device)
        replica_params = self._replica_params()
        for p in replica_params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self._exchange(own, [p.grad for p in replica_params], p2p.Tag.REPLICA_GRAD)  # type: ignore[misc]
        copy_hyperparameters(main_optimizer, self.optimizer)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)

    def _exchange(self, outgoing: list[Tensor], targets: list[Tensor], tag: p2p.Tag) -> None:
        """Send ``outgoing`` (flat buckets) to the predecessor; receive the successor's into ``targets``.

        Every rank sends and receives in the same batch, so the ring (two ranks: each other's predecessor and
        successor) cannot deadlock.
        """
        buckets = _by_dtype(targets)
        incoming = [
            torch.empty(sum(t.numel() for t in bucket), dtype=bucket[0].dtype, device=self.device)
            for bucket in buckets
        ]
        ops = [p2p.isend_op(flat, self.groups.predecessor_rank, tag) for flat in outgoing]
        ops += [p2p.irecv_op(flat, self.groups.successor_rank, tag) for flat in incoming]
        p2p.run_batch(ops)
        for bucket, flat in zip(buckets, incoming):
            offset = 0
            for target in bucket:
                target.copy_(flat[offset : offset + target.numel()].view_as(target))
                offset += target.numel()


def copy_hyperparameters(source: Optimizer, target: Optimizer) -> None:
    """Copy every param-group setting but ``params`` from ``source`` to ``target`` (same group count)."""
    if len(source.param_groups) != len(target.param_groups):
        raise RuntimeError(
            f"replica optimizer has {len(target.param_groups)} param groups but the stage's optimizer has "
            f"{len(source.param_groups)}; configure_optimizers must build the same groups for every stage"
        )
    for src, dst in zip(source.param_groups, target.param_groups):
        for key, value in src.items():
            if key != "params":
                dst[key] = value


def _grad_or_zeros(p: Tensor) -> Tensor:
    return p.grad.detach() if p.grad is not None else torch.zeros_like(p)


def _by_dtype(tensors: Iterable[Tensor]) -> list[list[Tensor]]:
    buckets: dict[torch.dtype, list[Tensor]] = {}
    for tensor in tensors:
        buckets.setdefault(tensor.dtype, []).append(tensor)
    return list(buckets.values())


def _flatten(tensors: list[Tensor], device: torch.device) -> list[Tensor]:
    return [torch.cat([t.reshape(-1).to(device) for t in bucket]) for bucket in _by_dtype(tensors)]
