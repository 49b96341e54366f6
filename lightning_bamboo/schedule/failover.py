"""Who runs which stage after a preemption: the predecessor takes over the lost stage."""

from __future__ import annotations

__all__ = ["remap_after_failure"]


def remap_after_failure(num_stages: int, failed_stage: int) -> dict[int, list[int]]:
    """Stage ownership of one pipeline after rank ``failed_stage`` is gone.

    Its predecessor ``(failed_stage - 1) % num_stages`` holds the failed stage's replica (layers, optimizer
    state and, thanks to eager ``FR``, the activations), so it now runs both stages; every other survivor
    keeps its own. The lost stage is listed after the predecessor's own, in pipeline order.

    Args:
        num_stages: pipeline length before the failure; at least 2 (one stage has no replica to fall back on).
        failed_stage: the rank (= stage) that was lost, in ``0..num_stages-1``.

    Returns:
        surviving rank -> stages it owns, ranks in increasing order.

    Raises:
        ValueError: if ``num_stages < 2`` or ``failed_stage`` is out of range.
    """
    if not isinstance(num_stages, int) or num_stages < 2:
        raise ValueError(
            f"remap_after_failure needs num_stages >= 2 (a single stage has no replica), got {num_stages!r}"
        )
    if not isinstance(failed_stage, int) or not 0 <= failed_stage < num_stages:
        raise ValueError(f"failed_stage must be in 0..{num_stages - 1}, got {failed_stage!r}")
    predecessor = (failed_stage - 1) % num_stages
    owners = {rank: [rank] for rank in range(num_stages) if rank != failed_stage}
    owners[predecessor].append(failed_stage)
    return owners
