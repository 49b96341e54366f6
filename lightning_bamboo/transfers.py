"""Non-blocking, ordered point-to-point traffic of one rank during one pipeline step.

Every message between neighbouring stages is known from the schedule before the step starts: ``F`` of
stage s in slot t sends micro-batch i's activation to s+1, ``B`` of stage s+1 in slot t sends its input
gradient to s. :func:`rank_transfers` lists this rank's sends and receives in one **canonical order**,
sorted by ``(slot, link, kind)`` where ``link`` is the lower stage of the pair and a header comes before its
activation, and the activation before a gradient of the same slot. Both ends of a link derive the same
order from the same schedule, so:

* gloo matches each ``(peer, tag)`` in issue order, and every kind has its own tag;
* NCCL matches the operations between two ranks in issue order and runs them one after another on one
  stream; both ends issue the link's operations in the same order, so the k-th operation on one side always
  meets the k-th on the other. Across links the order is the global slot order, which is a valid execution
  of the schedule (``validate_schedule``), so even a backend that serialises ALL of a rank's point-to-point
  operations on one stream cannot wait in a cycle.

:func:`lightning_bamboo.schedule.lower_schedule` places the same operations, as explicit ``SEND``/``RECV``
entries, into each rank's program (the lowering derives them from producers and consumers of any action
kind; for ``F``/``B`` schedules the order is exactly :func:`rank_transfers`'s, which the tests check), and
:class:`StepTransfers` issues them: a receive is posted long before the action that consumes it, a send as
soon as the action that produces its tensor has run. Nothing blocks until an action needs a received tensor
(:meth:`StepTransfers.take`) or the step ends (:meth:`StepTransfers.finish`, which waits for the sends).

Activation shapes are sent once, not per message: a fixed-size int64 header ``[dtype, ndim, shape...]``
precedes the first activation of every micro-batch *signature* (the shapes and dtypes of the micro-batch's
tensors, and the train/eval mode); later activations of the same signature reuse the cached shape. Both
ends see the same micro-batches, so both decide the same way which activations carry a header. The price:
a stage's output shape must be a function of that signature (true for any model whose shapes follow its
input shapes); a stage whose output shape changes without its input shape changing gets a clear error.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_bamboo import p2p
from lightning_bamboo.schedule import ActionKind, Schedule
from lightning_bamboo.schedule.lowering import Comm, CommKind

ShapeKey = tuple[Any, ...]
"""What an activation's shape is cached under: ``(train, signature of the micro-batch)``."""


class Kind(IntEnum):
    """What a transfer carries; the value orders transfers of one slot and link."""

    HEADER = 0
    ACTIVATION = 1
    GRADIENT = 2


@dataclass(frozen=True)
class Transfer:
    """One send or receive of this rank.

    Attributes:
        slot: the schedule slot of the action that produces the tensor.
        link: the lower stage of the two neighbours (link ``s`` joins stages ``s`` and ``s + 1``).
        kind: header, activation (``s -> s+1``) or gradient (``s+1 -> s``).
        microbatch: the micro-batch it belongs to.
        send: ``True`` for a send of this rank, ``False`` for a receive.
        peer_stage: the stage at the other end.
    """

    slot: int
    link: int
    kind: Kind
    microbatch: int
    send: bool
    peer_stage: int

    def order(self) -> tuple[int, int, int]:
        """The canonical sort key, the same at both ends of the link."""
        return (self.slot, self.link, int(self.kind))


def rank_transfers(
    schedule: Schedule, stage: int, headers: Mapping[int, set[int]] | None = None
) -> list[Transfer]:
    """Every send and receive of ``stage`` in ``schedule``, in canonical order.

    Args:
        schedule: the full schedule of one pipeline (``stage -> slots``).
        stage: this rank's stage.
        headers: for each link (lower stage), the micro-batches whose activation is preceded by a shape
            header; ``None``: none.
    """
    headers = headers or {}
    last = len(schedule) - 1
    transfers: list[Transfer] = []
    for link in (stage - 1, stage):
        if link < 0 or link + 1 > last:
            continue
        lower, upper = link, link + 1
        for slot, action in enumerate(schedule[lower]):
            if action is not None and action.kind is ActionKind.FORWARD and action.stage == lower:
                send = stage == lower
                peer = upper if send else lower
                mb = action.microbatch
                if mb in headers.get(link, set()):
                    transfers.append(Transfer(slot, link, Kind.HEADER, mb, send, peer))
                transfers.append(Transfer(slot, link, Kind.ACTIVATION, mb, send, peer))
        for slot, action in enumerate(schedule[upper]):
            if action is not None and action.kind is ActionKind.BACKWARD and action.stage == upper:
                send = stage == upper
                transfers.append(
                    Transfer(slot, link, Kind.GRADIENT, action.microbatch, send, lower if send else upper)
                )
    return sorted(transfers, key=Transfer.order)


def microbatch_signature(value: Any) -> Any:
    """Hashable description of a micro-batch's structure: tensor shapes and dtypes, plain leaf values."""
    if isinstance(value, Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, Mapping):
        return ("map", tuple((key, microbatch_signature(item)) for key, item in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(microbatch_signature(item) for item in value))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__qualname__


@dataclass
class ShapeCache:
    """Activation shapes learned from headers, kept across steps (one per engine).

    Attributes:
        sent: ``key -> (dtype, shape)`` of the activations this rank sent a header for.
        received: the same for the headers this rank received.
    """

    sent: dict[ShapeKey, tuple[torch.dtype, tuple[int, ...]]] = field(default_factory=dict)
    received: dict[ShapeKey, tuple[torch.dtype, tuple[int, ...]]] = field(default_factory=dict)


def header_microbatches(keys: Sequence[ShapeKey], known: Mapping[ShapeKey, Any]) -> set[int]:
    """The micro-batches whose activation carries a header: the first one of every key not yet known."""
    first: dict[ShapeKey, int] = {}
    for mb, key in enumerate(keys):
        if key not in known:
            first.setdefault(key, mb)
    return set(first.values())


class StepTransfers:
    """Issues one step's ``SEND``/``RECV`` operations of this rank (from the lowered program) in order.

    The lowered program (:func:`lightning_bamboo.schedule.lower_schedule`) lists them in the canonical order
    and places each as early as it can go: a receive right after the rank's previous operation, a send right
    after the action producing its tensor. This class turns them into non-blocking ``irecv``/``isend``; the
    only blocking points are :meth:`take` (the consuming action waits for its tensor, as late as possible)
    and :meth:`finish` (the sends, at the end of the step).

    Shape headers: a receive of an activation whose micro-batch signature is new waits for its header before
    the activation's buffer can be allocated. It is not waited for when posted: operations after it stay
    queued (in order) until an action needs a tensor or the step ends.

    Args:
        stage: this rank's stage (for error messages).
        rank_of_stage: global rank of a rank position of this pipeline (``Comm.peer``).
        device: where receive buffers are allocated.
        keys: ``ShapeKey`` of every micro-batch of the step.
        shapes: the engine's shape cache (read and updated).
        gradient_buffer: ``micro-batch -> empty tensor`` shaped like this rank's output of it (the receive
            buffer of its gradient).
        trace: where to record ``(event, start, end)`` of every blocking receive wait; ``None``: nowhere.
    """

    def __init__(
        self,
        stage: int,
        rank_of_stage: Callable[[int], int],
        device: torch.device,
        keys: Sequence[ShapeKey],
        shapes: ShapeCache,
        gradient_buffer: Callable[[int], Tensor],
        trace: list[tuple[str, float, float]] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.stage = stage
        self.rank_of_stage = rank_of_stage
        self.device = device
        self.keys = keys
        self.shapes = shapes
        self.gradient_buffer = gradient_buffer
        self._header_in = header_microbatches(keys, shapes.received)
        self._header_out = header_microbatches(keys, shapes.sent)
        self._queue: deque[tuple[Comm, Tensor | None]] = deque()
        self._inbox: dict[tuple[Kind, int], tuple[Tensor, Any]] = {}
        self._sends: list[Any] = []
        self.trace = trace
        self.clock = clock
        """The clock of ``trace`` events."""

    def post(self, comm: Comm, tensor: Tensor | None = None) -> None:
        """Queue ``comm`` (a send with its ``tensor``, or a receive) and issue what can go without waiting."""
        if comm.kind.is_send and tensor is None:
            raise RuntimeError(f"stage {self.stage}: {comm} has no tensor to send")
        self._queue.append((comm, None if tensor is None else tensor.detach().contiguous()))
        self._pump(force=False)

    def take(self, kind: Kind, microbatch: int) -> Tensor:
        """The received activation or gradient of ``microbatch``: issue up to its receive and wait for it."""
        target = (kind, microbatch)
        while target not in self._inbox:
            if not self._queue:
                raise RuntimeError(
                    f"stage {self.stage} waits for the {kind.name.lower()} of micro-batch {microbatch}, "
                    "which its lowered program never receives before this action"
                )
            self._issue(*self._queue[0], force=True)
        self._pump(force=False)  # what queued behind a header may go now
        buffer, work = self._inbox.pop(target)
        start = self.clock()
        work.wait()
        if self.trace is not None:
            self.trace.append((f"wait {kind.name[0]}{microbatch}", start, self.clock()))
        return buffer

    def finish(self) -> None:
        """Issue everything left and wait for this rank's sends (their tensors may be reused after)."""
        self._pump(force=True)
        if self._inbox:
            raise RuntimeError(f"stage {self.stage} received tensors no action used: {sorted(self._inbox)}")
        for work in self._sends:
            work.wait()
        self._sends = []

    def _pump(self, force: bool) -> None:
        while self._queue and self._issue(*self._queue[0], force=force):
            pass

    # ------------------------------------------------------------------ one operation
    def _issue(self, comm: Comm, tensor: Tensor | None, force: bool) -> bool:
        """Issue the queue's head ``comm`` if it can go now (or, with ``force``, after its header)."""
        peer = self.rank_of_stage(comm.peer)
        mb = comm.microbatch
        if comm.kind is CommKind.SEND_F:
            assert tensor is not None
            key = self.keys[mb]
            if mb in self._header_out:
                self.shapes.sent[key] = (tensor.dtype, tuple(tensor.shape))
                self._sends.append(dist.isend(p2p.encode_header(tensor), peer, tag=int(p2p.Tag.HEADER)))
                self._header_out.discard(mb)
            else:
                self._check_cached_shape(mb, tensor)
            self._sends.append(dist.isend(tensor, peer, tag=int(p2p.Tag.ACTIVATION)))
        elif comm.kind is CommKind.SEND_B:
            assert tensor is not None
            self._sends.append(dist.isend(tensor, peer, tag=int(p2p.Tag.GRADIENT)))
        elif comm.kind is CommKind.RECV_F:
            key = self.keys[mb]
            if mb in self._header_in:
                if (Kind.HEADER, mb) not in self._inbox:
                    header = torch.empty(p2p.HEADER_LEN, dtype=torch.int64, device=self.device)
                    work = dist.irecv(header, peer, tag=int(p2p.Tag.HEADER))
                    self._inbox[(Kind.HEADER, mb)] = (header, work)
                if not force:
                    return False  # do not block on the header while actions could run
                header, work = self._inbox.pop((Kind.HEADER, mb))
                work.wait()
                self.shapes.received[key] = p2p.decode_header(header.cpu())
                self._header_in.discard(mb)
            dtype, shape = self.shapes.received[key]
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
            work = dist.irecv(buffer, peer, tag=int(p2p.Tag.ACTIVATION))
            self._inbox[(Kind.ACTIVATION, mb)] = (buffer, work)
        else:
            buffer = self.gradient_buffer(mb)
            self._inbox[(Kind.GRADIENT, mb)] = (buffer, dist.irecv(buffer, peer, tag=int(p2p.Tag.GRADIENT)))
        self._queue.popleft()
        return True

    def _check_cached_shape(self, mb: int, tensor: Tensor) -> None:
        expected = self.shapes.sent[self.keys[mb]]
        if (tensor.dtype, tuple(tensor.shape)) != expected:
            raise RuntimeError(
                f"stage {self.stage}'s output for micro-batch {mb} is {tensor.dtype} of shape "
                f"{tuple(tensor.shape)}, but an earlier micro-batch with the same input shapes gave "
                f"{expected[0]} of shape {expected[1]}; the engine sends an activation's shape once per "
                "micro-batch shape, so a stage's output shape must follow from its input shapes"
            )
