"""The replay's cost model: Bamboo, checkpoint-restart and on-demand machines over one spot trace.

Time advances from event to event; between events a system either trains at a constant rate (samples/s
from the measured step time of its layout) or is paused (failover, rejoin, checkpoint, restart). The model
and its assumptions are written out in docs/bamboo-replay.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import groupby

from lightning_bamboo.layout.ownership import (
    FallbackNeeded,
    OwnershipMap,
    failover,
    fallback,
    initial,
    rejoin,
)
from lightning_bamboo.simulate.costs import Costs, rate
from lightning_bamboo.simulate.traces import Event, Trace


@dataclass(frozen=True)
class Prices:
    """Dollars per node-hour (the Bamboo paper's simulator prices by default)."""

    spot: float = 0.91
    on_demand: float = 3.06

    def __post_init__(self) -> None:
        if self.spot <= 0 or self.on_demand <= 0:
            raise ValueError(
                f"prices must be > 0 per node-hour, got spot={self.spot} on_demand={self.on_demand}"
            )


@dataclass
class Result:
    """One system's replay: totals, counters, and the timeline ``(t_s, nodes, cumulative samples)``."""

    system: str
    duration_s: float
    samples: float = 0.0
    node_seconds: float = 0.0
    price: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)
    seconds_lost: float = 0.0
    checkpoint_interval_s: float | None = None
    timeline: list[tuple[float, int, float]] = field(default_factory=list)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def dollars_per_hour(self) -> float:
        return self.node_seconds / self.duration_s * self.price if self.duration_s > 0 else 0.0

    @property
    def value(self) -> float:
        """Samples per dollar."""
        dollars = self.node_seconds / 3600.0 * self.price
        return self.samples / dollars if dollars > 0 else 0.0


class _Clock:
    """Advances one system through time: training at ``rate`` or paused, with periodic checkpoints."""

    def __init__(self, result: Result, checkpoint_s: float, interval_s: float | None, ticks: Sequence[float]):
        self.r = result
        self.t = 0.0
        self.rate = 0.0
        self.nodes = 0
        self.pause_left = 0.0
        self.pause_is_checkpoint = False
        self.since_checkpoint = 0.0  # training seconds since the last completed checkpoint
        self.samples_at_checkpoint = 0.0
        self.checkpoint_s = checkpoint_s
        self.interval_s = interval_s
        self.ticks = list(ticks)

    def advance_to(self, t_end: float) -> None:
        while self.ticks and self.ticks[0] <= t_end:
            self._advance(self.ticks.pop(0) - self.t)
            self.r.timeline.append((self.t, self.nodes, self.r.samples))
        self._advance(t_end - self.t)

    def _advance(self, dt: float) -> None:
        self.r.node_seconds += self.nodes * max(dt, 0.0)
        while dt > 1e-12:
            if self.pause_left > 0:
                d = min(dt, self.pause_left)
                self.pause_left -= d
                if self.pause_left <= 1e-12 and self.pause_is_checkpoint:
                    self.pause_left, self.pause_is_checkpoint = 0.0, False
                    self.since_checkpoint = 0.0
                    self.samples_at_checkpoint = self.r.samples
                    self.r.counts["checkpoints"] = self.r.counts.get("checkpoints", 0) + 1
            elif self.rate <= 0:
                d = dt
            else:
                d = dt if self.interval_s is None else min(dt, self.interval_s - self.since_checkpoint)
                self.r.samples += self.rate * d
                self.since_checkpoint += d
                if self.interval_s is not None and self.since_checkpoint >= self.interval_s - 1e-12:
                    self.pause_left, self.pause_is_checkpoint = self.checkpoint_s, True
            self.t += d
            dt -= d

    def pause(self, seconds: float, extend: bool = True) -> None:
        """Stop training for ``seconds`` (a checkpoint in progress is abandoned); overlapping pauses merge."""
        if self.pause_is_checkpoint:
            self.pause_left, self.pause_is_checkpoint = 0.0, False
        self.pause_left = max(self.pause_left, seconds) if extend else seconds
        self.r.seconds_lost += seconds

    def rollback(self) -> None:
        """Lose the work since the last completed checkpoint."""
        lost = self.r.samples - self.samples_at_checkpoint
        if self.rate > 0:
            self.r.seconds_lost += lost / self.rate
        self.r.samples = self.samples_at_checkpoint
        self.since_checkpoint = 0.0


def _groups(trace: Trace, compression: float) -> list[tuple[float, list[Event]]]:
    return [(t / compression, list(events)) for t, events in groupby(trace.events, key=lambda e: e.t_s)]


def _ticks(duration_s: float, points: int) -> list[float]:
    return [duration_s * (i + 1) / points for i in range(points)]


def _count(result: Result, key: str) -> None:
    result.counts[key] = result.counts.get(key, 0) + 1


def _replay(
    result: Result,
    trace: Trace,
    compression: float,
    clock: _Clock,
    on_events: Callable[[list[str], list[Event]], None],
) -> Result:
    alive: list[str] = []  # join order: the first nodes fill the pipelines, the rest are standby
    for t, events in _groups(trace, compression):
        if t > result.duration_s:
            break
        clock.advance_to(t)
        on_events(alive, events)
    clock.advance_to(result.duration_s)
    return result


def shape_key(owners: OwnershipMap) -> str:
    """The layout of a map as the live benchmark logs it: ``<positions>x<pipelines>`` when every pipeline
    has as many positions (a member running two stages fused is one position), else e.g. ``2+1``."""
    lengths = sorted((len(owners.positions(p)) for p in owners.pipeline_ids()), reverse=True)
    if len(set(lengths)) == 1:
        return f"{lengths[0]}x{len(lengths)}"
    return "+".join(str(n) for n in lengths)


def map_rate(owners: OwnershipMap, costs: Costs, recovery: str | None = None) -> float:
    """Samples/s of the job laid out as ``owners`` under ``recovery`` (default: ``costs.recovery``): the rate
    below for the mode the live benchmark ran (``costs.recovery``), times the full layout's measured speed-up
    of ``recovery`` over it at the same ``S x P`` (``Costs.recovery_steps``): a map with fused positions is
    assumed to gain from another mode what its full layout gains.

    The benchmark's own mode's rate:

    The measured step time of its shape when the benchmark saw it (``step_s_by_layout``/``step_s_by_shape``).
    Otherwise a step waits for its slowest pipeline, the one with the fewest positions ``L`` (its members run
    the most stages each): with ``costs.fused_slowdown`` (a projection's published figure), ``S x P``'s rate
    over it; else the rate of ``L x P`` (weak scaling from the widest ``L``-position layout measured,
    :func:`rate`); if no ``L``-position layout was measured, ``S x P``'s rate times ``L / S`` (the busiest
    member runs ``S / L`` times the layers). Stated in docs/bamboo-replay.md.
    """
    base = _measured_mode_rate(owners, costs)
    if recovery is None or recovery == costs.recovery:
        return base
    stages, pipelines = owners.num_stages, len(owners.pipelines)
    steps = costs.recovery_steps(recovery)
    if not steps:
        raise KeyError(
            f"the costs measured no failure-free step under recovery={recovery!r} (they were measured under "
            f"recovery={costs.recovery!r}); measure it: python benchmarks/bamboo_preemption.py --recovery "
            f"{recovery}"
        )
    mode = rate(steps, stages, pipelines, costs.samples_per_step)
    return base * mode / rate(costs.step_s_by_layout, stages, pipelines, costs.samples_per_step)


def _measured_mode_rate(owners: OwnershipMap, costs: Costs) -> float:
    key = shape_key(owners)
    if key in costs.step_s_by_shape:
        return costs.samples_per_step / costs.step_s_by_shape[key]
    lengths = [len(owners.positions(p)) for p in owners.pipeline_ids()]
    shortest, pipelines = min(lengths), len(lengths)
    if costs.fused_slowdown is not None and shortest < owners.num_stages:
        full = rate(costs.step_s_by_layout, owners.num_stages, pipelines, costs.samples_per_step)
        return full / costs.fused_slowdown
    try:
        return rate(costs.step_s_by_layout, shortest, pipelines, costs.samples_per_step)
    except KeyError:
        full = rate(costs.step_s_by_layout, owners.num_stages, pipelines, costs.samples_per_step)
        return full * shortest / owners.num_stages


def _capped(owners: OwnershipMap, cap: int | None) -> OwnershipMap:
    """At most ``cap`` pipelines: the others' members become spares."""
    if cap is None or len(owners.pipelines) <= cap:
        return owners
    keep = owners.pipeline_ids()[:cap]
    extra = [m for p in owners.pipeline_ids()[cap:] for m in owners.pipelines[p].values()]
    return OwnershipMap(
        owners.generation, owners.num_stages, {p: owners.pipelines[p] for p in keep},
        tuple(sorted(set(owners.spares) | set(extra))),
    )


def simulate_bamboo(
    trace: Trace,
    costs: Costs,
    stages: int,
    price: float,
    compression: float = 1.0,
    cap: int | None = None,
    checkpoint_interval_s: float | None = None,
    points: int = 400,
    recovery: str | None = None,
) -> Result:
    """Bamboo as its runtime re-forms: the replay keeps the job's ownership map and changes it with the
    runtime's own rules (:mod:`lightning_bamboo.layout.ownership`), under ``recovery`` (default: the mode
    the costs were measured under, ``costs.recovery``; ``BambooStrategy(recovery=...)``: its failure-free
    step, :func:`map_rate`; its failover cost, ``Costs.recovery_failover_s``; under ``"peers"`` a stage is
    recovered only from another pipeline, so a
    stage lost in every pipeline, or any loss of a one-pipeline job, falls back). A loss of a member costs
    ``failover_s``
    (:func:`~lightning_bamboo.layout.ownership.failover`: a replica takes over and the member before it runs
    the lost stages fused; a pipeline that lost two adjacent positions is kept when other pipelines'
    survivors own the stages it lost, else dropped and its survivors wait as spares); a loss no pipeline
    survives falls back to the last checkpoint (``fallback_s``, else ``restart_s``, plus the lost work) on
    the survivors
    (:func:`~lightning_bamboo.layout.ownership.fallback`).
    A node added after the start is paid for at once but joins ``rejoin_delay_s`` later (its process starts
    and waits for a step boundary while the job trains on; a node removed before that never joins), through
    :func:`~lightning_bamboo.layout.ownership.rejoin` (splitting fused positions first, then new pipelines,
    with the
    spares), pausing ``rejoin_s`` when the map changes; when the benchmark measured no rejoin (``rejoin_s``
    null: the runtime could not), new nodes stay spares. Nodes are members in join order."""
    recovery = recovery or costs.recovery
    duration = trace.duration_s / compression
    result = Result("bamboo", duration, price=price, checkpoint_interval_s=checkpoint_interval_s)
    clock = _Clock(result, costs.checkpoint_s, checkpoint_interval_s, _ticks(duration, points))
    ids: dict[str, int] = {}
    state: dict[str, OwnershipMap | None] = {"map": None}
    start = trace.events[0].t_s if trace.events else 0.0
    delay = costs.rejoin_delay_s * compression  # in trace seconds
    joins = [
        Event(e.t_s + (delay if e.t_s > start else 0.0), "join", e.node)  # type: ignore[arg-type]
        for e in trace.events
        if e.kind == "add" and costs.rejoin_s is not None
    ]
    timeline = Trace(tuple(sorted(trace.events + tuple(joins), key=lambda e: e.t_s)), trace.duration_s)

    def on_events(alive: list[str], events: list[Event]) -> None:
        owners = state["map"]
        lost_nodes = {e.node for e in events if e.kind == "remove"}
        added = [e.node for e in events if e.kind == "add"]
        for node in added:
            ids[node] = len(ids)
        alive[:] = [n for n in alive if n not in lost_nodes] + added
        lost = {ids[n] for n in lost_nodes}
        joined = [ids[e.node] for e in events if e.kind == "join" and e.node in alive]
        if owners is None:
            members = [ids[n] for n in alive]
            owners = _capped(initial(stages, members), cap) if len(members) >= stages else None
        else:
            if lost & set(owners.members()):
                try:
                    owners = failover(owners, lost, replicas=recovery != "peers")
                    clock.pause(costs.recovery_failover_s(recovery) + costs.failover_warmup_s)
                    _count(result, "failovers")
                except FallbackNeeded:
                    survivors = [m for m in owners.members() + list(owners.spares) if m not in lost]
                    clock.rollback()
                    clock.pause(costs.fallback_s if costs.fallback_s is not None else costs.restart_s,
                                extend=False)
                    _count(result, "fallbacks")
                    owners = fallback(owners, survivors) if survivors else None
            elif lost and owners is not None:
                owners = OwnershipMap(owners.generation, owners.num_stages, owners.pipelines,
                                      tuple(m for m in owners.spares if m not in lost))
            newcomers = [ids[n] for n in added]
            if newcomers and owners is not None and costs.rejoin_s is None:  # no rejoin: they stay spares
                owners = OwnershipMap(owners.generation, owners.num_stages, owners.pipelines,
                                      tuple(sorted(set(owners.spares) | set(newcomers))))
            if joined and owners is not None and costs.rejoin_s is not None:
                grown = _capped(rejoin(owners, joined), cap)
                if shape_key(grown) != shape_key(owners):
                    clock.pause(costs.rejoin_s + costs.rejoin_warmup_s)
                    _count(result, "rejoins")
                owners = grown
        state["map"] = owners
        clock.nodes = len(alive)
        clock.rate = map_rate(owners, costs, recovery) if owners is not None else 0.0

    return _replay(result, timeline, compression, clock, on_events)


def young_daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young/Daly's optimal checkpoint interval ``sqrt(2 * checkpoint cost * MTBF)``."""
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def simulate_checkpoint_restart(
    trace: Trace,
    costs: Costs,
    stages: int,
    price: float,
    compression: float = 1.0,
    cap: int | None = None,
    checkpoint_interval_s: float | None = None,
    points: int = 400,
) -> Result:
    """Checkpoint-restart (torchrun elastic + checkpoints): ``floor(nodes/stages)`` pipelines without
    redundancy; losing an active node kills everyone, loses the work since the last checkpoint and relaunches;
    a join that grows the layout drains (checkpoint at the next step boundary, exit: nothing lost) and
    relaunches — or kills at once a launch still starting, which has trained nothing. Each restart pauses
    :meth:`Costs.restart_parts`: the stop, the relaunch at the new layout, its warm-up, all measured.
    Checkpoints every ``checkpoint_interval_s`` of training (default: Young/Daly with the trace's MTBF)."""
    duration = trace.duration_s / compression
    if checkpoint_interval_s is None:
        groups = trace.removal_groups()
        mtbf = duration / groups if groups else math.inf
        checkpoint_interval_s = young_daly_interval(costs.checkpoint_s, mtbf) if groups else None
    result = Result("checkpoint_restart", duration, price=price, checkpoint_interval_s=checkpoint_interval_s)
    clock = _Clock(result, costs.checkpoint_s, checkpoint_interval_s, _ticks(duration, points))
    by_layout = costs.cr_step_s_by_layout or costs.step_s_by_layout
    state: dict[str, tuple[int, int] | float] = {"layout": (0, 0), "relaunched_at": -math.inf}

    def on_events(alive: list[str], events: list[Event]) -> None:
        s, p = state["layout"]  # type: ignore[misc]
        active = set(alive[: s * p])
        lost = {e.node for e in events if e.kind == "remove"}
        added = [e.node for e in events if e.kind == "add"]
        alive[:] = [n for n in alive if n not in lost] + added
        pipelines = len(alive) // stages if cap is None else min(len(alive) // stages, cap)
        layout = (stages, pipelines) if pipelines else (0, 0)
        started = state["relaunched_at"] > -math.inf  # type: ignore[operator]  # the first launch is free
        starting = clock.t < state["relaunched_at"]  # type: ignore[operator]  # the launch has not trained yet
        restart, stop = False, None
        if lost & active:
            clock.rollback()
            restart, stop = True, "kill"
        elif added and layout[1] > p and (p > 0 or started):
            # grow: drain (its checkpoint: nothing lost), or kill a launch still starting (it trained nothing)
            restart, stop = True, None if p == 0 else "kill" if starting else "drain"
            clock.since_checkpoint, clock.samples_at_checkpoint = 0.0, result.samples
        elif added and layout[1] > p:
            state["relaunched_at"] = clock.t  # the trace's first fleet: launched before time 0
        if restart:
            # with no pipeline left nothing trains (rate 0) until an add relaunches (stop None)
            halt, relaunch, warmup = costs.restart_parts(stop, *layout) if layout[1] else (0.0, 0.0, 0.0)
            clock.pause(halt + relaunch + warmup, extend=False)
            state["relaunched_at"] = clock.t + halt + relaunch
            _count(result, "restarts")
        state["layout"] = layout
        clock.nodes = len(alive)
        clock.rate = rate(by_layout, *layout, costs.samples_per_step) if layout[1] else 0.0

    return _replay(result, trace, compression, clock, on_events)


def simulate_on_demand(
    trace: Trace,
    costs: Costs,
    stages: int,
    price: float,
    nodes: int,
    compression: float = 1.0,
    points: int = 400,
) -> Result:
    """On-demand machines: ``nodes`` (a multiple of ``stages``) for the whole trace, never preempted."""
    if nodes < stages or nodes % stages:
        raise ValueError(f"on-demand nodes must be a positive multiple of stages ({stages}), got {nodes}")
    duration = trace.duration_s / compression
    result = Result("on_demand", duration, price=price)
    clock = _Clock(result, costs.checkpoint_s, None, _ticks(duration, points))
    clock.nodes = nodes
    by_layout = costs.cr_step_s_by_layout or costs.step_s_by_layout
    clock.rate = rate(by_layout, stages, nodes // stages, costs.samples_per_step)
    clock.advance_to(duration)
    return result
