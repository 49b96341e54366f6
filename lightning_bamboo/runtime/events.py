"""Bamboo's runtime events (notice, failover, rejoin, fallback) fired on the user's callbacks.

The strategy fires each event once (on every rank that takes part) through its :class:`Events` object (public:
``BambooStrategy.emit(name, **payload)``); each callback of the trainer that has a method ``name`` gets
``(trainer, pl_module, **payload)``. Payloads are checked here so a hook never sees a half-filled event.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_bamboo.notices.base import Notice

log = logging.getLogger(__name__)

EVENTS: dict[str, tuple[str, ...]] = {
    "on_preemption_notice": ("notice",),
    "on_drain": ("member", "rank"),
    "on_failover": ("old_map", "new_map"),
    "on_rejoin": ("old_map", "new_map"),
    "on_fallback": ("checkpoint_path",),
    "on_step_phase": ("phase", "step", "member"),
    "on_step_aborted": ("step",),
    "on_evaluation_rerun": ("loop",),
    "on_job_stop": ("member", "step"),
}
"""Event name -> its required payload keys (see ``lightning_bamboo.callbacks.BambooCallback``)."""

OPTIONAL = ("seconds_lost", "pipeline_length", "step", "cause", "members", "microbatch", "generation")
"""Payload keys any event may add: ``seconds_lost`` (wall seconds no counted step ran because of the event),
``pipeline_length`` (positions of this rank's pipeline after it), ``step`` (the global step training goes on
from), ``cause`` (failover: ``"lost"`` for a dead peer, ``"drain"`` for an announced departure) and
``members`` (the member ids that left or joined). ``on_step_phase`` (elastic runtime only) marks the points
of its two-phase step: ``forward`` (before each forward action, with its ``microbatch``), ``exchange``
(schedule done, replica gradients not sent), ``prepared`` (prepared, outcome not read), ``commit`` (committed,
nothing applied), ``applied`` (own stages and replica stepped), ``validate`` (a validation batch) and
``form`` (the next generation, with its ``generation`` number, has its process group, no layer moved yet)."""


def fire(trainer: pl.Trainer, name: str, **payload: Any) -> int:
    """Call hook ``name`` on every callback of ``trainer`` that defines it; return how many were called.

    Raises:
        ValueError: for an unknown event, a missing payload key or an unexpected one.
    """
    if name not in EVENTS:
        raise ValueError(f"unknown Bamboo event {name!r}; expected one of {sorted(EVENTS)}")
    required = EVENTS[name]
    missing = [key for key in required if key not in payload]
    extra = [key for key in payload if key not in required and key not in OPTIONAL]
    if missing or extra:
        raise ValueError(
            f"event {name!r} needs payload keys {list(required)} (optional {list(OPTIONAL)}); "
            f"missing {missing}, unexpected {extra}"
        )
    called = 0
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        hook = getattr(callback, name, None)
        if callable(hook):
            hook(trainer, trainer.lightning_module, **payload)
            called += 1
    return called


def drain_with_checkpoint(trainer: pl.Trainer, rank: int, checkpoint_dir: str | Path | None = None) -> Path:
    """Graceful stop for a drained rank while no failover runtime is available: checkpoint, then stop.

    Every rank must call it at the same step boundary (the checkpoint save is collective). The
    checkpoint is ``<checkpoint_dir or default_root_dir>/bamboo-drain/step<global_step>.ckpt``; training
    ends after this step (``trainer.should_stop``), and ``on_fallback`` fires with its path.
    """
    default = Path(trainer.default_root_dir) / "bamboo-drain"
    base = Path(checkpoint_dir) if checkpoint_dir is not None else default
    path = base / f"step{trainer.global_step}.ckpt"
    if not trainer.should_stop:
        rank_zero_warn(
            f"Bamboo: rank {rank} was given notice; no failover runtime here, so training stops after step "
            f"{trainer.global_step} with a checkpoint at {path} (resume with ckpt_path)"
        )
        trainer.save_checkpoint(path)
        trainer.should_stop = True
        fire(trainer, "on_fallback", checkpoint_path=str(path))
    return path


class Events:
    """The strategy's event bus: fires an event on the trainer's callbacks, and the step's phases unless
    they are muted (a fallback re-runs old steps whose phases already fired).

    ``trainer`` returns the trainer whose callbacks get the events (``None`` before one is attached).
    """

    def __init__(self, trainer: Callable[[], pl.Trainer | None]) -> None:
        self._trainer = trainer
        self.muted = False

    def emit(self, name: str, **payload: Any) -> int:
        """Fire event ``name`` on the trainer's callbacks (see :func:`fire`)."""
        trainer = self._trainer()
        if trainer is None:
            raise RuntimeError(f"cannot emit {name!r}: the strategy has no LightningModule attached")
        return fire(trainer, name, **payload)

    def announce(self, name: str, message: str, **payload: Any) -> int:
        """Warn the user with ``message`` and fire ``name``: the same fact, once read, once as data."""
        log.warning(message)
        return self.emit(name, **payload)

    def phase(self, phase: str, step: int, member: int, **payload: Any) -> None:
        """``on_step_phase`` at a point of the two-phase step (:data:`OPTIONAL` lists the phases); tests and
        demos kill a member there (:class:`lightning_bamboo.testing.PhaseFaults`)."""
        if not self.muted:
            self.emit("on_step_phase", phase=phase, step=step, member=member, **payload)


@runtime_checkable
class Drains(Protocol):
    """A strategy that takes warned ranks out itself (``BambooStrategy.drain``); for any other strategy a
    warned rank checkpoints and stops (:func:`drain_with_checkpoint`)."""

    def drain(
        self,
        ranks: list[int],
        checkpoint_dir: str | Path | None = None,
        notices: dict[int, Notice] | None = None,
    ) -> None: ...
