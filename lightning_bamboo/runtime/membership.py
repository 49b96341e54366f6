"""The membership runtime: which generation this member is in, and what it does when the job's membership
changes (failover, rejoin, fallback, drain, stop).

A failure (a communication error, or the generation changing while waiting) makes a member wait for the
supervisor's next generation (:mod:`lightning_bamboo.launch` decides membership), release the old process
group as its backend needs (:mod:`lightning_bamboo.runtime.release`: gloo's sockets cut, NCCL's backends
aborted from a watcher thread; a failed generation is never destroyed) and form the new one:
``init_process_group`` on ``PrefixStore("gen{g}")``, layers moved peer to peer where the new
ownership map needs them (:mod:`lightning_bamboo.runtime.reshard`; a promoted replica moves nothing), new
groups, engine and replica (:class:`~lightning_bamboo.runtime.formation.Formation`). An aborted step is then
*replayed* on the new layout with the same batch (every batch of the step, with ``accumulate_grad_batches``),
so the run's trajectory is the uninterrupted one. Every step, evaluation batch and the formation of a
generation run inside :meth:`~lightning_bamboo.step.session.StepSession.retrying`, the one retry loop.

Joins: a worker the supervisor starts while the job runs registers in ``on_train_start``; the members adopt
the supervisor's proposal at a step's commit and form it at the next step boundary with the joiner, which
receives its layers and optimizer state from peers and the trainer's progress as JSON
(:mod:`lightning_bamboo.control.join`, :mod:`lightning_bamboo.step.progress`). Announced departures (a
SIGTERM, a
spot notice) drain at a step boundary (:mod:`lightning_bamboo.control.drain`); a loss redundancy cannot cover
loads the last periodic checkpoint and re-runs the steps since (:mod:`lightning_bamboo.runtime.fallback`).

Without a supervisor (an outside launcher, one process) there is no next generation: a lost peer's error
ends the job, as under DDP.
"""

from __future__ import annotations

import contextlib
import logging
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_bamboo._lightning import private as _private
from lightning_bamboo.control import commit as commit_protocol
from lightning_bamboo.control import crash
from lightning_bamboo.control import drain as departure
from lightning_bamboo.control import join as joining
from lightning_bamboo.control import store as ms
from lightning_bamboo.control.drain import DrainTimer
from lightning_bamboo.layout.ownership import FallbackNeeded, OwnershipMap, initial
from lightning_bamboo.runtime import release as releases
from lightning_bamboo.runtime.collective_commit import CollectiveCommit, report_applied, settle
from lightning_bamboo.runtime.cutter import FAILED_KINDS
from lightning_bamboo.runtime.events import drain_with_checkpoint
from lightning_bamboo.runtime.joins import Joins
from lightning_bamboo.runtime.lightning_side import LightningSide
from lightning_bamboo.runtime.rank_zero import RankZeroDuties

if TYPE_CHECKING:

    from lightning_bamboo.notices.base import Notice
    from lightning_bamboo.runtime.events import Events
    from lightning_bamboo.runtime.fallback import Fallback
    from lightning_bamboo.runtime.formation import Formation
    from lightning_bamboo.runtime.generation import Generation
    from lightning_bamboo.step.session import StepSession

log = logging.getLogger(__name__)


class Spare(RuntimeError):
    """This member has no stage in the new generation: it leaves (not an error of the training code)."""


class Membership:
    """This member's place in the job and its generation transitions (see the module docstring).

    ``env`` is the supervisor's worker environment (``None``: an outside launcher, fixed membership).
    """

    def __init__(self, env: ms.WorkerEnv | None, formation: Formation, gen: Generation, session: StepSession,
                 fallback: Fallback, events: Events, lightning: LightningSide, failure_wait: float,
                 timeout: timedelta | None) -> None:
        self.env = env
        gen.member = env.member if env is not None else 0
        self.nproc = env.nproc if env is not None else 1
        # a worker counts as its member id until generation 0 forms, so Lightning's rank-zero-only output
        # while the Trainer is built and fit starts (tips, device summary, warnings) comes from member 0 only
        self.rank, self.world = gen.member, 1
        self.elastic = env is not None  # a supervisor publishes generations (set per fit in setup)
        self.store: dist.Store | None = None
        self.backend: str | None = None
        self._formation, self._gen, self._session, self._fallback = formation, gen, session, fallback
        self._events, self._lightning = events, lightning
        self._failure_wait, self._timeout = failure_wait, timeout
        self._heartbeat: ms.Heartbeat | None = None
        self._release: releases.Release | None = None  # how this backend lets go of a generation
        self._generations: ms.GenerationWatch | None = None  # the boundary's look at the generation
        self._collective: CollectiveCommit | None = None  # the commit by all-reduce (a store across machines)
        self.failovers: list[tuple[OwnershipMap, OwnershipMap]] = []
        self.join_adopted = False  # the last commit adopted a join: form it at the next step boundary
        self.lost_since: float | None = None  # a peer lost after a commit: when (formed at the boundary)
        self.joining_setup = False  # a joiner before its first step: no collective with the running job
        self.skip: Any = None  # a joiner's training batch sampler (progress.SkipFirstBatches)
        self.departed = False  # this member left by an announced departure (it stops after its last step)
        self.left = False  # a departed member's fit has ended: it is no rank of the job any more
        self.created_during_eval: list[torch.nn.Module] = []
        self.rank_zero = RankZeroDuties()  # rows and progress bar, when this member becomes rank 0
        self.drain_timer = DrainTimer()
        self.joins = Joins(gen, formation, lambda: session.step, lightning, lambda: self.store)

    @property
    def member(self) -> int:
        """This worker's id in the job (the generation's ``member``: one value, read by every part)."""
        return self._gen.member

    @member.setter
    def member(self, member: int) -> None:
        self._gen.member = member

    def start(self, store: dist.Store, elastic: bool, heartbeat: float | None) -> None:
        """An entry point connected ``store``; the elastic one starts the heartbeat (every ``heartbeat``
        seconds; ``None``: :func:`~lightning_bamboo.control.store.default_heartbeat`) and the watcher of
        the backend's release (:mod:`~lightning_bamboo.runtime.release`)."""
        self.store, self.elastic = store, elastic
        if self._release is not None:
            self._release.stop()
        self._release = releases.for_backend(self.backend, self.env if elastic else None,
                                             self._lightning.device, self._timeout)
        if elastic:
            assert self.env is not None
            interval = heartbeat if heartbeat is not None else ms.default_heartbeat(store)
            self._heartbeat = ms.Heartbeat(self.env, interval)
            self._generations = ms.GenerationWatch(store)
            if isinstance(store, ms.RoundTripStore):
                env = self.env
                self._collective = CollectiveCommit(store, lambda: ms.connect(env.store_url, env.job),
                                                    self._lightning.device)

    # ------------------------------------------------------------------ generations
    def generation_zero(self) -> OwnershipMap:
        """Generation 0 (``num_stages`` x the pipelines of the workers), agreed in the store."""
        assert self.store is not None
        formation = self._formation
        owners = initial(formation.num_stages, range(self.nproc))
        text = owners.to_json()
        stored = self.store.compare_set("gen0/map", "", text).decode()
        if stored != text:
            raise ValueError(
                f"this worker was started with num_stages={formation.num_stages}, but the job's "
                f"generation 0 is {OwnershipMap.from_json(stored).format()}"
            )
        self.store.compare_set("config/num_stages", "", str(formation.num_stages))
        self.store.compare_set(ms.REPLICAS, "", "1" if formation.redundancy else "0")
        total = str(formation.num_microbatches * len(owners.pipelines))
        agreed = self.store.compare_set(ms.GLOBAL_MICROBATCHES, "", total).decode()
        formation.global_microbatches = int(agreed)
        if self.member not in owners.members():
            raise RuntimeError(
                f"member {self.member} has no stage in generation 0 (spare workers are not "
                "supported at start: use a multiple of num_stages)"
            )
        formation.warn_if_unrecoverable(owners)
        return owners

    def begin(self, owners: OwnershipMap) -> None:
        """Release the last generation's process groups and create ``owners``' (ranks follow it): by the
        backend's failed-generation release when a failure generation ended it, else by destroy."""
        assert self.store is not None and self._release is not None
        if dist.is_initialized():
            kind = ms.read_if_set(self.store, f"gen{owners.generation}/kind") if self.elastic else None
            self._release.end(failed=kind is not None and kind.decode() in FAILED_KINDS)
        self._release.before_init()
        self._gen.owners = owners
        self.rank, self.world = owners.rank_of(self.member), len(owners.members())
        device = self._lightning.device()
        kwargs: dict[str, Any] = {"timeout": self._release.pg_timeout(self._timeout)}
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore(f"gen{owners.generation}", self.store),
            rank=self.rank,
            world_size=self.world,
            **kwargs,
        )
        self._release.began(owners.generation)
        self._lightning.ranks_changed()

    def formed(self, generation: int) -> None:
        """Tell the supervisor this member formed ``generation`` (and watch its groups)."""
        assert self.store is not None and self._release is not None
        self._release.formed(generation)
        self.store.add(f"gen{generation}/formed", 1)

    # ------------------------------------------------------------------ around a step (the session's Runtime)
    def attempt(self) -> contextlib.AbstractContextManager[None]:
        """Around one attempt of the retry loop: the backend's deadline backstop, where it has one."""
        return self._release.attempt() if self._release is not None else contextlib.nullcontext()

    def vote(self, step: int, prepare: bool) -> str:
        """The commit's outcome of ``step``: prepare and wait for it (``prepare``), or settle it after an
        error. On a store across machines the members commit by all-reduce and settle a cut step from what
        each survivor applied (:mod:`~lightning_bamboo.runtime.collective_commit`); else, and for a step
        that adopts a join, through the store (:class:`~lightning_bamboo.control.commit.StepCommit`: abort
        unless decided). A job with fixed membership has no one to wait for."""
        owners = self._gen.owners
        if prepare and not self.elastic:
            return commit_protocol.COMMIT
        assert self.store is not None and owners is not None
        collective = self._collective
        if not prepare and collective is not None:
            return settle(self.store, owners.generation, owners.members(), step, self._failure_wait)
        if collective is not None:
            outcome = collective.prepare_and_wait(owners.generation, step, self.rank)
            if outcome is not None:
                return outcome
        commit = commit_protocol.StepCommit(self.store, owners.generation, len(owners.members()))
        if prepare:
            return commit.prepare_and_wait(step, self.joins.claim, joining.proposal_key(owners.generation))
        return commit.decide(step, commit_protocol.ABORT)

    def _report_applied(self) -> None:
        """Leaving this generation: say how many steps this member applied in it (what a settlement of a
        step cut by a loss reads, :func:`~lightning_bamboo.runtime.collective_commit.settle`)."""
        owners = self._gen.owners
        if self._collective is None or owners is None or self.store is None:
            return
        with contextlib.suppress(Exception):  # the store may be what failed; a settlement then waits it out
            report_applied(self.store, owners.generation, self.member, self._session.step)

    def recover(self, since: float) -> None:
        """The step in progress was cut by a lost peer: undo it, form the next generation (which runs the
        step's earlier batches again), and let the caller run the batch in flight again."""
        self._session.undo()
        self.stop_if_asked()
        self._events.announce("on_step_aborted", f"Bamboo: step {self._session.step} aborted by a lost peer; "
                              "replaying it on the next generation", step=self._session.step, cause="lost")
        self.next_generation(since=since)

    def generation_ended(self, err: BaseException) -> bool:
        """Whether ``err`` came from a lost peer: the launcher publishes a new generation soon after."""
        owners = self._gen.owners
        assert self.store is not None and owners is not None
        if isinstance(err, (KeyboardInterrupt, SystemExit, Spare)):
            return False
        if not self.elastic:  # no supervisor publishes a next generation: the error ends the job
            if crash.is_communication_error(err):
                log.error(
                    "Bamboo: a peer was lost (%s) and this job has no Bamboo supervisor to fail over: start "
                    "the script plainly (python train.py, Trainer(devices=N)) or with python -m "
                    "lightning_bamboo.launch to survive it", type(err).__name__,
                )
            return False
        if not crash.is_communication_error(err) and ms.current_generation(self.store) <= owners.generation:
            # an error of the training code: a failover would raise it again on the member taking the
            # stage over. Raised, it stops the job (on_exception records it for the supervisor).
            return False
        # what a lost peer does to this member's collectives: expected, and the supervisor reports the
        # failover; a failover that does not come raises the error below (INFO: shown with logging at INFO)
        log.info("Bamboo member %d: %s: %s", self.member, type(err).__name__,
                 str(err).splitlines()[0] if str(err) else "")
        self._report_applied()
        with contextlib.suppress(Exception):  # a hint for the coordinator; the store may be what failed
            ms.report_lost_peer(self.store, owners.generation)
        self._abort_groups()
        deadline = time.monotonic() + self._failure_wait
        while time.monotonic() < deadline:
            if ms.current_generation(self.store) > owners.generation:
                return True
            time.sleep(0.01)
        return False

    def _abort_groups(self) -> None:
        """Release the failed generation as its backend needs (:meth:`.release.Release.failed`: gloo's
        sockets cut, NCCL's backends aborted, never destroyed) and drop what ran on it."""
        assert self._release is not None
        self._release.failed()
        self._gen.engine = None
        self._gen.view = None

    def next_generation(self, since: float | None = None) -> None:
        """Wait for the generation after this one and form it (or wait as a spare).

        ``since`` (``time.monotonic()``) is when training stopped counting: the event's ``seconds_lost``.
        A peer lost while this generation forms (its process group, or the layers moved to it) ends it
        like any lost peer: the newest generation the supervisor published is formed instead.
        """
        since = time.monotonic() if since is None else since
        old = self._gen.owners
        assert old is not None
        self._report_applied()
        kind, new, start = self._session.retrying(lambda: self._form_next(old), lambda err, since: None)
        if self.rank == 0 and self.member in old.members() and old.rank_of(self.member) != 0:
            self.rank_zero.take_over(self._lightning.module().trainer, self.store)
        self.failovers.append((old, new))
        # inside a step of several batches: the done ones again, on the new layout
        self._session.replay_window()
        info = {"step": self._session.step, "seconds_lost": time.monotonic() - since,
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
            f"[bamboo] {kind} at step {self._session.step}: generation {old.generation} -> {new.generation} "
            f"({time.monotonic() - start:.2f}s to re-form)\n{old.format()}\n->\n{new.format()}",
            flush=True,
        )

    def _form_next(self, old: OwnershipMap) -> tuple[str, OwnershipMap, float]:
        """Form the newest generation after the current one: its kind, its map, when forming began."""
        assert self.store is not None
        current = self._gen.owners
        assert current is not None
        while True:
            generation = ms.current_generation(self.store)
            if generation > current.generation:
                break
            time.sleep(0.01)
        kind = ms.get_str(self.store, f"gen{generation}/kind")
        if kind == "stop":
            self._stop()
        new = ms.read_map(self.store, generation)
        if self.member not in new.members():
            raise Spare(f"Bamboo member {self.member} is a spare in generation {generation}")
        start = time.monotonic()
        self._session.restore_window_buffers()
        # one schedule for all: a newcomer starts with the mode's FR, a survivor that switched it goes back
        self._formation.forward_redundancy = self._formation.default_forward_redundancy
        self.joins.send_progress(old, new)
        self.begin(new)
        if kind == "fallback":
            self._fallback.fall_back(new, self.member, self.rank, self.store)
        else:
            try:
                self._formation.form(self._gen, self.member, self.store, self._lightning.module(),
                                     self._lightning.optimizer())
            except FallbackNeeded as err:  # every member plans the same moves, so all of them get here
                log.warning("Bamboo: %s", err)
                kind = "fallback"
                self._fallback.fall_back(new, self.member, self.rank, self.store)
        self.formed(generation)
        return kind, new, start

    def _stop(self) -> None:
        timeout = self._timeout.total_seconds() if self._timeout is not None else 30.0
        self._fallback.stop(self.store, self.rank == 0 and not self.left, timeout)

    def stop_if_asked(self) -> None:
        """Stop here (:meth:`Fallback.stop`) when the generation that ended this one is a ``stop``: no
        replay."""
        assert self.store is not None and self._gen.owners is not None
        generation = ms.current_generation(self.store)
        ended = generation > self._gen.owners.generation
        if ended and ms.get_str(self.store, f"gen{generation}/kind") == "stop":
            self._stop()

    # ------------------------------------------------------------------ step boundaries
    def committed(self, outcome: str, lost_since: float | None) -> None:
        """The step committed: a lost peer after the commit (rolled forward) or an adopted join makes the
        next generation form at the next step boundary (:meth:`join_at_boundary`), where a joiner can be
        positioned."""
        report = self.drain_timer.committed()
        if report is not None:
            rank_zero_only(print)(report, flush=True)
        if lost_since is not None:
            self.lost_since = lost_since  # seconds_lost of the failover formed at the next boundary
        self.join_adopted = outcome == commit_protocol.COMMIT_JOIN

    def join_at_boundary(self) -> None:
        """Form the next generation before the step when the last commit adopted a join (every member read
        the same outcome, so all switch here) or when a generation came without a failure seen here."""
        assert self.store is not None and self._gen.owners is not None
        self.joining_setup = False
        if self.join_adopted or self._generation_newer(self._gen.owners.generation):
            self.join_adopted = False
            since, self.lost_since = self.lost_since, None
            self.next_generation(since=since)

    def _generation_newer(self, generation: int) -> bool:
        """Whether the store holds a generation after ``generation``: through the member's watch while it
        trains elastically, else one read."""
        assert self.store is not None
        if self._generations is not None:
            return self._generations.newer_than(generation)
        return ms.current_generation(self.store) > generation

    def drain(
        self,
        ranks: list[int],
        checkpoint_dir: str | Path | None = None,
        notices: dict[int, Notice] | None = None,
    ) -> None:
        """Take ``ranks`` out at this step boundary (``BambooStrategy.drain``, :mod:`.drain`): an announced
        departure under a supervisor; without one (no next generation can come) checkpoint and stop."""
        trainer = self._lightning.module().trainer
        if not self.elastic:
            for rank in ranks:
                drain_with_checkpoint(trainer, rank, checkpoint_dir)
            return
        assert self.store is not None and self._gen.owners is not None
        start, old, step = time.monotonic(), self._gen.owners, self._session.step
        leaving = departure.announce(self.store, old, ranks, step)
        for member in leaving:
            self._events.emit("on_drain", member=member, rank=old.rank_of(member), step=step)
        self.drain_timer.begin(leaving, step, [n.received_at for n in (notices or {}).values()])
        departure.wait_without(self.store, old.generation, leaving, self._failure_wait)
        if self.member in leaving:
            log.warning("Bamboo member %d: leaving after step %d (announced departure)", self.member, step)
            self.departed = True
            # leave ``fit`` now, the way Lightning's own tuner callbacks end it early: teardown hooks run,
            # nothing else. Whatever ran after this boundary (ModelCheckpoint's collective decisions and save,
            # on_train_end) would run against a world the survivors have already left. ``teardown`` then
            # ends the process (BambooDeparted, exit 0): the script's code after ``fit`` is the survivors'.
            raise _private.LeaveFit
        self.next_generation(since=start)
        self.drain_timer.reformed()

    def reform_during_evaluation(self, since: float) -> None:
        """Form the next generation in training mode (a fallback re-runs training steps), then put every
        module back in evaluation mode. Modules the re-form created were never seen by Lightning's capture
        of the modes, so Lightning would not restore them: ``on_validation_end`` puts them back in training
        mode (:attr:`created_during_eval`)."""
        module = self._lightning.module()
        before = {id(m) for m in module.modules()}
        module.train()
        try:
            self.next_generation(since=since)
        finally:
            module.eval()
        self.created_during_eval += [m for m in module.modules() if id(m) not in before]

    def evaluation_ended(self) -> None:
        for created in self.created_during_eval:
            created.training = True
        self.created_during_eval = []

    # ------------------------------------------------------------------ the end
    def finish(self) -> None:
        """Tell the supervisor this member is done (its heartbeat stops now)."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if self._release is not None:
            self._release.stop()
            self._release = None
        if self._generations is not None:
            self._generations.close()
            self._generations = None
        if self._collective is not None:
            self._report_applied()
            self._collective.close()
            self._collective = None
        if self.store is not None and self.elastic:
            self.store.set(f"done/{self.member}", "1")
        self.elastic = False


def record_exception(store: dist.Store | None, member: int, exception: BaseException) -> None:
    """``fit`` ends with ``exception``: unless a lost peer caused it, record it in the job's store, so the
    supervisor stops the job with it instead of failing over (:mod:`lightning_bamboo.control.crash`)."""
    if store is None or isinstance(exception, (SystemExit, KeyboardInterrupt, Spare)):
        return
    if crash.is_communication_error(exception):
        return
    try:
        first = crash.record(store, member, exception)
        earlier = crash.recorded(store, first) if first != member else None
    except Exception as err:  # the supervisor is gone: nobody to tell
        log.warning("Bamboo member %d: could not record its error in the store: %s", member, err)
        return
    if earlier is not None:  # every worker met the same error: its traceback once, not once per worker
        crash.report_once(exception, member, earlier)
