"""The decision side of an elastic Bamboo job: the one place membership is decided.

:class:`Coordinator` reads what happened (members lost, announced departures, joiners registered) and
writes generation ``g+1``'s ownership map into the store (``ownership.failover``, a checkpoint fallback when
redundancy cannot cover the loss, ``ownership.rejoin`` for joins); workers form the new generation
themselves. It starts no process: the agent elected coordinator (:mod:`lightning_bamboo.control.agent`, one
per machine, one machine included) decides from the exits every agent reports into the store
(:class:`~lightning_bamboo.control.node_coordinator.CoordinatorRole`). Only one coordinator writes at a time,
and a generation's map is
written with ``compare_set`` (the first writer of ``gen{g}/map`` wins), so even a deposed coordinator that
has not noticed yet cannot publish a second generation ``g``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import torch.distributed as dist

from lightning_bamboo.layout.ownership import FallbackNeeded, OwnershipMap, failover, fallback, rejoin
from lightning_bamboo.protocol import commit as commit_protocol
from lightning_bamboo.protocol import crash
from lightning_bamboo.protocol import drain as departure
from lightning_bamboo.protocol import join as joining
from lightning_bamboo.protocol import store as ms


class Superseded(RuntimeError):
    """Another coordinator published this generation first: this one is no longer the coordinator."""


class Coordinator:
    """Decides every next generation from losses, departures and joins (see the module docstring).

    ``codes``: how each lost member exited, as the agents reported it (its exit code, negative for a signal,
    ``None`` when it was lost with its machine); shared with the role that collects the reports, so that it
    outlives a coordinator's term.
    """

    def __init__(self, store: dist.Store, log=print, codes: dict[int, int | None] | None = None) -> None:
        self.store = store
        self.log = log
        self.codes: dict[int, int | None] = {} if codes is None else codes
        self.finished: set[int] = set()
        self.lost: set[int] = set()
        self.departed: set[int] = set()
        self.events: list[dict[str, object]] = []
        self._pending_joins: list[int] = []
        self._maps: dict[int, OwnershipMap] = {}  # a generation's map never changes once written
        self._pass_generation: int | None = None  # the generation read in this pass (:meth:`one_pass`)
        self._in_pass = False
        self.start_time = time.monotonic()
        self._lock = threading.RLock()  # add_worker / kill may come from another thread while run() runs
        self._added_at: dict[int, float] = {}
        self._proposal: tuple[int, OwnershipMap, float] | None = None  # (generation, next map, proposed at)
        self._join_watch: dict[str, object] | None = None
        self.joins: list[dict[str, object]] = []
        """One entry per completed join: members, step, generation, start_s, wait_s, join_s."""
        self.error: dict[str, object] | None = None
        """The failure that stopped the job (:mod:`lightning_bamboo.protocol.crash`): member, type, message,
        traceback."""

    # ------------------------------------------------------------------ what happened
    def exit_codes(self, members: set[int]) -> dict[int, int | None]:
        """How each of ``members`` exited: its exit code, negative for a signal, ``None`` unknown (a lost
        machine)."""
        return {m: self.codes.get(m) for m in members}

    def _failure_in_code(self, lost: set[int]) -> dict[str, object] | None:
        """The error a lost member recorded before exiting non-zero (:mod:`lightning_bamboo.protocol.crash`),
        when no member lost with it was killed by a signal (a preemption, or fenced for a silent heartbeat)
        or lost with its machine: an error of the training code, which a failover would only raise again.
        ``None``: fail over."""
        codes = self.exit_codes(lost)
        if any(code is None or code < 0 for code in codes.values()):
            return None
        for member in sorted(codes):
            failure = crash.recorded(self.store, member)
            if failure is not None:
                self.error = failure
                self.log(
                    f"[bamboo.launch] member {member} failed with {failure['type']}: {failure['message']} "
                    "(an error of the training code, not a preemption; its traceback is in the worker's "
                    "output): stopping the job",
                    flush=True,
                )
                return failure
        return None

    @contextlib.contextmanager
    def one_pass(self) -> Iterator[None]:
        """A round of decisions (an agent's tick): the current generation is read once in it, where each of
        the round's questions (who is placed, who leaves, the joins, the end) read it again, four round
        trips to etcd per tick. Only this coordinator publishes a generation in the round (a rival's
        publication fails its own, :class:`Superseded`), and :meth:`_publish` updates what was read."""
        self._pass_generation, self._in_pass = None, True
        try:
            yield
        finally:
            self._pass_generation, self._in_pass = None, False

    def _generation(self) -> int:
        if not self._in_pass:
            return ms.current_generation(self.store)
        if self._pass_generation is None:
            self._pass_generation = ms.current_generation(self.store)
        return self._pass_generation

    def _current(self) -> tuple[int, OwnershipMap | None]:
        """The current generation and its map (read once per generation: the coordinator asks every tick,
        and across machines each read is a round trip to etcd)."""
        generation = self._generation()
        if generation < 0:
            return generation, None
        if generation not in self._maps:
            text = ms.read_if_set(self.store, f"gen{generation}/map")
            if text is None:
                return generation, None
            self._maps[generation] = OwnershipMap.from_json(text)
        return generation, self._maps[generation]

    def _publish(self, new: OwnershipMap, kind: str) -> None:
        """Write ``new`` as the next generation; the first writer of its map wins.

        Raises:
            Superseded: another coordinator wrote this generation's map first.
        """
        text = new.to_json()
        key = f"gen{new.generation}/map"
        if new.generation > 0 and self.store.compare_set(key, "", text).decode() != text:
            raise Superseded(f"generation {new.generation} was published by another coordinator")
        if new.generation == 0:
            self.store.set(key, text)
        self.store.set(f"gen{new.generation}/kind", kind)
        self.store.set("gen", str(new.generation))
        if self._in_pass:
            self._pass_generation = new.generation

    def _departures(self) -> set[int]:
        """Members of the current generation announced as leaving (in it or in an earlier generation)."""
        generation, current = self._current()
        if current is None:
            return set()
        leaving: set[int] = set()
        # members announce in the generation they train in, which may have just been superseded by a loss
        for g in range(max(generation - 2, 0), generation + 1):
            leaving |= set(departure.announced(self.store, g))
        return (leaving & set(current.members())) - self.departed

    # ------------------------------------------------------------------ deciding
    def _reform(
        self, lost: set[int], joined: list[int], leaving: frozenset[int] | set[int] = frozenset()
    ) -> bool:
        """Publish the next generation; ``False`` when the job cannot continue."""
        generation, old = self._current()
        if old is None:
            self.log("[bamboo.launch] a worker was lost before generation 0 formed", flush=True)
            return False
        proposed = set(self._proposal[1].members()) if self._proposal is not None else set()
        if lost and not leaving and not lost & (set(old.members()) | set(old.spares) | proposed):
            with self._lock:
                self._pending_joins = [m for m in self._pending_joins if m not in lost]
            return True  # a joiner died before it was placed anywhere: nothing to re-form
        gone = set(lost) | set(leaving)
        if gone:
            adopted = joining.close(self.store, generation)
            if adopted is not None and self._proposal is not None:
                # the members adopted the join before the loss: the failover applies to the joined layout
                old = self._publish_join(adopted)
            self._proposal = None
        kind = ("failover" if lost else "drain") if gone else "rejoin"
        try:
            new = failover(old, gone) if gone else old
            if joined:
                new = rejoin(new, joined, self._max_pipelines())
        except FallbackNeeded as err:
            survivors = sorted(m for m in old.members() + list(old.spares) if m not in gone) + joined
            if not survivors:
                self.log(f"[bamboo.launch] {err}\nno worker left", flush=True)
                return False
            new = fallback(old, survivors)
            kind = "fallback"
        left = f" left {sorted(leaving)}" if leaving else ""
        headline = f"{kind}: lost {sorted(lost)}{left} joined {joined}"
        self._announce(kind, headline, old, new, lost, set(leaving), joined)
        return True

    def _max_pipelines(self) -> int | None:
        """The most pipelines a join may form: the job's global micro-batches per step (each pipeline runs
        at least one; the workers write the count when they form generation 0), ``None`` before that."""
        if not self.store.check([ms.GLOBAL_MICROBATCHES]):
            return None
        return int(self.store.get(ms.GLOBAL_MICROBATCHES).decode())

    def _announce(
        self,
        kind: str,
        headline: str,
        old: OwnershipMap,
        new: OwnershipMap,
        lost: set[int] | frozenset[int] = frozenset(),
        left: set[int] | frozenset[int] = frozenset(),
        joined: list[int] | None = None,
    ) -> None:
        """Log the change (``headline``, then both maps), record it in :attr:`events` and publish ``new``:
        every generation change (failover, drain, fallback, rejoin) goes out the same way."""
        self.log(f"[bamboo.launch] {headline}\n{old.format()}\n->\n{new.format()}", flush=True)
        self.events.append(
            {
                "t_s": time.monotonic() - self.start_time,
                "kind": kind,
                "lost": sorted(lost),
                "left": sorted(left),
                "joined": list(joined or []),
                "old": old.to_json(),
                "new": new.to_json(),
            }
        )
        self._publish(new, kind)

    def _stop_generation(self) -> set[int]:
        """Publish a ``stop`` generation (the current map, one generation on): every member leaves ``fit`` at
        its next step boundary. Returns the members of the current generation."""
        generation, current = self._current()
        if current is None:
            return set()
        following = OwnershipMap(generation + 1, current.num_stages, current.pipelines, current.spares)
        self._publish(following, "stop")
        return set(current.members())

    def _advance_joins(self) -> None:
        """Propose a map with the registered joiners, publish it once adopted, report the join's cost."""
        generation, current = self._current()
        if current is None:
            return
        self._watch_join()
        if self._proposal is None:
            with self._lock:
                pending = [
                    m
                    for m in self._pending_joins
                    if m not in current.members() and m not in self.lost and joining.registered(self.store, m)
                ]
            if not pending:
                return
            proposal = rejoin(current, pending, self._max_pipelines())
            if proposal.pipelines == current.pipelines:
                return  # not enough new workers to change the layout yet: they wait
            joining.propose(self.store, generation, proposal)
            self._proposal = (generation, proposal, time.monotonic())
            return
        proposed_in, _, _ = self._proposal
        step = joining.adopted_step(self.store, proposed_in)
        if step is not None and self.store.check([f"g{proposed_in}/outcome/{step}"]):
            self._publish_join(step)

    def _publish_join(self, step: int) -> OwnershipMap:
        """Publish the adopted proposal as the next generation (the members form it after ``step``)."""
        assert self._proposal is not None
        generation, proposal, proposed_at = self._proposal
        old = ms.read_map(self.store, generation)
        joined = sorted(set(proposal.members()) - set(old.members()))
        self._announce("rejoin", f"rejoin after step {step}: joined {joined}", old, proposal, joined=joined)
        with self._lock:
            self._pending_joins = [m for m in self._pending_joins if m not in joined]
        self._proposal = None
        now = time.monotonic()
        self._join_watch = {
            "members": joined,
            "step": step + 1,
            "generation": proposal.generation,
            "start_s": max((proposed_at - self._added_at.get(m, proposed_at) for m in joined), default=0.0),
            "proposed_at": proposed_at,
            "wait_s": now - proposed_at,
        }
        return proposal

    def _watch_join(self) -> None:
        """The join is complete when the first step at the new size commits: print its cost."""
        watch = self._join_watch
        if watch is None:
            return
        generation, step = watch["generation"], watch["step"]
        if ms.current_generation(self.store) != generation:
            self._join_watch = None  # a failover came first: no step ran at the joined size
            return
        key = f"g{generation}/outcome/{step}"
        if not self.store.check([key]) or ms.get_str(self.store, key) == commit_protocol.ABORT:
            return
        join_s = time.monotonic() - float(watch.pop("proposed_at"))  # type: ignore[arg-type]
        entry = {**watch, "join_s": join_s}
        self.joins.append(entry)
        self._join_watch = None
        self.log(
            f"[bamboo.launch] join members={entry['members']} step={step} generation={generation} "
            f"wait_s={entry['wait_s']:.3f} join_s={join_s:.3f} start_s={entry['start_s']:.2f}",
            flush=True,
        )

    def _job_done(self) -> bool:
        """Every member of the current generation has finished training (exited 0)."""
        _, current = self._current()
        return current is not None and bool(current.members()) and set(current.members()) <= self.finished

