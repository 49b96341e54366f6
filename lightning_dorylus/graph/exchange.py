"""Scatter (SC): copy boundary rows to the graph servers that hold them as ghosts, with torch.distributed P2P.

Forward sends ``h[send_index[p]]`` to every partition ``p`` and receives this partition's ghost rows into
slots ``recv_ptr[q]:recv_ptr[q+1]`` from each owner ``q``. Backward (∇SC) is the mirror: the gradient of every
ghost row goes back to its owner, which adds it to the gradient of the owned row. Only tensors cross the
process boundary (``batch_isend_irecv``: works on gloo and NCCL).

SC is one autograd node, :class:`_Scatter`, whatever the staleness: it asks its exchange for the ghost rows
(:meth:`GhostExchange.receive_ghosts`) and, in backward, to add the peers' ghost gradients
(:meth:`GhostExchange.add_ghost_grads`). This class answers both with this epoch's rows and gradients
(blocking: staleness 0); :class:`~lightning_dorylus.graph.stale.StaleGhostExchange` answers from buffers up
to ``S`` epochs old.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dorylus.lost_server import collective

if TYPE_CHECKING:
    from lightning_dorylus.data.partition import GraphPartition


class GhostExchange:
    """Moves rows between graph servers; one instance per graph server, owned by the strategy.

    Args:
        group: The process group whose rank ``r`` is the graph server of partition ``r`` (default: world).
    """

    def __init__(self, group: Any | None = None) -> None:
        self.group = group

    def fill_ghosts(
        self, h_local: Tensor, partition: GraphPartition, layer: int = 0, epoch: int = 0
    ) -> Tensor:
        """SC as seen by the receiver: ``[h_local; ghost rows]`` of shape ``(n_local + n_ghost, F)``.

        Differentiable: the gradient of the ghost rows is returned to their owners in backward. ``layer``
        and ``epoch`` tag the messages of an exchange that keeps them apart (the stale one); this one
        exchanges the current rows and gradients and ignores them.
        """
        if h_local.size(0) != partition.n_local:
            raise ValueError(
                f"h_local has {h_local.size(0)} rows but partition {partition.part_id} owns "
                f"{partition.n_local} vertices"
            )
        if partition.num_parts == 1:
            return h_local
        return _Scatter.apply(h_local, self, partition, layer, epoch)

    def receive_ghosts(
        self, h_local: Tensor, partition: GraphPartition, out: Tensor, layer: int, epoch: int
    ) -> None:
        """SC's forward: writes the ghost rows into ``out`` ``(n_ghost, F)``; here this epoch's, blocking."""
        self.send_rows(h_local, partition, out=out)

    def add_ghost_grads(
        self, grad_ghost: Tensor, partition: GraphPartition, grad_local: Tensor, layer: int, epoch: int
    ) -> None:
        """SC's backward: sends ``grad_ghost`` to the owners and adds the ghost gradients of this
        partition's rows that the peers send into ``grad_local``; here this epoch's, blocking."""
        self.return_grads(grad_ghost, partition, grad_local=grad_local)

    def _peer_ranks(self, partition: GraphPartition) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                f"partition {partition.part_id} of {partition.num_parts} needs ghost rows from other graph "
                "servers, but torch.distributed is not initialized: train it with "
                f"Trainer(strategy='dorylus', "
                f"devices={partition.num_parts}) or use a single partition"
            )
        world = dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        if world != partition.num_parts or rank != partition.part_id:
            raise RuntimeError(
                f"graph server rank {rank} of world size {world} was given partition {partition.part_id} of "
                f"{partition.num_parts}; expected partition {rank} of {world}"
            )

    def send_rows(self, h_local: Tensor, partition: GraphPartition, out: Tensor | None = None) -> Tensor:
        """Forward SC: returns the ``(n_ghost, F)`` ghost rows received from their owners.

        Args:
            h_local: This server's ``(n_local, F)`` rows.
            partition: This server's partition.
            out: Optional contiguous ``(n_ghost, F)`` buffer to receive into (e.g. the ghost slice of a
                preallocated ``[local; ghost]`` matrix, so no concatenation copy is needed).
        """
        self._peer_ranks(partition)
        recv_ptr = partition.recv_ptr.tolist()
        shape = (partition.n_ghost, *h_local.shape[1:])
        if out is None:
            out = h_local.new_empty(shape)
        elif tuple(out.shape) != shape or not out.is_contiguous():
            raise ValueError(
                f"out has shape {tuple(out.shape)}; expected a contiguous buffer of shape {shape}"
            )
        ops = []
        for peer in range(partition.num_parts):
            if peer == partition.part_id:
                continue
            index = partition.send_index[peer]
            if index.numel() > 0:
                rows = h_local.index_select(0, index).contiguous()
                ops.append(dist.P2POp(dist.isend, rows, self._global(peer), self.group))
            start, end = recv_ptr[peer], recv_ptr[peer + 1]
            if end > start:
                ops.append(dist.P2POp(dist.irecv, out[start:end], self._global(peer), self.group))
        with collective("the ghost-row exchange with the other graph servers (SC, forward)"):
            self._run(ops)
        return out

    def return_grads(
        self, grad_ghost: Tensor, partition: GraphPartition, grad_local: Tensor | None = None
    ) -> Tensor:
        """Backward SC: sends ghost gradients to their owners; returns the ``(n_local, F)`` sum received.

        Args:
            grad_ghost: ``(n_ghost, F)`` gradient of this server's ghost rows.
            partition: This server's partition.
            grad_local: Optional ``(n_local, F)`` gradient to add the received rows into (in place);
                default: a zero matrix.
        """
        self._peer_ranks(partition)
        recv_ptr = partition.recv_ptr.tolist()
        grad_ghost = grad_ghost.contiguous()
        if grad_local is None:
            grad_local = grad_ghost.new_zeros((partition.n_local, *grad_ghost.shape[1:]))
        ops, received = [], []
        for peer in range(partition.num_parts):
            if peer == partition.part_id:
                continue
            start, end = recv_ptr[peer], recv_ptr[peer + 1]
            if end > start:
                ops.append(dist.P2POp(dist.isend, grad_ghost[start:end], self._global(peer), self.group))
            index = partition.send_index[peer]
            if index.numel() > 0:
                buf = grad_ghost.new_empty((index.numel(), *grad_ghost.shape[1:]))
                ops.append(dist.P2POp(dist.irecv, buf, self._global(peer), self.group))
                received.append((index, buf))
        with collective("the ghost-gradient exchange with the other graph servers (SC, backward)"):
            self._run(ops)
        for index, buf in received:
            grad_local.index_add_(0, index, buf)
        return grad_local

    def _global(self, peer: int) -> int:
        return peer if self.group is None else dist.get_global_rank(self.group, peer)

    @staticmethod
    def _run(ops: list[dist.P2POp]) -> None:
        if not ops:
            return
        for work in dist.batch_isend_irecv(ops):
            work.wait()


class _Scatter(torch.autograd.Function):
    """SC forward / ∇SC backward as one autograd node (the exchange itself is not differentiable by torch),
    for every exchange: where the ghost rows and gradients come from is the exchange's choice.

    Forward writes the local rows and receives the ghost rows into ONE preallocated
    ``(n_local + n_ghost, F)`` buffer (no ``torch.cat`` copy of the wide matrix); backward returns the local
    rows' gradient plus the ghost gradients sent back by the partitions holding them.
    """

    @staticmethod
    def forward(
        ctx: Any, h_local: Tensor, exchange: GhostExchange, partition: GraphPartition, layer: int, epoch: int
    ) -> Tensor:
        ctx.exchange, ctx.partition, ctx.layer, ctx.epoch = exchange, partition, layer, epoch
        n_local = partition.n_local
        full = h_local.new_empty((n_local + partition.n_ghost, *h_local.shape[1:]))
        full[:n_local].copy_(h_local.detach())
        exchange.receive_ghosts(h_local.detach(), partition, full[n_local:], layer, epoch)
        return full

    @staticmethod
    def backward(ctx: Any, grad_full: Tensor) -> tuple[Tensor | None, ...]:
        n_local = ctx.partition.n_local
        grad_local = grad_full[:n_local].clone()
        ctx.exchange.add_ghost_grads(grad_full[n_local:], ctx.partition, grad_local, ctx.layer, ctx.epoch)
        return grad_local, None, None, None, None
