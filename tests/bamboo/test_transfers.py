"""The engine's point-to-point plan (canonical order, headers once per shape) and the asynchronous engine
over micro-batches whose shape changes, checked against single-process training."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from lightning_bamboo.pipeline.engine import forward_only_schedule
from lightning_bamboo.pipeline.transfers import (
    Kind,
    Transfer,
    header_microbatches,
    microbatch_signature,
    rank_transfers,
)
from lightning_bamboo.schedule import ActionKind, Schedule, add_forward_redundancy, build_1f1b, rank_program
from tests.bamboo.launch import run_script
from tests.bamboo.scripts import engine_shapes

SCHEDULES = (
    [pytest.param(build_1f1b(s, m), id=f"1f1b-{s}x{m}") for s in (2, 3, 4) for m in (1, 2, 4, 7)]
    + [
        pytest.param(add_forward_redundancy(build_1f1b(s, m), s, m), id=f"fr-{s}x{m}")
        for s in (2, 3, 4)
        for m in (1, 2, 4, 8)
    ]
    + [pytest.param(forward_only_schedule(3, 5), id="forward-only-3x5")]
)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_both_ends_of_every_link_issue_the_same_sequence(schedule: Schedule) -> None:
    """NCCL matches a pair's operations in issue order: the two ends must list the same messages, in the
    same order, one sending what the other receives."""
    last_mb = max(action.microbatch for action in rank_program(schedule, 0))
    headers = {link: {0, last_mb} for link in range(len(schedule) - 1)}  # first and last micro-batch
    for link in range(len(schedule) - 1):
        lower = [t for t in rank_transfers(schedule, link, headers) if t.link == link]
        upper = [t for t in rank_transfers(schedule, link + 1, headers) if t.link == link]
        assert [(t.slot, t.kind, t.microbatch) for t in lower] == [
            (t.slot, t.kind, t.microbatch) for t in upper
        ]
        assert all(a.send != b.send for a, b in zip(lower, upper))
        assert all(t.send == (t.kind is not Kind.GRADIENT) for t in lower)
        assert [t.microbatch for t in lower if t.kind is Kind.HEADER] == sorted(headers[link])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_needed_receive_never_waits_behind_an_unproduced_send(schedule: Schedule) -> None:
    """Walking a rank's program: when an action takes a message, every send listed before that message
    was produced by an action already run (so ``StepTransfers.take`` can always issue up to it)."""
    last = len(schedule) - 1
    for stage in schedule:
        transfers = rank_transfers(schedule, stage)
        position = {(t.kind, t.microbatch, t.send): i for i, t in enumerate(transfers)}
        produced: set[tuple[Kind, int]] = set()
        for action in rank_program(schedule, stage):
            needs = None
            if action.kind is ActionKind.FORWARD and stage > 0:
                needs = (Kind.ACTIVATION, action.microbatch, False)
            elif action.kind is ActionKind.BACKWARD and stage < last:
                needs = (Kind.GRADIENT, action.microbatch, False)
            if needs is not None:
                for earlier in transfers[: position[needs]]:
                    if earlier.send:
                        assert (earlier.kind, earlier.microbatch) in produced, (stage, action, earlier)
            if action.kind is ActionKind.FORWARD and stage < last:
                produced.add((Kind.ACTIVATION, action.microbatch))
            elif action.kind is ActionKind.BACKWARD and stage > 0:
                produced.add((Kind.GRADIENT, action.microbatch))


def test_rank_order_of_the_redundant_two_stage_schedule() -> None:
    """Rank 1 of 2 stages x 4 micro-batches with FR: receives in slot order, its gradient sends between."""
    schedule = add_forward_redundancy(build_1f1b(2, 4), 2, 4)
    order = [
        ("send" if t.send else "recv", t.kind.name[0], t.microbatch, t.slot)
        for t in rank_transfers(schedule, 1, {0: {0}})
    ]
    assert order == [
        ("recv", "H", 0, 0),
        ("recv", "A", 0, 0),
        ("recv", "A", 1, 2),
        ("send", "G", 0, 2),
        ("send", "G", 1, 4),
        ("recv", "A", 2, 5),
        ("recv", "A", 3, 7),
        ("send", "G", 2, 7),
        ("send", "G", 3, 9),
    ]


def test_headers_go_once_per_microbatch_shape() -> None:
    small, big = (
        microbatch_signature((torch.zeros(1, 8), torch.zeros(1, 1))),
        microbatch_signature((torch.zeros(2, 8), torch.zeros(2, 1))),
    )
    assert small != big
    assert microbatch_signature({"x": torch.zeros(2, 8, dtype=torch.float64)}) != microbatch_signature(
        {"x": torch.zeros(2, 8)}
    )
    assert header_microbatches([big, big, small, big], {}) == {0, 2}
    assert header_microbatches([big, big, small, big], {big: None}) == {2}
    assert header_microbatches([big, big], {big: None, small: None}) == set()


# --------------------------------------------------------------------------------------------------
# the engine itself, three ranks


def reference() -> list[dict[str, torch.Tensor]]:
    """Single-process SGD on the whole body: mean of the micro-batch losses per step, parameters after;
    first the initial parameters, last the evaluation loss."""
    body = engine_shapes.body()
    optimizer = torch.optim.SGD(body.parameters(), lr=engine_shapes.LR, momentum=engine_shapes.MOMENTUM)
    states = [{k: v.detach().clone() for k, v in body.named_parameters()}]
    for x, y in engine_shapes.batches():
        losses = [F.mse_loss(body(xs), ys) for xs, ys in zip(x.chunk(2), y.chunk(2))]
        loss = torch.stack(losses).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        params = {k: v.detach().clone() for k, v in body.named_parameters()}
        states.append({"loss": loss.detach().reshape(1), **params})
    x, y = engine_shapes.eval_batch()
    with torch.no_grad():
        losses = [F.mse_loss(body(a), b) for a, b in zip(x.chunk(3), y.chunk(3))]
    states.append({"loss": torch.stack(losses).mean().reshape(1)})
    return states


@pytest.mark.multiprocess
@pytest.mark.slow
def test_engine_with_changing_microbatch_shapes_matches_single_process(tmp_path: Path) -> None:
    """3 ranks, FR schedule, micro-batches of 2, 2, 1, 2, 1 rows: losses and stages equal the single
    process; the replica exchange is left in flight after each step and the replica's forward pre-hook
    applies it, so every FR runs with the successor's current parameters (and equals its F bit for bit)."""
    run_script("engine_shapes.py", ["--out", str(tmp_path), "--stages", "3"], timeout=150)
    expected = reference()
    tol = {"rtol": 1e-10, "atol": 1e-12}
    names = set(expected[0])
    prior: list[dict[str, torch.Tensor]] = []  # the ranks' snapshots of the previous step
    for step in range(1, len(engine_shapes.SIZES) + 1):
        ranks = [load_file(str(tmp_path / f"step{step}_rank{r}.safetensors")) for r in range(3)]
        covered = set()
        for rank, got in enumerate(ranks):
            successor = ranks[(rank + 1) % 3]
            torch.testing.assert_close(got["loss"], expected[step]["loss"], **tol)
            assert got["pending"].tolist() == [True]
            for key in (k for k in got if k.startswith("own/")):
                name = key[len("own/") :]
                torch.testing.assert_close(got[key], expected[step][name], **tol, msg=f"step {step} {key}")
                covered.add(name)
            for key in (k for k in got if k.startswith("replica_used/")):
                name = key[len("replica_used/") :]
                before = expected[0][name] if step == 1 else prior[(rank + 1) % 3][f"own/{name}"]
                torch.testing.assert_close(got[key], before, rtol=0, atol=0, msg=f"step {step} {key}")
            # rank s's FR of stage s+1 equals stage s+1's own F, bit for bit (the last rank: stage 0's)
            frs = {k: v for k, v in got.items() if k.startswith("fr/")}
            assert len(frs) == engine_shapes.MICROBATCHES
            for key, value in frs.items():
                torch.testing.assert_close(value, successor["fwd/" + key[len("fr/") :]], rtol=0, atol=0)
        assert covered == names
        prior = ranks
    for rank in range(3):
        got = load_file(str(tmp_path / f"eval_rank{rank}.safetensors"))
        torch.testing.assert_close(got["loss"], expected[-1]["loss"], **tol)
        for key in (k for k in got if k.startswith("replica/")):  # the final replica, read via ReplicaSync
            twin = prior[(rank + 1) % 3]["own/" + key[len("replica/") :]]
            torch.testing.assert_close(got[key], twin, rtol=0, atol=0)
        # training: micro-batches of 2 and 1 rows; evaluation: 2 rows, a third shape key (eval mode)
        received, sent = got["received_sent"].tolist()
        assert (received, sent) == ((0 if rank == 0 else 3), (0 if rank == 2 else 3))


def simulate_rendezvous(
    schedule: Schedule,
    headers: dict[int, set[int]],
    shared_stream: bool,
    order: Callable[[Schedule, int, dict[int, set[int]]], list[Transfer]] = rank_transfers,
) -> None:
    """Run every rank's program with NCCL-like point-to-point semantics and fail on a deadlock.

    Each rank issues its transfers in ``rank_transfers`` order (a receive when every earlier one is
    issued; a send once its action ran; an activation receive after its header arrived) onto a stream
    that runs them one at a time: one stream per rank for all peers (``shared_stream``), or one per peer.
    An operation completes only when it is at the head of its stream and the matching operation is at
    the head of the peer's. An action runs once the tensors it takes have arrived.
    """
    stages = len(schedule)
    programs = {r: rank_program(schedule, r) for r in range(stages)}
    transfers = {r: order(schedule, r, headers) for r in range(stages)}
    issued = dict.fromkeys(range(stages), 0)
    done = dict.fromkeys(range(stages), 0)
    streams: dict[tuple[int, int], list] = {}
    arrived: set[tuple[int, Kind, int]] = set()  # (rank, kind, micro-batch) received
    produced: set[tuple[int, Kind, int]] = set()
    last = stages - 1

    def stream_of(rank: int, peer: int) -> tuple[int, int]:
        return (rank, -1) if shared_stream else (rank, peer)

    while any(done[r] < len(programs[r]) for r in programs) or any(streams.values()):
        progress = False
        for r in programs:  # issue
            while issued[r] < len(transfers[r]):
                t = transfers[r][issued[r]]
                payload = Kind.ACTIVATION if t.kind is Kind.HEADER else t.kind
                if t.send and (r, payload, t.microbatch) not in produced:
                    break
                has_header = t.microbatch in headers.get(t.link, set())
                if (
                    not t.send
                    and t.kind is Kind.ACTIVATION
                    and has_header
                    and (r, Kind.HEADER, t.microbatch) not in arrived
                ):
                    break
                streams.setdefault(stream_of(r, t.peer_stage), []).append((r, t))
                issued[r] += 1
                progress = True
        for ops in list(streams.values()):  # complete matching heads
            if not ops:
                continue
            r, t = ops[0]
            peer_ops = streams.get(stream_of(t.peer_stage, r), [])
            if peer_ops:
                p, u = peer_ops[0]
                if (u.link, u.kind, u.microbatch, u.send) == (t.link, t.kind, t.microbatch, not t.send):
                    ops.pop(0)
                    peer_ops.pop(0)
                    receiver = r if not t.send else p
                    arrived.add((receiver, t.kind, t.microbatch))
                    progress = True
        for r in programs:  # compute
            while done[r] < len(programs[r]):
                action = programs[r][done[r]]
                if (
                    action.kind is ActionKind.FORWARD
                    and r > 0
                    and (r, Kind.ACTIVATION, action.microbatch) not in arrived
                ):
                    break
                if (
                    action.kind is ActionKind.BACKWARD
                    and r < last
                    and (r, Kind.GRADIENT, action.microbatch) not in arrived
                ):
                    break
                if action.kind is ActionKind.FORWARD and r < last:
                    produced.add((r, Kind.ACTIVATION, action.microbatch))
                if action.kind is ActionKind.BACKWARD and r > 0:
                    produced.add((r, Kind.GRADIENT, action.microbatch))
                done[r] += 1
                progress = True
        if not progress:
            heads = {key: ops[0][1] for key, ops in streams.items() if ops}
            raise AssertionError(f"deadlock: programs at {done}, stream heads {heads}")
    assert all(issued[r] == len(transfers[r]) for r in programs), issued


@pytest.mark.parametrize("shared_stream", [True, False], ids=["one-stream-per-rank", "one-stream-per-pair"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_no_deadlock_when_every_operation_waits_for_its_peer(schedule: Schedule, shared_stream: bool) -> None:
    """The strictest point-to-point model (NCCL's: operations run in issue order and a send waits for its
    receive), with and without shape headers, cannot wait in a cycle."""
    simulate_rendezvous(schedule, {}, shared_stream)
    last_mb = max(action.microbatch for action in rank_program(schedule, 0))
    simulate_rendezvous(schedule, {link: {0, last_mb} for link in range(len(schedule) - 1)}, shared_stream)


def test_the_rendezvous_model_detects_an_inconsistent_order() -> None:
    """Sanity check of the model: if rank 1 listed its sends before its receives, it would wait forever."""

    def sends_first_on_rank_1(schedule: Schedule, stage: int, headers: dict[int, set[int]]) -> list:
        transfers = rank_transfers(schedule, stage, headers)
        return sorted(transfers, key=lambda t: not t.send) if stage == 1 else transfers

    with pytest.raises(AssertionError, match="deadlock"):
        simulate_rendezvous(build_1f1b(2, 2), {}, shared_stream=True, order=sends_first_on_rank_1)
