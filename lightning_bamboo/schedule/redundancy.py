"""Bamboo's eager forward redundancy as a pass over a plain schedule.

Rank ``s`` keeps a replica of stage ``s+1`` (ring: the last rank replicates stage 0) and runs that replica's
forward (``FR``) on its own output of every micro-batch, so that if the successor is preempted the
predecessor already holds the successor's layers *and* activations and can take over at once.

Placement rule (the part that decides the cost):

* Window. ``FR(s+1, i)`` on rank ``s`` may run once rank ``s`` has its own output of micro-batch ``i`` (after
  ``F(s, i)``) and must run before ``B(s, i)``: once the successor's gradient for ``i`` has come back, the
  successor no longer needs its activations of ``i``, so a later replica forward protects nothing. The last
  rank replicates stage 0, whose input is the micro-batch itself, so it may start at once; it must run no
  later than stage 0's own ``B(0, i)`` (same slot allowed: if rank 0 is lost during ``B(0, i)``, the replica
  activations exist by the time the loss is noticed). That is a slot-time deadline: no tensor flows between
  the two ranks for it, so only the schedule orders them.
* Bubbles first. On each rank, bubbles are swept in time order and each is given to the waiting ``FR``
  whose window closes first (earliest deadline first). For unit-time slots and interval windows this fills
  as many bubbles as any assignment can. In 1F1B the first bubbles that open after a rank's own forwards are
  exactly the ones where it waits for its successor's gradient, which is where Bamboo puts them.
* Then new slots. Each ``FR`` left over gets a slot of its own, which is the real overhead of redundancy:
  it is put either right after ``F(s, i)`` or right before ``B(s, i)`` (for the last rank: at the start or
  right before ``B(s, i)``), whichever gives the shorter schedule, and right before ``B(s, i)`` on a tie.
  With fixed per-rank orders one extra unit slot delays any later action by at most one slot, so the
  schedule grows by at most the number of leftover ``FR``. If those shifts push a last-rank ``FR(0, i)`` past
  ``B(0, i)``, it moves to right before the last rank's own ``B(p-1, i)``, which is always in time.
* Then by time. Slots count a backward like a forward; the engine pays about two. :func:`search_programs`
  looks (within a fixed node budget) for per-rank orders that the unit-cost model of :mod:`.cost`
  (``F = 1, B = 2, FR = 1``) runs faster, under the same rules and 1F1B's memory bound, and uses them if it
  finds one. For 2 stages it reaches the floor of ``4M`` units per rank with no idle time (M = 4: 16 units
  against 15 without redundancy, a predicted ``rc_overhead`` of 1.07; the slot passes alone give 17).
"""

from __future__ import annotations

from ._checks import check_pipeline_shape
from .actions import Action, ActionKind, Schedule
from .cost import UNIT_COSTS, makespan
from .dependencies import DependencyFn, dependencies, place_programs

__all__ = ["add_forward_redundancy", "forward_redundancy_windows", "place_in_bubbles", "search_programs"]

SEARCH_BUDGET = 2_000
"""Most nodes :func:`search_programs` visits (a count, not a time, so the result is deterministic)."""


def forward_redundancy_windows(
    schedule: Schedule, num_stages: int, num_microbatches: int
) -> dict[int, dict[Action, tuple[int, int]]]:
    """For each rank, each ``FR`` it must run -> the first and last slot (inclusive) it may use.

    Slots are those of the plain ``schedule``; see the module docstring for the rule.
    """
    windows: dict[int, dict[Action, tuple[int, int]]] = {}
    slot_of_first = {action: t for t, action in enumerate(schedule[0]) if action is not None}
    for rank in range(num_stages):
        slot_of = {action: t for t, action in enumerate(schedule[rank]) if action is not None}
        successor = (rank + 1) % num_stages
        windows[rank] = {}
        for mb in range(num_microbatches):
            fr = Action(successor, ActionKind.FORWARD_REDUNDANT, mb)
            if successor == 0:
                windows[rank][fr] = (0, slot_of_first[Action(0, ActionKind.BACKWARD, mb)])
            else:
                release = slot_of[Action(rank, ActionKind.FORWARD, mb)] + 1
                deadline = slot_of[Action(rank, ActionKind.BACKWARD, mb)] - 1
                windows[rank][fr] = (release, deadline)
    return windows


def place_in_bubbles(
    schedule: Schedule, num_stages: int, num_microbatches: int
) -> dict[int, dict[Action, int]]:
    """For each rank, the ``FR`` actions that fit in a bubble of the plain ``schedule`` -> that bubble's slot.

    Bubbles are swept in time order and each goes to the waiting ``FR`` whose window closes first (ties: lower
    micro-batch), which fills as many bubbles as any assignment of unit actions to interval windows can.
    ``FR`` missing from the result need a new slot.
    """
    windows = forward_redundancy_windows(schedule, num_stages, num_microbatches)
    placement: dict[int, dict[Action, int]] = {}
    for rank, window in windows.items():
        assigned: dict[Action, int] = {}
        for t, action in enumerate(schedule[rank]):
            if action is not None:
                continue
            ready = [fr for fr, (lo, hi) in window.items() if fr not in assigned and lo <= t <= hi]
            if ready:
                assigned[min(ready, key=lambda fr: (window[fr][1], fr.microbatch))] = t
        placement[rank] = assigned
    return placement


def add_forward_redundancy(schedule: Schedule, num_stages: int, num_microbatches: int) -> Schedule:
    """Return a new schedule where rank ``s`` also runs ``FR(s+1 mod num_stages, i)`` for every micro-batch.

    Args:
        schedule: a plain schedule (``F``/``B`` only), e.g. from ``build_1f1b``; it is not modified.
        num_stages: pipeline length, at least 2 (a single stage has no other stage to replicate).
        num_microbatches: micro-batches per iteration.

    Raises:
        ValueError: on a bad shape, ``num_stages < 2``, or a schedule that already has redundant actions.
    """
    from .validate import validate_schedule

    check_pipeline_shape(num_stages, num_microbatches)
    if num_stages < 2:
        raise ValueError(
            f"forward redundancy needs num_stages >= 2 (a stage cannot be its own replica), got {num_stages}"
        )
    plain_kinds = (ActionKind.FORWARD, ActionKind.BACKWARD)
    if any(a is not None and a.kind not in plain_kinds for slots in schedule.values() for a in slots):
        raise ValueError("add_forward_redundancy expects a plain F/B schedule; this one already has FR")
    validate_schedule(schedule, num_stages, num_microbatches)

    windows = forward_redundancy_windows(schedule, num_stages, num_microbatches)
    bubbles = place_in_bubbles(schedule, num_stages, num_microbatches)
    programs: dict[int, list[Action]] = {}
    leftovers: list[tuple[int, Action]] = []
    for rank in range(num_stages):
        in_bubbles = bubbles[rank]
        timed = [(t, a) for t, a in enumerate(schedule[rank]) if a is not None]
        timed += [(t, fr) for fr, t in in_bubbles.items()]  # bubble slots: no two entries share a slot
        programs[rank] = [action for _, action in sorted(timed, key=lambda entry: entry[0])]
        leftovers += [(rank, fr) for fr in windows[rank] if fr not in in_bubbles]

    known: dict[Action, list[Action]] = {}

    def deps(action: Action) -> list[Action]:  # memoised: placement is re-run for every leftover FR
        if action not in known:
            known[action] = dependencies(action, num_stages, redundant=True)
        return known[action]

    for rank, fr in leftovers:
        programs[rank] = _insert_leftover(programs, rank, fr, deps)
    redundant = _meet_stage0_deadlines(programs, num_stages, deps)
    validate_schedule(redundant, num_stages, num_microbatches)
    searched = search_programs(schedule, redundant, num_stages, num_microbatches, deps)
    if searched is not None:
        validate_schedule(searched, num_stages, num_microbatches)
        return searched
    return redundant


def _meet_stage0_deadlines(
    programs: dict[int, list[Action]], num_stages: int, deps: DependencyFn
) -> Schedule:
    """Place ``programs``, moving any last-rank ``FR(0, i)`` that lands after ``B(0, i)`` to an earlier spot.

    No tensor ties ``FR(0, i)`` to ``B(0, i)``, so slots inserted on other ranks can push one past its
    deadline. Right before the last rank's own ``B(p-1, i)`` is always in time (``B(0, i)`` waits for the
    gradient chain that ``B(p-1, i)`` starts), so each move is final and the loop ends.
    """
    last = num_stages - 1
    while True:
        schedule = place_programs(programs, deps)
        slot = {a: t for row in schedule.values() for t, a in enumerate(row) if a is not None}
        late = [
            a
            for a in programs[last]
            if a.kind is ActionKind.FORWARD_REDUNDANT
            and slot[a] > slot[Action(0, ActionKind.BACKWARD, a.microbatch)]
        ]
        if not late:
            return schedule
        for fr in late:
            programs[last].remove(fr)
            programs[last].insert(programs[last].index(Action(last, ActionKind.BACKWARD, fr.microbatch)), fr)


def _insert_leftover(
    programs: dict[int, list[Action]], rank: int, fr: Action, deps: DependencyFn
) -> list[Action]:
    """``rank``'s program with ``fr`` in a new slot: before ``B(s, i)`` or eagerly, whichever ends sooner."""
    program = programs[rank]
    before_backward = program.index(Action(rank, ActionKind.BACKWARD, fr.microbatch))
    eager = 0 if fr.stage == 0 else program.index(Action(rank, ActionKind.FORWARD, fr.microbatch)) + 1
    placed = {action for prog in programs.values() for action in prog} | {fr}

    def deps_so_far(action: Action) -> list[Action]:
        # Leftover FRs that are not inserted yet must not count as missing producers.
        return [d for d in deps(action) if d in placed or d.kind is not ActionKind.FORWARD_REDUNDANT]

    best: tuple[int, list[Action]] | None = None
    for position in dict.fromkeys((before_backward, eager)):  # on a tie the first one wins
        trial = [*program[:position], fr, *program[position:]]
        length = len(place_programs({**programs, rank: trial}, deps_so_far)[rank])
        if best is None or length < best[0]:
            best = (length, trial)
    assert best is not None
    return best[1]


def search_programs(
    plain: Schedule,
    placed: Schedule,
    num_stages: int,
    num_microbatches: int,
    deps: DependencyFn,
    budget: int = SEARCH_BUDGET,
) -> Schedule | None:
    """A redundant schedule that runs faster than ``placed`` under the unit-cost model, or ``None``.

    Slots treat a backward like a forward; the engine does not (``B`` costs about 2 ``F``). This pass
    searches per-rank orders (depth first, ranks advanced in the order they become free, each kind of
    action in micro-batch order) by the time :mod:`.cost` predicts, and keeps an order only if it also

    * holds no more micro-batches in flight on any rank than ``plain`` does (1F1B's memory bound),
    * places on no more slots than ``placed`` and passes every rule of ``validate_schedule`` (``FR`` before
      the rank's own ``B``, the last rank's ``FR(0, i)`` no later than ``B(0, i)`` on the slot grid).

    Branches that cannot beat the best time so far (free time plus work left, per rank) are cut, and the
    search stops after ``budget`` nodes, so large pipelines keep ``placed``.
    """
    stages = range(num_stages)
    kinds = (ActionKind.BACKWARD, ActionKind.FORWARD_REDUNDANT, ActionKind.FORWARD)
    queues = {
        rank: {
            ActionKind.FORWARD: [Action(rank, ActionKind.FORWARD, i) for i in range(num_microbatches)],
            ActionKind.BACKWARD: [Action(rank, ActionKind.BACKWARD, i) for i in range(num_microbatches)],
            ActionKind.FORWARD_REDUNDANT: [
                Action((rank + 1) % num_stages, ActionKind.FORWARD_REDUNDANT, i)
                for i in range(num_microbatches)
            ],
        }
        for rank in stages
    }
    in_flight_limit = {rank: _max_in_flight(plain[rank]) for rank in stages}
    work = num_microbatches * sum(UNIT_COSTS[kind] for kind in kinds)
    best_time = makespan(placed)
    best: list[Schedule] = []
    programs: dict[int, list[Action]] = {rank: [] for rank in stages}
    taken = {rank: dict.fromkeys(kinds, 0) for rank in stages}
    free = dict.fromkeys(stages, 0.0)
    left = dict.fromkeys(stages, work)
    end: dict[Action, float] = {}
    nodes = 0

    def finish() -> None:
        nonlocal best_time
        try:
            schedule = place_programs(programs, deps)
            if len(schedule[0]) > len(placed[0]):
                return
            from .validate import validate_schedule

            validate_schedule(schedule, num_stages, num_microbatches)
        except ValueError:
            return
        best_time = max(free.values())
        best[:] = [schedule]

    def visit() -> None:
        nonlocal nodes
        nodes += 1
        if nodes > budget or max(free[r] + left[r] for r in stages) >= best_time:
            return
        mine: list[tuple[float, int, ActionKind, Action]] = []
        rank = -1
        for candidate in sorted(stages, key=lambda r: (free[r], r)):  # advance the rank free first
            for order, kind in enumerate(kinds):
                index = taken[candidate][kind]
                if index == num_microbatches:
                    continue
                action = queues[candidate][kind][index]
                alive = taken[candidate][ActionKind.FORWARD] - taken[candidate][ActionKind.BACKWARD]
                if kind is ActionKind.FORWARD and alive >= in_flight_limit[candidate]:
                    continue
                inputs = deps(action)
                if all(dep in end for dep in inputs):
                    mine.append((max([free[candidate], *(end[dep] for dep in inputs)]), order, kind, action))
            if mine:
                rank = candidate
                break
        if not mine:
            if all(len(programs[r]) == 3 * num_microbatches for r in stages):
                finish()
            return
        mine.sort()  # earliest start first
        for start, _, kind, action in mine:
            saved = free[rank]
            programs[rank].append(action)
            taken[rank][kind] += 1
            end[action] = free[rank] = start + UNIT_COSTS[kind]
            left[rank] -= UNIT_COSTS[kind]
            visit()
            left[rank] += UNIT_COSTS[kind]
            free[rank] = saved
            del end[action]
            taken[rank][kind] -= 1
            programs[rank].pop()

    visit()
    return best[0] if best else None


def _max_in_flight(row: list[Action | None]) -> int:
    """Most micro-batches whose ``F`` ran and whose ``B`` did not, at any point of a rank's row."""
    alive = most = 0
    for action in row:
        if action is not None and action.kind is ActionKind.FORWARD:
            alive += 1
            most = max(most, alive)
        elif action is not None and action.kind is ActionKind.BACKWARD:
            alive -= 1
    return most
