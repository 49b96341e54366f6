"""What a preemption notice is, and the one small interface every notice source implements."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

NoticeAction = Literal["drain", "kill"]


@dataclass(frozen=True)
class Notice:
    """A warning that this worker's machine is about to go away.

    Attributes:
        source: name of the source that saw it (``"aws"``, ``"gce"``, ``"sigterm"``, ``"fault"``).
        action: ``"drain"``: leave gracefully at the next step boundary (every real cloud notice);
            ``"kill"``: the fault injector is about to kill the process without a drain.
        detail: what the source read (e.g. the IMDS body ``{"action": "terminate", "time": ...}``).
        deadline: the cloud's announced time of the preemption (ISO 8601) when it gives one, else ``None``.
        received_at: ``time.time()`` when the notice was seen.
        rank: the global rank that saw it; set by the watcher.
    """

    source: str
    action: NoticeAction = "drain"
    detail: str = ""
    deadline: str | None = None
    received_at: float = field(default_factory=time.time)
    rank: int = -1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class PreemptionNoticeSource(ABC):
    """Something that can tell this worker its machine is about to be taken away.

    ``poll`` is called from the watcher's daemon thread every ``poll_interval_s`` seconds, never from a
    training step, so it may block for up to its own network timeout. ``detect`` says whether the source
    applies here at all (e.g. "is this an EC2 instance"); it is probed once, on the watcher thread.
    """

    name: str = "source"
    poll_interval_s: float = 5.0

    def detect(self) -> bool:
        """Whether this source can work on this machine (default: always)."""
        return True

    @abstractmethod
    def poll(self) -> Notice | None:
        """A notice if one is pending now, else ``None``. Must not raise for a transient endpoint error."""

    def on_step(self, step: int) -> Notice | None:
        """Called at each step boundary with the global step; step-triggered sources answer here, at once."""
        return None

    def close(self) -> None:  # noqa: B027 (optional hook, most sources hold nothing)
        """Release what the source holds (sockets, signal handlers)."""
