"""Classic 1F1B (PipeDream-flush) with unit-time forward and backward slots."""

from __future__ import annotations

from ._checks import check_pipeline_shape
from .actions import Action, ActionKind, Schedule
from .dependencies import dependencies, place_programs

__all__ = ["build_1f1b", "one_f_one_b_program"]


def one_f_one_b_program(rank: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """Rank ``rank``'s action order: warm-up forwards, then one forward / one backward, then cool-down.

    Rank ``r`` runs ``min(num_stages - r, num_microbatches)`` forwards before its first backward, so at most
    that many micro-batches' activations are alive on it at once (the memory bound that makes 1F1B useful).
    """
    forwards = [Action(rank, ActionKind.FORWARD, mb) for mb in range(num_microbatches)]
    backwards = [Action(rank, ActionKind.BACKWARD, mb) for mb in range(num_microbatches)]
    warmup = min(num_stages - rank, num_microbatches)
    program = forwards[:warmup]
    for mb in range(num_microbatches):
        program.append(backwards[mb])
        if warmup + mb < num_microbatches:
            program.append(forwards[warmup + mb])
    return program


def build_1f1b(num_stages: int, num_microbatches: int) -> Schedule:
    """Build the 1F1B schedule of one pipeline; stage ``s`` runs on rank ``s``.

    Every action sits in the first slot where its inputs are there (``F(s, i)`` after ``F(s-1, i)``;
    ``B(s, i)`` after ``F(s, i)`` and ``B(s+1, i)``), so the grid shows the real bubbles:
    ``2 * (num_microbatches + num_stages - 1)`` slots, of which each rank idles ``2 * (num_stages - 1)``.

    Raises:
        ValueError: if ``num_stages < 1`` or ``num_microbatches < 1``.
    """
    check_pipeline_shape(num_stages, num_microbatches)
    programs = {rank: one_f_one_b_program(rank, num_stages, num_microbatches) for rank in range(num_stages)}
    return place_programs(programs, lambda action: dependencies(action, num_stages, redundant=False))
