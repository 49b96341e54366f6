"""User hooks into Bamboo's preemption events, the metrics they log, and the notice watcher's callback.

    class Alert(BambooCallback):
        def on_failover(self, trainer, pl_module, old_map, new_map, **info):
            page_oncall(f"stage owners {old_map} -> {new_map}")

    Trainer(strategy="bamboo", callbacks=[Alert(), BambooNotices(aws={"enabled": "auto"}), BambooMetrics()])
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_bamboo.notices.base import Notice
from lightning_bamboo.notices.config import build_watcher
from lightning_bamboo.notices.watcher import NoticeWatcher
from lightning_bamboo.runtime.events import Drains, drain_with_checkpoint, fire
from lightning_bamboo.step.broadcast import broadcast_json

log = logging.getLogger(__name__)


class BambooCallback(Callback):
    """A Lightning ``Callback`` with Bamboo's event hooks (all no-ops: override the ones you need).

    Each event fires once, on every rank that takes part in it. ``info`` may hold ``seconds_lost`` (wall
    seconds in which no counted step ran because of the event), ``pipeline_length`` (positions of this
    rank's pipeline after it), ``step`` (the global step training goes on from), ``cause`` and ``members``.
    ``old_map``/``new_map`` are the failover runtime's
    :class:`~lightning_bamboo.layout.ownership.OwnershipMap`
    (``{pipeline: {stage: member}}`` and the generation) before and after the event.
    """

    def on_preemption_notice(self, trainer: pl.Trainer, pl_module: pl.LightningModule, notice: Notice,
                             **info: Any) -> None:
        """A rank was warned it will be preempted (``notice.rank``); it is drained at this step boundary."""

    def on_drain(self, trainer: pl.Trainer, pl_module: pl.LightningModule, member: int, rank: int,
                 **info: Any) -> None:
        """Member ``member`` (rank ``rank`` of the ending generation) leaves after the step just committed.

        Fired by the failover runtime on every member, the leaving one included (its last chance to act,
        e.g. upload its logs); the survivors' ``on_failover`` (``cause="drain"``) follows once they re-formed.
        """

    def on_failover(self, trainer: pl.Trainer, pl_module: pl.LightningModule, old_map: Any,
                    new_map: Any, **info: Any) -> None:
        """Stages changed owner after members left (``info["cause"]``: ``"lost"`` = died, ``"drain"`` =
        announced); their predecessors' replicas took over. Fired on the survivors once they re-formed."""

    def on_rejoin(self, trainer: pl.Trainer, pl_module: pl.LightningModule, old_map: Any,
                  new_map: Any, **info: Any) -> None:
        """New nodes joined and the stages were rebalanced."""

    def on_fallback(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint_path: str,
                    **info: Any) -> None:
        """Redundancy could not cover a loss (or no failover runtime): training goes back to a checkpoint."""

    def on_step_aborted(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int,
                        **info: Any) -> None:
        """Step ``step`` was cut by a lost peer before it committed: nothing of it was applied, and the next
        generation runs it again (``info["cause"]``: ``"lost"``). Fired on each survivor, then it re-forms."""

    def on_evaluation_rerun(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loop: str,
                            **info: Any) -> None:
        """A ``loop`` (``"validation"``/``"test"``) batch was cut by a lost peer; the next generation runs it
        again (evaluation changes no state). Fired on every survivor, before it re-forms."""

    def on_job_stop(self, trainer: pl.Trainer, pl_module: pl.LightningModule, member: int, step: int,
                    **info: Any) -> None:
        """The supervisor stops the job (it got SIGTERM, or a worker failed): member ``member`` leaves after
        the committed step ``step``, its stop checkpoint written; ``fit`` then ends as on SIGTERM."""


_PROG_BAR = ("bamboo/preemptions", "bamboo/failovers", "bamboo/pipeline_length")


class BambooMetrics(BambooCallback):
    """Logs the events as metrics (progress bar and every logger): counts, seconds lost, pipeline length.

    Logged after every training batch under ``bamboo/``: ``preemptions``, ``drains``, ``failovers``,
    ``rejoins``, ``fallbacks``, ``seconds_lost`` and ``pipeline_length`` (the strategy's live
    ``pipeline_length`` when it has one, else the last one an event reported, else its ``num_stages``).
    Place it after ``BambooNotices`` in ``callbacks`` so a notice acted on at a
    step boundary is counted in that step's metrics.
    """

    def __init__(self, prog_bar: bool = True) -> None:
        self.prog_bar = prog_bar
        self.counts = {"preemptions": 0, "drains": 0, "failovers": 0, "rejoins": 0, "fallbacks": 0}
        self.seconds_lost = 0.0
        self.pipeline_length: int | None = None

    def _account(self, key: str, info: Mapping[str, Any]) -> None:
        self.counts[key] += 1
        self.seconds_lost += float(info.get("seconds_lost", 0.0))
        if info.get("pipeline_length") is not None:
            self.pipeline_length = int(info["pipeline_length"])

    @override
    def on_preemption_notice(self, trainer: pl.Trainer, pl_module: pl.LightningModule, notice: Notice,
                             **info: Any) -> None:
        self._account("preemptions", info)

    @override
    def on_drain(self, trainer: pl.Trainer, pl_module: pl.LightningModule, member: int, rank: int,
                 **info: Any) -> None:
        self._account("drains", info)

    @override
    def on_failover(self, trainer: pl.Trainer, pl_module: pl.LightningModule, old_map: Any,
                    new_map: Any, **info: Any) -> None:
        self._account("failovers", info)

    @override
    def on_rejoin(self, trainer: pl.Trainer, pl_module: pl.LightningModule, old_map: Any,
                  new_map: Any, **info: Any) -> None:
        self._account("rejoins", info)

    @override
    def on_fallback(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint_path: str,
                    **info: Any) -> None:
        self._account("fallbacks", info)

    def metrics(self, trainer: pl.Trainer) -> dict[str, float]:
        length = getattr(trainer.strategy, "pipeline_length", None)
        if length is None:
            length = self.pipeline_length
        if length is None:
            length = int(getattr(trainer.strategy, "num_stages", 1))
        return {
            **{f"bamboo/{key}": float(value) for key, value in self.counts.items()},
            "bamboo/seconds_lost": self.seconds_lost,
            "bamboo/pipeline_length": float(length),
        }

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        for key, value in self.metrics(trainer).items():
            bar = self.prog_bar and key in _PROG_BAR
            pl_module.log(key, value, prog_bar=bar, on_step=True, on_epoch=False, rank_zero_only=True)


class BambooEventLog(BambooCallback):
    """Appends every Bamboo event this process sees to ``<dirpath>/events-<who>.jsonl``, one JSON line each.

    ``<who>`` is ``member<m>`` under the elastic runtime (member ids outlive generations) and ``rank<r>``
    otherwise. Lines are written and flushed when the event fires, so a worker preempted right after keeps
    what it saw. Each line: ``{"event", "time", "global_step", **payload}``; ownership maps are written as
    their JSON form and notices as dicts.

    Args:
        dirpath: directory of the logs (default: ``<trainer.default_root_dir>/bamboo-events``).
    """

    def __init__(self, dirpath: str | Path | None = None) -> None:
        self.dirpath = Path(dirpath) if dirpath is not None else None

    def _path(self, trainer: pl.Trainer) -> Path:
        base = self.dirpath if self.dirpath is not None else Path(trainer.default_root_dir) / "bamboo-events"
        member = getattr(trainer.strategy, "member", None)
        who = f"member{member}" if isinstance(member, int) else f"rank{trainer.global_rank}"
        return base / f"events-{who}.jsonl"

    def _write(self, trainer: pl.Trainer, event: str, payload: Mapping[str, Any]) -> None:
        record = {"event": event, "time": time.time(), "global_step": trainer.global_step}
        record.update({key: _plain(value) for key, value in payload.items()})
        path = self._path(trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as stream:
            stream.write(json.dumps(record) + "\n")

    @override
    def on_preemption_notice(self, trainer: pl.Trainer, pl_module: pl.LightningModule, notice: Notice,
                             **info: Any) -> None:
        self._write(trainer, "on_preemption_notice", {"notice": notice, **info})

    @override
    def on_drain(self, trainer: pl.Trainer, pl_module: pl.LightningModule, member: int, rank: int,
                 **info: Any) -> None:
        self._write(trainer, "on_drain", {"member": member, "rank": rank, **info})

    @override
    def on_failover(self, trainer: pl.Trainer, pl_module: pl.LightningModule, old_map: Any,
                    new_map: Any, **info: Any) -> None:
        self._write(trainer, "on_failover", {"old_map": old_map, "new_map": new_map, **info})

    @override
    def on_rejoin(self, trainer: pl.Trainer, pl_module: pl.LightningModule, old_map: Any,
                  new_map: Any, **info: Any) -> None:
        self._write(trainer, "on_rejoin", {"old_map": old_map, "new_map": new_map, **info})

    @override
    def on_fallback(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint_path: str,
                    **info: Any) -> None:
        self._write(trainer, "on_fallback", {"checkpoint_path": checkpoint_path, **info})

    @override
    def on_step_aborted(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int,
                        **info: Any) -> None:
        self._write(trainer, "on_step_aborted", {"step": step, **info})

    @override
    def on_evaluation_rerun(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loop: str,
                            **info: Any) -> None:
        self._write(trainer, "on_evaluation_rerun", {"loop": loop, **info})

    @override
    def on_job_stop(self, trainer: pl.Trainer, pl_module: pl.LightningModule, member: int, step: int,
                    **info: Any) -> None:
        self._write(trainer, "on_job_stop", {"member": member, "step": step, **info})


def _plain(value: Any) -> Any:
    """A payload value as JSON data: ownership maps by their JSON form, notices as dicts."""
    to_json = getattr(value, "to_json", None)
    if callable(to_json):
        return json.loads(to_json())
    to_dict = getattr(value, "to_dict", None)
    return to_dict() if callable(to_dict) else value


class BambooNotices(Callback):
    """Watches the preemption-notice sources and drains a warned rank at the next step boundary.

    The sources run on the watcher's daemon thread; at each step boundary (end of a training batch that
    stepped the optimizer) every rank contributes its "warned" flag to a tiny all-reduce on a dedicated
    gloo group, issued without waiting (``async_op``) and read at the following boundary, so a step never
    waits on it. When ranks are warned, every rank fires ``on_preemption_notice`` with the warned rank's
    notice, then calls the strategy's public ``drain(ranks)`` once: the elastic runtime's announced departure
    (:mod:`lightning_bamboo.protocol.drain`), or, without a failover runtime,
    :func:`lightning_bamboo.runtime.events.drain_with_checkpoint` (checkpoint, then stop).

    Args:
        watcher: a ready ``NoticeWatcher``; else one is built from ``aws``, ``gce``, ``sigterm``, ``faults``
            (see :func:`lightning_bamboo.notices.build_watcher`).
        sigterm: SIGTERM becomes a notice (the worker drains instead of dying). ``None`` (default): on when
            the strategy drains on SIGTERM (``BambooStrategy(drain_on_sigterm=True)``, its default),
            off otherwise.
        checkpoint_dir: where the checkpoint-and-stop drain writes (default
            ``<default_root_dir>/bamboo-drain``).
    """

    def __init__(
        self,
        watcher: NoticeWatcher | None = None,
        aws: Mapping[str, Any] | None = None,
        gce: Mapping[str, Any] | None = None,
        sigterm: bool | Mapping[str, Any] | None = None,
        faults: Sequence[Mapping[str, Any]] = (),
        checkpoint_dir: str | Path | None = None,
    ) -> None:
        self._config = {"aws": aws, "gce": gce, "sigterm": sigterm, "faults": list(faults)}
        self.watcher = watcher
        self.checkpoint_dir = checkpoint_dir
        self._group: Any = None
        self._world: Any = None
        self._flags: torch.Tensor | None = None
        self._work: Any = None
        self._last_step = -1
        self.drained: list[int] = []

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.watcher is None:
            config = dict(self._config)
            if config["sigterm"] is None:
                config["sigterm"] = bool(getattr(trainer.strategy, "drain_on_sigterm", False))
            self.watcher = build_watcher(**config)
        self._refresh_group()

    def _refresh_group(self) -> bool:
        """(Re)create the flag group when the default process group is new (the failover runtime re-forms
        the world per generation; every member reaches the same step boundary). True if it was re-created."""
        if not (dist.is_available() and dist.is_initialized()):
            # the failover runtime aborted its world (a peer lost after a commit): flags wait for the next one
            self._world = self._group = self._work = self._flags = None
            return False
        world = dist.group.WORLD
        if world is self._world:
            return False
        self._world = world
        self._group = dist.new_group(backend="gloo")
        self._work, self._flags = None, None  # flags of the old world's ranks mean nothing in the new one
        self.drained = []
        return True

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start watching before Lightning's sanity check: a SIGTERM during it is a notice too (acted on at
        the first training boundaries), not Lightning's ``SIGTERMException``, which ends the worker with 0."""
        self.on_train_start(trainer, pl_module)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start watching: after Lightning installed its SIGTERM handler (the SIGTERM source replaces it)."""
        assert self.watcher is not None
        self.watcher.start(trainer.global_rank)

    def _distributed(self) -> bool:
        return self._group is not None

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._last_step:  # accumulating gradients: not a step boundary
            return
        self._last_step = trainer.global_step
        assert self.watcher is not None
        self.watcher.rank = trainer.global_rank  # ranks change when the failover runtime re-forms the world
        notice = self.watcher.on_step(trainer.global_step)
        if notice is not None:
            notice = replace(notice, rank=trainer.global_rank)
        self._refresh_group()
        if not self._distributed():
            if trainer.world_size > 1:
                return  # between two generations of the failover runtime: the notice stays pending
            if notice is not None and not self.drained:
                self._act(trainer, [trainer.global_rank], notice)
            return
        warned: list[int] = []
        if self._work is not None:  # the flags issued at the previous boundary
            self._work.wait()
            assert self._flags is not None
            warned = [r for r, flag in enumerate(self._flags.tolist()) if flag and r not in self.drained]
        flags = torch.zeros(trainer.world_size, dtype=torch.int32)
        flags[trainer.global_rank] = int(notice is not None)
        self._flags = flags
        self._work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        if warned:
            self._act(trainer, warned, notice)

    def _act(self, trainer: pl.Trainer, ranks: list[int], local: Notice | None) -> None:
        strategy = trainer.strategy
        notices: dict[int, Notice] = {}
        for rank in ranks:
            notice = local
            if self._distributed():
                mine = local.to_dict() if rank == trainer.global_rank and local is not None else None
                notice = Notice(**broadcast_json(mine, rank, torch.device("cpu"), group=self._group))
            assert notice is not None
            notices[rank] = notice
            fire(trainer, "on_preemption_notice", notice=notice, step=trainer.global_step)
        self.drained.extend(ranks)
        if isinstance(strategy, Drains):  # Bamboo: all ranks warned at this boundary leave together
            strategy.drain(ranks, self.checkpoint_dir, notices)
            return
        for rank in ranks:
            drain_with_checkpoint(trainer, rank, self.checkpoint_dir)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Stop watching before Lightning restores its signal handlers (it does so before ``teardown``)."""
        self._finish()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._finish()  # training ended by an exception: on_train_end did not run

    def _finish(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self.watcher is not None:
            self.watcher.stop()
