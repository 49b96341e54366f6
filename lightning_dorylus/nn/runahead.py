"""Running ahead across the epoch boundary (``staleness >= 1``): the next epoch's first-layer AV, sent early.

An epoch of a first layer whose first op is AV on the features (weight-first GCN: ``ApplyGather``; GAT's
``gat.project``: ``TensorOp`` with a ``RowInput``) starts with server work (the features' dropout, per
interval) and an AV request per interval whose round trip nothing overlaps, and it ends with the ∇AV
requests of the same layer, during which the server has nothing left to do. With bounded staleness
``S >= 1`` the pipeline starts epoch ``e + 1``'s first-layer AV during epoch ``e``'s last wait: while epoch
``e``'s ∇AV requests are out, the server makes epoch ``e + 1``'s dropped-out rows interval by interval and
sends their AV requests with the parameters as they are then, ``W_e`` (epoch ``e``'s update is not applied
yet). Epoch ``e + 1`` then finds its first-layer results back (or on their way) and goes on at once.

Weight versions: the request carries the parameters, as a Lambda fetches one version from a weight server,
so each interval's forward of epoch ``e + 1`` reads one version, ``W_e``, one update behind the optimizer's
``W_{e+1}``: within the bound ``S``. Its backward uses the same version: GCN's first-layer ∇AV needs no
weight (``∇W = Xᵀ ∇P``); ``gat.project``'s backward reads ``weight``, ``att_src`` and ``att_dst``, so the
forward keeps the copy its prefetch carried (:attr:`Prefetch.weights`) and its backward sends that copy, not
the current parameters. The ring of stashed versions thus holds at most 2 (``W_e`` for the backward in
progress, ``W_{e+1}`` for the requests it sends ahead): within ``S + 1``. The gradients are applied to
``W_{e+1}``: delayed by one step, as Dorylus's weight servers apply gradients that were computed on an
earlier version. A prefetch is used only if the next training forward asks for exactly what was prefetched
(same partition intervals, same dropout key: one training step per epoch), else it is dropped and recomputed.
"""

from __future__ import annotations

from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor


@dataclass
class Prefetch:
    """First-layer AV requests of a coming epoch: the ``RowSource`` that made their rows (its kept-entry bits
    let ∇AV make them again), their futures and weight version."""

    key: int  # dropout key of the rows (identifies the step they belong to)
    blocks: list  # what the requests were cut by: column blocks or intervals (the same objects = same cut)
    source: Any  # a RowSource under ``key``
    futures: list[Future]
    weights: dict[str, Tensor]  # the version sent with them, by op input name (copies: the stashed version)


@dataclass
class RunAhead:
    """Per graph server: the prefetched first-layer requests, by layer index."""

    pending: dict[int, Prefetch] = field(default_factory=dict)
    used: int = 0  # forwards that found their requests already sent
    dropped: int = 0  # prefetches thrown away (another step came, or a checkpoint discarded them)

    def put(self, layer: int, prefetch: Prefetch) -> None:
        old = self.pending.pop(layer, None)
        if old is not None:
            _settle(old)
            self.dropped += 1
        self.pending[layer] = prefetch

    def take(self, layer: int, key: int, blocks: list) -> Prefetch | None:
        """The prefetch of ``layer`` if it was made for ``key`` and these ``blocks``; else drops it."""
        prefetch = self.pending.pop(layer, None)
        if prefetch is None:
            return None
        same = len(prefetch.blocks) == len(blocks) and all(a is b for a, b in zip(prefetch.blocks, blocks))
        if prefetch.key == key and same:
            self.used += 1
            return prefetch
        _settle(prefetch)
        self.dropped += 1
        return None

    def drain(self, discard: bool) -> None:
        """Wait until every prefetched request is back (a failed one raises where it is used, not here);
        ``discard`` also forgets them (checkpoints, teardown)."""
        for prefetch in self.pending.values():
            wait(prefetch.futures)
        if discard:
            self.dropped += len(self.pending)
            self.pending.clear()


def _settle(prefetch: Prefetch) -> None:
    """Let a dropped prefetch's requests finish (their results are ignored; errors too)."""
    for future in prefetch.futures:
        future.add_done_callback(_ignore)


def _ignore(future: Future[Any]) -> None:
    future.exception()
