"""Bounded-stale ghost exchange (SC and ∇SC with staleness ``S >= 1``): per-peer tagged non-blocking P2P.

At epoch ``e`` a layer's SC posts its boundary rows to every peer (``isend``, one tag per layer and direction)
and posts the receive of this epoch's ghost rows (``irecv``) into a fresh buffer stamped ``e``; it then reads
the freshest buffer that has fully arrived, and waits only when none is stamped ``>= e - S``. ∇SC does the
same with the ghost rows' gradients going back to their owners: an owner adds the freshest ghost gradient
stamped ``>= e - S``. The graph server never waits on a peer's current epoch unless it is more than ``S``
epochs behind. Gloo matches sends and receives per (peer, tag) in posting order, and every server posts the
same sequence per layer, so buffers pair up by epoch. :meth:`StaleGhostExchange.drain` waits for everything
in flight (validation, test and checkpoints run on drained, synchronous exchanges).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from lightning_dorylus.data.partition import GraphPartition


@dataclass
class _InFlight:
    """One epoch's receive buffer of one layer and direction, and the P2P works that fill it."""

    epoch: int
    buffer: Tensor
    works: list[Any]
    received: list[tuple[Tensor, Tensor]]  # ∇SC: (owned row index, rows) to add into the owner's gradient

    def done(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        for w in self.works:
            w.wait()


class StaleGhostExchange:
    """Stale-capable SC/∇SC over its own process group (so it never interleaves with collectives).

    Args:
        staleness: ``S >= 1``: how many epochs old ghost rows (and ghost gradients) may be.
        group: A process group whose rank ``r`` serves partition ``r`` (created by the strategy).
    """

    def __init__(self, staleness: int, group: Any) -> None:
        if staleness < 1:
            raise ValueError(f"staleness={staleness}: the stale exchange needs S >= 1 (S = 0 is synchronous)")
        self.staleness, self.group = staleness, group
        self._pending: dict[tuple[int, str], list[_InFlight]] = {}
        self._sends: list[Any] = []
        self.waits = 0  # how often a read had to wait (no buffer fresh enough had arrived yet)
        self.reads = 0
        self.max_age = 0  # oldest ghost data used, in epochs

    def fill_ghosts(self, h_local: Tensor, partition: GraphPartition, layer: int, epoch: int) -> Tensor:
        """``[h_local; ghost rows of epoch >= epoch - S]``, differentiable (stale ∇SC in backward)."""
        return _StaleScatter.apply(h_local, self, partition, layer, epoch)

    def _tag(self, layer: int, direction: str) -> int:
        return 2 * layer + (0 if direction == "rows" else 1)

    def post_rows(self, h_local: Tensor, partition: GraphPartition, layer: int, epoch: int) -> None:
        """SC of epoch ``epoch``: send boundary rows to every peer; post the receive of our ghost rows."""
        tag = self._tag(layer, "rows")
        recv_ptr = partition.recv_ptr.tolist()
        buffer = h_local.new_empty((partition.n_ghost, *h_local.shape[1:]))
        works = []
        for peer in range(partition.num_parts):
            if peer == partition.part_id:
                continue
            index = partition.send_index[peer]
            if index.numel() > 0:
                rows = h_local.detach().index_select(0, index).contiguous()
                self._sends.append((dist.isend(rows, self._global(peer), self.group, tag), rows))
            start, end = recv_ptr[peer], recv_ptr[peer + 1]
            if end > start:
                works.append(dist.irecv(buffer[start:end], self._global(peer), self.group, tag))
        self._pending.setdefault((layer, "rows"), []).append(_InFlight(epoch, buffer, works, []))

    def post_grads(self, grad_ghost: Tensor, partition: GraphPartition, layer: int, epoch: int) -> None:
        """∇SC of epoch ``epoch``: send ghost gradients to their owners; post the receive of ours."""
        tag = self._tag(layer, "grads")
        recv_ptr = partition.recv_ptr.tolist()
        grad_ghost = grad_ghost.contiguous()
        works, received = [], []
        for peer in range(partition.num_parts):
            if peer == partition.part_id:
                continue
            start, end = recv_ptr[peer], recv_ptr[peer + 1]
            if end > start:
                rows = grad_ghost[start:end]
                self._sends.append((dist.isend(rows, self._global(peer), self.group, tag), rows))
            index = partition.send_index[peer]
            if index.numel() > 0:
                buf = grad_ghost.new_empty((index.numel(), *grad_ghost.shape[1:]))
                works.append(dist.irecv(buf, self._global(peer), self.group, tag))
                received.append((index, buf))
        self._pending.setdefault((layer, "grads"), []).append(_InFlight(epoch, grad_ghost, works, received))

    def take(self, layer: int, direction: str, epoch: int) -> _InFlight:
        """The freshest arrived buffer stamped ``>= epoch - S`` (waiting only if none has arrived yet);
        older buffers are dropped."""
        queue = self._pending[(layer, direction)]
        arrived = [i for i, f in enumerate(queue) if f.done()]
        best = arrived[-1] if arrived else None
        if best is None or queue[best].epoch < epoch - self.staleness:
            best = next(i for i, f in enumerate(queue) if f.epoch >= epoch - self.staleness)
            if not queue[best].done():
                self.waits += 1
            queue[best].wait()
        chosen = queue[best]
        for old in queue[:best]:
            old.wait()  # already overtaken; completes the P2P before its buffer is freed
        del queue[: best + 1]
        self.reads += 1
        self.max_age = max(self.max_age, epoch - chosen.epoch)
        self._reap_sends()
        return chosen

    def _reap_sends(self) -> None:
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]

    def drain(self) -> None:
        """Wait for every send and receive in flight and drop all buffers (before validation/checkpoints)."""
        for queue in self._pending.values():
            for f in queue:
                f.wait()
        for work, _ in self._sends:
            work.wait()
        self._pending.clear()
        self._sends.clear()

    def _global(self, peer: int) -> int:
        return dist.get_global_rank(self.group, peer)


class _StaleScatter(torch.autograd.Function):
    """SC with stale ghost rows forward, stale ∇SC backward (own rows exact, peers' contributions stale)."""

    @staticmethod
    def forward(
        ctx: Any,
        h_local: Tensor,
        exchange: StaleGhostExchange,
        partition: GraphPartition,
        layer: int,
        epoch: int,
    ) -> Tensor:
        ctx.exchange, ctx.partition, ctx.layer, ctx.epoch = exchange, partition, layer, epoch
        exchange.post_rows(h_local, partition, layer, epoch)
        ghosts = exchange.take(layer, "rows", epoch).buffer
        return torch.cat([h_local.detach(), ghosts], dim=0)

    @staticmethod
    def backward(ctx: Any, grad_full: Tensor) -> tuple[Tensor | None, ...]:
        exchange, partition = ctx.exchange, ctx.partition
        n_local = partition.n_local
        grad_local = grad_full[:n_local].clone()
        exchange.post_grads(grad_full[n_local:], partition, ctx.layer, ctx.epoch)
        for index, rows in exchange.take(ctx.layer, "grads", ctx.epoch).received:
            grad_local.index_add_(0, index, rows)
        return grad_local, None, None, None, None
