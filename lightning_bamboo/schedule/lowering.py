"""Lowering a schedule to per-rank programs with explicit ``SEND``/``RECV`` actions.

A schedule says which rank computes what and when; it leaves the tensors that cross ranks implicit. This
pass makes them explicit, as ``torch.distributed.pipelining`` does (``_add_send_recv``: ``SEND_F``,
``RECV_F``, ``SEND_B``, ``RECV_B``), so that the runtime only walks a list. Transfers are derived from who
*produces* a tensor and who *consumes* it, so ``F``, ``B`` and ``FR`` share this one pass:

* a stage's output of micro-batch ``i`` is produced by its ``F`` and consumed by the next stage's ``F``;
* a stage's input gradient is produced by its ``B`` and consumed by the previous stage's ``B``;
* ``FR(s+1, i)`` reads rank ``s``'s own output (or, on the last rank, the micro-batch): nothing is sent.

Placement, per rank:

* ``SEND`` right after the action that produces the tensor (posted as early as possible; the runtime
  waits for sends only at the end of the step);
* ``RECV`` (posting the non-blocking receive) as early as the **canonical order** allows; the wait happens
  inside the consuming action, as late as possible.

Canonical order: every transfer is keyed by ``(slot of its producer, lower rank, higher rank, kind,
sending rank)``, and both ends of a link issue their operations in that order. Both derive it from the
same schedule, so gloo (matching per peer and tag in issue order) and NCCL (matching a pair's operations
in issue order, one stream) always pair the k-th operation on one side with the k-th on the other; and the
order across links is the slot order, a valid execution of the schedule, so no cycle of waits can form. A
``RECV`` therefore goes right after the rank's previous operation in that order (at the start if it has
none); a ``SEND`` cannot move earlier than its producer, so a ``RECV`` listed after a ``SEND`` waits for the
action producing that send.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from .actions import Action, ActionKind, Schedule, ScheduleError

__all__ = ["Comm", "CommKind", "LoweredAction", "format_program", "lower_schedule", "transfers_of"]

F, B = ActionKind.FORWARD, ActionKind.BACKWARD


class CommKind(str, Enum):
    """A point-to-point operation of one rank (names as in ``torch.distributed.pipelining``)."""

    SEND_F = "SEND_F"
    """Send a stage's output activation to the rank running the next stage."""
    RECV_F = "RECV_F"
    """Post the receive of a stage's input activation."""
    SEND_B = "SEND_B"
    """Send a stage's input gradient to the rank running the previous stage."""
    RECV_B = "RECV_B"
    """Post the receive of a stage's output gradient."""

    @property
    def is_send(self) -> bool:
        return self in (CommKind.SEND_F, CommKind.SEND_B)

    @property
    def is_forward(self) -> bool:
        return self in (CommKind.SEND_F, CommKind.RECV_F)


@dataclass(frozen=True)
class Comm:
    """One send or receive of a rank.

    Attributes:
        stage: the stage on THIS rank the tensor belongs to: the producer's stage for a send, the consumer's
            for a receive (``1RECV_F0``: stage 1 receives its input of micro-batch 0).
        kind: send or receive, activation (``F``) or gradient (``B``).
        microbatch: the micro-batch.
        peer: the rank (position in the pipeline) at the other end.
        key: the canonical order key, the same at both ends of the link.
    """

    stage: int
    kind: CommKind
    microbatch: int
    peer: int
    key: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"


LoweredAction = Action | Comm
"""An entry of a lowered program: a compute action or a point-to-point operation."""


@dataclass(frozen=True)
class _Transfer:
    producer: Action
    consumer: Action
    sender: int
    receiver: int
    key: tuple[int, ...]


def transfers_of(schedule: Schedule) -> list[_Transfer]:
    """Every tensor that crosses ranks in ``schedule``, in canonical order.

    Raises:
        ScheduleError: if a consumer's input is produced by no action of the schedule.
    """
    where: dict[Action, tuple[int, int]] = {}
    for rank, row in schedule.items():
        for slot, action in enumerate(row):
            if action is not None:
                where[action] = (rank, slot)
    last = max((a.stage for a in where), default=0)
    transfers = []
    for consumer, (receiver, _) in where.items():
        producer = _producer(consumer, last, where)
        if producer is None:
            continue
        sender, slot = where[producer]
        if sender == receiver:
            continue
        kind = 0 if consumer.kind is F else 1
        key = (slot, min(sender, receiver), max(sender, receiver), kind, sender)
        transfers.append(_Transfer(producer, consumer, sender, receiver, key))
    return sorted(transfers, key=lambda t: t.key)


def _producer(consumer: Action, last: int, where: dict[Action, tuple[int, int]]) -> Action | None:
    """The action whose output ``consumer`` reads from ANOTHER stage (``None``: it reads none)."""
    stage, mb = consumer.stage, consumer.microbatch
    if consumer.kind is F and stage > 0:
        producer = Action(stage - 1, F, mb)
    elif consumer.kind is B and stage < last:
        producer = Action(stage + 1, B, mb)
    else:  # FR reads its own rank's output or the micro-batch; the last stage's B reads the loss
        return None
    if producer not in where:
        raise ScheduleError(f"{consumer} needs {producer}, which no rank runs")
    return producer


def lower_schedule(schedule: Schedule) -> dict[int, list[LoweredAction]]:
    """Each rank's program with its ``SEND``/``RECV`` operations placed (see the module docstring).

    Args:
        schedule: any valid schedule (plain or redundant); one pipeline.

    Returns:
        rank -> compute actions in slot order, with ``Comm`` entries in between.
    """
    transfers = transfers_of(schedule)
    sends_after: dict[Action, list[Comm]] = {}
    recvs_after: dict[Action | None, list[Comm]] = {}
    ops_of_rank: dict[int, list[tuple[Comm, Action | None]]] = {rank: [] for rank in schedule}
    for t in transfers:
        forward = t.consumer.kind is F
        send = Comm(
            t.producer.stage,
            CommKind.SEND_F if forward else CommKind.SEND_B,
            t.producer.microbatch,
            t.receiver,
            t.key,
        )
        recv = Comm(
            t.consumer.stage,
            CommKind.RECV_F if forward else CommKind.RECV_B,
            t.consumer.microbatch,
            t.sender,
            t.key,
        )
        ops_of_rank[t.sender].append((send, t.producer))
        ops_of_rank[t.receiver].append((recv, None))
    for rank, ops in ops_of_rank.items():
        anchor: Action | None = None  # a receive goes right after the rank's previous operation
        for comm, producer in ops:  # already in canonical order
            if producer is not None:
                sends_after.setdefault(producer, []).append(comm)
                anchor = producer
            else:
                recvs_after.setdefault(_anchor_key(rank, anchor), []).append(comm)  # type: ignore[arg-type]
    programs: dict[int, list[LoweredAction]] = {}
    for rank, row in schedule.items():
        program: list[LoweredAction] = list(recvs_after.get(_anchor_key(rank, None), []))  # type: ignore[arg-type]
        for action in row:
            if action is None:
                continue
            program.append(action)
            program += sends_after.get(action, [])
            program += recvs_after.get(action, [])
        programs[rank] = program
    _check_receives_precede_consumers(programs)
    return programs


def _anchor_key(rank: int, anchor: Action | None) -> Action | tuple[str, int]:
    return anchor if anchor is not None else ("start", rank)  # type: ignore[return-value]


def _check_receives_precede_consumers(programs: dict[int, list[LoweredAction]]) -> None:
    """A receive must be posted before the action that consumes it (a broken lowering, not a user error)."""
    for rank, program in programs.items():
        done: set[tuple[int, int, bool]] = set()
        for entry in program:
            if isinstance(entry, Action):
                if entry.kind in (F, B):
                    done.add((entry.stage, entry.microbatch, entry.kind is F))
            elif not entry.kind.is_send and (entry.stage, entry.microbatch, entry.kind.is_forward) in done:
                raise ScheduleError(f"rank {rank}: {entry} is posted after the action that needs it")


def format_program(program: Sequence[LoweredAction]) -> str:
    """One rank's lowered program as text: ``0F0 0SEND_F0 0RECV_B0 ...``."""
    return " ".join(str(entry) for entry in program)
