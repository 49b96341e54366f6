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

from lbd_common import codec
from lightning_bamboo.pipeline import p2p
from lightning_bamboo.schedule import ActionKind, Schedule
from lightning_bamboo.schedule.lowering import Comm, CommKind

ShapeKey = tuple[Any, ...]
"""What an activation's shape is cached under: ``(train, signature of the micro-batch)``."""

STRUCTURED = -1
"""Dtype code of a header announcing a structured boundary; ``header[2]`` is the length of its JSON layout,
which follows as a second message (uint8) on the header tag."""
_ALIGN = 16
"""Each tensor of a packed boundary starts at a multiple of this many bytes."""


@dataclass(frozen=True)
class BoundaryLayout:
    """How a tuple, list or dict of tensors crossing a stage boundary lies in one flat byte buffer.

    The activation of a micro-batch travels as ONE uint8 message (so the number and the order of messages on
    a link are those of a single-tensor boundary), described once per micro-batch signature by this layout
    (JSON, never pickled). ``grads[i]``: the sender's tensor ``i`` is floating and requires grad, so the
    receiver makes it a leaf that requires grad and sends its gradient back; the gradient message packs the
    gradients of those tensors only, in order.
    """

    kind: str
    keys: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    grads: tuple[bool, ...]

    @staticmethod
    def of(value: Any, grads: bool) -> BoundaryLayout:
        kind, keys, tensors = boundary_tensors(value)
        return BoundaryLayout(
            kind,
            keys,
            tuple(codec.dtype_name(t.dtype, "between stages") for t in tensors),
            tuple(tuple(t.shape) for t in tensors),
            tuple(grads and t.is_floating_point() and t.requires_grad for t in tensors),
        )

    def to_bytes(self) -> bytes:
        fields = [self.kind, self.keys, self.dtypes, self.shapes, self.grads]
        return codec.json_bytes(fields, "boundary layout")

    @staticmethod
    def from_bytes(data: bytes) -> BoundaryLayout:
        """Inverse of :meth:`to_bytes`. Raises ``MalformedHeader`` (a ``RuntimeError``) for what it did not
        write."""
        value = codec.parse_json(data, "boundary layout")
        if not (isinstance(value, list) and len(value) == 5 and all(isinstance(v, list) for v in value[1:])):
            raise codec.MalformedHeader(f"corrupt boundary layout: {codec.shorten(value)}")
        kind, keys, dtypes, shapes, grads = value
        if kind not in ("tuple", "list", "dict") or not len(dtypes) == len(shapes) == len(grads):
            raise codec.MalformedHeader(f"corrupt boundary layout: {codec.shorten(value)}")
        for name in dtypes:
            codec.dtype_of(name, "boundary layout")
        return BoundaryLayout(
            kind,
            tuple(keys),
            tuple(dtypes),
            tuple(codec.checked_shape(s, "boundary layout") for s in shapes),
            tuple(bool(g) for g in grads),
        )

    def specs(self, gradients: bool = False) -> list[codec.Spec]:
        """The specs of the boundary's tensors (or of the gradients of :meth:`grad_indices`), in order."""
        which = self.grad_indices() if gradients else range(len(self.dtypes))
        return [codec.Spec(codec.dtype_of(self.dtypes[i]), self.shapes[i]) for i in which]

    def nbytes(self, gradients: bool = False) -> int:
        return codec.spans(self.specs(gradients), _ALIGN)[1]

    def grad_indices(self) -> list[int]:
        return [i for i, flag in enumerate(self.grads) if flag]

    def pack(self, tensors: Sequence[Tensor], gradients: bool = False) -> Tensor:
        """``tensors`` (the boundary's, or the gradients of :meth:`grad_indices`) in one uint8 buffer."""
        expected = len(self.grad_indices()) if gradients else len(self.dtypes)
        if len(tensors) != expected:
            raise ValueError(f"{len(tensors)} tensors to pack for a boundary layout of {expected}")
        return codec.pack(tensors, _ALIGN)

    def unpack(self, buffer: Tensor, gradients: bool = False) -> list[Tensor]:
        """The tensors in ``buffer``, each in its own (aligned, dense) storage, as the sender had them."""
        return codec.unpack(buffer, self.specs(gradients), _ALIGN, "stage boundary")

    def rebuild(self, tensors: list[Tensor]) -> Any:
        """The boundary value (tuple, list or dict) from its tensors in order."""
        if self.kind == "dict":
            return dict(zip(self.keys, tensors, strict=True))
        return tuple(tensors) if self.kind == "tuple" else list(tensors)


def boundary_tensors(value: Any) -> tuple[str, tuple[str, ...], list[Tensor]]:
    """``(kind, dict keys, tensors)`` of a structured boundary value: a tuple, list or str-keyed dict of
    tensors (one level).

    Raises:
        TypeError: for anything else, saying what a boundary may carry.
    """
    if isinstance(value, Mapping) and value and all(isinstance(k, str) for k in value):
        keys, items = tuple(value), list(value.values())
        kind = "dict"
    elif isinstance(value, (tuple, list)) and value and not hasattr(value, "_fields"):
        keys, items = (), list(value)
        kind = "tuple" if isinstance(value, tuple) else "list"
    else:
        items, kind, keys = [], "", ()
    if not kind or not all(isinstance(item, Tensor) for item in items):
        shown = type(value).__name__
        if kind:
            shown += " holding " + ", ".join(sorted({type(item).__name__ for item in items}))
        raise TypeError(
            f"got a {shown}: a stage boundary carries one tensor, or a non-empty tuple, list or dict (str "
            "keys) of tensors, one level deep"
        )
    return kind, keys, items


@dataclass
class Packed:
    """A structured boundary value ready to send: its bytes and their layout."""

    buffer: Tensor
    layout: BoundaryLayout


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
        sent: ``key -> (dtype, shape)`` of the activations this rank sent a header for (a
            :class:`BoundaryLayout` for a tuple/list/dict boundary).
        received: the same for the headers this rank received.
    """

    sent: dict[ShapeKey, tuple[torch.dtype, tuple[int, ...]] | BoundaryLayout] = field(default_factory=dict)
    received: dict[ShapeKey, tuple[torch.dtype, tuple[int, ...]] | BoundaryLayout] = field(
        default_factory=dict
    )


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
        position: this rank's position in its pipeline (for error messages, which call it its stage).
        rank_of_position: global rank of a position of this pipeline (``Comm.peer``).
        device: where receive buffers are allocated.
        keys: ``ShapeKey`` of every micro-batch of the step.
        shapes: the engine's shape cache (read and updated).
        gradient_buffer: ``micro-batch -> empty tensor`` shaped like this rank's output of it (the receive
            buffer of its gradient).
        trace: where to record ``(event, start, end)`` of every blocking receive wait; ``None``: nowhere.
    """

    def __init__(
        self,
        position: int,
        rank_of_position: Callable[[int], int],
        device: torch.device,
        keys: Sequence[ShapeKey],
        shapes: ShapeCache,
        gradient_buffer: Callable[[int], Tensor],
        trace: list[tuple[str, float, float]] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.position = position
        self.rank_of_position = rank_of_position
        self.device = device
        self.keys = keys
        self.shapes = shapes
        self.gradient_buffer = gradient_buffer
        self._header_in = header_microbatches(keys, shapes.received)
        self._header_out = header_microbatches(keys, shapes.sent)
        self._queue: deque[tuple[Comm, Tensor | Packed | None]] = deque()
        self._inbox: dict[tuple[Kind, int], tuple[Tensor, Any]] = {}
        self._sends: list[Any] = []
        self.trace = trace
        self.clock = clock
        """The clock of ``trace`` events."""

    def post(self, comm: Comm, tensor: Tensor | Packed | None = None) -> None:
        """Queue ``comm`` (a send with its ``tensor``, or a receive) and issue what can go without waiting."""
        if comm.kind.is_send and tensor is None:
            raise RuntimeError(f"stage {self.position}: {comm} has no tensor to send")
        if isinstance(tensor, Tensor):
            tensor = tensor.detach().contiguous()
        self._queue.append((comm, tensor))
        self._pump(force=False)

    def layout_in(self, microbatch: int) -> BoundaryLayout | None:
        """The layout of ``microbatch``'s received activation, if it is a structured boundary (else None)."""
        shape = self.shapes.received.get(self.keys[microbatch])
        return shape if isinstance(shape, BoundaryLayout) else None

    def take(self, kind: Kind, microbatch: int) -> Tensor:
        """The received activation or gradient of ``microbatch``: issue up to its receive and wait for it."""
        target = (kind, microbatch)
        while target not in self._inbox:
            if not self._queue:
                raise RuntimeError(
                    f"stage {self.position} waits for the {kind.name.lower()} of micro-batch {microbatch}, "
                    "which its lowered program never receives before this action"
                )
            self._issue(*self._queue[0], force=True)
        self._pump(force=False)  # what queued behind a header may go now
        buffer, work = self._inbox.pop(target)
        start = self.clock()
        work.wait()
        if self.trace is not None:
            self.trace.append((f"wait {kind.name[0]}{microbatch}", start, self.clock()))
        layout = self.layout_in(microbatch) if kind is Kind.ACTIVATION else None
        return buffer if layout is None else layout.rebuild(layout.unpack(buffer))

    def finish(self) -> None:
        """Issue everything left and wait for this rank's sends (their tensors may be reused after)."""
        self._pump(force=True)
        if self._inbox:
            unused = sorted(self._inbox)
            raise RuntimeError(f"stage {self.position} received tensors no action used: {unused}")
        for work in self._sends:
            work.wait()
        self._sends = []

    def _pump(self, force: bool) -> None:
        while self._queue and self._issue(*self._queue[0], force=force):
            pass

    # ------------------------------------------------------------------ one operation
    def _issue(self, comm: Comm, tensor: Tensor | Packed | None, force: bool) -> bool:
        """Issue the queue's head ``comm`` if it can go now (or, with ``force``, after its header)."""
        peer = self.rank_of_position(comm.peer)
        mb = comm.microbatch
        if comm.kind is CommKind.SEND_F:
            assert tensor is not None
            key = self.keys[mb]
            described = tensor.layout if isinstance(tensor, Packed) else (tensor.dtype, tuple(tensor.shape))
            if mb in self._header_out:
                self.shapes.sent[key] = described
                for header in _headers(tensor):
                    self._sends.append(dist.isend(header, peer, tag=int(p2p.Tag.HEADER)))
                self._header_out.discard(mb)
            else:
                self._check_cached_shape(mb, described)
            payload = tensor.buffer if isinstance(tensor, Packed) else tensor
            self._sends.append(dist.isend(payload, peer, tag=int(p2p.Tag.ACTIVATION)))
        elif comm.kind is CommKind.SEND_B:
            assert isinstance(tensor, Tensor)
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
                self.shapes.received[key] = self._read_header(header, peer)
                self._header_in.discard(mb)
            described = self.shapes.received[key]
            if isinstance(described, BoundaryLayout):
                buffer = torch.empty(described.nbytes(), dtype=torch.uint8, device=self.device)
            else:
                buffer = torch.empty(described[1], dtype=described[0], device=self.device)
            work = dist.irecv(buffer, peer, tag=int(p2p.Tag.ACTIVATION))
            self._inbox[(Kind.ACTIVATION, mb)] = (buffer, work)
        else:
            buffer = self.gradient_buffer(mb)
            self._inbox[(Kind.GRADIENT, mb)] = (buffer, dist.irecv(buffer, peer, tag=int(p2p.Tag.GRADIENT)))
        self._queue.popleft()
        return True

    def _read_header(
        self, header: Tensor, peer: int
    ) -> tuple[torch.dtype, tuple[int, ...]] | BoundaryLayout:
        """A single tensor's ``(dtype, shape)``, or, for a structured boundary, the layout that follows."""
        values = header.cpu()
        if int(values[0]) != STRUCTURED:
            return p2p.decode_header(values)
        length = codec.check_header_length(int(values[2]), f"boundary layout from rank {peer}")
        payload = torch.empty(length, dtype=torch.uint8, device=self.device)
        dist.irecv(payload, peer, tag=int(p2p.Tag.HEADER)).wait()  # sent right behind the header
        return BoundaryLayout.from_bytes(codec.tensor_bytes(payload))

    def _check_cached_shape(self, mb: int, described: Any) -> None:
        expected = self.shapes.sent[self.keys[mb]]
        if described != expected:
            raise RuntimeError(
                f"stage {self.position}'s output for micro-batch {mb} is {_shown(described)}, but an earlier "
                f"micro-batch with the same input shapes gave {_shown(expected)}; the engine sends an "
                "activation's shape once per micro-batch shape, so a stage's output shapes (and which of its "
                "tensors require grad) must follow from its input shapes"
            )


def _shown(described: Any) -> str:
    if isinstance(described, BoundaryLayout):
        parts = [f"{d} {list(s)}{' (grad)' if g else ''}"
                 for d, s, g in zip(described.dtypes, described.shapes, described.grads, strict=True)]
        return f"a {described.kind} of " + ", ".join(parts)
    return f"{described[0]} of shape {described[1]}"


def _headers(tensor: Tensor | Packed) -> list[Tensor]:
    """The header message(s) announcing ``tensor``: one int64 header, plus the JSON layout of a packed one."""
    if isinstance(tensor, Tensor):
        return [p2p.encode_header(tensor)]
    layout = tensor.layout.to_bytes()
    header = torch.zeros(p2p.HEADER_LEN, dtype=torch.int64)
    header[0], header[1], header[2] = STRUCTURED, 1, len(layout)
    device = tensor.buffer.device
    return [header.to(device), codec.bytes_tensor(layout, device)]
