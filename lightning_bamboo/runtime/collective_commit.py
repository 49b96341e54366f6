"""The commit of a training step across machines: one all-reduce of the generation's members, and the store
only when a loss cuts the step.

Why: on etcd every request is a network round trip, and the store's two-phase commit
(:class:`~lightning_bamboo.protocol.commit.StepCommit`: a vote, the last voter's decision, a read after the
wake) put about three of them on every step's critical path. A failure-free step of the six-member
multi-machine benchmark took 0.18 s where the same pipeline without fault tolerance took 0.055 s
(``docs/bamboo-elastic-reference.md``, "The two-phase step").

The rule is the store commit's: a step commits when every member prepared (its gradients, and its replica's,
are where the step needs them), and every survivor of a loss ends on the same side of the step. Here:

* **Prepare and commit.** A prepared member enters one all-reduce (MAX) with the whole generation. It
  completes only once every member entered it, so a member it completes on knows that all prepared, and
  applies the step at once. Nothing is written to the store for it, except that rank 0 records the outcome
  in the background (``g{g}/outcome/{step}``: the job's timeline, and the first step at a new size that
  the coordinator waits for after a join).
* **A join proposal** (``gen{g}/join``, watched, no read per step) is the all-reduce's value: when any
  member has seen one, every member that completes the all-reduce takes this step through the store's
  commit, where the join is claimed as before. All of them read the same reduced value.
* **A loss mid-step.** The all-reduce may complete on some members and fail on others (a member lost
  inside it). Every member that leaves a generation reports how many steps it applied
  (``g{g}/applied/{member}``): at the error that ended the generation, or at the step boundary where it
  saw the next one. A member whose step was cut *settles* it: it waits for the reports of every member of
  the generation still in the job (the newest map's members and spares), and proposes ``commit`` if one of
  them applied the step, else ``abort``; the first proposal written wins (the outcome key's
  compare-and-set), and every member follows it. A survivor that applied the step reports it, so no
  settlement can abort a step a survivor applied; one that commits a step no survivor applied rolls it
  forward, which is valid because the all-reduce completed somewhere, so every member had prepared.
  A member lost after applying a step matters to no one: its stages come from a replica or a peer, which
  applied the step or roll it forward.

Settling costs a failover a few requests (a report; the others' read in one request each time the watch
sees one written); the failure-free step costs one small all-reduce. On one machine the store is local (a
``TCPStore``: a round trip of well under a millisecond), and the store commit stays
(:meth:`Membership.vote`): it measured no slower there, and faster under load, where an all-reduce needs
every worker scheduled at once (docs/bamboo-elastic-reference.md, "The two-phase step").
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from lightning_bamboo.protocol import crash
from lightning_bamboo.protocol import join as joining
from lightning_bamboo.protocol import store as ms
from lightning_bamboo.protocol.commit import ABORT, COMMIT, decide

log = logging.getLogger(__name__)


def applied_key(generation: int, member: int) -> str:
    """Where ``member`` reports the steps it applied when it leaves ``generation``."""
    return f"g{generation}/applied/{member}"


def report_applied(store: dist.Store, generation: int, member: int, steps: int) -> None:
    """``member`` leaves ``generation`` having applied ``steps`` steps (the count of committed steps)."""
    store.set(applied_key(generation, member), str(steps))


def settle(store: dist.Store, generation: int, members: list[int], step: int, wait_s: float,
           poll_s: float = 0.01) -> str:
    """The outcome of ``step`` of ``generation`` (whose members were ``members``), cut by a loss: ``commit``
    if a member still in the job applied it, else ``abort``; the first proposal written holds.

    Waits for the reports of the members still in the job (the newest generation's members and spares; one
    whose error is recorded is not waited for, it stopped the job), at most ``wait_s`` seconds, after which
    the reports present decide (a member silent that long is stuck; the warning names it). On a
    :class:`~lightning_bamboo.protocol.store.RoundTripStore` it sleeps on the watch of the reports and the
    generation and reads them in one request per wake (every settling member polling every member's key
    would be a burst of requests on etcd at the moment the failover needs it); other stores are polled every
    ``poll_s`` seconds.
    """
    deadline = time.monotonic() + wait_s
    old = sorted(members)
    keys = ["gen"] + [applied_key(generation, m) for m in old]
    maps: dict[int, set[int]] = {}  # a generation's members and spares (a map never changes once written)
    crashed: set[int] = set()
    watched = isinstance(store, ms.RoundTripStore)
    with store.watching(keys) if watched else contextlib.nullcontext() as sleep:  # type: ignore[attr-defined]
        while True:
            values = store.read_many(keys) if watched else {key: ms.read_if_set(store, key) for key in keys}
            newest = int(values["gen"]) if values["gen"] is not None else -1
            waiting = set(old)
            if newest > generation:
                if newest not in maps:
                    new = ms.read_map(store, newest)
                    maps[newest] = set(new.members()) | set(new.spares)
                waiting &= maps[newest]
            reports = {m: values[applied_key(generation, m)] for m in sorted(waiting - crashed)}
            missing = [m for m, value in reports.items() if value is None]
            crashed |= {m for m in missing if crash.recorded(store, m) is not None}
            missing = [m for m in missing if m not in crashed]
            if not missing:
                break
            if time.monotonic() > deadline:
                log.warning(
                    "Bamboo: settling step %d of generation %d without the reports of members %s (silent "
                    "for %.0f s); deciding from the others'", step, generation, missing, wait_s,
                )
                break
            if sleep is not None:
                sleep(max(deadline - time.monotonic(), 0.0))
            else:
                time.sleep(poll_s)
    applied = any(value is not None and int(value) > step for value in reports.values())
    return decide(store, generation, step, COMMIT if applied else ABORT)


class CollectiveCommit:
    """One member's commit of its steps by all-reduce (see the module docstring).

    ``store``: the job's store (read for the join proposal, written when settling); ``record_store``: a
    connection of its own for rank 0's background record of each outcome (the main thread's requests do not
    wait behind it); ``device``: where the all-reduce's tensor lives (the process group's device).
    """

    def __init__(self, store: dist.Store, record_store: Callable[[], dist.Store],
                 device: Callable[[], torch.device]) -> None:
        self._store, self._device = store, device
        self._proposal: tuple[int, ms.WatchedKey] | None = None
        self._records: list[tuple[int, int]] = []
        self._recorded = threading.Condition()
        self._record_store = record_store
        self._recorder: threading.Thread | None = None
        self._closing = False

    def prepare_and_wait(self, generation: int, step: int, rank: int) -> str | None:
        """This member prepared ``step``: ``commit`` once every member has, or ``None`` when a member has seen
        a join proposal (the step then commits through the store, where the join is claimed). Raises the
        process group's error when a member is lost before the all-reduce completes here."""
        seen = self._proposal_seen(generation)
        flag = torch.tensor([1 if seen else 0], dtype=torch.int32, device=self._device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag.item()):
            return None
        if rank == 0:
            self._record(generation, step)
        return COMMIT

    def _proposal_seen(self, generation: int) -> bool:
        """Whether ``generation`` has a join proposal, through a watch on its key (no read per step)."""
        if self._proposal is None or self._proposal[0] != generation:
            if self._proposal is not None:
                self._proposal[1].close()
            self._proposal = (generation, ms.WatchedKey(self._store, joining.proposal_key(generation)))
        return self._proposal[1].read() is not None

    def _record(self, generation: int, step: int) -> None:
        """Write ``commit`` as the outcome of ``step`` in the background (the first writer wins, so a
        settlement that decided first stands: it decided ``commit`` too, since this member applied it)."""
        with self._recorded:
            self._records.append((generation, step))
            self._recorded.notify()
        if self._recorder is None:
            self._recorder = threading.Thread(target=self._write_records, name="bamboo-commit-record",
                                              daemon=True)
            self._recorder.start()

    def _write_records(self) -> None:
        store = self._record_store()
        while True:
            with self._recorded:
                self._recorded.wait_for(lambda: bool(self._records) or self._closing)
                records, self._records = self._records, []
                closing = self._closing
            for generation, step in records:
                with contextlib.suppress(Exception):  # the store gone: the job is over
                    decide(store, generation, step, COMMIT)
            if closing:
                return

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop watching for join proposals, and stop the recorder once the outcomes it holds are written:
        the last steps' records are the job's timeline (a member's ``fit`` ending must not drop them), and
        the thread ends with the member's membership instead of lingering in code after ``fit``. A store
        that does not answer within ``timeout_s`` is left behind (the thread is a daemon)."""
        if self._proposal is not None:
            self._proposal[1].close()
            self._proposal = None
        recorder, self._recorder = self._recorder, None
        if recorder is None:
            return
        with self._recorded:
            self._closing = True
            self._recorded.notify()
        recorder.join(timeout_s)
        if recorder.is_alive():
            log.warning("Bamboo: the record of the last committed steps did not finish within %.0f s",
                        timeout_s)
