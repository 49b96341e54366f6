"""A multi-machine run's timeline as the replay's costs file, so the replay (and the advisor's choice of a
recovery mode) is checked against the network-namespace runs of ``bamboo_nodes.py`` / ``bamboo_modes.py``.

``bamboo_nodes.py`` records when each step was committed and by which generation, what each generation's
ownership map looked like, which members every machine held, and when the trace segment's events were
applied. :func:`replay_costs` turns that into a schema-2 costs file (docs/bamboo-replay.md) that
``lightning_bamboo.simulate.validate`` replays: the same events, worker by worker, with the run's own
costs, each measured as the preemption benchmark measures it on one machine:

* the step of every layout the run trained on (``step_s_by_layout`` for the full ``SxP``,
  ``step_s_by_shape`` for maps with fused positions, e.g. ``2+1+1``): the mean interval between
  consecutive commits of the generations with that shape, after each generation's first
  :data:`WARMUP_SPANS` intervals. A mean, not a median: the replay turns it into samples per second, and
  the occasional slow step inside a generation (a replacement starting on the same cores, a collection) is
  part of what the generation trained. The median left those out, and the replay over-predicted every
  mode by 8-10 % (benchmarks/results/bamboo-elastic-history.md, "The replay's step: a mean");
* ``failover_s``: a machine lost to the first step a later generation committed (``bamboo_nodes.py``'s own
  figure); ``failover_warmup_s``: the excess of a failover generation's first intervals over its steady step;
* ``rejoin_delay_s``: a replacement machine started to the last step the job committed without it (its
  workers start and wait for a step boundary while the job trains on); ``rejoin_s``: from that step to the
  first one with it, less one step; ``rejoin_warmup_s`` as for a failover.

The run holds no checkpoint-restart parts (the modes never fall back in it); ``checkpoint_s`` and
``restart_s``, which the replay needs only for a fallback, come from the one-machine preemption benchmark's
file and are labelled so. Member ids are the runtime's: a machine's workers are named ``<machine>/<member>``
and join in member order, so the replay's ownership rules see the ids the coordinator placed."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WARMUP_SPANS = 10
"""Commit intervals at the start of a generation counted as its warm-up, not its steady step (the
preemption benchmark's ``failover_warmup_s`` and ``rejoin_warmup_s`` use the same 10 steps)."""


@dataclass(frozen=True)
class Generation:
    """One generation of the job as the run saw it: its map's shape, its member count, and the commit times
    of its steps in order."""

    shape: str
    members: int
    commits: tuple[float, ...]

    @property
    def spans(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.commits)]


@dataclass(frozen=True)
class Applied:
    """A segment event as applied: ``t_s`` after the segment's start, the machine's plan name, the members
    it held (empty: it never registered them), and for a removal whether a member was training."""

    t_s: float
    kind: str
    machine: str
    members: tuple[int, ...]
    training: bool = True


def generations(commits: Sequence[tuple[int, float, int]], shapes: dict[int, str],
                sizes: dict[int, int]) -> dict[int, Generation]:
    """``commits``: ``(step, time, generation)`` in step order; ``shapes``/``sizes``: each generation's map
    shape (``simulate.model.shape_key``) and member count."""
    times: dict[int, list[float]] = {}
    for _, t, g in commits:
        times.setdefault(g, []).append(t)
    return {g: Generation(shapes[g], sizes[g], tuple(ts)) for g, ts in sorted(times.items())}


def steady_steps(gens: dict[int, Generation]) -> dict[str, float]:
    """The mean commit interval per shape (its rate: see the module docstring), pooled over its generations
    after their warm-up (a generation too short for a warm-up contributes its intervals but the first)."""
    pooled: dict[str, list[float]] = {}
    for gen in gens.values():
        spans = gen.spans
        steady = spans[WARMUP_SPANS:] if len(spans) > WARMUP_SPANS + 2 else spans[1:]
        pooled.setdefault(gen.shape, []).extend(steady)
    return {shape: statistics.fmean(spans) for shape, spans in pooled.items() if spans}


def _warmup_excess(gen: Generation, step: float) -> float:
    spans = gen.spans[:WARMUP_SPANS]
    return max(0.0, sum(spans) - len(spans) * step)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def replay_costs(
    gens: dict[int, Generation],
    applied: Sequence[Applied],
    initial: dict[str, tuple[int, ...]],
    failover_s: Sequence[float],
    segment_start: float,
    segment_s: float,
    live_samples_per_s: float,
    samples_per_step: float,
    num_stages: int,
    recovery: str,
    reference: dict[str, Any],
) -> dict[str, Any]:
    """The run as a schema-2 costs file with ``live.bamboo`` for ``simulate.validate``.

    ``applied``: the segment's events, ``t_s`` relative to ``segment_start`` (the commit times' clock);
    ``initial``: the machines at the start and their members; ``reference``: the preemption benchmark's
    costs file (``checkpoint_s``, ``restart_s`` for a fallback the run never had)."""
    steps = steady_steps(gens)
    full = max(gens.values(), key=lambda g: g.members)
    full_key = full.shape
    order = sorted(gens)
    failover_warmups, rejoins, rejoin_delays, rejoin_warmups = [], [], [], []
    adds = sorted((a for a in applied if a.kind == "add"), key=lambda a: a.t_s)
    for before, after in itertools.pairwise(order):
        prev, gen = gens[before], gens[after]
        step = steps.get(gen.shape)
        if step is None:
            continue
        if gen.members < prev.members:
            failover_warmups.append(_warmup_excess(gen, step))
        elif gen.members > prev.members:
            rejoins.append(max(0.0, gen.commits[0] - prev.commits[-1] - step))
            rejoin_warmups.append(_warmup_excess(gen, step))
            # the latest replacement started before the job's last step without it
            started = [segment_start + a.t_s for a in adds if segment_start + a.t_s <= prev.commits[-1]]
            if started:
                rejoin_delays.append(prev.commits[-1] - max(started))
    starters = [name for _, name in sorted((m, f"{machine}/{m}") for machine, members in initial.items()
                                           for m in members)]
    workers_per_machine = len(next(iter(initial.values())))
    events = []
    for event in sorted(applied, key=lambda a: a.t_s):
        names = [f"{event.machine}/{m}" for m in sorted(event.members)] or \
            [f"{event.machine}/unregistered{j}" for j in range(workers_per_machine)]
        events += [{"t_s": round(event.t_s, 6), "kind": event.kind, "node": name} for name in names]
    costs = {
        "step_s": steps[full_key],
        "step_s_by_layout": {full_key: steps[full_key]},
        "replica_step_s_by_layout": {full_key: steps[full_key]},
        "checkpoint_restart_step_s_by_layout": {full_key: steps[full_key]},
        "step_s_by_shape": {k: v for k, v in steps.items() if k != full_key},
        "failover_s": _median(list(failover_s)) or 0.0,
        "failover_warmup_s": statistics.fmean(failover_warmups) if failover_warmups else 0.0,
        "rejoin_s": _median(rejoins),
        "rejoin_delay_s": _median(rejoin_delays) or 0.0,
        "rejoin_warmup_s": statistics.fmean(rejoin_warmups) if rejoin_warmups else 0.0,
        "checkpoint_s": float(reference["costs"]["checkpoint_s"]),
        "restart_s": float(reference["costs"]["restart_s"]),
        "fallback_s": None,
        "restart_stop_s": {},
        "relaunch_s_by_layout": {},
        "relaunch_warmup_s_by_layout": {},
    }
    if recovery == "peers":
        costs["peers_failover_s"] = costs["failover_s"]
    pipelines = int(full_key.split("x")[1])
    return {
        "schema": 2,
        "num_stages": num_stages,
        "max_pipelines": pipelines,
        "samples_per_step": samples_per_step,
        "costs": costs,
        "events": events,
        "initial_nodes": starters,
        "live": {"bamboo": {"wall_s": segment_s, "samples_per_s": live_samples_per_s, "recovery": recovery,
                            "layout": full_key, "initial_nodes": starters}},
        "sources": {
            "step_s_by_layout, step_s_by_shape": f"measured: mean commit interval per map shape after "
                                                 f"each generation's first {WARMUP_SPANS}",
            "failover_s": "measured: machine lost -> first step committed by a later generation (median)",
            "failover_warmup_s, rejoin_warmup_s": f"measured: excess of a generation's first {WARMUP_SPANS} "
                                                  "intervals over its shape's steady step (mean)",
            "rejoin_s, rejoin_delay_s": "measured: last step without the replacement -> first with it, less "
                                        "a step; replacement started -> that last step (medians)",
            "checkpoint_s, restart_s": "reference: benchmarks/results/bamboo_preemption.json (only a "
                                       "fallback would use them; the run had none)",
        },
        "generations": {str(g): {"shape": gen.shape, "members": gen.members, "steps": len(gen.commits)}
                        for g, gen in gens.items()},
    }


def failover_times(commits: Sequence[tuple[int, float, int]],
                   kills: Sequence[tuple[int, float, int, bool]]) -> list[float]:
    """Each loss of a training machine to the first step committed by a generation after the one it was
    lost in (``nan`` when none came): ``commits`` are ``(step, time, generation)``, ``kills`` ``(host, time,
    generation, training)``. A step the survivors commit before that, which the lost members had prepared,
    is not the failover; a machine none of whose members trained interrupts nothing and is left out."""
    return [next((t - lost for _, t, g in commits if t > lost and g > generation), math.nan)
            for _, lost, generation, training in kills if training]


def replay_kept_run(run: Path) -> dict[str, Any]:
    """The costs file of a run that ``bamboo_nodes.py --out`` kept, built again from what it recorded
    (``commits.json`` and the ``replay_costs.json`` it wrote): the replay's model applied anew to old runs
    after a change of how a cost is measured, without running them again."""
    written = json.loads((run / "replay_costs.json").read_text())
    kept = json.loads((run / "commits.json").read_text())
    commits = [(int(step), float(t), int(g)) for step, t, g in kept["commits"]]
    kills = [(int(h), float(t), int(g), bool(training)) for h, t, g, training in kept["kills"]]
    recorded = written["generations"]
    gens = generations(commits, {int(g): v["shape"] for g, v in recorded.items()},
                       {int(g): int(v["members"]) for g, v in recorded.items()})
    applied: list[Applied] = []
    for event in written["events"]:  # a machine's workers, one event each, back into one event per machine
        machine, _, worker = event["node"].partition("/")
        members = () if worker.startswith("unregistered") else (int(worker),)
        last = applied[-1] if applied else None
        if last is not None and (last.t_s, last.kind, last.machine) == (event["t_s"], event["kind"], machine):
            applied[-1] = Applied(last.t_s, last.kind, machine, last.members + members)
        else:
            applied.append(Applied(event["t_s"], event["kind"], machine, members))
    initial: dict[str, tuple[int, ...]] = {}
    for node in written["initial_nodes"]:
        machine, _, member = node.partition("/")
        initial[machine] = (*initial.get(machine, ()), int(member))
    removes = [a for a in applied if a.kind == "remove"]
    # the segment's clock: kept since it was recorded, else a kill's time less its event's offset
    start = kept.get("segment_start", kills[0][1] - removes[0].t_s if kills and removes else 0.0)
    live, costs = written["live"]["bamboo"], written["costs"]
    reference = {"costs": {"checkpoint_s": costs["checkpoint_s"], "restart_s": costs["restart_s"]}}
    return replay_costs(gens, applied, initial, failover_times(commits, kills), start, live["wall_s"],
                        live["samples_per_s"], written["samples_per_step"], written["num_stages"],
                        live["recovery"], reference)
