"""Argument checks shared by the schedule passes."""

from __future__ import annotations


def check_pipeline_shape(num_stages: int, num_microbatches: int) -> None:
    """Raise ValueError naming the bad value when the pipeline shape is impossible."""
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an integer >= 1, got {num_stages!r}")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be an integer >= 1, got {num_microbatches!r}")
