"""What the Bamboo runtime does when the job's membership changes: failover, rejoin, fallback, drain, stop.

:class:`ElasticRuntime` is the part of :class:`~lightning_bamboo.strategy.BambooStrategy` that runs between
generations. A failure (a gloo error, or the generation changing while waiting) makes a member wait for the
supervisor's next generation (:mod:`lightning_bamboo.launch` decides membership), destroy the old process
group and form the new one: ``init_process_group`` on ``PrefixStore("gen{g}")``, layers moved peer to peer
where the new ownership map needs them (:mod:`lightning_bamboo.elastic.reshard`; a promoted replica moves
nothing),
new groups, engine and replica; Lightning's ``global_rank``/``world_size``/``rank_zero_only.rank`` follow. An
aborted step is then *replayed* on the new layout with the same batch (every batch of the step, with
``accumulate_grad_batches``), so the run's trajectory is the uninterrupted one.

Joins: a worker the supervisor starts while the job runs registers in ``on_train_start``; the members adopt
the supervisor's proposal at a step's commit and form it at the next step boundary with the joiner, which
receives its layers and optimizer state from peers and the trainer's progress as JSON
(:mod:`lightning_bamboo.elastic.join`, :mod:`lightning_bamboo.progress`). Announced departures (a SIGTERM, a
spot
notice) drain at a step boundary (:mod:`lightning_bamboo.elastic.drain`); a loss redundancy cannot cover loads
the last periodic checkpoint and re-runs the steps since (:mod:`lightning_bamboo.checkpoint.periodic`).

Without a supervisor (an outside launcher, one process) there is no next generation: a lost peer's error
ends the job, as under DDP.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

from lightning_bamboo import _private
from lightning_bamboo import progress as trainer_progress
from lightning_bamboo.checkpoint import periodic as fb
from lightning_bamboo.checkpoint import sharded as ckpt
from lightning_bamboo.checkpoint import stop as stop_checkpoint
from lightning_bamboo.clipping import apply_clipping
from lightning_bamboo.elastic import commit as commit_protocol
from lightning_bamboo.elastic import crash
from lightning_bamboo.elastic import drain as departure
from lightning_bamboo.elastic import join as joining
from lightning_bamboo.elastic import store as ms
from lightning_bamboo.elastic.ownership import FallbackNeeded, OwnershipMap
from lightning_bamboo.elastic.reshard import gather

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_bamboo.notices.base import Notice

log = logging.getLogger(__name__)


class _Spare(RuntimeError):
    """This member has no stage in the new generation: it leaves (not an error of the training code)."""


class ElasticRuntime:
    """Membership changes of :class:`~lightning_bamboo.strategy.BambooStrategy` (see the module docstring).

    A mixin over the strategy's state (``owners``, ``_store``, ``_layers``, the step window, ...): it is not
    used on its own.
    """

    def _recover(self, since: float) -> None:
        """The step in progress was cut by a lost peer: undo it, form the next generation (which runs the
        step's earlier batches again), and let the caller run the batch in flight again."""
        self._undo_step()
        self._stop_if_asked()
        log.warning(
            "Bamboo: step %d aborted by a lost peer; replaying it on the next generation", self._step
        )
        self._next_generation(since=since)

    def _restore_window_buffers(self) -> None:
        """Buffers back to the step's start before its batches run again (BatchNorm statistics once)."""
        if self._window_done:
            with torch.no_grad():
                for buffer, saved in self._window_buffers:
                    buffer.copy_(saved)

    # ------------------------------------------------------------------ membership changes
    def _generation_ended(self, err: BaseException) -> bool:
        """Whether ``err`` came from a lost peer: the launcher publishes a new generation soon after."""
        assert self._store is not None and self.owners is not None
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            return False
        if not self._elastic:  # no supervisor publishes a next generation: the error ends the job
            if crash.is_communication_error(err):
                log.error(
                    "Bamboo: a peer was lost (%s) and this job has no Bamboo supervisor to fail over: start "
                    "the script plainly (python train.py, Trainer(devices=N)) or with python -m "
                    "lightning_bamboo.launch to survive it", type(err).__name__,
                )
            return False
        if not crash.is_communication_error(err) and (
            ms.current_generation(self._store) <= self.owners.generation
        ):
            # an error of the training code: a failover would raise it again on the member taking the
            # stage over. Raised, it stops the job (on_exception records it for the supervisor).
            return False
        # what a lost peer does to this member's collectives: expected, and the supervisor reports the
        # failover; a failover that does not come raises the error below (INFO: shown with logging at INFO)
        log.info(
            "Bamboo member %d: %s: %s",
            self.member,
            type(err).__name__,
            str(err).splitlines()[0] if str(err) else "",
        )
        with contextlib.suppress(Exception):  # a hint for the coordinator; the store may be what failed
            ms.report_lost_peer(self._store, self.owners.generation)
        self._abort_groups()
        deadline = time.monotonic() + self._failure_wait
        while time.monotonic() < deadline:
            if ms.current_generation(self._store) > self.owners.generation:
                return True
            time.sleep(0.01)
        return False

    def _abort_groups(self) -> None:
        """Abort this member's process groups: peers blocked on it fail now instead of at their timeout.

        Its connections are shut down first (:meth:`~.cutter.GenerationCutter.cut_now`): a peer waiting for a
        message this member will not send now (the rest of a broadcast it abandoned) is failed by gloo only
        when this side's sockets close, not by ``abort`` (measured: 20 s, the group's timeout, without it)."""
        if not dist.is_initialized():
            return
        if self._cutter is not None:
            self._cutter.cut_now()
        try:
            _private.abort_process_group()
        except Exception as err:  # the groups are being thrown away either way
            log.warning(
                "Bamboo: aborting the process group failed (%s); peers may wait for their timeout", err
            )
        self.engine = None
        self.view = None
        self.groups = None
        if dist.is_initialized():
            dist.destroy_process_group()

    def _next_generation(self, since: float | None = None) -> None:
        """Wait for the generation after this one and form it (or wait as a spare).

        ``since`` (``time.monotonic()``) is when training stopped counting: the event's ``seconds_lost``.
        """
        assert self._store is not None and self.owners is not None
        since = time.monotonic() if since is None else since
        old = self.owners
        while True:
            generation = ms.current_generation(self._store)
            if generation > old.generation:
                break
            time.sleep(0.01)
        kind = ms.get_str(self._store, f"gen{generation}/kind")
        if kind == "stop":
            self._stop()
        new = ms.read_map(self._store, generation)
        if self.member not in new.members():
            raise _Spare(f"Bamboo member {self.member} is a spare in generation {generation}")
        start = time.monotonic()
        self._restore_window_buffers()
        # every member of the new generation runs the same schedule: a member new to the job (a join, or a
        # fallback's newcomer) starts with FR on, so a survivor that had it switched off switches it back on
        self._forward_redundancy = self._redundancy
        self._send_progress(old, new)
        self._init_generation(new)
        if kind == "fallback":
            self._fall_back(new)
        else:
            try:
                self._form(new)
            except FallbackNeeded as err:  # every member plans the same moves, so all of them get here
                log.warning("Bamboo: %s", err)
                kind = "fallback"
                self._fall_back(new)
        self._formed(generation)
        if self._rank == 0 and self.member in old.members() and old.rank_of(self.member) != 0:
            assert self.lightning_module is not None
            self._rank_zero.take_over(self.lightning_module.trainer, self._store)
        self.failovers.append((old, new))
        if self._window:  # inside a step of several batches: the done ones again, on the new layout
            self._window_buffers = self._buffer_snapshot()
            self._replay_window()
        info = {
            "step": self._step,
            "seconds_lost": time.monotonic() - since,
            "pipeline_length": self.pipeline_length,
        }
        if kind == "fallback":
            self._emit("on_fallback", checkpoint_path=self._fallback_path, **info)
        elif kind == "rejoin":
            joined = sorted(set(new.members()) - set(old.members()))
            self._emit("on_rejoin", old_map=old, new_map=new, members=joined, **info)
        else:
            gone = sorted(set(old.members()) - set(new.members()) - set(new.spares))
            cause = "drain" if kind == "drain" else "lost"
            self._emit("on_failover", old_map=old, new_map=new, cause=cause, members=gone, **info)
        rank_zero_only(print)(
            f"[bamboo] {kind} at step {self._step}: generation {old.generation} -> {generation} "
            f"({time.monotonic() - start:.2f}s to re-form)\n{old.format()}\n->\n{new.format()}",
            flush=True,
        )

    def _stop_if_asked(self) -> None:
        """Stop here (:meth:`_stop`) when the generation that ended this one is a ``stop``: no replay."""
        assert self._store is not None and self.owners is not None
        generation = ms.current_generation(self._store)
        if generation > self.owners.generation and ms.get_str(self._store, f"gen{generation}/kind") == "stop":
            self._stop()

    def _stop(self) -> None:
        """The supervisor stops the job (it got SIGTERM, or a worker failed) with a ``stop`` generation.

        Every member is at the same committed step here: a step in flight was aborted or rolled forward as
        in a failover (the cutter ends the old generation's collectives). The final checkpoint, when
        ``checkpoint_every_n_steps`` is set, is therefore one consistent step (written by the first
        pipeline; ``teardown`` waits for the write), and so is the Lightning checkpoint folder a new run
        resumes from (:meth:`_write_stop_checkpoint`). ``fit`` then ends as Lightning ends it on SIGTERM
        (``SIGTERMException``: teardown runs; the process exits with 143 unless the script catches it).
        """
        assert self.owners is not None
        self._maybe_checkpoint(final=True)
        self._write_stop_checkpoint()
        print(
            f"[bamboo] member {self.member}: the job is stopping; leaving after step {self._step} "
            f"(generation {self.owners.generation})",
            flush=True,
        )
        raise SIGTERMException(128 + signal.SIGTERM)

    def _write_stop_checkpoint(self) -> None:
        """Every member writes its part of ``<checkpoint_dir>/<job id>/stop-step=<k>.ckpt``, a Lightning
        checkpoint of the last committed step ``k`` (:mod:`lightning_bamboo.checkpoint.stop`), meeting the
        others through the store. Skipped without ``checkpoint_dir``, when a member's error stopped the job
        (its stages may be in no other member), or where the loop has no resumable state (said once)."""
        checkpointer, owners, store = self._checkpointer, self.owners, self._store
        if checkpointer is None or owners is None or store is None or self.lightning_module is None:
            return
        members = owners.members()
        if any(crash.recorded(store, m) is not None for m in members):
            return
        checkpoint = stop_checkpoint.trainer_checkpoint(self.lightning_module.trainer)
        path = stop_checkpoint.path(checkpointer.root, self._step)
        if checkpoint is None:
            rank_zero_only(print)(
                f"[bamboo] no stop checkpoint at step {self._step}: the job stopped where the trainer has no "
                "resumable state (the first batch of an epoch, or during validation)",
                flush=True,
            )
            return
        writers = sorted({m for m, _ in owners.positions(owners.pipeline_ids()[0])})
        writer = self.member in writers
        if not writer:
            checkpoint = stop_checkpoint.without_tensors(checkpoint)
        if self._ties:
            checkpoint[ckpt.TIED_KEY] = self._tie_aliases()
        arrivals = iter(range(3))
        timeout = self._timeout.total_seconds()
        ckpt.save_sharded(
            checkpoint,
            path,
            self.is_global_zero,
            lambda: ms.store_barrier(store, f"stop/ckpt/{next(arrivals)}", len(members), timeout),
            stage=self.stage_index if writer else None,
            shard=self.stage_index + 1 if writer else 0,
        )
        rank_zero_only(print)(
            f"[bamboo] stop checkpoint step={self._step} path={path} (resume: trainer.fit(model, "
            "ckpt_path=...))",
            flush=True,
        )

    def _join_at_boundary(self) -> None:
        """Form the next generation before the step when the last commit adopted a join (every member read
        the same outcome, so all switch here) or when a generation came without a failure seen here."""
        assert self._store is not None and self.owners is not None
        self._joining_setup = False
        if self._join_adopted or ms.current_generation(self._store) > self.owners.generation:
            self._join_adopted = False
            since, self._lost_since = self._lost_since, None
            self._next_generation(since=since)

    # ------------------------------------------------------------ joining (lightning_bamboo.elastic.join)

    # ------------------------------------------------------------ joining (lightning_bamboo.elastic.join)
    def _claim_join(self, step: int) -> bool:
        """Called by the member committing ``step``: adopt the launcher's join proposal after it, unless the
        next step starts an epoch (no mid-epoch position to give a joiner) or there is no next step."""
        assert self._store is not None and self.owners is not None and self.lightning_module is not None
        trainer = self.lightning_module.trainer
        if trainer.accumulate_grad_batches != 1:
            return False  # a joiner could not run the step's earlier batches again: joins wait (documented)
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            return False
        if trainer.max_steps != -1 and trainer.global_step + 1 >= trainer.max_steps:
            return False
        return joining.claim(self._store, self.owners.generation, step)

    def _send_progress(self, old: OwnershipMap, new: OwnershipMap) -> None:
        """The lowest continuing member writes the trainer's progress for the members joining in ``new``."""
        assert self._store is not None and self.lightning_module is not None
        joiners = set(new.members()) - set(old.members())
        staying = sorted(set(old.members()) & set(new.members()))
        if not joiners or not staying or self.member != staying[0]:
            return
        snap = trainer_progress.snapshot(self.lightning_module.trainer, self.optimizers[0], self._step)
        self._store.set(f"gen{new.generation}/progress", trainer_progress.to_json(snap))

    def _setup_joiner(self, trainer: pl.Trainer) -> None:
        """A joiner's ``setup``: its optimizer over the whole body, no process group yet.

        It joins the job in :meth:`on_train_start`, once Lightning's own start (logger, data, callbacks) is
        done, so the members wait for nothing but the re-form; the optimizer's param groups are then refilled
        with its stages' layers and their state (:func:`lightning_bamboo.elastic.reshard.install`).
        """
        self._joining_setup = True
        self._setup_model_and_optimizer(trainer, self.lightning_module)

    def _join(self, trainer: pl.Trainer) -> None:
        """Register, wait for a generation listing this member, form it, position the trainer."""
        assert self._store is not None
        joining.register(self._store, self.member)
        owners = joining.wait_for_membership(self._store, self.member)
        start = time.monotonic()
        self._init_generation(owners)
        self._global_microbatches = int(self._store.get(ms.GLOBAL_MICROBATCHES).decode())  # the job's split
        self._form(owners, holdings={})
        progress = json.loads(self._store.get(f"gen{owners.generation}/progress"))
        trainer_progress.restore_optimizer(trainer, self.optimizers[0], progress)
        trainer_progress.restore_loop(trainer, progress)
        self._step = int(progress["step"])
        if self._skip is None:
            raise RuntimeError("Bamboo: the joiner's training DataLoader was not prepared to skip batches")
        self._skip.skip = int(progress["skip"])
        self._formed(owners.generation)
        print(
            f"[bamboo] member {self.member} joined generation {owners.generation} at step {self._step} "
            f"(global step {progress['global_step']}, epoch {progress['epoch']}, batch {self._skip.skip}; "
            f"{time.monotonic() - start:.2f}s to form)\n{owners.format()}",
            flush=True,
        )

    def _drain_all(
        self,
        ranks: list[int],
        checkpoint_dir: str | Path | None = None,
        notices: dict[int, Notice] | None = None,
    ) -> None:
        """Announced departure of ``ranks`` after the step just committed
        (:mod:`lightning_bamboo.elastic.drain`).

        Called on every member at the same boundary. A leaver ends its ``fit`` (teardown hooks run, not
        ``on_train_end``) once the launcher published the generation without it, and its process exits 0
        (:class:`~lightning_bamboo.elastic.drain.BambooDeparted`, raised by ``teardown``); the survivors
        form that generation now and replay nothing. ``checkpoint_dir`` is not used: nothing is checkpointed.

        Without a supervisor (no next generation can come), the job checkpoints and stops instead
        (:func:`lightning_bamboo.events.drain_with_checkpoint`).
        """
        if not self._elastic:
            super()._drain_all(ranks, checkpoint_dir, notices)  # type: ignore[misc]
            return
        assert self._store is not None and self.owners is not None and self.lightning_module is not None
        start = time.monotonic()
        old = self.owners
        leaving = departure.announce(self._store, old, ranks, self._step)
        for member in leaving:
            self._emit("on_drain", member=member, rank=old.rank_of(member), step=self._step)
        self.drain_timer.begin(leaving, self._step, [n.received_at for n in (notices or {}).values()])
        departure.wait_without(self._store, old.generation, leaving, self._failure_wait)
        if self.member in leaving:
            log.warning(
                "Bamboo member %d: leaving after step %d (announced departure)", self.member, self._step
            )
            self.departed = True
            # leave ``fit`` now, the way Lightning's own tuner callbacks end it early: teardown hooks run,
            # nothing else. Whatever ran after this boundary (ModelCheckpoint's collective decisions and save,
            # on_train_end) would run against a world the survivors have already left. ``teardown`` then
            # ends the process (BambooDeparted, exit 0): the script's code after ``fit`` is the survivors'.
            raise _private.LeaveFit
        self._next_generation(since=start)
        self.drain_timer.reformed()

    # ------------------------------------------------------------------ checkpoint fallback

    # ------------------------------------------------------------------ checkpoint fallback
    def _maybe_checkpoint(self, final: bool = False) -> None:
        """Before a step that is a multiple of N (``final``: before the step the job stops at): the first
        pipeline's members write their stages' layers."""
        checkpointer, owners = self._checkpointer, self.owners
        if checkpointer is None or owners is None or not checkpointer.due(self._step, final):
            return
        writers = sorted({m for m, _ in owners.positions(owners.pipeline_ids()[0])})
        if self.member not in writers:
            return
        layers = [layer for s in owners.stages_of(self.member) for layer in self._stage_layers[s]]
        held = gather({layer: self._layers[layer] for layer in layers}, self.optimizers[0])
        written = checkpointer.wait(strict=True)
        if written is not None:
            print(
                f"[bamboo] checkpoint_written step={written[0]} member={self.member} "
                f"write_s={written[1]:.4f}",
                flush=True,
            )
        blocking, size = checkpointer.save(
            self._step,
            held,
            writers,
            len(self._layers),
            fb.settings(self.optimizers[0], self.lr_scheduler_configs),
        )
        print(
            f"[bamboo] checkpoint step={self._step} member={self.member} blocking_s={blocking:.4f} "
            f"bytes={size}",
            flush=True,
        )

    def _fall_back(self, new: OwnershipMap) -> None:
        """Load the last complete checkpoint into ``new`` (whose process group is formed) and re-run the
        steps since it, so the members are where they were before the loss."""
        assert self._store is not None
        if self._checkpointer is None:
            raise RuntimeError(
                f"Bamboo: redundancy cannot cover the loss (generation {new.generation}):\n{new.format()}\n"
                "and there is no checkpoint to fall back to: pass checkpoint_every_n_steps and "
                "checkpoint_dir to BambooStrategy"
            )
        start = time.monotonic()
        target = self._step
        root = self._checkpointer.root
        self._checkpointer.wait(strict=False)  # this member's part of the last checkpoint, if it was writing
        fb.finalize(root)
        dist.barrier()  # every survivor has finished its writes: the set of complete checkpoints is settled
        key = f"gen{new.generation}/fallback_from"
        if self._rank == 0:
            latest = fb.latest_complete(root)
            self._store.set(key, str(-1 if latest is None else latest))
        step = int(ms.get_str(self._store, key))
        if step < 0:
            raise RuntimeError(
                f"Bamboo: redundancy cannot cover the loss and {root} holds no complete checkpoint"
            )
        fb.share_batches(self._ring, range(step, target), self.root_device)  # for members that joined later
        held, saved = fb.load_layers(
            fb.folder(root, step), self._needs(new)[self.member], self._template, self.root_device
        )
        self._form(new, held=held)
        fb.restore_settings(self.optimizers[0], self.lr_scheduler_configs, saved)
        self._step = step
        self._rerunning = True
        try:
            while self._step < target:
                batch_idx, batch = self._ring.get(self._step)
                # Lightning steps the schedulers after the step in progress returns; earlier ones are ours
                self._rerun_step(batch, batch_idx, step_schedulers=self._step < self._in_step)
        finally:
            self._rerunning = False
        self._fallback_path = str(fb.folder(root, step))
        rank_zero_only(print)(
            f"[bamboo] fallback: loaded checkpoint step={step} from {fb.folder(root, step)}, re-ran steps "
            f"{step}..{target - 1} ({target - step} steps) in {time.monotonic() - start:.2f}s",
            flush=True,
        )

    def _rerun_step(self, batch: Any, batch_idx: int, step_schedulers: bool) -> None:
        """One step of the fallback's re-run: schedule, replica exchange, commit, optimizer and scheduler.

        Lightning's hooks around a step (``training_step``, ``on_before_optimizer_step``, logging) are not
        called again: they ran when the step first ran.
        """
        assert self.engine is not None and self._store is not None and self.owners is not None
        optimizer = self.optimizers[0]
        for p in self._stage_params():
            p.grad = None
        # the training step's own schedule run (one batch per step: the fallback refuses accumulation)
        self._run_schedule(self._share(batch), position=0)
        self._add_stashed_grads()
        self._exchange_replica_gradients()
        self._plan_clipping()
        commit = commit_protocol.StepCommit(self._store, self.owners.generation, len(self.owners.members()))
        if commit.prepare_and_wait(self._step) != commit_protocol.COMMIT:
            raise RuntimeError(
                f"Bamboo: a member was lost while re-running step {self._step} after a fallback"
            )
        apply_clipping(self._clip_plan, [p.grad for p in self._stage_params()])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self._update_replica(optimizer)
        if step_schedulers:
            assert self.lightning_module is not None
            for config in self.lr_scheduler_configs:
                if config.interval == "step" and (batch_idx + 1) % config.frequency == 0:
                    self.lightning_module.lr_scheduler_step(config.scheduler, None)
        self._step += 1

    # ------------------------------------------------------------------ phases of a step

    def _reform_during_evaluation(self, since: float) -> None:
        """Form the next generation in training mode (a fallback re-runs training steps), then put every
        module back in evaluation mode. Modules the re-form created were never seen by Lightning's capture
        of the modes, so Lightning would not restore them: :meth:`on_validation_end` puts them back in
        training mode."""
        assert self.lightning_module is not None
        module = self.lightning_module
        before = {id(m) for m in module.modules()}
        module.train()
        try:
            self._next_generation(since=since)
        finally:
            module.eval()
        self._created_during_eval += [m for m in module.modules() if id(m) not in before]

    @override
    def on_exception(self, exception: BaseException) -> None:
        """``fit`` ends with ``exception``: unless a lost peer caused it, record it in the job's store, so the
        supervisor stops the job with it instead of failing over (:mod:`lightning_bamboo.elastic.crash`)."""
        super().on_exception(exception)
        if self._store is None or isinstance(exception, (SystemExit, KeyboardInterrupt, _Spare)):
            return
        if crash.is_communication_error(exception):
            return
        try:
            first = crash.record(self._store, self.member, exception)
            earlier = crash.recorded(self._store, first) if first != self.member else None
        except Exception as err:  # the supervisor is gone: nobody to tell
            log.warning("Bamboo member %d: could not record its error in the store: %s", self.member, err)
            return
        if earlier is not None:  # every worker met the same error: its traceback once, not once per worker
            crash.report_once(exception, self.member, earlier)
