"""Generation transitions: what a member does when the job's membership changes (failover, rejoin, fallback,
drain, stop), as decisions the step session's retry loop acts on.

A lost peer cut the step in progress: :meth:`Transitions.aborted` undoes it and returns the
:class:`~lightning_bamboo.step.session.Reform` to run; the loop (:meth:`~lightning_bamboo.step.session.
StepSession.retrying`) runs :meth:`Transitions.form` before it runs the step again. Forming waits for the
supervisor's next generation (:mod:`lightning_bamboo.launch` decides membership), creates its process group
(:meth:`~lightning_bamboo.runtime.membership.Membership.begin`, which releases the old one as its backend
needs) and its layout (:class:`~lightning_bamboo.runtime.formation.Formation`; a loss redundancy cannot
cover loads the last periodic checkpoint, :mod:`lightning_bamboo.runtime.fallback`), then replays the
step's earlier batches on the new layout, so the run's trajectory is the uninterrupted one.

At a step boundary an adopted join or a generation published without a failure seen here
(:meth:`Transitions.at_boundary`), and an announced departure (:meth:`Transitions.drain`,
:mod:`lightning_bamboo.protocol.drain`), return their re-form the same way. Nothing here holds the step
session: it is passed to the calls that replay its batches.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_bamboo._lightning import private as _private
from lightning_bamboo.layout.ownership import FallbackNeeded, OwnershipMap
from lightning_bamboo.protocol import commit as commit_protocol
from lightning_bamboo.protocol import crash
from lightning_bamboo.protocol import drain as departure
from lightning_bamboo.protocol import store as ms
from lightning_bamboo.runtime.events import drain_with_checkpoint
from lightning_bamboo.step.session import Reform

if TYPE_CHECKING:
    import torch

    from lightning_bamboo.notices.base import Notice
    from lightning_bamboo.runtime.events import Events
    from lightning_bamboo.runtime.fallback import Fallback
    from lightning_bamboo.runtime.formation import Formation
    from lightning_bamboo.runtime.generation import Generation
    from lightning_bamboo.runtime.lightning_side import LightningSide
    from lightning_bamboo.runtime.membership import Membership
    from lightning_bamboo.step.session import StepSession

log = logging.getLogger(__name__)


class Transitions:
    """This member's generation transitions (see the module docstring)."""

    def __init__(self, members: Membership, formation: Formation, gen: Generation, fallback: Fallback,
                 events: Events, lightning: LightningSide) -> None:
        self._members, self._formation, self._gen, self._fallback = members, formation, gen, fallback
        self._events, self._lightning = events, lightning
        self.failovers: list[tuple[OwnershipMap, OwnershipMap]] = []
        self.created_during_eval: list[torch.nn.Module] = []
        self._join_adopted = False  # the last commit adopted a join: form it at the next step boundary
        self._lost_since: float | None = None  # a peer lost after a commit: when (formed at the boundary)

    # ------------------------------------------------------------------ decisions
    def aborted(self, session: StepSession, since: float) -> Reform:
        """The step in progress was cut by a lost peer: undo it; the re-form that runs before it runs again
        (and runs the step's earlier batches again). A ``stop`` generation stops here instead."""
        session.undo()
        self.stop_if_asked(session.step)
        self._events.announce("on_step_aborted", f"Bamboo: step {session.step} aborted by a lost peer; "
                              "replaying it on the next generation", step=session.step, cause="lost")
        return Reform(self._owners(), since)

    def evaluation_cut(self, step: int, what: str, since: float) -> Reform:
        """A validation or test batch was cut by a lost peer: the re-form (in training mode: a fallback
        re-runs training steps) after which the batch runs again; evaluation changes no state."""
        self.stop_if_asked(step)
        self._events.announce("on_evaluation_rerun", f"Bamboo: {what} batch interrupted by a lost peer; "
                              "re-running it", loop=what, step=step)
        return Reform(self._owners(), since, evaluation=True)

    def committed(self, outcome: str, lost_since: float | None) -> None:
        """The step committed: a lost peer after the commit (rolled forward) or an adopted join makes the
        next generation form at the next step boundary (:meth:`at_boundary`), where a joiner can be
        positioned."""
        report = self._members.drain_timer.committed()
        if report is not None:
            rank_zero_only(print)(report, flush=True)
        if lost_since is not None:
            self._lost_since = lost_since  # seconds_lost of the failover formed at the next boundary
        self._join_adopted = outcome == commit_protocol.COMMIT_JOIN

    def at_boundary(self) -> Reform | None:
        """Before a step: the re-form of an adopted join (every member read the same outcome, so all switch
        here) or of a generation that came without a failure seen here; else ``None``."""
        self._members.joining_setup = False
        if not (self._join_adopted or self._members.generation_newer(self._owners().generation)):
            return None
        self._join_adopted = False
        since, self._lost_since = self._lost_since, None
        return Reform(self._owners(), time.monotonic() if since is None else since)

    def drain(self, step: int, ranks: list[int], checkpoint_dir: str | Path | None = None,
              notices: dict[int, Notice] | None = None) -> Reform | None:
        """Take ``ranks`` out at this step boundary (``BambooStrategy.drain``): an announced departure under a
        supervisor (the survivors' re-form returned); without one (no next generation can come) checkpoint
        and stop. A leaving member leaves ``fit`` here."""
        members = self._members
        trainer = self._lightning.module().trainer
        if not members.elastic:
            for rank in ranks:
                drain_with_checkpoint(trainer, rank, checkpoint_dir)
            return None
        assert members.store is not None
        start, old = time.monotonic(), self._owners()
        leaving = departure.announce(members.store, old, ranks, step)
        for member in leaving:
            self._events.emit("on_drain", member=member, rank=old.rank_of(member), step=step)
        members.drain_timer.begin(leaving, step, [n.received_at for n in (notices or {}).values()])
        departure.wait_without(members.store, old.generation, leaving, members.failure_wait)
        if members.member in leaving:
            log.warning("Bamboo member %d: leaving after step %d (announced departure)", members.member, step)
            members.departed = True
            # leave ``fit`` now, the way Lightning's own tuner callbacks end it early: teardown hooks run,
            # nothing else. Whatever ran after this boundary (ModelCheckpoint's collective decisions and save,
            # on_train_end) would run against a world the survivors have already left. ``teardown`` then
            # ends the process (BambooDeparted, exit 0): the script's code after ``fit`` is the survivors'.
            raise _private.LeaveFit
        return Reform(old, start, drain=True)

    # ------------------------------------------------------------------ forming
    def form(self, session: StepSession, reform: Reform) -> None:
        """Form the generation after ``reform.old`` (or wait as a spare), replay the step's earlier batches on
        it and report the transition. Run by the retry loop: a peer lost in here raises, and the loop runs
        the same re-form again towards the newest generation."""
        if not reform.evaluation:
            self._form(session, reform)
            return
        # Modules the re-form creates were never seen by Lightning's capture of the evaluation modes, so
        # Lightning would not restore them: ``on_validation_end`` puts them back (evaluation_ended)
        module = self._lightning.module()
        before = {id(m) for m in module.modules()}
        module.train()
        try:
            self._form(session, reform)
        finally:
            module.eval()
            self.created_during_eval += [m for m in module.modules() if id(m) not in before]

    def _form(self, session: StepSession, reform: Reform) -> None:
        members, old = self._members, reform.old
        members.report_applied(session.step)
        kind, new, start = self._form_next(session, old)
        session.replay_window()  # inside a step of several batches: the done ones again, on the new layout
        if members.rank == 0 and members.member in old.members() and old.rank_of(members.member) != 0:
            members.rank_zero.take_over(self._lightning.module().trainer, members.store)
        self.failovers.append((old, new))
        info = {"step": session.step, "seconds_lost": time.monotonic() - reform.since,
                "pipeline_length": self._gen.pipeline_length}
        if kind == "fallback":
            self._events.emit("on_fallback", checkpoint_path=self._fallback.path, **info)
        elif kind == "rejoin":
            joined = sorted(set(new.members()) - set(old.members()))
            self._events.emit("on_rejoin", old_map=old, new_map=new, members=joined, **info)
        else:
            gone = sorted(set(old.members()) - set(new.members()) - set(new.spares))
            cause = "drain" if kind == "drain" else "lost"
            self._events.emit("on_failover", old_map=old, new_map=new, cause=cause, members=gone, **info)
        rank_zero_only(print)(
            f"[bamboo] {kind} at step {session.step}: generation {old.generation} -> {new.generation} "
            f"({time.monotonic() - start:.2f}s to re-form)\n{old.format()}\n->\n{new.format()}",
            flush=True,
        )
        if reform.drain:
            members.drain_timer.reformed()

    def _form_next(self, session: StepSession, old: OwnershipMap) -> tuple[str, OwnershipMap, float]:
        """Form the newest generation after the current one: its kind, its map, when forming began."""
        members = self._members
        store, current = members.store, self._owners()
        assert store is not None
        while True:
            generation = ms.current_generation(store)
            if generation > current.generation:
                break
            time.sleep(0.01)
        kind = ms.get_str(store, f"gen{generation}/kind")
        if kind == "stop":
            self._stop(session.step)
        new = ms.read_map(store, generation)
        if members.member not in new.members():
            raise crash.Spare(f"Bamboo member {members.member} is a spare in generation {generation}")
        start = time.monotonic()
        session.restore_window_buffers()
        # one schedule for all: a newcomer starts with the mode's FR, a survivor that switched it goes back
        self._formation.forward_redundancy = self._formation.default_forward_redundancy
        members.joins.send_progress(old, new, session.step)
        members.begin(new)
        session.phase("form", generation=generation)  # its process group exists, no layer moved yet
        if kind != "fallback":
            try:
                self._formation.form(self._gen, members.member, store, self._lightning.module(),
                                     self._lightning.optimizer())
            except FallbackNeeded as err:  # every member plans the same moves, so all of them get here
                log.warning("Bamboo: %s", err)
                kind = "fallback"
        if kind == "fallback":
            self._fallback.fall_back(session, new, members.member, members.rank, store)
        members.formed(generation)
        return kind, new, start

    # ------------------------------------------------------------------ stopping and evaluation
    def stop_if_asked(self, step: int) -> None:
        """Stop here (:meth:`Fallback.stop`) when the generation that ended this one is a ``stop``: no
        replay."""
        store = self._members.store
        assert store is not None
        generation = ms.current_generation(store)
        if generation > self._owners().generation and ms.get_str(store, f"gen{generation}/kind") == "stop":
            self._stop(step)

    def _stop(self, step: int) -> None:
        members = self._members
        timeout = members.timeout.total_seconds() if members.timeout is not None else 30.0
        self._fallback.stop(step, members.store, members.rank == 0 and not members.left, timeout)

    def evaluation_ended(self) -> None:
        """``on_validation_end``: modules a re-form created during evaluation go back to training mode."""
        for created in self.created_during_eval:
            created.training = True
        self.created_during_eval = []

    def _owners(self) -> OwnershipMap:
        owners = self._gen.owners
        assert owners is not None
        return owners
