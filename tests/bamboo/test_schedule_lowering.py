"""Lowering schedules to per-rank programs with explicit SEND/RECV actions (data only, no processes)."""

from __future__ import annotations

import pytest

from lightning_bamboo.pipeline.engine import forward_only_schedule
from lightning_bamboo.pipeline.transfers import Kind, rank_transfers
from lightning_bamboo.schedule import (
    Action,
    ActionKind,
    Comm,
    CommKind,
    Schedule,
    ScheduleError,
    add_forward_redundancy,
    build_1f1b,
    format_program,
    lower_schedule,
    rank_program,
)

PLAIN_AND_REDUNDANT = (
    [pytest.param(build_1f1b(s, m), id=f"1f1b-{s}x{m}") for s in (2, 3, 4) for m in (1, 2, 4, 7)]
    + [
        pytest.param(add_forward_redundancy(build_1f1b(s, m), s, m), id=f"fr-{s}x{m}")
        for s in (2, 3, 4)
        for m in (1, 2, 4, 8)
    ]
    + [pytest.param(forward_only_schedule(3, 5), id="forward-only-3x5")]
)


def test_two_stage_redundant_program_golden() -> None:
    """2 stages x 4 micro-batches with FR: sends right after their producers, receives as early as the
    canonical order allows (rank 1 posts both first activations at once), FR needs no transfer."""
    programs = lower_schedule(add_forward_redundancy(build_1f1b(2, 4), 2, 4))
    assert format_program(programs[0]) == (
        "0F0 0SEND_F0 1FR0 0F1 0SEND_F1 0RECV_B0 0RECV_B1 1FR1 0B0 0F2 0SEND_F2 0B1 0F3 0SEND_F3 "
        "0RECV_B2 0RECV_B3 1FR2 1FR3 0B2 0B3"
    )
    assert format_program(programs[1]) == (
        "1RECV_F0 1RECV_F1 0FR0 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1 1RECV_F2 1RECV_F3 0FR1 1F2 1B2 1SEND_B2 "
        "1F3 1B3 1SEND_B3 0FR2 0FR3"
    )


@pytest.mark.parametrize("schedule", PLAIN_AND_REDUNDANT)
def test_lowered_operations_follow_the_canonical_transfer_order(schedule: Schedule) -> None:
    """For F/B schedules the lowering lists exactly ``rank_transfers`` (the order both link ends use)."""
    for rank, program in lower_schedule(schedule).items():
        ops = [(e.kind.is_send, e.kind.is_forward, e.microbatch) for e in program if isinstance(e, Comm)]
        expected = [(t.send, t.kind is Kind.ACTIVATION, t.microbatch) for t in rank_transfers(schedule, rank)]
        assert ops == expected


@pytest.mark.parametrize("schedule", PLAIN_AND_REDUNDANT)
def test_every_link_pairs_each_send_with_a_receive_in_the_same_order(schedule: Schedule) -> None:
    programs = lower_schedule(schedule)
    for rank, program in programs.items():
        for peer in programs:
            mine = [e for e in program if isinstance(e, Comm) and e.peer == peer]
            theirs = [e for e in programs[peer] if isinstance(e, Comm) and e.peer == rank]
            assert [e.key for e in mine] == [e.key for e in theirs]
            assert all(a.kind.is_send != b.kind.is_send for a, b in zip(mine, theirs))
            assert all(a.microbatch == b.microbatch for a, b in zip(mine, theirs))


@pytest.mark.parametrize("schedule", PLAIN_AND_REDUNDANT)
def test_sends_follow_their_producer_and_receives_precede_their_consumer(schedule: Schedule) -> None:
    for rank, program in lower_schedule(schedule).items():
        assert [e for e in program if isinstance(e, Action)] == rank_program(schedule, rank)
        for i, entry in enumerate(program):
            if isinstance(entry, Comm) and entry.kind.is_send:
                j = i - 1
                while isinstance(program[j], Comm) and program[j].kind.is_send:
                    j -= 1
                producer = program[j]
                assert isinstance(producer, Action) and producer.microbatch == entry.microbatch
                assert producer.stage == entry.stage
            if isinstance(entry, Action) and entry.kind in (ActionKind.FORWARD, ActionKind.BACKWARD):
                kind = CommKind.RECV_F if entry.kind is ActionKind.FORWARD else CommKind.RECV_B
                later = [
                    e
                    for e in program[i:]
                    if isinstance(e, Comm)
                    and e.kind is kind
                    and (e.stage, e.microbatch) == (entry.stage, entry.microbatch)
                ]
                assert not later, (rank, entry)


@pytest.mark.parametrize("shared_stream", [True, False], ids=["one-stream-per-rank", "one-stream-per-pair"])
@pytest.mark.parametrize("schedule", PLAIN_AND_REDUNDANT)
def test_lowered_programs_cannot_deadlock(schedule: Schedule, shared_stream: bool) -> None:
    """NCCL's model: a rank's operations run in issue order on one stream (or one per peer), a send and its
    receive complete together, and an action waits for the receives it consumes."""
    simulate(lower_schedule(schedule), shared_stream)


def test_lowering_names_a_missing_producer() -> None:
    schedule = {0: [None, None], 1: [Action(1, ActionKind.FORWARD, 0), Action(1, ActionKind.BACKWARD, 0)]}
    with pytest.raises(ScheduleError, match="1F0 needs 0F0, which no rank runs"):
        lower_schedule(schedule)


def test_the_model_detects_a_receive_posted_out_of_order() -> None:
    """Sanity check of the model: rank 1 posting its second activation receive before its first deadlocks."""
    programs = lower_schedule(build_1f1b(2, 2))
    first, second = [i for i, e in enumerate(programs[1]) if isinstance(e, Comm)][:2]
    programs[1][first], programs[1][second] = programs[1][second], programs[1][first]
    with pytest.raises(AssertionError, match="deadlock"):
        simulate(programs, shared_stream=True)


def simulate(programs: dict[int, list], shared_stream: bool) -> None:
    cursor = dict.fromkeys(programs, 0)
    streams: dict[tuple[int, int], list[tuple[int, Comm]]] = {}
    arrived: set[tuple[int, int, int, bool]] = set()  # (rank, stage, microbatch, activation?)
    progress = True
    while progress:
        progress = False
        for rank, program in programs.items():  # walk until an action waits for a receive
            while cursor[rank] < len(program):
                entry = program[cursor[rank]]
                if isinstance(entry, Comm):
                    stream = (rank, rank if shared_stream else entry.peer)
                    streams.setdefault(stream, []).append((rank, entry))
                elif entry.kind in (ActionKind.FORWARD, ActionKind.BACKWARD):
                    forward = entry.kind is ActionKind.FORWARD
                    needs = [
                        e
                        for e in program[: cursor[rank]]
                        if isinstance(e, Comm)
                        and not e.kind.is_send
                        and e.kind.is_forward == forward
                        and (e.stage, e.microbatch) == (entry.stage, entry.microbatch)
                    ]
                    if needs and (rank, entry.stage, entry.microbatch, forward) not in arrived:
                        break
                cursor[rank] += 1
                progress = True
        for (rank, _), ops in list(streams.items()):  # match stream heads
            while ops:
                _, comm = ops[0]
                peer_ops = streams.get((comm.peer, comm.peer if shared_stream else rank), [])
                if not peer_ops or peer_ops[0][1].key != comm.key:
                    break
                _, other = peer_ops.pop(0)
                ops.pop(0)
                recv_rank, recv = (comm.peer, other) if comm.kind.is_send else (rank, comm)
                arrived.add((recv_rank, recv.stage, recv.microbatch, recv.kind.is_forward))
                progress = True
    assert all(cursor[r] == len(p) for r, p in programs.items()), f"deadlock at {cursor}"
    assert not any(streams.values())
