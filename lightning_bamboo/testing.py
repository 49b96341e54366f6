"""Fault injection for tests and demos: kill an elastic Bamboo member at a chosen phase of a chosen step.

The runtime only *reports* the phases of its two-phase step (the ``on_step_phase`` event); this callback acts
on them. Nothing here runs unless a script adds the callback::

    Trainer(strategy=BambooStrategy(...), callbacks=[PhaseFaults.from_env()])
    BAMBOO_FAULT=1:2:forward python -m lightning_bamboo.launch --nproc 2 train.py
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning.pytorch import Callback

from lightning_bamboo.protocol.store import store_barrier

if TYPE_CHECKING:
    import lightning.pytorch as pl

ENV_FAULT = "BAMBOO_FAULT"
PHASES = ("forward", "exchange", "prepared", "commit", "applied", "validate", "form")


@dataclass(frozen=True)
class Fault:
    """Members ``members`` die together (SIGKILL, or SIGSTOP: hang) at ``phase`` of step ``step``."""

    members: tuple[int, ...]
    step: int
    phase: str
    signal: int = signal.SIGKILL


def parse_faults(spec: str | None) -> list[Fault]:
    """``member:step:phase[:STOP]``, several separated by commas; ``1+2:...`` kills members 1 and 2 together
    (each waits at the phase until all listed have reached it: use a phase each reaches on its own).

    Raises:
        ValueError: naming the malformed item and the expected form.
    """
    faults = []
    for item in filter(None, (spec or "").split(",")):
        parts = item.split(":")
        if len(parts) not in (3, 4) or parts[2] not in PHASES or (len(parts) == 4 and parts[3] != "STOP"):
            raise ValueError(
                f"{ENV_FAULT} must be member:step:phase[:STOP] with phase one of {PHASES}, got {item!r}"
            )
        sig = signal.SIGSTOP if len(parts) == 4 else signal.SIGKILL
        faults.append(Fault(tuple(int(m) for m in parts[0].split("+")), int(parts[1]), parts[2], sig))
    return faults


class PhaseFaults(Callback):
    """Kills (or stops) this process when its member reaches a listed phase of a listed step.

    ``forward`` acts at the forward of micro-batch 1 (micro-batch 0 with one micro-batch), so the member dies
    with the step's communication under way.
    """

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = faults

    @classmethod
    def from_env(cls) -> PhaseFaults:
        """The faults named by ``BAMBOO_FAULT`` (none when it is unset)."""
        return cls(parse_faults(os.environ.get(ENV_FAULT)))

    def on_step_phase(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, phase: str, step: int, member: int,
        microbatch: int | None = None, **payload: Any,
    ) -> None:
        if phase == "forward":
            engine = trainer.strategy.engine  # type: ignore[attr-defined]
            if microbatch != min(1, engine.num_microbatches - 1):
                return
        for fault in self.faults:
            if member in fault.members and step == fault.step and phase == fault.phase:
                if len(fault.members) > 1:  # die together: wait until every listed member is here
                    store = trainer.strategy.store  # type: ignore[attr-defined]
                    store_barrier(store, f"fault/{step}/{phase}", len(fault.members), poll=0.002)
                os.kill(os.getpid(), fault.signal)
                time.sleep(0.1)  # a SIGSTOP takes effect before this member runs on
