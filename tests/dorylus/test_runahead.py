"""RunAhead: a prefetch is used only for the step and intervals it was made for; drains keep or drop it."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from lightning_dorylus.nn.runahead import Prefetch, RunAhead


def _prefetch(key: int, blocks: list, done: bool = True) -> Prefetch:
    future: Future = Future()
    if done:
        future.set_result({"h": torch.zeros(1)})
    return Prefetch(key, blocks, None, [future], {"weight": torch.zeros(1)})


def test_prefetch_is_used_only_for_its_key_and_blocks() -> None:
    blocks = [object(), object()]
    ahead = RunAhead()
    ahead.put(0, _prefetch(7, blocks))
    assert ahead.take(0, 7, list(blocks)) is not None  # another list of the same blocks: same intervals
    assert ahead.take(0, 7, blocks) is None  # taken once
    ahead.put(0, _prefetch(7, blocks))
    assert ahead.take(0, 8, blocks) is None  # another step: dropped, not kept for later
    ahead.put(0, _prefetch(7, blocks))
    assert ahead.take(0, 7, [object(), object()]) is None  # re-cut intervals
    ahead.put(1, _prefetch(7, blocks))
    ahead.put(1, _prefetch(9, blocks))  # replaces the older one
    assert (ahead.used, ahead.dropped) == (1, 3)


def test_drain_keeps_for_evaluation_and_drops_for_checkpoints() -> None:
    blocks = [object()]
    ahead = RunAhead()
    ahead.put(0, _prefetch(3, blocks))
    ahead.drain(discard=False)
    assert ahead.take(0, 3, blocks) is not None
    ahead.put(0, _prefetch(3, blocks))
    ahead.drain(discard=True)
    assert ahead.take(0, 3, blocks) is None and ahead.dropped == 1
