"""What Bamboo's redundancy costs, and how its pipeline compares with PyTorch's own 1F1B.

One run times an optimizer step of the same GPT on the same batch five ways:

    (a) plain       one process, gradient accumulation over the same micro-batches
    (b) torch_1f1b  torch.distributed.pipelining.Schedule1F1B over the same stages
    (c) bamboo      the Bamboo pipeline engine, redundancy off
    (d) bamboo_rc   the Bamboo pipeline engine, redundant computation on
    (e) bamboo_replica  the replica kept current (its update every step) without the FR forwards: what
                    ``BambooStrategy.set_forward_redundancy(False)`` runs, the failover then replays the step

    python benchmarks/bamboo_overhead.py                      # 2 stages, one process per stage
    python benchmarks/bamboo_overhead.py --stages 2 --microbatches 8 --steps 20

(a) runs in this process; (b)-(e) run in one set of worker processes, one per stage (this file re-run
with ``--worker``; gloo; one thread each), interleaved step by step so that all four see the same
machine load. Every step is bracketed by barriers so all ranks time the same interval, fill and drain
included; the figure is the median over ``--steps`` steps after ``--warmup`` steps. Workers report JSON
through a file. The line before the last is ``replica_only_overhead=<(e)/(c)>``; the last line printed is
``rc_overhead=<(d)/(c)> vs_torch_1f1b=<(c)/(b)>``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_bamboo.layout.groups import BambooGroups
from lightning_bamboo.layout.plan import StageLayout, estimate_layer_costs
from lightning_bamboo.layout.view import PipelineView
from lightning_bamboo.models.gpt import build_pipeline
from lightning_bamboo.pipeline.engine import PipelineEngine
from lightning_bamboo.pipeline.microbatch import split_microbatches
from lightning_bamboo.pipeline.replica import ReplicaSync
from lightning_bamboo.schedule import (
    Action,
    ActionKind,
    Schedule,
    add_forward_redundancy,
    build_1f1b,
    predicted_overhead,
    rank_program,
)
from lightning_bamboo.schedule.cost import program_makespan
from recipes.components.text import DEFAULT_MODULES, VOCAB_SIZE, TokenWindows, corpus_tokens

try:  # imported by the tests, the checkout on sys.path
    from benchmarks._harness import free_port, kill_groups, rank_env, watch
except ImportError:  # run as a script: its own directory is first on sys.path
    from _harness import free_port, kill_groups, rank_env, watch  # type: ignore[no-redef]

ADAMW_IMPLEMENTATIONS = ("fused", "foreach", "loop")
"""``--adamw`` choices: PyTorch's AdamW implementations (``fused=True``, ``foreach=True``, the for-loop)."""
MODES = ("plain", "torch_1f1b", "bamboo", "bamboo_rc", "bamboo_replica")
StepFn = Callable[[], float | None]
"""One optimizer step; returns the step's mean loss where this process knows it."""

LABELS = {
    "plain": "(a) one process, grad. accumulation",
    "torch_1f1b": "(b) torch.distributed.pipelining 1F1B",
    "bamboo": "(c) bamboo, redundancy off",
    "bamboo_rc": "(d) bamboo, redundancy on",
    "bamboo_replica": "(e) bamboo, replica update, no FR",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages = worker processes")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps first")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per optimizer step")
    parser.add_argument("--block-size", type=int, default=64, help="sequence length T")
    parser.add_argument("--n-layer", type=int, default=6, help="transformer blocks")
    parser.add_argument("--n-embd", type=int, default=128, help="model width C")
    parser.add_argument("--n-head", type=int, default=4, help="attention heads")
    parser.add_argument(
        "--adamw", choices=ADAMW_IMPLEMENTATIONS, default="fused",
        help="PyTorch AdamW implementation of every mode and of the replica (default: fused, the fastest on "
        "CPU; loop: PyTorch's CPU default, the per-parameter for-loop; foreach: the multi-tensor one)",
    )
    parser.add_argument(
        "--trace", action="store_true",
        help="after timing, record one more step of (c) and (d) per rank and print the timelines",
    )
    parser.add_argument(
        "--cpu-profile", type=int, default=0, metavar="N",
        help="after timing, record N more steps of (c) and (d) in each rank's CPU time and replay the "
        "schedules with those costs (a free core per rank): an estimate of rc_overhead that survives load",
    )
    parser.add_argument(
        "--no-keyed-rng", action="store_true",
        help="(c) and (d) draw random numbers from the global generators instead of forking them per forward "
        "keyed by (seed, step, micro-batch, stage), the engine's default: what the keying costs",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed for the workers")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_args(args)
    return args


def check_args(args: argparse.Namespace) -> None:
    """Reject sizes the pipeline cannot run, printing the arithmetic."""
    sizes = ("stages", "microbatches", "steps", "batch_size", "block_size", "n_layer", "n_embd", "n_head")
    if args.cpu_profile < 0:
        raise SystemExit(f"--cpu-profile must be >= 0, got {args.cpu_profile}")
    for name in sizes:
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.stages < 2:
        raise SystemExit(f"--stages must be >= 2 for a pipeline, got {args.stages}")
    if args.batch_size % args.microbatches:
        raise SystemExit(
            f"--microbatches ({args.microbatches}) does not divide --batch-size ({args.batch_size}): "
            f"{args.batch_size} % {args.microbatches} = {args.batch_size % args.microbatches}"
        )
    if args.microbatches < args.stages:
        raise SystemExit(f"--microbatches ({args.microbatches}) must be >= --stages ({args.stages}) for 1F1B")
    if args.n_layer + 2 < args.stages:
        raise SystemExit(
            f"--stages ({args.stages}) exceeds the pipeline's layers: n_layer + 2 = {args.n_layer + 2}"
        )


def build_model(args: argparse.Namespace) -> nn.Sequential:
    """The GPT body, initialised from seed 0: every mode and every rank starts from the same weights.

    Untied (``tie_embeddings=False``): the modes here split the body by hand, without the strategy that keeps
    a tie across stages, and the committed figures were measured untied."""
    torch.manual_seed(0)
    return build_pipeline(VOCAB_SIZE, args.block_size, args.n_layer, args.n_head, args.n_embd,
                          tie_embeddings=False)


def fixed_batch(args: argparse.Namespace) -> tuple[Tensor, Tensor]:
    """The first ``batch_size`` windows of the stdlib byte corpus: inputs and targets, (B, T) int64 each."""
    windows = TokenWindows(corpus_tokens(DEFAULT_MODULES), args.block_size)
    pairs = [windows[i] for i in range(args.batch_size)]
    return torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy, as ``GPT.pipeline_loss`` computes it."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def make_optimizer(params: list[nn.Parameter], args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW with the GPT recipe's settings, in the ``--adamw`` implementation, for every part alike.

    Every compared system steps with the same implementation (each at its best: ``fused`` by default, the
    fastest PyTorch has on CPU; ``loop`` is what ``torch.optim.AdamW`` picks on CPU when not told). The
    replica gets the same optimizer as its successor stage (Bamboo builds it from the same
    ``configure_optimizers``), so its update uses the same kernel and stays bit for bit equal to the
    successor's.
    """
    flags = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[args.adamw]
    return torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, **flags)


def plan_layout(args: argparse.Namespace, world_size: int) -> StageLayout:
    """Bamboo's stage layout for the GPT body: parameter-count costs, so every rank plans the same split."""
    return StageLayout.plan(estimate_layer_costs(list(build_model(args))), world_size, world_size)


def stage_module(args: argparse.Namespace, layers: range) -> nn.Sequential:
    """A fresh copy of the body's ``layers`` (seed-0 weights, so every copy of a layer starts equal)."""
    return nn.Sequential(*list(build_model(args))[layers.start : layers.stop])


def time_steps(step: StepFn, args: argparse.Namespace) -> dict:
    """Run ``warmup + steps`` optimizer steps of one process; time the last ``steps``."""
    seconds, losses = [], []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        losses.append(step())
        if i >= args.warmup:
            seconds.append(time.perf_counter() - start)
    return {"step_seconds": seconds, "losses": losses}


def time_interleaved(steps: dict[str, StepFn], args: argparse.Namespace) -> dict[str, dict]:
    """Round-robin one step of each part per round, each bracketed by barriers so all ranks time the same
    interval. Interleaving exposes every part to the same machine load, which keeps the ratios honest on
    a shared machine; the starting part rotates each round so none always runs first."""
    names = list(steps)
    results: dict[str, dict] = {name: {"step_seconds": [], "losses": []} for name in names}
    for i in range(args.warmup + args.steps):
        rotation = i % len(names)
        for name in names[rotation:] + names[:rotation]:
            dist.barrier()
            start = time.perf_counter()
            loss = steps[name]()
            dist.barrier()
            if i >= args.warmup:
                results[name]["step_seconds"].append(time.perf_counter() - start)
            results[name]["losses"].append(loss)
    return results


# --------------------------------------------------------------------------------------------------
# (a) one process


def plain_step(args: argparse.Namespace) -> StepFn:
    """Forward + backward of each micro-batch (loss / m, gradients accumulate), then one optimizer step."""
    model = build_model(args)
    optimizer = make_optimizer(list(model.parameters()), args)
    inputs, targets = fixed_batch(args)
    micro = list(zip(inputs.chunk(args.microbatches), targets.chunk(args.microbatches)))

    def step() -> float:
        optimizer.zero_grad()
        total = 0.0
        for x, y in micro:
            loss = lm_loss(model(x), y)  # (B/m, T, V) logits -> scalar
            (loss / args.microbatches).backward()
            total += loss.item()
        optimizer.step()
        return total / args.microbatches

    return step


# --------------------------------------------------------------------------------------------------
# (b) torch.distributed.pipelining


def torch_1f1b_step(args: argparse.Namespace, rank: int, world_size: int) -> StepFn:
    """``Schedule1F1B`` over ``PipelineStage``s cut at the same layer bounds as Bamboo's."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    submodule = stage_module(args, plan_layout(args, world_size).stage_layers[rank])
    stage = PipelineStage(submodule, rank, world_size, torch.device("cpu"))
    schedule = Schedule1F1B(stage, args.microbatches, loss_fn=lm_loss)  # scales grads by 1/m, like (a)
    optimizer = make_optimizer(list(submodule.parameters()), args)
    inputs, targets = fixed_batch(args)

    def step() -> float | None:
        optimizer.zero_grad()
        losses: list[Tensor] = []
        if rank == 0:
            schedule.step(inputs)
        elif rank == world_size - 1:
            schedule.step(target=targets, losses=losses)
        else:
            schedule.step()
        optimizer.step()
        return sum(loss.item() for loss in losses) / len(losses) if losses else None

    return step


# --------------------------------------------------------------------------------------------------
# (c), (d) Bamboo


class TimedReplicaSync(ReplicaSync):
    """``ReplicaSync`` that adds the time of posting (``step``) and of applying (``flush``) to ``seconds``.

    The apply runs inside the next training step (before the first ``FR``), so its time is part of (d)'s
    step time; it is reported on its own line only to show where the replica's cost goes.
    """

    def __init__(self, *args: Any, seconds: list[float], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seconds = seconds
        self.trace: list[tuple[str, float, float]] | None = None
        self.clock: Callable[[], float] = time.perf_counter
        """The clock of ``trace`` (the engine's)."""

    def step(self, main_optimizer: torch.optim.Optimizer) -> None:
        start, mark = time.perf_counter(), self.clock()
        super().step(main_optimizer)
        self.seconds[-1] += time.perf_counter() - start
        if self.trace is not None:
            self.trace.append(("replica post", mark, self.clock()))

    def flush(self) -> None:
        start, mark = time.perf_counter(), self.clock()
        was_pending = self.pending
        super().flush()
        if self.seconds:
            self.seconds[-1] += time.perf_counter() - start
        if self.trace is not None and was_pending:
            self.trace.append(("replica apply", mark, self.clock()))


def bamboo_step(
    args: argparse.Namespace, groups: PipelineView, redundancy: bool, replica_seconds: list[float],
    forward_redundancy: bool = True,
) -> tuple[StepFn, PipelineEngine, TimedReplicaSync | None]:
    """Bamboo's ``PipelineEngine`` over the same stages, driven as ``BambooStrategy`` drives it.

    With ``redundancy`` the schedule gains the ``FR`` actions (eager forward of the successor's replica,
    in bubbles first) and every step ends with the replica update: the stage's gradients go to the
    predecessor, which applies them to its replica with its own AdamW (when the replica is next used, at
    the first ``FR`` of the next step); ``replica_seconds`` gets one entry per step: posting that exchange
    plus applying the previous one. Both are the per-step price of being able to take over a preempted
    successor. ``forward_redundancy=False`` keeps the replica and its update but no ``FR``: the update is
    then applied when the next one is posted (in the step's tail), as the strategy does with ``FR`` off.
    """
    device = torch.device("cpu")
    layout = plan_layout(args, dist.get_world_size())
    stage = stage_module(args, layout.stage_layers[groups.position])
    optimizer = make_optimizer(list(stage.parameters()), args)
    schedule = build_1f1b(layout.num_stages, args.microbatches)
    replica, sync = None, None
    if redundancy:
        if forward_redundancy:
            schedule = add_forward_redundancy(schedule, layout.num_stages, args.microbatches)
        replica = stage_module(args, layout.stage_layers[layout.successor(groups.position)])
        replica_optimizer = make_optimizer(list(replica.parameters()), args)  # the successor's settings
        sync = TimedReplicaSync(stage, replica, replica_optimizer, groups, device, seconds=replica_seconds)
        sync.sync_parameters()
    engine = PipelineEngine(
        stage, groups, schedule, device=device, replica=replica, keyed_rng=not args.no_keyed_rng,
        inputs_fn=lambda microbatch: microbatch[0],
        loss_fn=lambda logits, microbatch: lm_loss(logits, microbatch[1]),
    )
    microbatches = split_microbatches(fixed_batch(args), args.microbatches)

    def step() -> float:
        replica_seconds.append(0.0)
        loss = engine.run_step(microbatches)
        start = engine.clock()
        optimizer.step()
        if engine.trace is not None:
            engine.trace.append(("optimizer", start, engine.clock()))
        if sync is not None:
            sync.step(optimizer)
        optimizer.zero_grad()
        return loss.item()

    return step, engine, sync


# --------------------------------------------------------------------------------------------------
# processes


def worker_main(args: argparse.Namespace) -> None:
    """One pipeline rank of (b), (c) and (d), interleaved; the last rank (it has the losses) writes JSON.

    Per step, the slowest rank's time counts (``all_reduce(MAX)``).
    """
    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
    try:
        groups = BambooGroups.create(plan_layout(args, world_size), rank)
        replica_seconds: list[float] = []
        bamboo, engine, _ = bamboo_step(args, groups, redundancy=False, replica_seconds=[])
        bamboo_rc, engine_rc, sync = bamboo_step(
            args, groups, redundancy=True, replica_seconds=replica_seconds
        )
        bamboo_replica, _, sync_only = bamboo_step(
            args, groups, redundancy=True, replica_seconds=[], forward_redundancy=False
        )
        torch_1f1b = torch_1f1b_step(args, rank, world_size)
        steps = {"torch_1f1b": torch_1f1b, "bamboo": bamboo, "bamboo_rc": bamboo_rc,
                 "bamboo_replica": bamboo_replica}
        results = time_interleaved(steps, args)
        assert sync is not None
        if args.trace:
            traces = {
                "bamboo": trace_step(bamboo, engine, None),
                "bamboo_rc": trace_step(bamboo_rc, engine_rc, sync),
            }
            print_traces(traces, rank, world_size)
        if args.cpu_profile:
            parts = {"bamboo": (bamboo, engine, None), "bamboo_rc": (bamboo_rc, engine_rc, sync)}
            results["cpu_profile"] = cpu_profile(parts, args)  # type: ignore[assignment]
        sync.flush()  # the last step's exchange, before the process group goes
        assert sync_only is not None
        sync_only.flush()
        results["bamboo_rc"]["replica_update_seconds"] = replica_seconds[args.warmup :]
        for result in results.values():
            for key in ("step_seconds", "replica_update_seconds"):
                if key in result:
                    seconds = torch.tensor(result[key], dtype=torch.float64)
                    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
                    result[key] = seconds.tolist()
        if rank == world_size - 1:
            args.out.write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def trace_step(
    step: StepFn,
    engine: PipelineEngine,
    sync: TimedReplicaSync | None,
    clock: Callable[[], float] = time.perf_counter,
) -> list[tuple]:
    """One more step with the engine (and replica) recording in ``clock`` time; times relative to the opening
    barrier."""
    trace: list[tuple[str, float, float]] = []
    engine.trace, engine.clock = trace, clock
    if sync is not None:
        sync.trace, sync.clock = trace, clock
    dist.barrier()
    origin = clock()
    step()
    start = clock()
    dist.barrier()
    trace.append(("barrier", start, clock()))
    engine.trace, engine.clock = None, time.perf_counter
    if sync is not None:
        sync.trace, sync.clock = None, time.perf_counter
    return [(name, begin - origin, end - origin) for name, begin, end in trace]


PROFILE_KEYS = ("F", "B", "FR", "replica apply", "tail")
"""Per rank and Bamboo part, the median CPU seconds :func:`cpu_profile` reports, in this order. ``tail``: the
loss broadcast, the optimizer step and (d)'s replica post after the last action (:data:`TAIL_EVENTS`)."""
TAIL_EVENTS = ("allreduce+loss", "optimizer", "replica post")


def cpu_profile(
    parts: dict[str, tuple[StepFn, PipelineEngine, TimedReplicaSync | None]], args: argparse.Namespace
) -> dict[str, list[list[float]]]:
    """``--cpu-profile N``: N steps of each Bamboo part, every event timed in this rank's main-thread CPU time
    (``time.thread_time``: what the rank computed, not what it waited, so load from other jobs hardly moves
    it); the median per action kind, gathered from every rank: ``{part: [rank][PROFILE_KEYS]}``."""
    samples: dict[str, dict[str, list[float]]] = {part: {} for part in parts}
    for _ in range(args.cpu_profile):
        for part, (step, engine, sync) in parts.items():
            first_fr = True
            for name, begin, end in trace_step(step, engine, sync, clock=time.thread_time):
                kind = name.split(" ")[0].rstrip("0123456789,") if name[0] in "FB" else name
                if kind == "FR" and first_fr:  # its span contains the replica apply (the forward pre-hook)
                    first_fr = False
                    continue
                samples[part].setdefault(kind, []).append(end - begin)
    result = {}
    for part, by_kind in samples.items():
        median = {kind: statistics.median(values) for kind, values in by_kind.items()}
        tail = sum(median.get(kind, 0.0) for kind in TAIL_EVENTS)
        values = [tail if key == "tail" else median.get(key, 0.0) for key in PROFILE_KEYS]
        gathered = [torch.zeros(len(PROFILE_KEYS), dtype=torch.float64) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, torch.tensor(values, dtype=torch.float64))
        result[part] = [row.tolist() for row in gathered]
    return result


def replay_estimate(profile: dict[str, list[list[float]]], args: argparse.Namespace) -> dict[str, float]:
    """Step time of (c) and (d) with the profiled CPU costs: every rank runs its program in order on a core
    of its own, transfers are free (:func:`program_makespan`), the first ``FR`` also applies the replica
    update, and the step ends with the slowest rank's tail. ``bamboo_rc_no_update``: (d) without the replica
    update (no apply, (c)'s tail).

    ``F`` and ``B`` are the same computation in (c) and (d), so both replays use the mean of the two parts'
    medians: the ratio then depends on what redundancy adds (``FR``, apply, tail), not on the noise between
    two measurements of the same forward (about +-1 ms per action under load, 0.02-0.04 on the ratio).
    """
    plain = build_1f1b(args.stages, args.microbatches)
    redundant = add_forward_redundancy(plain, args.stages, args.microbatches)
    shared = {
        key: [(c[PROFILE_KEYS.index(key)] + d[PROFILE_KEYS.index(key)]) / 2
              for c, d in zip(profile["bamboo"], profile["bamboo_rc"])]
        for key in ("F", "B")
    }

    def step_time(part: str, schedule: Schedule, update: bool) -> float:
        costs = [
            {**dict(zip(PROFILE_KEYS, row)), "F": shared["F"][rank], "B": shared["B"][rank]}
            for rank, row in enumerate(profile[part])
        ]
        programs = {rank: rank_program(schedule, rank) for rank in range(args.stages)}
        first_fr = {
            rank: next((i for i, a in enumerate(p) if a.kind is ActionKind.FORWARD_REDUNDANT), -1)
            for rank, p in programs.items()
        }

        def duration(rank: int, index: int, action: Action) -> float:
            extra = costs[rank]["replica apply"] if update and index == first_fr[rank] else 0.0
            return costs[rank][action.kind.value] + extra

        body = program_makespan(programs, args.stages, duration=duration)
        tails = [c["tail"] if update else profile["bamboo"][rank][-1] for rank, c in enumerate(costs)]
        return body + max(tails)

    return {
        "bamboo": step_time("bamboo", plain, True),
        "bamboo_rc": step_time("bamboo_rc", redundant, True),
        "bamboo_rc_no_update": step_time("bamboo_rc", redundant, False),
    }


def print_traces(traces: dict[str, list[tuple]], rank: int, world_size: int) -> None:
    """Print each rank's timelines, one rank after the other (ms from the step's opening barrier).

    One line per rank and part: ``event start-end`` in ms. Events: the engine's actions (``F0,1`` is
    stage 0's forward of micro-batch 1, ``FR1,0`` the replica of stage 1 run on micro-batch 0; an action
    that takes a received tensor includes its ``wait``), ``wait A1``/``wait G1`` (blocking on the receive of
    micro-batch 1's activation / gradient), ``finish`` (waiting for this rank's sends), ``allreduce+loss``,
    ``optimizer``, ``replica apply`` (the replica's AdamW, run by the first ``FR``), ``replica post`` and
    the closing ``barrier``.
    """
    for turn in range(world_size):
        dist.barrier()
        if turn != rank:
            continue
        for mode, trace in traces.items():
            events = "  ".join(f"{name} {1e3 * begin:.0f}-{1e3 * end:.0f}" for name, begin, end in trace)
            print(f"rank{rank} {mode:<10} {events}", flush=True)
    dist.barrier()


def launch(args: argparse.Namespace, argv: list[str]) -> dict[str, dict]:
    """Start one worker per stage (``benchmarks/_harness.py``: as torchrun would, each in a session of its
    own), wait, read the last rank's JSON; whatever still runs at the end is killed with its group."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        base = {**os.environ, "OMP_NUM_THREADS": "1"}
        port = free_port()
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(args.stages):
                env = {**rank_env(base, rank, args.stages, port), "RANK": str(rank)}
                procs.append(subprocess.Popen(
                    [sys.executable, __file__, *argv, "--worker", "--out", str(out)],
                    env=env, start_new_session=True,
                ))
            failure = watch(procs, args.timeout)
        finally:
            kill_groups(procs)
        if failure.startswith("timed out"):
            raise SystemExit(f"workers did not finish within --timeout ({args.timeout} s)")
        if failure:
            raise SystemExit(f"workers {failure}")
        return json.loads(out.read_text())


def summarise(results: dict[str, dict]) -> dict[str, float]:
    return {mode: statistics.median(result["step_seconds"]) for mode, result in results.items()}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
        return
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    results = {"plain": time_steps(plain_step(args), args), **launch(args, argv)}
    profile = results.pop("cpu_profile", None)
    medians = summarise(results)
    print(f"GPT n_layer={args.n_layer} n_embd={args.n_embd} T={args.block_size}, batch {args.batch_size} in "
          f"{args.microbatches} micro-batches, {args.stages} stages; median of {args.steps} steps after "
          f"{args.warmup} warm-up; {len(os.sched_getaffinity(0))} CPUs, load average at start {load:.2f}"
          + f"; {args.adamw} AdamW" + ("; no keyed RNG" if args.no_keyed_rng else ""))
    print(f"{'mode':<42}{'s/step':>10}{'first loss':>12}{'last loss':>11}")
    for mode in MODES:
        losses = results[mode]["losses"]
        print(f"{LABELS[mode]:<42}{medians[mode]:>10.4f}{losses[0]:>12.4f}{losses[-1]:>11.4f}")
    replica_update = statistics.median(results["bamboo_rc"]["replica_update_seconds"])
    # posting this step's gradients + applying the previous step's to the replica (its AdamW)
    print(f"{'    of which replica update':<42}{replica_update:>10.4f}")
    speedup = medians["plain"] / medians["bamboo"]
    ideal = args.stages * args.microbatches / (args.microbatches + args.stages - 1)
    print(f"pipeline speed-up (a)/(c) {speedup:.2f}, ideal S*M/(M+S-1) {ideal:.2f}")
    if speedup < 1 + 0.5 * (ideal - 1):
        # the bubbles are only free time if every stage has a core of its own; see docs/bamboo-benchmark.md
        print(f"WARNING: the pipeline gains less than half its ideal speed-up: the {args.stages} workers did "
              "not get a core each (other load?), so the FR in bubbles cost compute and rc_overhead is "
              "inflated")
    plain_schedule = build_1f1b(args.stages, args.microbatches)
    redundant_schedule = add_forward_redundancy(plain_schedule, args.stages, args.microbatches)
    # F = 1, B = 2, FR = 1 and no overlap of compute (lightning_bamboo.schedule.cost)
    model = predicted_overhead(redundant_schedule, plain_schedule)
    print(f"unit-cost model of the schedules: rc_overhead {model:.3f}")
    if profile is not None:
        for part in ("bamboo", "bamboo_rc"):
            for rank, row in enumerate(profile[part]):
                costs = "  ".join(f"{key} {1e3 * value:.2f}" for key, value in zip(PROFILE_KEYS, row))
                print(f"CPU ms per action, {part:<9} rank {rank}: {costs}")
        estimate = replay_estimate(profile, args)
        plain_s, rc_s, bare_s = estimate["bamboo"], estimate["bamboo_rc"], estimate["bamboo_rc_no_update"]
        print(f"CPU-time replay ({args.cpu_profile} steps, a free core per rank, free transfers): (c) "
              f"{1e3 * plain_s:.1f} ms, (d) {1e3 * rc_s:.1f} ms, rc_overhead {rc_s / plain_s:.3f} "
              f"({bare_s / plain_s:.3f} without the replica update)")
    print(f"replica_only_overhead={medians['bamboo_replica'] / medians['bamboo']:.2f}")
    rc_overhead = medians["bamboo_rc"] / medians["bamboo"]
    vs_torch = medians["bamboo"] / medians["torch_1f1b"]
    print(f"rc_overhead={rc_overhead:.2f} vs_torch_1f1b={vs_torch:.2f}")


if __name__ == "__main__":
    main()
