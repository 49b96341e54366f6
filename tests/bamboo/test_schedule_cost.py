"""The unit-cost model of a schedule's step time, and the placement's predicted ``rc_overhead``."""

from __future__ import annotations

import pytest

from lightning_bamboo.schedule import (
    Action,
    ActionKind,
    ScheduleError,
    add_forward_redundancy,
    build_1f1b,
    makespan,
    predicted_overhead,
    program_makespan,
    validate_schedule,
)

F, B, FR = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.FORWARD_REDUNDANT


def test_plain_1f1b_takes_m_plus_p_minus_1_forward_backward_pairs():
    # (M + S - 1)(f + b) with f = 1, b = 2: the textbook 1F1B step
    for stages, microbatches in [(2, 2), (2, 4), (3, 6), (4, 8)]:
        assert makespan(build_1f1b(stages, microbatches)) == 3 * (microbatches + stages - 1)


def test_model_runs_each_rank_in_order_and_waits_for_inputs():
    programs = {0: [Action(0, F, 0), Action(0, B, 0)], 1: [Action(1, F, 0), Action(1, B, 0)]}
    assert program_makespan(programs, 2) == 1 + 1 + 2 + 2  # F0, F1, B1, B0 strictly in sequence
    with pytest.raises(ScheduleError, match="deadlock"):
        program_makespan({0: [Action(0, B, 0), Action(0, F, 0)], 1: [Action(1, F, 0), Action(1, B, 0)]}, 2)


def test_measured_durations_per_rank_and_position_replace_the_unit_costs():
    programs = {0: [Action(0, F, 0), Action(0, B, 0)], 1: [Action(1, F, 0), Action(1, B, 0)]}
    # rank 1 twice as slow, and its first action carries 0.5 of other work (a replica update)
    durations = {0: {F: 1.0, B: 2.0}, 1: {F: 2.0, B: 4.0}}

    def duration(rank: int, index: int, action: Action) -> float:
        return durations[rank][action.kind] + (0.5 if (rank, index) == (1, 0) else 0.0)

    assert program_makespan(programs, 2, duration=duration) == 1 + 2.5 + 4 + 2


@pytest.mark.parametrize(
    ("stages", "microbatches", "units", "overhead"),
    [
        (2, 2, 9, 1.0),  # every FR in a bubble
        (2, 4, 16, 16 / 15),  # the floor: 4M units of work per rank, no idle time (was 17: 1.13)
        (2, 8, 32, 32 / 27),  # the floor again (was 33)
    ],
)
def test_redundant_placement_reaches_the_unit_cost_floor(stages, microbatches, units, overhead):
    plain = build_1f1b(stages, microbatches)
    redundant = add_forward_redundancy(plain, stages, microbatches)
    validate_schedule(redundant, stages, microbatches)
    assert makespan(redundant) == units
    assert predicted_overhead(redundant, plain) == pytest.approx(overhead)
    assert len(redundant[0]) <= len(plain[0]) + microbatches  # slot grid no longer than before


def test_default_shape_meets_the_overhead_target():
    """The benchmark's default (2 stages, M = 4): the model predicts rc_overhead <= 1.10."""
    plain = build_1f1b(2, 4)
    assert predicted_overhead(add_forward_redundancy(plain, 2, 4), plain) <= 1.10


def test_search_keeps_the_1f1b_memory_bound():
    # no rank holds more micro-batches in flight than in plain 1F1B (S - r on rank r)
    for stages, microbatches in [(2, 4), (2, 8), (3, 6)]:
        redundant = add_forward_redundancy(build_1f1b(stages, microbatches), stages, microbatches)
        for rank in range(stages):
            alive = most = 0
            for action in (a for a in redundant[rank] if a is not None):
                alive += {F: 1, B: -1}.get(action.kind, 0)
                most = max(most, alive)
            assert most <= min(stages - rank, microbatches)
