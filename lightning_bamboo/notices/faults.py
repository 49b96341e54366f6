"""A fault injector for tests and demos: drain or kill a chosen rank at a chosen step or time."""

from __future__ import annotations

import logging
import os
import signal
import time

from lightning_bamboo.notices.base import Notice, NoticeAction, PreemptionNoticeSource

log = logging.getLogger(__name__)


class FaultInjector(PreemptionNoticeSource):
    """Acts on global rank ``rank`` once, when it reaches step ``at_step`` or ``at_time_s`` seconds of run.

    ``action="drain"`` raises a notice, exactly as a cloud warning would. ``action="kill"`` SIGKILLs the
    process with no notice at all (an unannounced preemption, which Bamboo must detect as a failed peer);
    a step-triggered kill happens at the step boundary, a time-triggered one on the watcher thread.

    Args:
        rank: the global rank to act on; other ranks never trigger.
        at_step: global step at (or after) which to act.
        at_time_s: seconds after the watcher started at which to act. Exactly one of the two is required.
        action: ``"drain"`` or ``"kill"``.
    """

    name = "fault"

    def __init__(
        self,
        rank: int,
        at_step: int | None = None,
        at_time_s: float | None = None,
        action: NoticeAction = "drain",
        poll_interval_s: float = 0.05,
    ) -> None:
        if (at_step is None) == (at_time_s is None):
            raise ValueError(f"give exactly one of at_step and at_time_s, got {at_step!r} and {at_time_s!r}")
        if action not in ("drain", "kill"):
            raise ValueError(f"action must be 'drain' or 'kill', got {action!r}")
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be an integer >= 0, got {rank!r}")
        self.rank = rank
        self.at_step = at_step
        self.at_time_s = at_time_s
        self.action: NoticeAction = action
        self.poll_interval_s = poll_interval_s
        self.my_rank = -1  # set by the watcher
        self._start = time.monotonic()
        self._step = -1
        self._fired = False

    def start(self, my_rank: int) -> None:
        self.my_rank = my_rank
        self._start = time.monotonic()

    def _due(self) -> bool:
        if self._fired or self.my_rank != self.rank:
            return False
        if self.at_step is not None:
            return self._step >= self.at_step
        assert self.at_time_s is not None
        return time.monotonic() - self._start >= self.at_time_s

    def _fire(self) -> Notice | None:
        self._fired = True
        if self.action == "kill":
            log.warning("Bamboo fault injector: killing rank %d (pid %d) now", self.rank, os.getpid())
            os.kill(os.getpid(), signal.SIGKILL)
        when = f"step {self.at_step}" if self.at_step is not None else f"{self.at_time_s} s"
        detail = f"injected drain of rank {self.rank} at {when}"
        return Notice(source=self.name, action="drain", detail=detail)

    def on_step(self, step: int) -> Notice | None:
        self._step = step
        if self.at_step is not None and self._due():
            return self._fire()
        return None

    def poll(self) -> Notice | None:
        if self.at_time_s is not None and self._due():
            return self._fire()
        return None
