"""Live preemption benchmark: Bamboo vs checkpoint-restart on a time-compressed segment of the AWS p3 trace.

    python benchmarks/bamboo_preemption.py          # full run (~4-5 min), writes benchmarks/results/...
    python benchmarks/bamboo_preemption.py --ci     # tiny: one kill, a few seconds of training per system

Four CPU worker processes (2 stages x 2 pipelines) train the recipe ``experiment=bamboo_gpt_elastic`` (GPT,
same seed, same global batch) while a segment of ``data/spot-traces/aws-p3-trace.csv``, its times divided
by ``--compression``, preempts them:

* **Mapping of the fleet onto 4 workers**: the segment starts with the p3 fleet at ``F0`` nodes; the
  benchmark's worker count is ``fleet - (F0 - 4)``, so each trace removal kills one worker (SIGKILL by PID;
  which one is drawn with ``--seed`` among the live ones) and each add starts one (never above 4).
* **Bamboo**: ``lightning_bamboo.control.supervisor.Supervisor`` over ``BambooStrategy`` workers; kills fail
  over inside the same ``fit``; an add starts a replacement that joins the running job
  (``Supervisor.add_worker``,
  when the runtime has it; otherwise the add is not applied and the JSON says ``rejoins: 0``).
* **Checkpoint-restart** (the strongest baseline: torchrun-style restarts + Young/Daly checkpoints): the plain
  ``BambooStrategy`` without redundancy, ``floor(n/2)`` pipelines on the ``n`` live workers. It checkpoints
  (sharded, atomic) every ``sqrt(2 * C * MTBF)`` seconds of training, ``C`` the median cost of its checkpoints
  so far in this run (the first right after the warm-up) and ``MTBF`` = window / removals of the segment. A
  removal of an active worker stops every process, relaunches at the new size and reloads the last
  checkpoint (the steps since are lost); an add that grows the layout checkpoints, stops and relaunches
  (nothing lost); losing an idle worker costs nothing.

Both systems run for the same window (the compressed segment), timed from their second completed step (so
neither pays its first start-up; every later restart is paid). Progress is the global step reached, so work
lost to a restart is not counted. Workers append every completed step to files; everything below comes from
them. Last line, exactly::

    vs_checkpoint_restart=<bamboo samples/s / checkpoint-restart samples/s> failover_s=<median s from kill to
    next completed step> step_s=<mean failure-free step s, 2x2>

(one line). ``--recovery`` picks Bamboo's mode (default: the strategy's, ``"replica"``). The JSON (``--out``)
is what ``lightning_bamboo.simulate`` reads (schema: docs/bamboo-replay.md); it names the mode
(``recovery``), the command, commit and machine it was measured on.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_bamboo.control.supervisor import Supervisor
from lightning_bamboo.layout.ownership import RECOVERY_MODES
from lightning_bamboo.protocol import store as ms
from lightning_bamboo.simulate.traces import parse_trace

try:  # imported as ``benchmarks.bamboo_preemption`` (the tests, bamboo_nodes.py: the checkout on sys.path)
    from benchmarks import _harness
    from benchmarks import preemption_timeline as timeline
    from benchmarks._young_daly import request_drain
except ImportError:  # run as a script: its own directory is first on sys.path
    import _harness  # type: ignore[no-redef]
    import preemption_timeline as timeline  # type: ignore[no-redef]
    from _young_daly import request_drain  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[1]

TRACE = "data/spot-traces/aws-p3-trace.csv"
WORKER = Path(__file__).with_name("preemption_worker.py")
STAGES, WORKERS, BATCH, MICROBATCHES = 2, 4, 16, 4
DEFAULT_RECOVERY = "replica"  # BambooStrategy's default (lightning_bamboo.runtime.parts.resolve_recovery)
WARMUP_STEPS = 2  # the window starts when this step completes (preemption_worker.WARMUP_STEPS)
FULL = {"segment_ms": (9_630_000, 10_650_000), "compression": 10.0}
"""p3 at 2.67-2.96 h: the fleet is 32, loses one node, regains it, twice (MTBF 510 s, the trace's mean is
520 s); compressed 10x the window is 102 s per system."""
CI = {"segment_ms": (9_780_000, 9_900_000), "compression": 20.0}
"""One removal (p3 at 2.73 h), 6 s per system."""


@dataclass
class Plan:
    """The compressed segment as the benchmark applies it: ``(t_s, kind, node)`` from the window start."""

    events: list[tuple[float, str, str]]
    window_s: float
    initial: list[str]
    fleet_start: int

    @property
    def removals(self) -> int:
        return len({t for t, kind, _ in self.events if kind == "remove"})


def make_plan(
    trace_path: Path, start_ms: int, end_ms: int, compression: float, seed: int, units: int = WORKERS
) -> Plan:
    """Map the segment's fleet changes onto ``units`` workers (or machines: ``bamboo_nodes.py``), see the
    module docstring."""
    trace = parse_trace(trace_path)
    fleet = fleet_start = trace.nodes_at(start_ms / 1000.0)
    rng = random.Random(seed)
    alive = [f"m{i}" for i in range(units)]
    initial = list(alive)
    fresh = units
    events: list[tuple[float, str, str]] = []
    count = units
    for event in trace.events:
        if not start_ms / 1000.0 < event.t_s <= end_ms / 1000.0:
            continue
        t = (event.t_s - start_ms / 1000.0) / compression
        fleet += 1 if event.kind == "add" else -1
        if event.kind == "remove" and alive:
            victim = rng.choice(alive)
            alive.remove(victim)
            events.append((t, "remove", victim))
            count -= 1
        elif event.kind == "add" and count < units:
            node = f"m{fresh}"
            fresh += 1
            alive.append(node)
            events.append((t, "add", node))
            count += 1
    return Plan(events, (end_ms - start_ms) / 1000.0 / compression, initial, fleet_start)


# ---------------------------------------------------------------------------------------------- step files
def read_steps(paths: list[Path]) -> list[tuple[int, float, str, str]]:
    """``(global_step, time, layout, source)`` of every completed step in ``paths``, in time order."""
    rows = []
    for path in paths:
        for line in path.read_text().splitlines():
            step, t, layout = line.split()
            rows.append((int(step), float(t), layout, path.stem))
    return sorted(rows, key=lambda r: r[1])


def progress_at(rows: list[tuple[int, float, str, str]], t: float) -> int:
    """The global step reached by time ``t`` (the last step completed at or before it)."""
    step = 0
    for s, when, _, _ in rows:
        if when > t:
            break
        step = s
    return step


def first_completion(rows: list[tuple[int, float, str, str]]) -> dict[int, tuple[float, str]]:
    """Per step, its first completion on any worker (Bamboo: every member logs every step)."""
    out: dict[int, tuple[float, str]] = {}
    for s, t, layout, _ in rows:
        if s not in out:
            out[s] = (t, layout)
    return out


def step_times(rows: list[tuple[int, float, str, str]], quiet: list[tuple[float, float]]) -> dict[str, float]:
    """Mean failure-free step time per layout — a throughput is samples over the *mean* step (slow steps are
    paid too; the median prices a step faster than the run's): consecutive steps of one source with the same
    layout and no event (kill, add, restart, checkpoint) inside ``(t_prev, t]`` (``quiet`` lists those)."""
    by_source: dict[str, list[tuple[int, float, str]]] = {}
    for s, t, layout, source in rows:
        by_source.setdefault(source, []).append((s, t, layout))
    samples: dict[str, list[float]] = {}
    for seq in by_source.values():
        for (s0, t0, l0), (s1, t1, l1) in itertools.pairwise(seq):
            if s1 != s0 + 1 or l0 != l1 or s0 < WARMUP_STEPS:
                continue
            if any(a < t1 and b > t0 for a, b in quiet):
                continue
            samples.setdefault(l1, []).append(t1 - t0)
    return {layout: statistics.fmean(v) for layout, v in samples.items() if len(v) >= 3}


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(0.02)


def window_start(run_dir: Path, pattern: str) -> float | None:
    """Wall time at which some worker completed step ``WARMUP_STEPS``."""
    for path in run_dir.glob(pattern):
        for line in path.read_text().splitlines():
            step, t, _ = line.split()
            if int(step) >= WARMUP_STEPS:
                return float(t)
    return None


def worker_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    for threads in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[threads] = "1"
    for inherited in ("LOCAL_RANK", "WORLD_SIZE", "RANK", "NODE_RANK", "BAMBOO_FAULT"):
        env.pop(inherited, None)
    return env


# ---------------------------------------------------------------------------------------------- bamboo
@dataclass
class Live:
    """What one system did in its window."""

    t0: float = 0.0
    applied: list[dict[str, Any]] = field(default_factory=list)
    restarts: list[dict[str, Any]] = field(default_factory=list)  # checkpoint-restart only
    joins: list[dict[str, Any]] = field(default_factory=list)  # bamboo: the supervisor's completed joins
    kills: list[float] = field(default_factory=list)  # bamboo: kills of a member of the map (failovers)
    added_at: dict[int, float] = field(default_factory=dict)  # bamboo: member -> wall time of its add
    drain_after_s: float | None = None  # checkpoint-restart: a drain measured after the window (none in it)
    log: str = ""


def add_replacement(sup: Supervisor) -> int | None:
    """The seam for rejoin: start a worker that joins the running job; ``None`` when the runtime cannot."""
    add = getattr(sup, "add_worker", None)
    return add() if callable(add) else None


def run_bamboo(plan: Plan, run_dir: Path, overrides: list[str], rejoin: bool, log: Any,
               recovery: str = DEFAULT_RECOVERY) -> Live:
    """The elastic job under its supervisor (``BambooStrategy(recovery=recovery)``), preempted by ``plan``
    (kills by PID, replacements)."""
    command = [
        sys.executable, str(WORKER), "--system", "bamboo", "--run-dir", str(run_dir), "--batch", str(BATCH),
        "--microbatches", str(MICROBATCHES), "--stages", str(STAGES), "--recovery", recovery, *overrides,
    ]
    # the supervisor's workers inherit this environment: one thread each, this checkout's code first
    os.environ.update({k: v for k, v in worker_env().items() if k.endswith("_THREADS") or k == "PYTHONPATH"})
    lines: list[str] = []
    sup = Supervisor(
        command, WORKERS, hang_timeout=10.0, log=lambda *a, **k: lines.append(" ".join(map(str, a)))
    )
    thread = threading.Thread(target=sup.run, name="bamboo-supervisor", daemon=True)
    thread.start()
    live = Live()
    node_member = {f"m{i}": i for i in range(WORKERS)}
    try:
        wait_for(lambda: window_start(run_dir, "steps-member*.txt") is not None, 600, "bamboo's first steps")
        live.t0 = window_start(run_dir, "steps-member*.txt")  # type: ignore[assignment]
        for t, kind, node in plan.events:
            time.sleep(max(0.0, live.t0 + t - time.time()))
            now = time.time()
            if kind == "remove":
                running = [n for n, m in node_member.items() if sup.workers[m].proc.poll() is None]
                victim = node if node in running else (sorted(running)[0] if running else None)
                if victim is None:
                    continue
                generation = ms.current_generation(sup.store)
                member_of_map = node_member[victim] in ms.read_map(sup.store, generation).members()
                sup.kill(node_member[victim])
                live.applied.append({"t_s": now - live.t0, "kind": "remove", "node": victim})
                if member_of_map:
                    live.kills.append(now)
                log(f"[bench] bamboo t={now - live.t0:6.2f}s kill {victim} (member {node_member[victim]})")
            elif rejoin:
                member = add_replacement(sup)
                if member is None:
                    log(f"[bench] bamboo t={now - live.t0:6.2f}s add {node}: no rejoin in runtime, skipped")
                    continue
                node_member[node] = member
                live.added_at[member] = now
                live.applied.append({"t_s": now - live.t0, "kind": "add", "node": node})
                log(f"[bench] bamboo t={now - live.t0:6.2f}s add {node} (member {member})")
            else:
                log(f"[bench] bamboo t={now - live.t0:6.2f}s add {node}: not applied (--no-rejoin)")
        time.sleep(max(0.0, live.t0 + plan.window_s - time.time()))
        # the window is over (progress is read at its end); a replacement still starting is let join so that
        # the join's costs are measured too (as checkpoint-restart's last relaunch is)
        added = [m for n, m in node_member.items() if n not in plan.initial]
        pending = [m for m in added if sup.workers[m].proc.poll() is None]

        def joined() -> bool:
            done = {m for j in getattr(sup, "joins", []) for m in j["members"]}
            return all(m in done or sup.workers[m].proc.poll() is not None for m in pending)

        try:
            wait_for(joined, 180, "the pending joins")
        except TimeoutError as err:
            log(f"[bench] bamboo: {err}; their cost is not measured")
        live.joins = [dict(j) for j in getattr(sup, "joins", [])]
    finally:
        sup.stop_all()
        thread.join(timeout=30)
        live.log = "\n".join(lines)
    return live


# ------------------------------------------------------------------------------------ checkpoint-restart
class CheckpointRestart:
    """Launches ``floor(n/2) * 2`` plain-Bamboo processes as torchrun would; stops and relaunches them."""

    def __init__(self, run_dir: Path, mtbf_s: float, overrides: list[str], log: Any) -> None:
        self.run_dir = run_dir
        self.mtbf_s = mtbf_s
        self.overrides = overrides
        self.log = log
        self.procs: list[subprocess.Popen[bytes]] = []
        self.launches = 0
        self.pipelines = 0

    def launch(self, pipelines: int) -> None:
        self.pipelines = pipelines
        if pipelines == 0:
            return
        world = pipelines * STAGES
        port = str(_harness.free_port())
        out = (self.run_dir / f"launch{self.launches}.log").open("wb")
        for rank in range(world):
            env = {**worker_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(world),
                   "LOCAL_RANK": str(rank), "NODE_RANK": "0", "BENCH_LAUNCH": str(self.launches)}
            self.procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), "--system", "checkpoint_restart",
                 "--run-dir", str(self.run_dir), "--batch", str(BATCH),
                 "--microbatches", str(MICROBATCHES), "--stages", str(STAGES),
                 "--mtbf-s", f"{self.mtbf_s:.6f}", *self.overrides],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            ))
        self.launches += 1

    def kill_all(self) -> None:
        _harness.kill_groups(self.procs)  # each rank runs in a session of its own
        self.procs = []

    def training(self) -> bool:
        """Whether the current launch has completed a step (it is past start-up and reload)."""
        path = self.run_dir / f"steps-launch{self.launches - 1}-rank0.txt"
        return self.pipelines > 0 and path.exists() and path.stat().st_size > 0

    def drain(self, timeout: float = 60.0) -> bool:
        """Checkpoint now and exit cleanly (a grow restart loses nothing). A launch still starting has
        trained nothing since the checkpoint it is loading: it is stopped at once. Returns whether it
        drained (``False``: stopped at once)."""
        if not self.training():
            self.kill_all()
            return False
        request_drain(self.run_dir, self.procs, timeout)
        self.kill_all()
        return True


def run_checkpoint_restart(
    plan: Plan, run_dir: Path, overrides: list[str], log: Any, measure_after: bool = True
) -> Live:
    cr = CheckpointRestart(run_dir, plan.window_s / max(plan.removals, 1), overrides, log)
    alive = list(plan.initial)
    live = Live()
    cr.launch(len(alive) // STAGES)
    try:
        wait_for(lambda: window_start(run_dir, "steps-launch0-*.txt") is not None, 600, "the first steps")
        live.t0 = window_start(run_dir, "steps-launch0-*.txt")  # type: ignore[assignment]
        for t, kind, node in plan.events:
            time.sleep(max(0.0, live.t0 + t - time.time()))
            now = time.time()
            active = alive[: cr.pipelines * STAGES]
            if kind == "remove":
                alive.remove(node)
                live.applied.append({"t_s": now - live.t0, "kind": "remove", "node": node})
                if node not in active:
                    log(f"[bench] checkpoint-restart t={now - live.t0:6.2f}s {node} (idle) lost: no restart")
                    continue
                cr.kill_all()
                start, why, drained = now, "kill", False
            else:
                alive.append(node)
                live.applied.append({"t_s": now - live.t0, "kind": "add", "node": node})
                if len(alive) // STAGES <= cr.pipelines:
                    log(f"[bench] checkpoint-restart t={now - live.t0:6.2f}s {node} added as a standby")
                    continue
                drained = cr.drain()
                start, why = now, "grow"
            stopped = time.time()
            cr.launch(len(alive) // STAGES)
            live.restarts.append({  # type: ignore[arg-type]
                "t_s": start - live.t0, "launch": cr.launches - 1, "why": why, "drained": drained,
                "stopped_s": stopped - live.t0, "launched_s": time.time() - live.t0,
                "layout": f"{STAGES}x{cr.pipelines}",
            })
            log(f"[bench] checkpoint-restart t={start - live.t0:6.2f}s {why} {node}: relaunch "
                f"{cr.pipelines} pipeline(s) ({time.time() - start:.2f}s to stop)")
        time.sleep(max(0.0, live.t0 + plan.window_s - time.time()))
        # the window is over (progress is read at its end); a relaunch still starting is let run to its
        # first step so that its restart cost is measured too
        if measure_after and cr.pipelines and not cr.training():
            try:
                wait_for(cr.training, 180, "the last relaunch's first step")
            except TimeoutError as err:
                log(f"[bench] checkpoint-restart: {err}; its restart cost is not measured")
        # a grow's drain (boundary, checkpoint, exit) is a cost the replay prices: when no grow of the window
        # found a launch training (all were still starting under load), one drain is measured after it
        if measure_after and not any(r["drained"] for r in live.restarts) and cr.training():
            start = time.time()
            if cr.drain():
                live.drain_after_s = time.time() - start
                log(f"[bench] checkpoint-restart: no drain in the window; one after it took "
                    f"{live.drain_after_s:.2f}s")
    finally:
        cr.kill_all()
    return live


# ---------------------------------------------------------------------------------------------- figures
def joined_at(bamboo: Live, join: dict[str, Any]) -> float:
    """Wall time at which a join completed (its first step at the new size)."""
    added = max(bamboo.added_at[m] for m in join["members"])
    return added + float(join["start_s"]) + float(join["join_s"])


def step_s_of(layouts: dict[str, float], stages: int, workers: int) -> float:
    return layouts.get(f"{stages}x{workers // stages}", 0.0)


def measure(plan: Plan, run_dir: Path, bamboo: Live, crl: Live, compression: float, segment: tuple[int, int],
            overrides: list[str]) -> dict[str, Any]:
    b_rows = read_steps(sorted((run_dir / "bamboo").glob("steps-member*.txt")))
    c_rows = read_steps(sorted((run_dir / "cr").glob("steps-launch*-rank0.txt")))
    b_end, c_end = bamboo.t0 + plan.window_s, crl.t0 + plan.window_s
    b_steps = progress_at(b_rows, b_end) - progress_at(b_rows, bamboo.t0)
    c_steps = progress_at(c_rows, c_end) - progress_at(c_rows, crl.t0)
    # failover: kill -> next completed step (a step's first completion on any member)
    b_times = sorted(t for t, _ in first_completion(b_rows).values())
    kills = bamboo.kills  # kills of a worker still starting (not yet joined) are no failover
    adds = [bamboo.t0 + e["t_s"] for e in bamboo.applied if e["kind"] == "add"]
    failovers = [next(t for t in b_times if t > k) - k for k in kills if any(t > k for t in b_times)]
    b_quiet = [(k, next((t for t in b_times if t > k), k) + 1e-9) for k in kills + adds]
    b_layouts = step_times(b_rows, b_quiet)
    # rejoin: the supervisor's own measure of each completed join (the old layout trains meanwhile):
    # start_s (add -> the new process registered), wait_s (-> the step boundary), join_s (-> first step at
    # the new size). The replay keeps training start_s + wait_s, then pauses join_s - wait_s.
    rejoins = [float(j["join_s"]) - float(j["wait_s"]) for j in bamboo.joins]
    rejoin_delays = [float(j["start_s"]) + float(j["wait_s"]) for j in bamboo.joins]
    # checkpoint-restart: checkpoints, restarts
    ckpts = [line.split() for line in (run_dir / "cr" / "checkpoints.txt").read_text().splitlines()] \
        if (run_dir / "cr" / "checkpoints.txt").exists() else []
    ckpt_costs = [float(c[2]) for c in ckpts]
    checkpoint_s = statistics.median(ckpt_costs) if ckpt_costs else 0.0
    c_quiet = [(float(c[1]) - float(c[2]) - 1e-3, float(c[1]) + 1e-3) for c in ckpts]
    c_quiet += [(crl.t0 + r["t_s"], crl.t0 + r["t_s"] + 1e-3) for r in crl.restarts]
    c_layouts = step_times(c_rows, c_quiet)
    restart_costs = []
    lost_steps = 0  # trained, then lost to a kill (the next launch that trains resumes from a checkpoint)
    for r in crl.restarts:
        later = [row for row in c_rows if int(row[3].split("-")[1][6:]) >= r["launch"]]
        if r["why"] == "kill" and later:
            lost_steps += max(0, progress_at(c_rows, crl.t0 + r["t_s"]) - (later[0][0] - 1))
    for r in crl.restarts:
        rows = [row for row in c_rows if row[3] == f"steps-launch{r['launch']}-rank0"]
        if not rows:
            continue
        first, layout = rows[0][1], rows[0][2]
        cost = first - (crl.t0 + r["t_s"]) - c_layouts.get(layout, 0.0)
        restart_costs.append(cost - (checkpoint_s if r["why"] == "grow" else 0.0))
    # where each restart's time goes (benchmarks/preemption_timeline.py); the warm-up after failovers, joins
    ckpt_marks = [(float(c[1]), float(c[2])) for c in ckpts]
    restart_each = timeline.restart_records(
        run_dir / "cr", crl.t0, crl.restarts, c_rows, ckpt_marks, c_layouts
    )
    for rec in restart_each:
        rec["stop_kind"] = "drain" if rec["drained"] else "kill"
    after = [{"stop_kind": "drain", "stop_s": crl.drain_after_s}] if crl.drain_after_s is not None else []
    stops = restart_each + after
    resumed = [next(t for t in b_times if t > k) for k in kills if any(t > k for t in b_times)]
    joins_done = [joined_at(bamboo, j) for j in bamboo.joins if j["members"][0] in bamboo.added_at]
    marks = sorted([bamboo.t0 + e["t_s"] for e in bamboo.applied] + [b_end])
    ends = [next(m for m in marks if m > t + 1e-9) if any(m > t + 1e-9 for m in marks) else t
            for t in resumed + joins_done]
    b_warm = timeline.event_warmups(b_rows, resumed + joins_done, ends, b_layouts)
    failover_warm, join_warm = b_warm[: len(resumed)], b_warm[len(resumed):]
    start_warm = {
        "bamboo": timeline.warmup_excess(
            sorted(t for t, _ in first_completion(b_rows).values() if t >= bamboo.t0),
            step_s_of(b_layouts, STAGES, WORKERS), (), min(marks)),
        "checkpoint_restart": timeline.warmup_excess(
            [r[1] for r in c_rows if r[3] == "steps-launch0-rank0" and r[1] >= crl.t0],
            step_s_of(c_layouts, STAGES, WORKERS), ckpt_marks,
            crl.t0 + crl.restarts[0]["t_s"] if crl.restarts else c_end),
    }
    interval = json.loads((run_dir / "cr" / "interval.json").read_text()) \
        if (run_dir / "cr" / "interval.json").exists() else {}
    step_s = b_layouts.get(f"{STAGES}x{WORKERS // STAGES}", 0.0)
    by_layout = {k: v for k, v in b_layouts.items() if "x" in k}
    by_shape = {k: v for k, v in b_layouts.items() if "+" in k}
    b_sps = b_steps * BATCH / plan.window_s
    c_sps = c_steps * BATCH / plan.window_s
    return {
        "schema": 2,
        "trace": TRACE,
        "segment": {"start_ms": segment[0], "end_ms": segment[1]},
        "compression": compression,
        "mapping": f"the p3 fleet starts the segment at {plan.fleet_start} nodes; workers = fleet - "
                   f"{plan.fleet_start - WORKERS} (each removal kills one worker, drawn with the seed; "
                   "each add starts one, at most 4)",
        "events": [{"t_s": round(t, 3), "kind": k, "node": n} for t, k, n in plan.events],
        "initial_nodes": plan.initial,
        "num_stages": STAGES,
        "max_pipelines": WORKERS // STAGES,
        "samples_per_step": BATCH,
        "model": "recipe experiment=bamboo_gpt_elastic (GPT gpt_tiny) " + " ".join(overrides),
        "costs": {
            "step_s": step_s,
            "step_s_by_layout": by_layout,
            "step_s_by_shape": by_shape,
            "checkpoint_restart_step_s_by_layout": c_layouts,
            "failover_s": statistics.median(failovers) if failovers else None,
            "rejoin_s": statistics.median(rejoins) if rejoins else None,
            "rejoin_delay_s": statistics.median(rejoin_delays) if rejoin_delays else None,
            "checkpoint_s": checkpoint_s,
            "restart_s": statistics.median(restart_costs) if restart_costs else None,
            "fallback_s": None,
            "restart_stop_s": timeline.median_by(stops, "stop_kind", "stop_s"),
            "relaunch_s_by_layout": timeline.median_by(restart_each, "layout", "relaunch_s"),
            "relaunch_warmup_s_by_layout": timeline.median_by(restart_each, "layout", "warmup_s"),
            "failover_warmup_s": timeline.median_of(failover_warm, "warmup_s"),
            "rejoin_warmup_s": timeline.median_of(join_warm, "warmup_s"),
            "warmup_window_steps": timeline.WARMUP_WINDOW,
        },
        "live": {
            "bamboo": {
                "wall_s": plan.window_s, "samples": b_steps * BATCH, "samples_per_s": b_sps,
                "failovers": len(kills), "fallbacks": 0,
                "rejoins": sum(1 for j in bamboo.joins if joined_at(bamboo, j) <= b_end),
                "events": bamboo.applied, "failover_s_each": failovers, "rejoin_s_each": rejoins,
                "joins": bamboo.joins, "failover_warmup_each": failover_warm, "rejoin_warmup_each": join_warm,
                "start_warmup": start_warm["bamboo"],
            },
            "checkpoint_restart": {
                "wall_s": plan.window_s, "samples": c_steps * BATCH, "samples_per_s": c_sps,
                "restarts": len(crl.restarts), "checkpoint_interval_s": interval.get("interval_s", 0.0),
                "checkpoints": sum(1 for c in ckpts if float(c[1]) <= c_end), "events": crl.applied,
                "lost_s": lost_steps * c_layouts.get(f"{STAGES}x{WORKERS // STAGES}", 0.0),
                "lost_steps": lost_steps, "restart_s_each": restart_costs, "checkpoint_s_each": ckpt_costs,
                "restart_each": restart_each, "start_warmup": start_warm["checkpoint_restart"],
                "drain_after_window_s": crl.drain_after_s,
            },
        },
        "load_average": os.getloadavg(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ci", action="store_true", help="tiny run: one kill, seconds per system")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON output (default: benchmarks/results/bamboo_preemption.json; --ci: none)")
    parser.add_argument("--compression", type=float, default=None, help="trace seconds per benchmark second")
    parser.add_argument("--segment", default=None, help="START_MS:END_MS of the p3 trace")
    parser.add_argument("--seed", type=int, default=0, help="which worker each removal kills")
    parser.add_argument("--no-rejoin", action="store_true", help="do not start replacements")
    parser.add_argument("--keep", type=Path, default=None, help="keep the run directory here")
    parser.add_argument("--remeasure", type=Path, default=None,
                        help="recompute the figures from a run directory kept with --keep (runs nothing)")
    parser.add_argument("--recovery", choices=RECOVERY_MODES, default=DEFAULT_RECOVERY,
                        help="Bamboo's BambooStrategy(recovery=...) (default: the strategy's default)")
    parser.add_argument("overrides", nargs="*", help="recipe overrides (both systems), e.g. model.n_layer=4")
    args = parser.parse_args()
    # workers run in their own sessions: a SIGTERM unwinds through the ``finally`` blocks that kill them
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    preset = CI if args.ci else FULL
    compression = args.compression or preset["compression"]
    segment = tuple(int(x) for x in args.segment.split(":")) if args.segment else preset["segment_ms"]
    if len(segment) != 2 or segment[1] <= segment[0]:
        raise SystemExit(f"--segment must be START_MS:END_MS with END_MS > START_MS, got {args.segment!r}")
    plan = make_plan(REPO / TRACE, segment[0], segment[1], compression, args.seed)
    default_out = None if args.ci else REPO / "benchmarks/results/bamboo_preemption.json"
    out = args.out if args.out is not None else default_out
    print(f"segment {segment[0]}-{segment[1]} ms of {TRACE}, compression {compression:g}: window "
          f"{plan.window_s:.1f} s, events {[(round(t, 2), k, n) for t, k, n in plan.events]}", flush=True)
    log = lambda line: print(line, flush=True)  # noqa: E731
    started = time.time()
    if args.remeasure is not None:  # the same run's files, measured again (e.g. after a fix to measure())
        tmp = args.remeasure
        kept = json.loads((tmp / "live.json").read_text())
        bamboo, crl = Live(**kept["bamboo"]), Live(**kept["cr"])
        bamboo.added_at = {int(k): v for k, v in bamboo.added_at.items()}
    else:
        tmp = Path(tempfile.mkdtemp(prefix="bamboo_preemption_")) if args.keep is None else args.keep
        (tmp / "bamboo").mkdir(parents=True, exist_ok=True)
        (tmp / "cr").mkdir(parents=True, exist_ok=True)
        bamboo = run_bamboo(plan, tmp / "bamboo", args.overrides, not args.no_rejoin, log, args.recovery)
        (tmp / "bamboo" / "supervisor.log").write_text(bamboo.log)
        crl = run_checkpoint_restart(plan, tmp / "cr", args.overrides, log, measure_after=not args.ci)
        kept = {"bamboo": vars(bamboo), "cr": vars(crl), "load_average": os.getloadavg(),
                "benchmark_wall_s": time.time() - started, "recovery": args.recovery,
                "provenance": _harness.provenance()}
        (tmp / "live.json").write_text(json.dumps(kept))
    try:
        result = measure(plan, tmp, bamboo, crl, compression, segment, args.overrides)  # type: ignore[arg-type]
    finally:
        if args.remeasure is None and args.keep is None:
            shutil.rmtree(tmp, ignore_errors=True)  # a temporary run directory: --keep DIR keeps one
    result["load_average"] = kept.get("load_average", result["load_average"])
    result["benchmark_wall_s"] = kept.get("benchmark_wall_s")
    # the mode Bamboo ran (what the replay prices by default), and the commit and machine it ran on
    result["recovery"] = kept.get("recovery", "replica+forward")  # runs kept before it was recorded: FR
    result["live"]["bamboo"]["recovery"] = result["recovery"]
    result.update(kept.get("provenance") or _harness.provenance())
    live = result["live"]
    cr = live["checkpoint_restart"]
    print(f"bamboo: {live['bamboo']['samples']} samples in {plan.window_s:.1f} s "
          f"({live['bamboo']['samples_per_s']:.1f}/s), failovers {live['bamboo']['failovers']} "
          f"{[round(x, 2) for x in live['bamboo']['failover_s_each']]}, rejoins {live['bamboo']['rejoins']}")
    costs = result["costs"]
    print(f"checkpoint-restart: {cr['samples']} samples ({cr['samples_per_s']:.1f}/s), restarts "
          f"{cr['restarts']} {[round(x, 2) for x in cr['restart_s_each']]}, checkpoints {cr['checkpoints']} "
          f"every {cr['checkpoint_interval_s']:.2f} s (cost {costs['checkpoint_s']:.3f} s)")
    where = tmp if (args.keep or args.remeasure) else "removed (--keep DIR keeps it)"
    print(f"step_s by layout: bamboo {costs['step_s_by_layout']} {costs['step_s_by_shape']}, "
          f"checkpoint-restart {costs['checkpoint_restart_step_s_by_layout']}; load average "
          f"{result['load_average']}; run dir {where}")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
    c_sps = live["checkpoint_restart"]["samples_per_s"]
    ratio = live["bamboo"]["samples_per_s"] / c_sps if c_sps > 0 else float("inf")
    failover = costs["failover_s"] if costs["failover_s"] is not None else float("nan")
    print(f"vs_checkpoint_restart={ratio:.2f} failover_s={failover:.2f} step_s={costs['step_s']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
