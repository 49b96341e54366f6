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

:class:`StepTransfers` issues the operations in that order as early as it can: a receive as soon as every
earlier operation is issued (so it is posted long before the action that consumes it), a send as soon as
the action that produces its tensor has run. Nothing blocks until an action needs a received tensor
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_bamboo import p2p
from lightning_bamboo.schedule import ActionKind, Schedule

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
    """Issues one step's transfers of this rank in canonical order, as early as possible.

    Args:
        schedule: the step's schedule.
        stage: this rank's stage.
        rank_of_stage: global rank of a stage of this pipeline.
        device: where receive buffers are allocated.
        keys: ``ShapeKey`` of every micro-batch of the step.
        shapes: the engine's shape cache (read and updated).
        gradient_buffer: ``micro-batch -> empty tensor`` shaped like this rank's output of it (the receive
            buffer of its gradient).
        trace: where to record ``(event, start, end)`` of every blocking receive wait; ``None``: nowhere.
    """

    def __init__(
        self,
        schedule: Schedule,
        stage: int,
        rank_of_stage: Callable[[int], int],
        device: torch.device,
        keys: Sequence[ShapeKey],
        shapes: ShapeCache,
        gradient_buffer: Callable[[int], Tensor],
        trace: list[tuple[str, float, float]] | None = None,
    ) -> None:
        self.stage = stage
        self.rank_of_stage = rank_of_stage
        self.device = device
        self.keys = keys
        self.shapes = shapes
        self.gradient_buffer = gradient_buffer
        headers = {
            stage - 1: header_microbatches(keys, shapes.received),
            stage: header_microbatches(keys, shapes.sent),
        }
        self.transfers = rank_transfers(schedule, stage, headers)
        self._next = 0
        self._outbox: dict[tuple[Kind, int], Tensor] = {}
        self._inbox: dict[tuple[Kind, int], tuple[Tensor, Any]] = {}
        self._sends: list[Any] = []
        self.trace = trace

    def offer(self, kind: Kind, microbatch: int, tensor: Tensor) -> None:
        """Hand over a tensor this rank sends (activation or gradient), then issue what became ready."""
        self._outbox[(kind, microbatch)] = tensor.detach().contiguous()
        self.pump()

    def take(self, kind: Kind, microbatch: int) -> Tensor:
        """The received activation or gradient of ``microbatch``: issue up to its receive and wait for it."""
        target = (kind, microbatch)
        while target not in self._inbox:
            if self._next >= len(self.transfers):
                raise RuntimeError(
                    f"stage {self.stage} waits for the {kind.name.lower()} of micro-batch {microbatch}, "
                    "which the schedule never sends to it"
                )
            self._issue(self.transfers[self._next], force=True)
        buffer, work = self._inbox.pop(target)
        start = time.perf_counter()
        work.wait()
        if self.trace is not None:
            self.trace.append((f"wait {kind.name[0]}{microbatch}", start, time.perf_counter()))
        return buffer

    def pump(self) -> None:
        """Issue transfers in order while the next one can go without waiting."""
        while self._next < len(self.transfers) and self._issue(self.transfers[self._next], force=False):
            pass

    def finish(self) -> None:
        """Issue everything left and wait for this rank's sends (their tensors may be reused after)."""
        while self._next < len(self.transfers):
            self._issue(self.transfers[self._next], force=True)
        if self._inbox:
            raise RuntimeError(f"stage {self.stage} received tensors no action used: {sorted(self._inbox)}")
        for work in self._sends:
            work.wait()
        self._sends = []

    # ------------------------------------------------------------------ one transfer
    def _issue(self, transfer: Transfer, force: bool) -> bool:
        """Issue ``transfer`` if it can go now (or, with ``force``, after waiting for the header it needs)."""
        peer = self.rank_of_stage(transfer.peer_stage)
        mb = transfer.microbatch
        if transfer.send:
            return self._issue_send(transfer, peer, force)
        if transfer.kind is Kind.HEADER:
            header = torch.empty(p2p.HEADER_LEN, dtype=torch.int64, device=self.device)
            self._inbox[(Kind.HEADER, mb)] = (header, dist.irecv(header, peer, tag=int(p2p.Tag.HEADER)))
        elif transfer.kind is Kind.ACTIVATION:
            key = self.keys[mb]
            if (Kind.HEADER, mb) in self._inbox:  # this activation's header was posted just before it
                if not force:
                    return False  # do not block on the header while actions could run
                header, work = self._inbox.pop((Kind.HEADER, mb))
                work.wait()
                self.shapes.received[key] = p2p.decode_header(header.cpu())
            dtype, shape = self.shapes.received[key]
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
            work = dist.irecv(buffer, peer, tag=int(p2p.Tag.ACTIVATION))
            self._inbox[(Kind.ACTIVATION, mb)] = (buffer, work)
        else:
            buffer = self.gradient_buffer(mb)
            self._inbox[(Kind.GRADIENT, mb)] = (buffer, dist.irecv(buffer, peer, tag=int(p2p.Tag.GRADIENT)))
        self._next += 1
        return True

    def _issue_send(self, transfer: Transfer, peer: int, force: bool) -> bool:
        mb = transfer.microbatch
        payload_kind = Kind.ACTIVATION if transfer.kind is Kind.HEADER else transfer.kind
        tensor = self._outbox.get((payload_kind, mb))
        if tensor is None:
            if force:
                raise RuntimeError(
                    f"stage {self.stage} must send the {payload_kind.name.lower()} of micro-batch {mb} "
                    f"(slot {transfer.slot}) before it can go on, but the action producing it has not run: "
                    "the schedule's order on this rank disagrees with its slots"
                )
            return False
        if transfer.kind is Kind.HEADER:
            self.shapes.sent[self.keys[mb]] = (tensor.dtype, tuple(tensor.shape))
            self._sends.append(dist.isend(p2p.encode_header(tensor), peer, tag=int(p2p.Tag.HEADER)))
        else:
            if transfer.kind is Kind.ACTIVATION:
                self._check_cached_shape(mb, tensor)
            del self._outbox[(payload_kind, mb)]
            tag = p2p.Tag.ACTIVATION if transfer.kind is Kind.ACTIVATION else p2p.Tag.GRADIENT
            self._sends.append(dist.isend(tensor, peer, tag=int(tag)))
        self._next += 1
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
