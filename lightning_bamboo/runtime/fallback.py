"""The checkpoint fallback as a part of the membership runtime: periodic checkpoints of the first pipeline's
stages, loading the last complete one when redundancy cannot cover a loss and re-running the steps since,
and the stop checkpoint a stopping job writes (:mod:`lightning_bamboo.checkpoint.periodic`,
:mod:`lightning_bamboo.checkpoint.stop`).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_bamboo.checkpoint import periodic as fb
from lightning_bamboo.checkpoint import sharded as ckpt
from lightning_bamboo.checkpoint import stop as stop_checkpoint
from lightning_bamboo.layout.ownership import OwnershipMap
from lightning_bamboo.pipeline.ties import aliases
from lightning_bamboo.protocol import commit as commit_protocol
from lightning_bamboo.protocol import crash
from lightning_bamboo.protocol import store as ms
from lightning_bamboo.runtime.reshard import gather

if TYPE_CHECKING:
    from lightning_bamboo.runtime.events import Events
    from lightning_bamboo.runtime.formation import Formation
    from lightning_bamboo.runtime.generation import Generation
    from lightning_bamboo.runtime.lightning_side import LightningSide
    from lightning_bamboo.step.session import StepSession


def first_pipeline_members(owners: OwnershipMap) -> list[int]:
    """The members that write checkpoints: those of the first pipeline (together they hold every stage)."""
    return sorted({m for m, _ in owners.positions(owners.pipeline_ids()[0])})


class Fallback:
    """Periodic checkpoints, the fallback onto them and the stop checkpoint (see the module docstring)."""

    def __init__(
        self,
        every: int | None,
        directory: str | Path | None,
        keep: int,
        formation: Formation,
        gen: Generation,
        events: Events,
        lightning: LightningSide,
    ) -> None:
        self._options = (every, directory, keep)
        self._formation, self._gen, self._events = formation, gen, events
        self._lightning = lightning
        self.checkpointer: fb.PeriodicCheckpointer | None = None
        # steps since the last complete checkpoint: at most 2N-1 before the step in progress (one write in
        # flight), plus the step in progress
        self.ring = fb.BatchRing(2 * every + 1 if every else 0)
        self.path = ""  # the checkpoint folder the last fallback loaded (on_fallback's payload)

    def start(self, job: str, member: int) -> None:
        """At fit's setup, once the optimizer and schedulers exist (their settings are checked now)."""
        every, directory, keep = self._options
        if every is None or directory is None:
            return
        schedulers = self._lightning.schedulers()
        fb.check_schedulers(schedulers)
        fb.settings(self._lightning.optimizer(), schedulers)  # JSON-ready, or a clear error now
        self.checkpointer = fb.PeriodicCheckpointer(Path(directory) / job, every, keep, member)

    def record(self, step: int, batch_idx: int, batch: Any) -> None:
        """Keep step ``step``'s batch for a re-run after a fallback."""
        if self.checkpointer is not None:
            self.ring.put(step, batch_idx, batch)

    def maybe_checkpoint(self, member: int, step: int, final: bool = False) -> None:
        """Before ``step`` when it is a multiple of N (``final``: the step the job stops at): the first
        pipeline's members write their stages' layers."""
        checkpointer, owners = self.checkpointer, self._gen.owners
        if checkpointer is None or owners is None or not checkpointer.due(step, final):
            return
        writers = first_pipeline_members(owners)
        if member not in writers:
            return
        layers = self._formation.layers
        optimizer = self._lightning.optimizer()
        held = gather({layer: layers[layer] for layer in self._formation.layers_of(owners.stages_of(member))},
                      optimizer)
        written = checkpointer.wait(strict=True)
        if written is not None:
            print(f"[bamboo] checkpoint_written step={written[0]} member={member} write_s={written[1]:.4f}",
                  flush=True)
        settings = fb.settings(optimizer, self._lightning.schedulers())
        blocking, size = checkpointer.save(step, held, writers, len(layers), settings)
        print(f"[bamboo] checkpoint step={step} member={member} blocking_s={blocking:.4f} bytes={size}",
              flush=True)

    def fall_back(self, session: StepSession, new: OwnershipMap, member: int, rank: int,
                  store: dist.Store) -> None:
        """Load the last complete checkpoint into ``new`` (whose process group is formed) and re-run the
        steps since it through ``session``, so the members are where they were before the loss."""
        if self.checkpointer is None:
            raise RuntimeError(
                f"Bamboo: redundancy cannot cover the loss (generation {new.generation}):\n{new.format()}\n"
                "and there is no checkpoint to fall back to: pass checkpoint_every_n_steps and "
                "checkpoint_dir to BambooStrategy"
            )
        lightning = self._lightning
        start = time.monotonic()
        target = session.step
        root = self.checkpointer.root
        self.checkpointer.wait(strict=False)  # this member's part of the last checkpoint, if it was writing
        fb.finalize(root)
        dist.barrier()  # every survivor has finished its writes: the set of complete checkpoints is settled
        key = f"gen{new.generation}/fallback_from"
        if rank == 0:
            latest = fb.latest_complete(root)
            store.set(key, str(-1 if latest is None else latest))
        step = int(ms.get_str(store, key))
        if step < 0:
            raise RuntimeError(
                f"Bamboo: redundancy cannot cover the loss and {root} holds no complete checkpoint"
            )
        device = lightning.device()
        fb.share_batches(self.ring, range(step, target), device)  # for members that joined later
        needs = self._formation.needs(new)[member]
        held, saved = fb.load_layers(fb.folder(root, step), needs, self._formation.template, device)
        self._formation.form(self._gen, member, store, lightning.module(), lightning.optimizer(), held=held)
        fb.restore_settings(lightning.optimizer(), lightning.schedulers(), saved)
        session.step = step
        self._events.muted = True
        try:
            while session.step < target:
                batch_idx, batch = self.ring.get(session.step)
                # Lightning steps the schedulers after the step in progress returns; earlier ones are ours
                self._rerun_step(session, batch, batch_idx, store,
                                 step_schedulers=session.step < session.in_step)
        finally:
            self._events.muted = False
        self.path = str(fb.folder(root, step))
        rank_zero_only(print)(
            f"[bamboo] fallback: loaded checkpoint step={step} from {fb.folder(root, step)}, re-ran steps "
            f"{step}..{target - 1} ({target - step} steps) in {time.monotonic() - start:.2f}s",
            flush=True,
        )

    def _rerun_step(self, session: StepSession, batch: Any, batch_idx: int, store: dist.Store,
                    step_schedulers: bool) -> None:
        """One step of the fallback's re-run: schedule, replica exchange, commit, optimizer and scheduler.

        Lightning's hooks around a step (``training_step``, ``on_before_optimizer_step``, logging) are not
        called again: they ran when the step first ran.
        """
        owners = self._gen.owners
        assert owners is not None
        optimizer = self._lightning.optimizer()
        for p in self._gen.stage_params():
            p.grad = None
        # the training step's own schedule run (one batch per step: the fallback refuses accumulation)
        session.run_schedule(session.share(batch), position=0)
        session.add_stashed_grads()
        session.exchange(optimizer)
        commit = commit_protocol.StepCommit(store, owners.generation, len(owners.members()))
        if commit.prepare_and_wait(session.step) != commit_protocol.COMMIT:
            raise RuntimeError(
                f"Bamboo: a member was lost while re-running step {session.step} after a fallback"
            )
        session.apply_stage_clipping()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        session.update_replica()
        if step_schedulers:
            module = self._lightning.module()
            for config in self._lightning.schedulers():
                if config.interval == "step" and (batch_idx + 1) % config.frequency == 0:
                    module.lr_scheduler_step(config.scheduler, None)
        session.step += 1

    def stop(self, step: int, store: dist.Store | None, is_global_zero: bool, timeout: float) -> None:
        """The supervisor stops the job (it got SIGTERM, or a worker failed) with a ``stop`` generation.

        Every member is at the same committed step here: a step in flight was aborted or rolled forward as
        in a failover (the cutter ends the old generation's collectives). The final checkpoint, when
        ``checkpoint_every_n_steps`` is set, is therefore one consistent step (written by the first
        pipeline; ``teardown`` waits for the write), and so is the Lightning checkpoint folder a new run
        resumes from (:meth:`_write_stop_checkpoint`). ``fit`` then ends as Lightning ends it on SIGTERM
        (``SIGTERMException``: teardown runs; the process exits with 143 unless the script catches it).
        """
        owners, member = self._gen.owners, self._gen.member
        assert owners is not None
        self.maybe_checkpoint(member, step, final=True)
        self._write_stop_checkpoint(step, member, store, is_global_zero, self._gen.stage_index, timeout)
        print(f"[bamboo] member {member}: the job is stopping; leaving after step {step} "
              f"(generation {owners.generation})", flush=True)
        self._events.emit("on_job_stop", member=member, step=step)
        raise SIGTERMException(128 + signal.SIGTERM)

    def _write_stop_checkpoint(
        self, step: int, member: int, store: dist.Store | None, is_global_zero: bool, stage_index: int,
        timeout: float,
    ) -> None:
        """Every member writes its part of ``<checkpoint_dir>/<job id>/stop-step=<k>.ckpt``, a Lightning
        checkpoint of the last committed step ``k`` (:mod:`lightning_bamboo.checkpoint.stop`), meeting the
        others through the store. Skipped without ``checkpoint_dir``, when a member's error stopped the job
        (its stages may be in no other member), or where the loop has no resumable state (said once)."""
        checkpointer, owners = self.checkpointer, self._gen.owners
        if checkpointer is None or owners is None or store is None:
            return
        members = owners.members()
        if any(crash.recorded(store, m) is not None for m in members):
            return
        checkpoint = stop_checkpoint.trainer_checkpoint(self._lightning.module().trainer)
        path = stop_checkpoint.path(checkpointer.root, step)
        if checkpoint is None:
            rank_zero_only(print)(
                f"[bamboo] no stop checkpoint at step {step}: the job stopped where the trainer has no "
                "resumable state (the first batch of an epoch, or during validation)",
                flush=True,
            )
            return
        writer = member in first_pipeline_members(owners)
        if not writer:
            checkpoint = stop_checkpoint.without_tensors(checkpoint)
        if self._formation.ties:
            checkpoint[ckpt.TIED_KEY] = aliases(self._formation.ties, self._formation.body_attr)
        arrivals = iter(range(3))
        ckpt.save_sharded(
            checkpoint,
            path,
            is_global_zero,
            lambda: ms.store_barrier(store, f"stop/ckpt/{next(arrivals)}", len(members), timeout),
            stage=stage_index if writer else None,
            shard=stage_index + 1 if writer else 0,
        )
        rank_zero_only(print)(
            f"[bamboo] stop checkpoint step={step} path={path} (resume: trainer.fit(model, ckpt_path=...))",
            flush=True,
        )

    def finish(self) -> None:
        """A write in flight finishes before the process exits; complete checkpoints are kept, old pruned."""
        if self.checkpointer is not None:
            self.checkpointer.wait(strict=False)
            fb.finalize(self.checkpointer.root)
            fb.prune(self.checkpointer.root, self.checkpointer.keep)


