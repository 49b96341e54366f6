"""Bounded-stale ghost exchange (SC and ∇SC with staleness ``S >= 1``): per-peer tagged non-blocking P2P.

At epoch ``e`` a layer's SC posts its boundary rows to every peer (``isend``, one tag per layer and direction)
and posts the receive of this epoch's ghost rows (``irecv``) into a fresh buffer stamped ``e``. The exchange
holds, per layer and direction, the buffer it read last and every newer one; a read picks one of those stamped
``>= e - S`` (:func:`choose_buffer`):

* ``"freshest"`` (Dorylus): the freshest that has fully arrived -- this epoch's if it is there, else e.g. the
  one read last epoch -- and waits only when none that fresh has arrived. Timing decides which: not
  reproducible.
* ``"oldest"`` (deterministic, PipeGCN's previous-epoch boundary data for ``S = 1``): always the one stamped
  ``e - S`` (waiting for it if needed); epochs before ``S`` read the oldest there is, so epoch 0 is exact.

∇SC does the same with the ghost rows' gradients going back to their owners: an owner adds the ghost
gradients of the chosen buffer, so a gradient may be added again in a later epoch when the newer one has not
arrived (PipeGCN's stale boundary gradients). Gloo matches sends and receives per (peer, tag) in posting
order, and every server posts the same sequence per layer, so buffers pair up by epoch.

Gloo's P2P works report ``is_completed()`` only after ``wait()`` (checked with torch 2.13), so arrival cannot
be polled: a communication thread (:class:`_Completer`) waits for every work in posting order (``wait``
releases the GIL) and flags each buffer as it completes. :meth:`StaleGhostExchange.drain` waits for everything
in flight (validation, test and checkpoints run on drained, synchronous exchanges); ``discard`` (checkpoints)
also drops the held buffers, so the next read is exact, as in a run resumed from that checkpoint.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch.distributed as dist
from torch import Tensor

from lightning_dorylus.graph.exchange import GhostExchange

if TYPE_CHECKING:
    from lightning_dorylus.data.partition import GraphPartition

StaleReads = Literal["freshest", "oldest"]
STALE_READS: tuple[str, ...] = ("freshest", "oldest")


def check_stale_reads(stale_reads: Any) -> None:
    """Raises a ValueError naming ``stale_reads`` and its choices unless it is one of :data:`STALE_READS`."""
    if stale_reads not in STALE_READS:
        raise ValueError(
            f"stale_reads={stale_reads!r}: expected 'freshest' (the freshest arrived ghosts, Dorylus) or "
            "'oldest' (always the ghosts of epoch e - S: deterministic)"
        )


def choose_buffer(
    stamps: Sequence[int], arrived: Sequence[bool], epoch: int, staleness: int, policy: StaleReads
) -> int:
    """Index of the held buffer (oldest first, ``stamps`` their epochs) that a read at ``epoch`` uses.

    Candidates are the buffers stamped ``>= epoch - staleness`` (this epoch's was just posted, so there is
    one). ``"freshest"``: the newest arrived candidate, else the oldest candidate (posted first, so it arrives
    first: the shortest wait). ``"oldest"``: the oldest candidate, arrived or not. The caller waits when the
    chosen one has not arrived.
    """
    candidates = [i for i, stamp in enumerate(stamps) if stamp >= epoch - staleness]
    if not candidates:
        raise RuntimeError(f"no ghost buffer stamped >= {epoch - staleness} held at epoch {epoch}: {stamps}")
    if policy == "freshest":
        ready = [i for i in candidates if arrived[i]]
        return ready[-1] if ready else candidates[0]
    return candidates[0]


@dataclass
class _InFlight:
    """One epoch's receive buffer of one layer and direction, and the P2P works that fill it."""

    epoch: int
    buffer: Tensor
    works: list[Any]
    received: list[tuple[Tensor, Tensor]]  # ∇SC: (owned row index, rows) to add into the owner's gradient
    arrived: threading.Event = field(default_factory=threading.Event)  # set by the communication thread


class _Completer:
    """The communication thread: waits for P2P works in posting order and flags what has completed.

    A work is waited on by this thread only, once; a failure (a peer gone, the group's timeout) is kept and
    raised by :meth:`check` in the training thread. Sends are waited on too, which frees their buffers.
    """

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[list[Any], threading.Event | None, Any] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def submit(self, works: list[Any], done: threading.Event | None, keep: Any = None) -> None:
        """Waits for ``works`` after everything submitted before; then sets ``done`` and drops ``keep``."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dorylus-stale-p2p", daemon=True)
            self._thread.start()
        self._queue.put((works, done, keep))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            works, done, _keep = item
            try:
                if self.error is None:  # after a failure the group is broken: flag the rest, do not hang
                    for work in works:
                        work.wait()
            except BaseException as error:  # re-raised in the training thread by check()
                self.error = error
            finally:
                if done is not None:
                    done.set()
                self._queue.task_done()

    def check(self) -> None:
        """Raises the communication thread's failure, if any, in the calling thread."""
        if self.error is not None:
            raise RuntimeError(f"a stale ghost exchange message failed: {self.error}") from self.error

    def join(self) -> None:
        """Blocks until every submitted work has completed (or failed: raised here)."""
        self._queue.join()
        self.check()

    def close(self) -> None:
        """Stops the thread after the works submitted so far (a later :meth:`submit` starts a new one)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None


class StaleGhostExchange(GhostExchange):
    """Stale-capable SC/∇SC over its own process group (so it never interleaves with collectives): the
    same SC node (:class:`~lightning_dorylus.graph.exchange._Scatter`), reading ghost rows and gradients
    from the held buffers instead of this epoch's messages.

    Args:
        staleness: ``S >= 1``: how many epochs old ghost rows (and ghost gradients) may be.
        group: A process group whose rank ``r`` serves partition ``r`` (created by the strategy).
        reads: Which buffer stamped ``>= e - S`` a read uses: ``"freshest"`` arrived (Dorylus; timing
            dependent) or ``"oldest"`` (always epoch ``e - S``'s: reproducible).

    Counters: ``reads``; ``waits`` (reads that blocked: the chosen buffer had not arrived); ``ages``
    (age in epochs -> number of reads using ghost data that old); ``max_age``.
    """

    def __init__(self, staleness: int, group: Any, reads: StaleReads = "freshest") -> None:
        if staleness < 1:
            raise ValueError(f"staleness={staleness}: the stale exchange needs S >= 1 (S = 0 is synchronous)")
        check_stale_reads(reads)
        super().__init__(group)
        self.staleness, self.policy = staleness, reads
        self._held: dict[tuple[int, str], list[_InFlight]] = {}  # the buffer read last, then newer ones
        self._completer = _Completer()
        self.waits = 0
        self.reads = 0
        self.ages: Counter[int] = Counter()
        self.max_age = 0

    def receive_ghosts(
        self, h_local: Tensor, partition: GraphPartition, out: Tensor, layer: int, epoch: int
    ) -> None:
        """SC's forward at ``epoch``: posts this epoch's rows, then writes the ghost rows of the buffer
        stamped ``>= epoch - S`` that the policy picks into ``out``."""
        self.post_rows(h_local, partition, layer, epoch)
        out.copy_(self.take(layer, "rows", epoch).buffer)

    def add_ghost_grads(
        self, grad_ghost: Tensor, partition: GraphPartition, grad_local: Tensor, layer: int, epoch: int
    ) -> None:
        """SC's backward at ``epoch``: posts this epoch's ghost gradients to their owners, then adds the
        received gradients of the buffer the policy picks (own rows exact, peers' contributions stale)."""
        self.post_grads(grad_ghost, partition, layer, epoch)
        for index, rows in self.take(layer, "grads", epoch).received:
            grad_local.index_add_(0, index, rows)

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
                self._completer.submit([dist.isend(rows, self._global(peer), self.group, tag)], None, rows)
            start, end = recv_ptr[peer], recv_ptr[peer + 1]
            if end > start:
                works.append(dist.irecv(buffer[start:end], self._global(peer), self.group, tag))
        self.post(layer, "rows", _InFlight(epoch, buffer, works, []))

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
                self._completer.submit([dist.isend(rows, self._global(peer), self.group, tag)], None, rows)
            index = partition.send_index[peer]
            if index.numel() > 0:
                buf = grad_ghost.new_empty((index.numel(), *grad_ghost.shape[1:]))
                works.append(dist.irecv(buf, self._global(peer), self.group, tag))
                received.append((index, buf))
        self.post(layer, "grads", _InFlight(epoch, grad_ghost, works, received))

    def post(self, layer: int, direction: str, inflight: _InFlight) -> None:
        """Holds ``inflight`` (a receive just posted) for later reads; the communication thread flags it
        ``arrived`` once its works complete."""
        self._held.setdefault((layer, direction), []).append(inflight)
        self._completer.submit(inflight.works, inflight.arrived)

    def take(self, layer: int, direction: str, epoch: int) -> _InFlight:
        """The buffer a read at ``epoch`` uses (:func:`choose_buffer` under this exchange's policy), waiting
        only if it has not arrived; it stays held (a later read may use it again), older ones are freed."""
        self._completer.check()
        held = self._held[(layer, direction)]
        best = self._choose(held, epoch)
        if not held[best].arrived.is_set():
            self.waits += 1
            held[best].arrived.wait()  # bounded by the group's timeout: a failed wait sets it too
            self._completer.check()
            best = self._choose(held, epoch)  # "freshest": newer ones may have come in meanwhile
        chosen = held[best]
        for old in held[:best]:
            old.arrived.wait()  # posted earlier, so already complete (works complete in posting order)
        del held[:best]
        age = epoch - chosen.epoch
        self.reads += 1
        self.ages[age] += 1
        self.max_age = max(self.max_age, age)
        return chosen

    def _choose(self, held: list[_InFlight], epoch: int) -> int:
        stamps = [f.epoch for f in held]
        return choose_buffer(stamps, [f.arrived.is_set() for f in held], epoch, self.staleness, self.policy)

    def drain(self, discard: bool = False) -> None:
        """Waits for every send and receive in flight (before evaluation and checkpoints). The arrived
        buffers stay held for the next epoch's reads, unless ``discard`` (checkpoints, teardown): then the
        next read is exact, as in a run resumed from that checkpoint, and the communication thread stops."""
        try:
            self._completer.join()
        finally:
            if discard:
                self._held.clear()
                self._completer.close()
