"""The two-phase commit of a training step, pure over the job's store (unit-tested with threads over a
``HashStore`` and a ``TCPStore``: ``tests/bamboo/test_commit.py``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import torch.distributed as dist

from lightning_bamboo.protocol.store import RoundTripStore, current_generation, get_str

COMMIT = "commit"
COMMIT_JOIN = "commit+join"
"""The step commits and the members adopt the join proposal after it
(:mod:`lightning_bamboo.protocol.join`)."""
ABORT = "abort"


def outcome_key(generation: int, step: int) -> str:
    return f"g{generation}/outcome/{step}"


def decide(store: dist.Store, generation: int, step: int, proposal: str) -> str:
    """Write ``proposal`` as the outcome of ``step`` in ``generation`` unless one exists; return the one that
    holds. Anyone may call it (the supervisor settles a step with ``abort`` before acting on a join claimed
    at it, :func:`lightning_bamboo.protocol.join.close`): the first writer wins."""
    return store.compare_set(outcome_key(generation, step), "", proposal).decode()


class StepCommit:
    """The commit point of a training step, decided once in the store for all members of a generation.

    Every member *prepares* (its replica holds the successor's gradients of the step) by bumping
    ``g{g}/prep/{step}``; the one that brings it to the member count writes ``commit`` into the outcome
    key, and a member that sees the generation end first writes ``abort`` there. ``compare_set`` makes the
    first writer win, so every member, and every survivor after a failure, reads the same outcome.

    What holds (``tests/bamboo/test_commit.py``, threads over a ``HashStore`` and a ``TCPStore``): one
    outcome per (generation, step), whoever races to write it; ``commit`` only once every member prepared,
    so a member lost before preparing aborts the step everywhere and one lost after preparing is rolled
    forward; a member that was waiting leaves only with an outcome (``abort`` once the generation ends).
    The store is the only thing it reads: no clock but the polling interval, no environment.

    On a :class:`RoundTripStore` (etcd, across machines) a member prepares with one vote and waits on a watch:
    polling there cost about 230 reads and 25 transactions per step with 6 members, and the step took 11x
    the step without fault tolerance (``benchmarks/results/bamboo-elastic-history.md``).
    """

    def __init__(self, store: dist.Store, generation: int, size: int) -> None:
        self.store = store
        self.generation = generation
        self.size = size

    def _outcome_key(self, step: int) -> str:
        return outcome_key(self.generation, step)

    def decide(self, step: int, proposal: str) -> str:
        """Write ``proposal`` unless an outcome exists; return the outcome that holds."""
        return decide(self.store, self.generation, step, proposal)

    def prepare_and_wait(self, step: int, claim_join: Callable[[int], bool] | None = None,
                         proposal_key: str | None = None) -> str:
        """Mark this member prepared and wait for the outcome (``abort`` if the generation ends first).

        ``claim_join(step)``: called by the member that commits; ``True`` when it adopted a join proposal
        after this step (the outcome is then ``commit+join``). ``proposal_key``: the key of that proposal;
        on a :class:`RoundTripStore` the vote reads it, and the committing member does not call
        ``claim_join`` while it is absent (a round trip less before the outcome every member waits for).
        """
        if isinstance(self.store, RoundTripStore):
            return self._vote_and_watch(step, claim_join, proposal_key)
        if self._prepare(step) == self.size:
            return self._commit(step, claim_join)
        key = self._outcome_key(step)
        polls = 0
        while True:
            if self.store.check([key]):
                return get_str(self.store, key)
            polls += 1
            if polls % 20 == 0 and current_generation(self.store) != self.generation:
                return self.decide(step, ABORT)
            time.sleep(0.0005 if polls < 200 else 0.005)

    def _commit(self, step: int, claim_join: Callable[[int], bool] | None) -> str:
        """The last member to prepare decides: commit, with the join proposal adopted after it or not."""
        joins = claim_join is not None and claim_join(step)
        return self.decide(step, COMMIT_JOIN if joins else COMMIT)

    def _prepare(self, step: int) -> int:
        """Mark this member prepared; return how many members of the generation prepared, this one too."""
        return self.store.add(self._prepare_key(step), 1)

    def _prepare_key(self, step: int) -> str:
        return f"g{self.generation}/prep/{step}"

    def _vote_and_watch(self, step: int, claim_join: Callable[[int], bool] | None,
                        proposal_key: str | None) -> str:
        """Prepare with a vote that reads the outcome and the generation in the same request, then sleep
        until one of them is written and read both again (one request each): a member not deciding pays
        two round trips a step, where a vote, two reads, a wake and a read again were five (a profiled
        worker spent about a third of its step waiting on them)."""
        key = self._outcome_key(step)
        store = self.store
        assert isinstance(store, RoundTripStore)
        with store.watching([key, "gen"]) as sleep:  # before the vote: no write after it is missed
            reads = [key, "gen"] + ([proposal_key] if proposal_key is not None else [])
            count, values = store.vote_and_read(self._prepare_key(step), uuid.uuid4().hex, reads)
            if count == self.size:
                proposed = proposal_key is None or values[proposal_key] is not None
                return self._commit(step, claim_join if proposed else None)
            while True:
                outcome, generation = values[key], values["gen"]
                if outcome is not None:
                    return outcome.decode()
                if generation is None or int(generation) != self.generation:
                    return self.decide(step, ABORT)
                sleep(60.0)
                values = store.read_many([key, "gen"])
