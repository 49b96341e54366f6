"""The bounded-stale exchange's read policy, in one process: fake P2P works that complete when told to.

A fake work's ``wait()`` blocks until the test delivers it, like a gloo receive whose data has not come in
(gloo's works report ``is_completed()`` only after ``wait()``, so the exchange's communication thread
waits for them and flags each buffer as it arrives). The multi-process runs are in ``test_strategy.py``.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lightning_dorylus import DorylusStrategy
from lightning_dorylus.graph.stale import StaleGhostExchange, _InFlight, choose_buffer


class FakeWork:
    """A receive that completes when :meth:`deliver` is called (or fails with ``error``)."""

    def __init__(self, error: Exception | None = None) -> None:
        self._delivered = threading.Event()
        self._error = error

    def deliver(self) -> None:
        self._delivered.set()

    def wait(self) -> bool:
        assert self._delivered.wait(10), "a fake work was never delivered"
        if self._error is not None:
            raise self._error
        return True


def post(exchange: StaleGhostExchange, epoch: int, delivered: bool) -> tuple[_InFlight, FakeWork]:
    """Posts epoch ``epoch``'s receive of layer 0's ghost rows (its value: the epoch)."""
    work = FakeWork()
    inflight = _InFlight(epoch, torch.full((2,), float(epoch)), [work], [])
    exchange.post(0, "rows", inflight)
    if delivered:
        arrive(inflight, work)
    return inflight, work


def arrive(inflight: _InFlight, work: FakeWork) -> None:
    work.deliver()
    assert inflight.arrived.wait(5), "the communication thread did not flag the delivered buffer"


def deliver_when_blocked(exchange: StaleGhostExchange, work: FakeWork) -> None:
    """Delivers ``work`` once the exchange counts a blocking read (after 5 s anyway: the test then fails on
    its counters instead of hanging), so the read cannot find it arrived however slow the machine."""
    waits = exchange.waits

    def deliver() -> None:
        for _ in range(5000):
            if exchange.waits > waits:
                break
            time.sleep(0.001)
        work.deliver()

    threading.Thread(target=deliver, daemon=True).start()


@pytest.mark.parametrize(
    ("stamps", "arrived", "epoch", "staleness", "policy", "expected"),
    [
        ([3], [True], 3, 1, "freshest", 0),  # this epoch's arrived: age 0
        ([2, 3], [True, False], 3, 1, "freshest", 0),  # not yet: last epoch's, no wait
        ([2, 3], [True, True], 3, 1, "freshest", 1),
        ([1, 2, 3], [True, False, False], 3, 1, "freshest", 1),  # epoch 1 too old: wait for epoch 2's
        ([1, 2, 3], [True, True, True], 3, 2, "oldest", 0),  # oldest: always e - S
        ([2, 3], [True, True], 3, 1, "oldest", 0),
        ([0], [False], 0, 2, "oldest", 0),  # epochs before S: the oldest there is
    ],
)
def test_choose_buffer(stamps, arrived, epoch, staleness, policy, expected) -> None:
    assert choose_buffer(stamps, arrived, epoch, staleness, policy) == expected


def test_freshest_reads_what_has_arrived_and_waits_only_when_nothing_fresh_enough_has() -> None:
    exchange = StaleGhostExchange(1, group=None)
    try:
        _, w0 = post(exchange, 0, delivered=False)
        deliver_when_blocked(exchange, w0)
        assert exchange.take(0, "rows", 0).epoch == 0  # nothing older: waits for epoch 0's (exact)
        assert (exchange.waits, exchange.max_age) == (1, 0)

        _, w1 = post(exchange, 1, delivered=False)
        assert exchange.take(0, "rows", 1).epoch == 0  # epoch 1's not in: epoch 0's again, no wait
        assert (exchange.waits, exchange.max_age) == (1, 1)

        b2, w2 = post(exchange, 2, delivered=False)
        deliver_when_blocked(exchange, w1)
        assert exchange.take(0, "rows", 2).epoch == 1  # epoch 0 is too old: waits for epoch 1's
        assert exchange.waits == 2
        assert [f.epoch for f in exchange._held[(0, "rows")]] == [1, 2]  # epoch 0's freed

        arrive(b2, w2)
        b3, w3 = post(exchange, 3, delivered=False)
        arrive(b3, w3)
        assert exchange.take(0, "rows", 3).epoch == 3  # the freshest arrived
        assert [f.epoch for f in exchange._held[(0, "rows")]] == [3]
        assert exchange.reads == 4 and exchange.waits == 2
        assert exchange.ages == {0: 2, 1: 2} and exchange.max_age == 1

        exchange.drain()  # keeps what has arrived for the next epoch's read
        post(exchange, 4, delivered=False)
        assert exchange.take(0, "rows", 4).epoch == 3
        exchange._held[(0, "rows")][-1].works[0].deliver()
        exchange.drain(discard=True)  # a checkpoint: the next read is exact
        assert exchange._held == {}
        _, w5 = post(exchange, 5, delivered=False)
        deliver_when_blocked(exchange, w5)
        assert exchange.take(0, "rows", 5).epoch == 5
        assert exchange.waits == 3
    finally:
        exchange.drain(discard=True)


@pytest.mark.parametrize(("staleness", "ages"), [(1, [0, 1, 1, 1]), (2, [0, 1, 2, 2])])
def test_oldest_always_reads_epoch_e_minus_s(staleness: int, ages: list[int]) -> None:
    exchange = StaleGhostExchange(staleness, group=None, reads="oldest")
    try:
        for epoch, age in enumerate(ages):
            post(exchange, epoch, delivered=True)  # even when this epoch's has arrived
            chosen = exchange.take(0, "rows", epoch)
            assert epoch - chosen.epoch == age
            assert chosen.buffer[0].item() == chosen.epoch
        assert exchange.waits == 0 and exchange.max_age == staleness
        assert len(exchange._held[(0, "rows")]) == staleness + 1  # epochs e - S .. e
        # the one of epoch e - S not in yet: waits for it though the newer ones are there
        exchange.drain(discard=True)
        first, w0 = post(exchange, 0, delivered=False)
        deliver_when_blocked(exchange, w0)
        assert exchange.take(0, "rows", 0) is first and exchange.waits == 1
    finally:
        exchange.drain(discard=True)


def test_a_failed_message_is_raised_in_the_training_thread() -> None:
    exchange = StaleGhostExchange(1, group=None)
    work = FakeWork(error=RuntimeError("Connection closed by peer"))
    exchange.post(0, "rows", _InFlight(0, torch.zeros(2), [work], []))
    deliver_when_blocked(exchange, work)
    failed = "a stale ghost exchange message failed"
    with pytest.raises(RuntimeError, match=f"{failed}: Connection closed by peer"):
        exchange.take(0, "rows", 0)
    with pytest.raises(RuntimeError, match=failed):
        exchange.drain(discard=True)
    assert exchange._completer._thread is None  # stopped all the same


@pytest.mark.parametrize("bad", ["newest", None, 1])
def test_bad_stale_reads_is_rejected(bad) -> None:
    match = r"stale_reads=.*: expected 'freshest' \(the freshest arrived ghosts, Dorylus\) or 'oldest'"
    with pytest.raises(ValueError, match=match):
        DorylusStrategy(staleness=1, stale_reads=bad)
    with pytest.raises(ValueError, match=match):
        StaleGhostExchange(1, group=None, reads=bad)


@pytest.mark.parametrize("staleness", [None, 0])
def test_oldest_reads_need_staleness(staleness) -> None:
    match = rf"stale_reads='oldest' needs staleness >= 1 \(staleness={staleness} reads no stale ghosts\)"
    with pytest.raises(ValueError, match=match):
        DorylusStrategy(staleness=staleness, stale_reads="oldest")
    assert DorylusStrategy(staleness=1, stale_reads="oldest").stale_reads == "oldest"
