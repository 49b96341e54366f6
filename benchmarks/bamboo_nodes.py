"""Multi-machine Bamboo under a spot trace: whole machines lost and replaced, timed from a loss to the next
committed step.

3 machines as Linux network namespaces (``tests/netns.py``; needs root and iproute2), etcd on the bridge
address of the root namespace, one ``python -m lightning_bamboo.launch --nnodes 3:3 --nproc-per-node 2``
agent per machine over ``tests/bamboo/scripts/train_elastic.py`` (``PipeMLP``, float64, 2 stages x 3
pipelines, gloo over each machine's ``eth0``). A segment of the AWS p3 trace, its times divided by
``--compression``, is applied per machine exactly as ``bamboo_preemption.py`` applies it per worker
(``make_plan`` with 3 units: each removal SIGKILLs a whole machine, every process of its namespace by PID,
the victim drawn with ``--seed``; each addition starts a replacement machine, a new namespace whose agent
joins the running job). The default segment (p3 at 2.67-2.96 h: the fleet loses a node and regains it,
twice) gives two machine losses and two replacements. The benchmark watches the job's commits in etcd
(``g{g}/outcome/{step}``, an etcd watch) from the root namespace, and compares the final parameters and
optimizer state with the uninterrupted single-process run on the same batches. A failover is timed from the
kill to the first step committed by a later generation. A machine none of whose members trained when it was
lost (a replacement taken before its workers joined) interrupts nothing: it counts in ``nodes_lost`` but
not in ``node_failover_s`` (its time to the next step is the JSON line's
``not_training_lost_to_next_step_s``).
The lease (``--lease``) bounds a failover from above: a machine lost silently is found when its agent is
probed after a missed renewal (its processes died) or when its lease expires (it is gone whole).

    sudo python benchmarks/bamboo_nodes.py [--steps 2000] [--lease 3] [--compression 10] [--seed 0] \
        [--no-trace] [--out DIR]

``--out DIR`` keeps the agents' logs and ``commits.json`` (each step's commit time and generation, the
kills). The line before the last is JSON (``final_state_equal`` and ``exit_codes`` apart: ``exact`` needs
both). Last line: ``node_failover_s=<median s from a machine lost to the next committed step> step_s=<median
failure-free step s> nodes_lost=<machines lost> exact=<true|false>``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# kept: this benchmark runs on the test suite's network namespaces and launcher (``tests.netns``,
# ``tests.process``), which no install provides; ``python benchmarks/bamboo_nodes.py`` puts only benchmarks/
# on sys.path (``python -m benchmarks.bamboo_nodes`` from the checkout needs no insert, but sudo usage and the
# docs run the file)
sys.path.insert(0, str(REPO))

import etcd3gw  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from benchmarks._nodes_replay import Applied, failover_times, generations, replay_costs  # noqa: E402
from benchmarks.bamboo_preemption import FULL, TRACE, make_plan  # noqa: E402
from lightning_bamboo.control import machines as mc  # noqa: E402
from lightning_bamboo.protocol import store as ms  # noqa: E402
from lightning_bamboo.simulate.model import shape_key  # noqa: E402
from tests.netns import Network  # noqa: E402
from tests.process import launch_env, run_process  # noqa: E402

SCRIPT = REPO / "tests" / "bamboo" / "scripts" / "train_elastic.py"
TOL = {"rtol": 1e-9, "atol": 1e-11}
MACHINES = 3
WARMUP_STEPS = 2  # the segment's clock starts when this many steps are committed


class Commits(threading.Thread):
    """Watches the job's committed steps in etcd (a watch of the job's step keys, pushed by etcd as they are
    written), with the time each was first seen: no polling that could fall behind a loaded machine or load
    etcd, and the trace's events are applied on time by the main loop whatever the commit rate."""

    OUTCOME = re.compile(r"g(\d+)/outcome/(\d+)$")

    def __init__(self, endpoint: str, job: str) -> None:
        super().__init__(name="commits", daemon=True)
        host, _, port = endpoint.rpartition(":")
        client = etcd3gw.client(host=host, port=int(port))
        # from revision 1: steps committed before the watch was in place are replayed, none is missed
        self._events, self._cancel = client.watch_prefix(f"/bamboo/{job}/g", start_revision=1,
                                                         filters=["NODELETE"])
        self.first: dict[int, tuple[float, int]] = {}  # step -> (time.monotonic() first seen, generation)

    def run(self) -> None:
        for event in self._events:
            now = time.monotonic()
            kv = event["kv"]
            match = self.OUTCOME.search(bytes(kv["key"]).decode())
            if match and bytes(kv.get("value", b"")).startswith(b"commit"):
                self.first.setdefault(int(match[2]), (now, int(match[1])))

    def stop(self) -> None:
        self._cancel()
        self.join(timeout=10)

    @property
    def seen(self) -> list[tuple[int, float, int]]:
        """``(step, time, generation)`` of the steps committed so far without a gap, in step order."""
        out = []
        for step in itertools.count():
            if step not in self.first:
                return out
            out.append((step, *self.first[step]))
        return out


def machine_members(store, agent_pid: int) -> tuple[int, ...]:
    """The members of the machine whose agent is ``agent_pid`` (none while it has not registered)."""
    machine = next((m for m in range(mc.count(store))
                    if (mc.describe(store, m) or {}).get("pid") == agent_pid), None)
    return tuple(mc.members_of(store, machine)) if machine is not None else ()


def trains(store, agent_pid: int, generation: int) -> bool:
    """Whether the machine whose agent is ``agent_pid`` has a member training in ``generation`` (a
    replacement whose workers have not joined yet has none)."""
    if generation < 0:
        return False
    return bool(set(machine_members(store, agent_pid)) & set(ms.read_map(store, generation).members()))


def exact(reference: dict[str, torch.Tensor], out: Path, steps: int) -> bool:
    covered: set[str] = set()
    finals = sorted(out.glob("final_member*.safetensors"))
    for path in finals:
        state = load_file(str(path))
        if int(state.pop("global_step")) != steps:
            return False
        for key, value in state.items():
            if not torch.allclose(value, reference[key], **TOL):
                return False
            covered.add(key)
    return bool(finals) and covered == {k for k in reference if k != "global_step"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="keep the run's files here (default: removed)")
    parser.add_argument("--steps", type=int, default=2000,
                        help="training steps (to outlast the segment, also on a loaded machine)")
    parser.add_argument("--lease", type=float, default=3.0, help="--node-lease of the agents (seconds)")
    parser.add_argument("--segment-ms", type=int, nargs=2, default=FULL["segment_ms"],
                        metavar=("START", "END"), help="the p3 trace segment (ms from the trace start)")
    parser.add_argument("--compression", type=float, default=FULL["compression"])
    parser.add_argument("--seed", type=int, default=0, help="which machine each removal takes")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds the whole run may take")
    parser.add_argument("--stages", type=int, choices=[2, 3], default=2,
                        help="2: 2 stages x 3 pipelines (a machine holds a whole pipeline); 3: 3 x 2 (a "
                             "machine holds stages of both pipelines, so recovery modes differ)")
    parser.add_argument("--recovery", choices=["replica", "replica+forward", "peers"], default=None,
                        help="BambooStrategy(recovery=...) (default: the script's 'replica+forward')")
    parser.add_argument("--no-trace", action="store_true",
                        help="apply none of the segment's events: a failure-free run, whose full-layout step "
                             "is the median over all its steps (the step without the trace's noise)")
    args = parser.parse_args()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        run(args, args.out)
        return
    with tempfile.TemporaryDirectory(prefix="bamboo-nodes-") as work:
        run(args, Path(work))


def global_batch(stages: int) -> int:
    """The job's global batch: 2 micro-batches of 2 samples per pipeline of ``MACHINES`` x 2 workers."""
    return 4 * (MACHINES * 2 // stages)


def run(args: argparse.Namespace, work: Path) -> None:
    plan = make_plan(REPO / TRACE, *args.segment_ms, args.compression, args.seed, units=MACHINES)
    batch = global_batch(args.stages)
    train = ["--stages", str(args.stages), "--steps", str(args.steps), "--batch-size", str(batch)]
    if args.recovery is not None:
        train += ["--recovery", args.recovery]
    run_process([sys.executable, str(SCRIPT), "--out", str(work / "reference"), "--strategy", "auto", *train],
                timeout=args.timeout)
    reference = load_file(str(work / "reference" / "final_reference.safetensors"))

    out = work / "run"
    out.mkdir(exist_ok=True)
    kills: list[tuple[int, float, int]] = []  # (machine, time.monotonic(), generation then)
    added = 0
    with Network(MACHINES) as net:
        etcd = net.serve_etcd(work / "etcd")
        store = ms.connect(f"etcd://{etcd}", "bench", timeout=30)
        procs, logs = {}, []

        def start_agent(host) -> None:
            cmd = [sys.executable, "-m", "lightning_bamboo.launch", "--nnodes", f"{MACHINES}:{MACHINES}",
                   "--nproc-per-node", "2", "--rdzv-endpoint", f"etcd://{etcd}", "--job-id", "bench",
                   "--node-lease", str(args.lease), str(SCRIPT), "--out", str(out), *train]
            logs.append((out / f"agent_h{host.index}.log").open("w"))
            procs[host.index] = net.popen(host, cmd, env=launch_env({"GLOO_SOCKET_IFNAME": host.interface}),
                                          stdout=logs[-1])

        for host in net.hosts:
            start_agent(host)
            if host.index == 0:  # the first to register is machine 0 and the coordinator
                while mc.coordinator(store) is None:
                    time.sleep(0.05)
        while not store.check([mc.CLOSED]):
            time.sleep(0.05)
        host_of = {}  # the plan's node names (m0, m1, .. then replacements) -> their namespace
        for machine in range(MACHINES):
            pid = int((mc.describe(store, machine) or {})["pid"])  # type: ignore[arg-type]
            host_of[f"m{machine}"] = next(h for h in net.hosts if procs[h.index].pid == pid)
        commits = Commits(etcd, "bench")
        commits.start()
        events = [] if args.no_trace else list(plan.events)
        applied: list[tuple[float, str, str, bool]] = []  # (monotonic time, kind, plan name, training)
        deadline = time.monotonic() + args.timeout
        window_start: float | None = None
        killed: set[int] = set()
        while time.monotonic() < deadline:
            live = [i for i, proc in procs.items() if i not in killed]
            if all(procs[i].poll() is not None for i in live):
                break
            if window_start is None and len(commits.seen) >= WARMUP_STEPS:
                window_start = time.monotonic()
            while window_start is not None and events and time.monotonic() - window_start >= events[0][0]:
                _, kind, node = events.pop(0)
                if kind == "remove":
                    host = host_of[node]
                    generation = ms.current_generation(store)
                    training = trains(store, procs[host.index].pid, generation)
                    net.kill_host(host)
                    now = time.monotonic()
                    applied.append((now, kind, node, training))
                    killed.add(host.index)
                    kills.append((host.index, now, generation, training))
                    print(f"[bench] step {len(commits.seen)}: machine {node} (host {host.index}) killed",
                          flush=True)
                else:
                    host_of[node] = net.add_host()
                    start_agent(host_of[node])
                    applied.append((time.monotonic(), kind, node, True))
                    added += 1
                    print(f"[bench] step {len(commits.seen)}: replacement machine {node} started", flush=True)
            time.sleep(0.005)
        commits.stop()
        codes = [procs[i].poll() for i in procs if i not in killed]
        members = {node: machine_members(store, procs[host.index].pid) for node, host in host_of.items()}
        maps = {g: ms.read_map(store, g) for g in sorted({g for _, _, g in commits.seen})}
        for log in logs:
            log.close()
    times = [t for _, t, _ in commits.seen]
    failovers = failover_times(commits.seen, kills)
    idle = [
        next((t - lost for _, t, _ in commits.seen if t > lost), float("nan"))
        for _, lost, _, training in kills if not training
    ]
    spans = [b - a for a, b in itertools.pairwise(times) if not any(a < k < b for _, k, _, _ in kills)]
    step_s = statistics.median(spans) if spans else float("nan")
    first_kill = min((k for _, k, _, _ in kills), default=float("inf"))
    full = [b - a for a, b in itertools.pairwise(t for t in times if t < first_kill)][WARMUP_STEPS:]
    full_layout_step_s = statistics.median(full) if full else float("nan")
    # committed samples per second while the segment's events are applied (its compressed length)
    segment_s = (args.segment_ms[1] - args.segment_ms[0]) / 1000.0 / args.compression
    start = window_start if window_start is not None else float("inf")
    in_segment = [t for t in times if start <= t <= start + segment_s]
    segment_rate = len(in_segment) * batch / segment_s
    final_equal = exact(reference, out, args.steps)
    is_exact = all(code == 0 for code in codes) and final_equal
    after_end = sum(1 for _, t, _, _ in kills if len(times) >= args.steps and t >= times[-1])
    ended_early = bool(times) and times[-1] < start + segment_s  # the rate would count a part of the segment
    if events or after_end or ended_early:
        how_early = f"{start + segment_s - times[-1]:.1f} s " if ended_early else ""
        print(f"[bench] the job's {args.steps} steps ended {how_early}before the trace segment did "
              f"({len(events)} events not applied, {after_end} machine(s) lost after the last step; "
              "segment_samples_per_s counts only the steps before): give more --steps", flush=True)
    result = {"steps_committed": len(times), "kills": [m for m, _, _, _ in kills], "replacements": added,
              "events_not_applied": len(events), "kills_after_last_step": after_end,
              "ended_before_segment": ended_early, "failover_s": failovers,
              "not_training_lost_to_next_step_s": idle,
              "step_s": step_s, "full_layout_step_s": full_layout_step_s, "stages": args.stages,
              "recovery": args.recovery, "segment_samples_per_s": segment_rate,
              "exit_codes": codes, "final_state_equal": final_equal, "exact": is_exact,
              "lease_s": args.lease,
              "segment_ms": args.segment_ms, "compression": args.compression, "work": str(work)}
    if window_start is not None:
        result["replay"] = replay_costs(
            generations(commits.seen, {g: shape_key(m) for g, m in maps.items()},
                        {g: len(m.members()) for g, m in maps.items()}),
            [Applied(t - window_start, kind, node, members[node], training)
             for t, kind, node, training in applied],
            {node: members[node] for node in plan.initial}, failovers, window_start, segment_s, segment_rate,
            batch, args.stages, args.recovery or "replica+forward",
            json.loads((REPO / "benchmarks" / "results" / "bamboo_preemption.json").read_text()))
    kept = {"commits": commits.seen, "kills": kills}
    if window_start is not None:
        kept["segment_start"] = window_start  # the replay's clock (``_nodes_replay.replay_kept_run``)
    (work / "commits.json").write_text(json.dumps(kept))
    print(json.dumps(result), flush=True)
    print(f"node_failover_s={statistics.median(failovers) if failovers else float('nan'):.3f} "
          f"step_s={step_s:.3f} nodes_lost={len(kills)} exact={'true' if is_exact else 'false'}")


if __name__ == "__main__":
    main()
