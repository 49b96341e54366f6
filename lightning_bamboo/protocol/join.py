"""Joining a running elastic job at a step boundary: the store protocol between launcher, members and joiner.

Why a protocol: the members of generation ``g`` must all switch to the next layout after the SAME step (one
that switched a step earlier than another would wait for it in a collective of a different process group),
and a join must never race a failover (both would be generation ``g+1``). So:

1. The joiner starts, builds its model and registers: ``join/{member}`` (:func:`register`).
2. The launcher (the only one deciding membership) writes the proposed next map into ``gen{g}/join``
   (:func:`propose`); it does not touch ``gen`` yet, so nobody changes anything.
3. The member that commits a step (the last to prepare, :class:`lightning_bamboo.protocol.commit.StepCommit`)
   claims ``gen{g}/next = "join@{step}"`` with ``compare_set`` (:func:`claim`) and writes the outcome
   ``commit+join``: every member reads it, applies the step and forms the proposal at the start of the next
   step. The launcher, on a loss, claims ``gen{g}/next = "failover"`` (:func:`close`): first writer wins, so
   a proposal is either adopted at one step by everyone, or dropped (the launcher proposes again later).
4. The launcher sees the claim and the step's outcome, publishes the proposal as generation ``g+1``, and
   the joiner (waiting for a generation that lists it, :func:`wait_for_membership`) forms it with the
   members: layers and optimizer state peer to peer, the trainer's progress as JSON
   (``gen{g+1}/progress``, :mod:`lightning_bamboo.step.progress`).
"""

from __future__ import annotations

import time

import torch.distributed as dist

from lightning_bamboo.layout.ownership import OwnershipMap
from lightning_bamboo.protocol import store as ms
from lightning_bamboo.protocol.commit import ABORT, COMMIT_JOIN, decide

FAILOVER = "failover"


def register(store: dist.Store, member: int) -> None:
    store.set(f"join/{member}", "1")


def registered(store: dist.Store, member: int) -> bool:
    return store.check([f"join/{member}"])


def proposal_key(generation: int) -> str:
    """Where the launcher proposes a join to ``generation`` (absent: no proposal, nothing to claim)."""
    return f"gen{generation}/join"


def propose(store: dist.Store, generation: int, proposal: OwnershipMap) -> None:
    store.set(proposal_key(generation), proposal.to_json())


def proposal(store: dist.Store, generation: int) -> OwnershipMap | None:
    key = proposal_key(generation)
    return OwnershipMap.from_json(store.get(key)) if store.check([key]) else None


def claim(store: dist.Store, generation: int, step: int) -> bool:
    """Adopt ``generation``'s proposal after ``step``; ``False`` when none, or a failover came first."""
    if not store.check([proposal_key(generation)]):
        return False
    mine = f"join@{step}"
    return store.compare_set(f"gen{generation}/next", "", mine).decode() == mine


def adopted_step(store: dist.Store, generation: int) -> int | None:
    """The step after which the proposal was adopted, ``None`` while it is not (or was dropped)."""
    key = f"gen{generation}/next"
    if not store.check([key]):
        return None
    value = ms.get_str(store, key)
    return int(value.removeprefix("join@")) if value.startswith("join@") else None


def close(store: dist.Store, generation: int) -> int | None:
    """Decide that a failover follows ``generation``; returns the step after which a join was adopted before
    it (the failover then applies to the proposal), or ``None``.

    A claim is an adoption only once its step commits: the claimer may be the member lost, between its claim
    and writing ``commit+join``. So the step's outcome is settled here (``abort`` unless decided); an aborted
    step adopted nothing, and its members replay it on the failover of the current layout.
    """
    value = store.compare_set(f"gen{generation}/next", "", FAILOVER).decode()
    if not value.startswith("join@"):
        return None
    step = int(value.removeprefix("join@"))
    return step if decide(store, generation, step, ABORT) == COMMIT_JOIN else None


def wait_for_membership(store: dist.Store, member: int, poll: float = 0.02) -> OwnershipMap:
    """The first generation whose map lists ``member`` among its stage owners (the joiner waits here)."""
    seen = -1
    while True:
        generation = ms.current_generation(store)
        if generation != seen and generation >= 0 and store.check([f"gen{generation}/map"]):
            seen = generation
            owners = ms.read_map(store, generation)
            if member in owners.members():
                return owners
        time.sleep(poll)
