"""The vocabulary of a schedule: action kinds, actions, and the ``Schedule`` type.

A schedule is plain data (``rank -> [Action | None]`` per time slot), following
``torch.distributed.pipelining``: rewrites such as adding redundancy are passes over that data, and the
runtime only interprets it. ``Action`` prints as ``2F0`` and parses back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

__all__ = ["Action", "ActionKind", "Schedule", "ScheduleError"]


class ActionKind(str, Enum):
    """What a rank computes in one time slot.

    ``FR`` runs the *replica* of the successor stage that Bamboo keeps on every rank (ring: the last rank
    replicates stage 0), so that a preempted stage's predecessor can take over without a restart.
    """

    FORWARD = "F"
    """Forward of the rank's own stage on one micro-batch."""
    BACKWARD = "B"
    """Backward of the rank's own stage (input gradient and weight gradient)."""
    FORWARD_REDUNDANT = "FR"
    """Eager forward of the successor stage's replica on this rank's own output (activations are kept)."""


# Longest value first so that "FR" is not read as "F" followed by "R...".
_KINDS_BY_LENGTH = sorted(ActionKind, key=lambda kind: -len(kind.value))
_ACTION_RE = re.compile(r"^(\d+)(" + "|".join(kind.value for kind in _KINDS_BY_LENGTH) + r")(\d+)$")


@dataclass(frozen=True)
class Action:
    """One unit of work: run ``stage``'s layers in direction ``kind`` on micro-batch ``microbatch``.

    For ``FR`` ``stage`` is the replicated stage (the successor of the rank's own stage), so the
    string says whose layers run: ``3FR0`` on rank 2 is the replica of stage 3 on micro-batch 0.
    """

    stage: int
    kind: ActionKind
    microbatch: int

    def __post_init__(self) -> None:
        if self.stage < 0:
            raise ValueError(f"Action stage must be >= 0, got {self.stage}")
        if self.microbatch < 0:
            raise ValueError(f"Action microbatch must be >= 0, got {self.microbatch}")
        if not isinstance(self.kind, ActionKind):
            raise ValueError(f"Action kind must be an ActionKind, got {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str(action)``: ``"3FR0"`` -> ``Action(3, FORWARD_REDUNDANT, 0)``.

        Raises:
            ValueError: if ``text`` is not ``<stage><kind><microbatch>`` with kind one of F, B, FR.
        """
        match = _ACTION_RE.match(text.strip())
        if match is None:
            kinds = ", ".join(kind.value for kind in ActionKind)
            raise ValueError(
                f"cannot parse action {text!r}: expected <stage><kind><microbatch> with kind in ({kinds}), "
                "e.g. '2F0' or '3FR1'"
            )
        stage, kind, microbatch = match.groups()
        return cls(int(stage), ActionKind(kind), int(microbatch))


Schedule = dict[int, list[Action | None]]
"""Rank (position in one pipeline, ``0..num_stages-1``) -> action per unit time slot; ``None`` is a bubble.

All rank lists have the same length; slot ``t`` of every rank happens at the same time.
"""


class ScheduleError(ValueError):
    """A schedule breaks an invariant; the message carries the grid with the offending cell marked."""
