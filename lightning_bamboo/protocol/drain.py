"""Announced departures: a member warned of its preemption leaves an elastic Bamboo job losing no step.

A notice (cloud warning, SIGTERM, injected drain) reaches every member at the same step boundary through
``BambooNotices`` (its all-reduced flags), and each member calls ``BambooStrategy.drain`` with
the same warned ranks, right after step ``k`` committed:

1. every member writes ``gen{g}/leave`` = ``{"members": [...], "step": k}`` (``compare_set``: the first
   writer wins and all write the same), the *announcement*; every member fires ``on_drain``;
2. the launcher, the only one that decides membership, sees the key and publishes generation ``g+1`` =
   :func:`lightning_bamboo.layout.ownership.failover` of the leavers, kind ``drain``; it counts the leavers'
   exit as a departure, not a failure;
3. the leavers wait for a published generation without them and end their ``fit`` the way Lightning's own
   early exits do (teardown hooks run, loggers are finalized), then the process exits 0 through
   :class:`BambooDeparted` instead of returning into the script: a leaver is no trainer of the job any more
   (it would run the script's post-``fit`` code as a stale rank, and its collectives with nobody); the
   survivors form that generation at once and go on with step ``k+1``: no step is replayed, since nothing
   was interrupted.

Nothing is sent by the leavers: after the commit of step ``k`` every replica holds exactly the stage it
mirrors (a step commits only once every replica holds its successor's gradients, and the replica applies
the same optimizer step with the owner's hyper-parameters), so each heir promotes its replica as in a
failover; a stage whose heir is not its replica holder (the first position) moves between survivors
through :mod:`lightning_bamboo.runtime.reshard`. What the drain costs is timed by :class:`DrainTimer`.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch.distributed as dist

from lightning_bamboo.layout.ownership import OwnershipMap
from lightning_bamboo.protocol import store as ms


class BambooDeparted(SystemExit):
    """Ends the process of a member that drained (its machine is being taken), with exit code 0.

    Raised at the end of ``fit``'s teardown on the leaver, after Lightning ran the teardown hooks and
    finalized the loggers, so nothing the script does after ``trainer.fit`` runs there: code after ``fit``
    (saving or uploading the result as rank 0, ``trainer.test``, ``trainer.save_checkpoint``) runs on the
    survivors only, where ``is_global_zero`` is true in exactly one process. It is a ``SystemExit``: ``except
    Exception`` does not catch it, ``finally`` blocks and ``atexit`` handlers run as at any exit, and the
    interpreter exits 0 without a traceback. A script that must do something on a leaver catches it:
    ``except BambooDeparted as gone: ...`` (``gone.member``, ``gone.step``); the leaver's strategy says
    ``is_global_zero=False`` from its drain on.
    """

    def __init__(self, member: int, step: int) -> None:
        super().__init__(0)
        self.member = member
        self.step = step  # the last step this member trained (the survivors go on with step + 1)

    def __str__(self) -> str:
        return f"Bamboo member {self.member} drained after step {self.step}: it left the job"


def _key(generation: int) -> str:
    return f"gen{generation}/leave"


def announce(store: dist.Store, owners: OwnershipMap, ranks: Iterable[int], step: int) -> list[int]:
    """Announce that the members at ``ranks`` of ``owners`` leave after ``step``; returns their member ids.

    Raises:
        ValueError: a rank that is not a rank of this generation.
    """
    members = owners.members()
    bad = [r for r in ranks if not 0 <= r < len(members)]
    if bad:
        raise ValueError(
            f"ranks {bad} are not ranks of generation {owners.generation} (0..{len(members) - 1})"
        )
    text = json.dumps({"members": sorted(members[r] for r in ranks), "step": step})
    agreed = store.compare_set(_key(owners.generation), "", text).decode()
    return list(json.loads(agreed)["members"])


def announced(store: dist.Store, generation: int) -> list[int]:
    """The members announced as leaving generation ``generation`` (none if nobody announced)."""
    if not store.check([_key(generation)]):
        return []
    return list(json.loads(ms.get_str(store, _key(generation)))["members"])


def wait_without(store: dist.Store, after: int, members: Iterable[int], timeout: float) -> OwnershipMap:
    """Wait for the launcher to publish a generation after ``after`` in which none of ``members`` own a stage.

    Raises:
        TimeoutError: none within ``timeout`` seconds (the launcher is gone or did not see the announcement).
    """
    leaving = set(members)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        generation = ms.current_generation(store)
        if generation > after:
            owners = ms.read_map(store, generation)
            if not leaving & set(owners.members()):
                return owners
        time.sleep(0.005)
    raise TimeoutError(
        f"Bamboo: members {sorted(leaving)} announced their departure from generation {after}, but the "
        f"launcher published no generation without them within {timeout}s"
    )


@dataclass
class _Pending:
    members: list[int]
    step: int
    boundary: float  # time.monotonic() when the drain began
    notice_s: float  # seconds from the earliest notice being seen to the drain beginning
    reform_s: float = 0.0


@dataclass
class DrainTimer:
    """Times what an announced departure costs: from the boundary where the drain begins to the next
    committed step (``drain_s``), next to the median failure-free step (``step_s``, commit to commit).

    ``drain_s - step_s`` is what the drain added; ``notice_s`` is how long the notice waited for its boundary
    (poll interval plus the one step BambooNotices' non-blocking flags take).
    """

    steps: list[float] = field(default_factory=list)
    drains: list[dict[str, float | int | list[int]]] = field(default_factory=list)
    _last: float | None = None
    _pending: _Pending | None = None

    def begin(self, members: list[int], step: int, received_at: Iterable[float]) -> None:
        seen = min(received_at, default=time.time())
        self._pending = _Pending(members, step, time.monotonic(), max(time.time() - seen, 0.0))

    def reformed(self) -> float:
        """Seconds since the drain began (when the survivors have formed the next generation)."""
        assert self._pending is not None
        self._pending.reform_s = time.monotonic() - self._pending.boundary
        return self._pending.reform_s

    def committed(self) -> str | None:
        """Call after every committed step; returns the drain's report line when this step ended a drain."""
        now = time.monotonic()
        pending, self._pending = self._pending, None
        last, self._last = self._last, now
        if pending is None:
            if last is not None:
                self.steps.append(now - last)
            return None
        step_s = statistics.median(self.steps) if self.steps else float("nan")
        record = {
            "members": pending.members,
            "step": pending.step,
            "notice_s": pending.notice_s,
            "reform_s": pending.reform_s,
            "drain_s": now - pending.boundary,
            "step_s": step_s,
        }
        self.drains.append(record)
        return (
            f"bamboo_drain members={','.join(map(str, pending.members))} step={pending.step} "
            f"notice_s={pending.notice_s:.3f} reform_s={pending.reform_s:.3f} "
            f"drain_s={record['drain_s']:.3f} step_s={step_s:.3f}"
        )
