"""Bamboo schedules as data: no processes, strings in and strings out, golden grids."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_bamboo.schedule import (
    Action,
    ActionKind,
    ScheduleError,
    add_forward_redundancy,
    bubble_fraction,
    build_1f1b,
    dependencies,
    format_grid,
    forward_redundancy_windows,
    parse_grid,
    place_by_priority,
    place_in_bubbles,
    place_programs,
    rank_program,
    validate_schedule,
)

GOLDEN = Path(__file__).parent / "golden"
GOLDEN_SHAPES = [(2, 2), (2, 4), (3, 6), (4, 4), (4, 8)]
SHAPES = [(p, m) for p in range(1, 6) for m in range(1, 9)]
F, B, FR = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.FORWARD_REDUNDANT


def slots_of(schedule):
    return {a: (rank, t) for rank, row in schedule.items() for t, a in enumerate(row) if a is not None}


# --- actions ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "action"),
    [
        ("2F0", Action(2, F, 0)),
        ("1B3", Action(1, B, 3)),
        ("3FR0", Action(3, FR, 0)),
        ("0FR12", Action(0, FR, 12)),
    ],
)
def test_action_str_and_parse_round_trip(text, action):
    assert str(action) == text
    assert Action.parse(text) == action
    assert Action.parse(f"  {text} ") == action


@pytest.mark.parametrize("text", ["", "F0", "2X0", "2F", "-1F0", "2FR", "2 F 0", "2f0", ".", "0BR1"])
def test_action_parse_rejects_bad_text(text):
    with pytest.raises(
        ValueError, match=rf"cannot parse action {text!r}: expected <stage><kind><microbatch>"
    ):
        Action.parse(text)


def test_action_parse_names_the_kinds_it_knows():
    # "BR" (a lazy replica backward) is no action kind: a failover re-plans instead of rewriting the schedule
    with pytest.raises(ValueError, match=r"cannot parse action '0BR1': .* with kind in \(F, B, FR\), e\.g\."):
        Action.parse("0BR1")


def test_action_rejects_negative_indices():
    with pytest.raises(ValueError, match="Action stage must be >= 0, got -1"):
        Action(-1, F, 0)
    with pytest.raises(ValueError, match="Action microbatch must be >= 0, got -2"):
        Action(0, B, -2)


# --- 1F1B ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("p", "m"), GOLDEN_SHAPES)
def test_golden_grids(p, m):
    plain = build_1f1b(p, m)
    redundant = add_forward_redundancy(plain, p, m)
    assert format_grid(plain) == (GOLDEN / f"1f1b_p{p}_m{m}.txt").read_text()
    assert format_grid(redundant) == (GOLDEN / f"redundant_p{p}_m{m}.txt").read_text()
    validate_schedule(plain, p, m)
    validate_schedule(redundant, p, m)


def test_1f1b_two_stages_two_microbatches_by_hand():
    assert format_grid(build_1f1b(2, 2)) == (
        "step     0    1    2    3    4    5\n"
        "rank0  0F0  0F1    .  0B0    .  0B1\n"
        "rank1    .  1F0  1B0  1F1  1B1    .\n"
    )


@pytest.mark.parametrize(("p", "m"), SHAPES)
def test_1f1b_shape_and_bubbles(p, m):
    schedule = build_1f1b(p, m)
    validate_schedule(schedule, p, m)
    assert all(len(row) == 2 * (m + p - 1) for row in schedule.values())
    assert bubble_fraction(schedule) == pytest.approx((p - 1) / (m + p - 1))
    for rank in range(p):
        program = rank_program(schedule, rank)
        first_backward = program.index(Action(rank, B, 0))
        assert program[:first_backward] == [Action(rank, F, i) for i in range(min(p - rank, m))]
        assert [a.microbatch for a in program if a.kind is B] == list(range(m))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 4), "num_stages must be an integer >= 1, got 0"),
        ((2, 0), "num_microbatches must be an integer >= 1, got 0"),
    ],
)
def test_1f1b_rejects_bad_shape(args, message):
    with pytest.raises(ValueError, match=message):
        build_1f1b(*args)


# --- forward redundancy --------------------------------------------------------------------------------


def max_matching(bubbles: list[int], windows: dict[Action, tuple[int, int]]) -> int:
    """Independent maximum bipartite matching (augmenting paths) of FRs to bubble slots."""
    owner: dict[int, Action] = {}

    def augment(fr, seen):
        for t in bubbles:
            lo, hi = windows[fr]
            if lo <= t <= hi and t not in seen:
                seen.add(t)
                if t not in owner or augment(owner[t], seen):
                    owner[t] = fr
                    return True
        return False

    return sum(augment(fr, set()) for fr in windows)


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in SHAPES if p >= 2])
def test_forward_redundancy_fills_as_many_bubbles_as_possible(p, m):
    plain = build_1f1b(p, m)
    windows = forward_redundancy_windows(plain, p, m)
    placement = place_in_bubbles(plain, p, m)
    for rank in range(p):
        bubbles = [t for t, a in enumerate(plain[rank]) if a is None]
        assert len(placement[rank]) == max_matching(bubbles, windows[rank])
        for fr, t in placement[rank].items():
            assert plain[rank][t] is None
            assert windows[rank][fr][0] <= t <= windows[rank][fr][1]
        assert len(set(placement[rank].values())) == len(placement[rank])


# From (8, 11) on, inserted slots push some last-rank FR(0, i) past B(0, i) unless the pass moves them.
@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in SHAPES if p >= 2] + [(8, 11), (8, 16), (6, 24)])
def test_forward_redundancy_is_complete_ordered_and_bounded(p, m):
    plain = build_1f1b(p, m)
    redundant = add_forward_redundancy(plain, p, m)
    validate_schedule(redundant, p, m)
    assert plain == build_1f1b(p, m), "the input schedule must not be modified"
    slots = slots_of(redundant)
    for rank in range(p):
        succ = (rank + 1) % p
        frs = [a for a in rank_program(redundant, rank) if a.kind is FR]
        assert sorted(a.microbatch for a in frs) == list(range(m))
        assert all(a.stage == succ for a in frs)
        for i in range(m):
            fr_slot = slots[Action(succ, FR, i)][1]
            if succ != 0:
                # The replica reads this rank's own output and is useless once the gradient is back.
                assert slots[Action(rank, F, i)][1] < fr_slot < slots[Action(rank, B, i)][1]
            else:
                # The replica of stage 0 reads the micro-batch; it is useful until stage 0's backward.
                assert fr_slot <= slots[Action(0, B, i)][1]
    placed = place_in_bubbles(plain, p, m)
    leftovers = p * m - sum(len(v) for v in placed.values())
    growth = len(redundant[0]) - len(plain[0])
    assert 0 <= growth <= leftovers
    if leftovers == 0:  # every FR fits a bubble: nothing else moves and the schedule does not grow
        assert growth == 0
        for action, (rank, t) in slots.items():
            if action.kind is FR:
                assert plain[rank][t] is None
            else:
                assert plain[rank][t] == action


def test_forward_redundancy_fits_bubbles_when_microbatches_are_few():
    # With m <= 2 every FR fits a plain bubble, so the redundant schedule costs no extra slot.
    for p in range(2, 6):
        for m in (1, 2):
            plain = build_1f1b(p, m)
            assert len(add_forward_redundancy(plain, p, m)[0]) == len(plain[0])
    assert bubble_fraction(add_forward_redundancy(build_1f1b(2, 2), 2, 2)) == 0.0


def test_forward_redundancy_first_fr_fills_the_wait_for_the_gradient():
    # Rank 0 of 4 stages idles after its warm-up forwards, waiting for 0B0: the replica forwards go there.
    redundant = add_forward_redundancy(build_1f1b(4, 8), 4, 8)
    assert [str(a) for a in redundant[0][3:8]] == ["0F3", "1FR0", "1FR1", "1FR2", "0B0"]
    # The last rank replicates stage 0 on the raw micro-batch, in the bubbles before its first forward.
    assert [str(a) for a in redundant[3][:4]] == ["0FR0", "0FR1", "0FR2", "3F0"]


def test_forward_redundancy_rejects_bad_input():
    with pytest.raises(ValueError, match=r"forward redundancy needs num_stages >= 2 .*got 1"):
        add_forward_redundancy(build_1f1b(1, 2), 1, 2)
    redundant = add_forward_redundancy(build_1f1b(2, 2), 2, 2)
    with pytest.raises(ValueError, match="expects a plain F/B schedule; this one already has FR"):
        add_forward_redundancy(redundant, 2, 2)
    with pytest.raises(ValueError, match="num_microbatches must be an integer >= 1, got -1"):
        add_forward_redundancy(build_1f1b(2, 2), 2, -1)


# --- validation -----------------------------------------------------------------------------------------


def test_validate_marks_a_backward_before_its_forward():
    schedule = build_1f1b(2, 2)
    schedule[1][1], schedule[1][2] = schedule[1][2], schedule[1][1]  # 1B0 before 1F0
    with pytest.raises(ScheduleError, match=r"1B0 at rank 1, step 1 runs before its input 1F0") as info:
        validate_schedule(schedule, 2, 2)
    assert "[1B0]!" in str(info.value)
    assert "rank1    .  [1B0]!" in str(info.value)


def test_validate_marks_a_cross_rank_dependency():
    schedule = build_1f1b(2, 2)
    schedule[0][2], schedule[0][3] = schedule[0][3], schedule[0][2]  # 0B0 in the same slot as 1B0
    with pytest.raises(
        ScheduleError, match=r"0B0 at rank 0, step 2 runs before its input 1B0 \(rank 1, step 2\)"
    ):
        validate_schedule(schedule, 2, 2)


def test_validate_requires_fr_before_own_backward():
    schedule = add_forward_redundancy(build_1f1b(2, 2), 2, 2)
    # Swap 1FR0 and 1FR1 on rank 0, so 1FR0 runs after 0B0: a replica forward after the gradient came back
    # protects nothing.
    assert [str(a) for a in schedule[0]] == ["0F0", "0F1", "1FR0", "0B0", "1FR1", "0B1"]
    schedule[0][2], schedule[0][4] = schedule[0][4], schedule[0][2]
    with pytest.raises(
        ScheduleError, match=r"0B0 at rank 0, step 3 runs before its input 1FR0 \(rank 0, step 4\)"
    ):
        validate_schedule(schedule, 2, 2)


def test_validate_requires_last_rank_fr_no_later_than_stage0_backward():
    schedule = add_forward_redundancy(build_1f1b(2, 2), 2, 2)
    assert str(schedule[1][5]) == "0FR1" and str(schedule[0][5]) == "0B1"  # the same slot is in time
    schedule[0].append(None)
    schedule[1][5:] = [None, Action(0, FR, 1)]
    with pytest.raises(
        ScheduleError, match=r"0FR1 at rank 1, step 6 runs after 0B1 \(rank 0, step 5\)"
    ) as info:
        validate_schedule(schedule, 2, 2)
    assert "[0FR1]!" in str(info.value)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s[0].__setitem__(2, Action(0, F, 0)), r"0F0 appears twice \(first at rank 0, step 0\)"),
        (lambda s: s[0].__setitem__(3, None), "0B0 is missing from rank 0"),
        (lambda s: s[0].__setitem__(2, Action(1, F, 0)), "1F0 cannot run on rank 0"),
        (
            lambda s: s[0].__setitem__(2, Action(0, F, 7)),
            r"microbatch 7 is out of range for num_microbatches \(2\)",
        ),
        (lambda s: s[0].__setitem__(2, Action(1, FR, 0)), "0FR0 is missing from rank 1"),
        (lambda s: s[1].append(None), r"all ranks must have the same number of slots"),
        (lambda s: s.pop(1), r"schedule ranks must be 0..1, got \[0\]"),
    ],
)
def test_validate_rejects_broken_schedules(edit, message):
    schedule = build_1f1b(2, 2)
    edit(schedule)
    with pytest.raises(ScheduleError, match=message):
        validate_schedule(schedule, 2, 2)


def test_validate_rejects_bad_shape():
    with pytest.raises(ValueError, match="num_stages must be an integer >= 1, got 0"):
        validate_schedule({}, 0, 1)


# --- grid -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("p", "m"), GOLDEN_SHAPES)
def test_grid_round_trip(p, m):
    for schedule in (build_1f1b(p, m), add_forward_redundancy(build_1f1b(p, m), p, m)):
        assert parse_grid(format_grid(schedule)) == schedule
        golden = (GOLDEN / f"1f1b_p{p}_m{m}.txt").read_text()
        assert format_grid(parse_grid(golden)) == golden


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "grid must start with a 'step 0 1 ...' header line"),
        ("step 0 1\nrank0 0F0\n", "grid row rank0 has 1 cells, the header has 2 steps"),
        ("step 0\nnode0 0F0\n", "grid row label must be 'rank<N>', got 'node0'"),
        ("step 0\nrank0 0F0\nrank0 0B0\n", "grid has two rows for rank 0"),
        ("step 0\nrank0 0Q0\n", "cannot parse action '0Q0'"),
    ],
)
def test_parse_grid_rejects_bad_text(text, message):
    with pytest.raises(ValueError, match=message):
        parse_grid(text)


def test_rank_program_and_bubble_fraction():
    schedule = build_1f1b(2, 2)
    assert [str(a) for a in rank_program(schedule, 1)] == ["1F0", "1B0", "1F1", "1B1"]
    assert bubble_fraction(schedule) == pytest.approx(4 / 12)
    with pytest.raises(KeyError, match=r"rank 5 is not in the schedule \(ranks: \[0, 1\]\)"):
        rank_program(schedule, 5)


# --- placement ------------------------------------------------------------------------------------------


def test_place_programs_detects_deadlock_and_missing_producers():
    def deps(action):
        return dependencies(action, 2, redundant=False)

    programs = {0: [Action(0, F, 0), Action(0, B, 0)], 1: [Action(1, B, 0), Action(1, F, 0)]}
    message = r"deadlock: every rank waits for an input no rank can produce \(\{0: '0B0', 1: '1B0'\}\)"
    with pytest.raises(ScheduleError, match=message):
        place_programs(programs, deps)
    with pytest.raises(ScheduleError, match="1F0 depends on 0F0, which no rank runs"):
        place_programs({0: [], 1: [Action(1, F, 0)]}, deps)


def test_place_by_priority_detects_cycles():
    def deps(action):
        return [Action(1 - action.stage, F, 0)]

    with pytest.raises(ScheduleError, match="dependency cycle at step 0: nothing can run"):
        place_by_priority({0: [Action(0, F, 0)], 1: [Action(1, F, 0)]}, deps)
