"""The membership: which generation this member is in, and what a failure or a step's outcome means for it.

A failure (a communication error, or the generation changing while waiting) makes a member wait for the
supervisor's next generation (:mod:`lightning_bamboo.launch` decides membership) and release the old process
group as its backend needs (:mod:`lightning_bamboo.runtime.release`: gloo's sockets cut, NCCL's backends
aborted from a watcher thread; a failed generation is never destroyed); :meth:`Membership.begin` then
creates the next one with ``init_process_group`` on ``PrefixStore("gen{g}")``. The membership answers the
step session's retry loop (:meth:`~lightning_bamboo.step.session.StepSession.retrying`) and returns: whether
an error ended the generation, the commit's outcome of a step, whether a re-form is due at a step boundary.
What forming the next generation does (layers moved, a fallback, a replay, the events) is
:mod:`lightning_bamboo.runtime.transitions`; joins are :mod:`lightning_bamboo.runtime.joins`.

Without a supervisor (an outside launcher, one process) there is no next generation: a lost peer's error
ends the job, as under DDP.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from lightning_bamboo.protocol import commit as commit_protocol
from lightning_bamboo.protocol import crash
from lightning_bamboo.protocol import join as joining
from lightning_bamboo.protocol import store as ms
from lightning_bamboo.protocol.drain import DrainTimer
from lightning_bamboo.runtime import release as releases
from lightning_bamboo.runtime.collective_commit import CollectiveCommit, report_applied, settle
from lightning_bamboo.runtime.cutter import FAILED_KINDS
from lightning_bamboo.runtime.joins import Joins
from lightning_bamboo.runtime.lightning_side import LightningSide
from lightning_bamboo.runtime.rank_zero import RankZeroDuties

if TYPE_CHECKING:
    from lightning_bamboo.layout.ownership import OwnershipMap
    from lightning_bamboo.runtime.formation import Formation
    from lightning_bamboo.runtime.generation import Generation

log = logging.getLogger(__name__)


class Membership:
    """This member's place in the job and the decisions the retry loop asks of it (see the module docstring).

    ``env`` is the supervisor's worker environment (``None``: an outside launcher, fixed membership).
    """

    def __init__(self, env: ms.WorkerEnv | None, formation: Formation, gen: Generation,
                 lightning: LightningSide, failure_wait: float, timeout: timedelta | None) -> None:
        self.env = env
        gen.member = env.member if env is not None else 0
        self.nproc = env.nproc if env is not None else 1
        # a worker counts as its member id until generation 0 forms, so Lightning's rank-zero-only output
        # while the Trainer is built and fit starts (tips, device summary, warnings) comes from member 0 only
        self.rank, self.world = gen.member, 1
        self.elastic = env is not None  # a supervisor publishes generations (set per fit in setup)
        self.store: dist.Store | None = None
        self.backend: str | None = None
        self._formation, self._gen, self._lightning = formation, gen, lightning
        self.failure_wait, self.timeout = failure_wait, timeout
        self._heartbeat: ms.Heartbeat | None = None
        self._release: releases.Release | None = None  # how this backend lets go of a generation
        self._generations: ms.GenerationWatch | None = None  # the boundary's look at the generation
        self._collective: CollectiveCommit | None = None  # the commit by all-reduce (a store across machines)
        self.joining_setup = False  # a joiner before its first step: no collective with the running job
        self.skip: Any = None  # a joiner's training batch sampler (progress.SkipFirstBatches)
        self.departed = False  # this member left by an announced departure (it stops after its last step)
        self.left = False  # a departed member's fit has ended: it is no rank of the job any more
        self.rank_zero = RankZeroDuties()  # rows and progress bar, when this member becomes rank 0
        self.drain_timer = DrainTimer()
        self.joins = Joins(gen, formation, lightning, lambda: self.store)

    @property
    def member(self) -> int:
        """This worker's id in the job (the generation's ``member``: one value, read by every part)."""
        return self._gen.member

    @member.setter
    def member(self, member: int) -> None:
        self._gen.member = member

    def start(self, store: dist.Store, elastic: bool, heartbeat: float | None) -> None:
        """An entry point connected ``store``; the elastic one starts the heartbeat (every ``heartbeat``
        seconds; ``None``: :func:`~lightning_bamboo.protocol.store.default_heartbeat`) and the watcher of
        the backend's release (:mod:`~lightning_bamboo.runtime.release`)."""
        self.store, self.elastic = store, elastic
        if self._release is not None:
            self._release.stop()
        self._release = releases.for_backend(self.backend, self.env if elastic else None,
                                             self._lightning.device, self.timeout)
        if elastic:
            assert self.env is not None
            interval = heartbeat if heartbeat is not None else ms.default_heartbeat(store)
            self._heartbeat = ms.Heartbeat(self.env, interval)
            self._generations = ms.GenerationWatch(store)
            # across machines the commit is one all-reduce; on one machine, the store's (measured faster
            # there: docs/bamboo-elastic-reference.md, "The two-phase step"), unless a measurement asks
            # otherwise
            one_machine_collective = os.environ.get(ms.ENV_ONE_MACHINE_COMMIT) == "collective"
            if isinstance(store, ms.RoundTripStore) or one_machine_collective:
                env = self.env
                self._collective = CollectiveCommit(store, lambda: ms.connect(env.store_url, env.job),
                                                    self._lightning.device)

    # ------------------------------------------------------------------ generations
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
        kwargs: dict[str, Any] = {"timeout": self._release.pg_timeout(self.timeout)}
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

    # ------------------------------------------------------------------ around a step (the retry loop's)
    def attempt(self) -> contextlib.AbstractContextManager[None]:
        """Around one attempt of the retry loop: the backend's deadline backstop, where it has one."""
        return self._release.attempt() if self._release is not None else contextlib.nullcontext()

    def vote(self, step: int, prepare: bool) -> str:
        """The commit's outcome of ``step``: prepare and wait for it (``prepare``), or settle it after an
        error. On a store across machines the members commit by all-reduce and settle a cut step from what
        each survivor applied (:mod:`~lightning_bamboo.runtime.collective_commit`); else, and for a step
        that adopts a join, through the store (:class:`~lightning_bamboo.protocol.commit.StepCommit`: abort
        unless decided). A job with fixed membership has no one to wait for."""
        owners = self._gen.owners
        if prepare and not self.elastic:
            return commit_protocol.COMMIT
        assert self.store is not None and owners is not None
        collective = self._collective
        if not prepare and collective is not None:
            return settle(self.store, owners.generation, owners.members(), step, self.failure_wait)
        if collective is not None:
            outcome = collective.prepare_and_wait(owners.generation, step, self.rank)
            if outcome is not None:
                return outcome
        commit = commit_protocol.StepCommit(self.store, owners.generation, len(owners.members()))
        if prepare:
            return commit.prepare_and_wait(step, self.joins.claim, joining.proposal_key(owners.generation))
        return commit.decide(step, commit_protocol.ABORT)

    def report_applied(self, step: int) -> None:
        """Leaving this generation: say that this member applied ``step`` steps in it (what a settlement of a
        step cut by a loss reads, :func:`~lightning_bamboo.runtime.collective_commit.settle`)."""
        owners = self._gen.owners
        if self._collective is None or owners is None or self.store is None:
            return
        with contextlib.suppress(Exception):  # the store may be what failed; a settlement then waits it out
            report_applied(self.store, owners.generation, self.member, step)

    def generation_ended(self, err: BaseException, step: int) -> bool:
        """Whether ``err`` came from a lost peer (``step`` steps applied here): the launcher publishes a new
        generation soon after."""
        owners = self._gen.owners
        assert self.store is not None and owners is not None
        if isinstance(err, (KeyboardInterrupt, SystemExit, crash.Spare)):
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
        self.report_applied(step)
        with contextlib.suppress(Exception):  # a hint for the coordinator; the store may be what failed
            ms.report_lost_peer(self.store, owners.generation)
        self._abort_groups()
        deadline = time.monotonic() + self.failure_wait
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

    def generation_newer(self, generation: int) -> bool:
        """Whether the store holds a generation after ``generation`` (a step boundary's look): through the
        member's watch while it trains elastically, else one read."""
        assert self.store is not None
        if self._generations is not None:
            return self._generations.newer_than(generation)
        return ms.current_generation(self.store) > generation

    # ------------------------------------------------------------------ the end
    def finish(self, step: int) -> None:
        """Tell the supervisor this member is done after ``step`` steps (its heartbeat stops now)."""
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
            self.report_applied(step)
            self._collective.close()
            self._collective = None
        if self.store is not None and self.elastic:
            self.store.set(f"done/{self.member}", "1")
        self.elastic = False
