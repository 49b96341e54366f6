"""Seconds per training epoch of Dorylus graph servers: synchronous vs the pipeline engine (staleness 0, 1).

    python benchmarks/dorylus_pipeline.py                                     # the part-1 graph: 1M vertices
    python benchmarks/dorylus_pipeline.py --nodes 4000 --features 16 --epochs 1 --warmup 1   # CI size
    python benchmarks/dorylus_pipeline.py --nodes 50000 --interval-size 4096 --rounds 5   # interleaved rounds

Setup (issue 10): the part-1 benchmark's generated power-law graph and 2-layer GCN
(``benchmarks/dorylus_epoch.py``; ``--model gat``: a 2-layer GAT instead, ``--heads`` heads of ``--hidden``
channels in its first layer, one averaged head in its second), ``--servers`` graph servers (2), the
``local`` executor (worker processes running the numpy Lambda handler) behind :class:`DelayedExecutor`,
which adds ``--latency-ms`` (20 ms) of round trip to every request before it reaches a worker, the way an
AWS Lambda invocation would. The delay is this benchmark's, not the executor's. Concurrent requests are
not capped (Lambda's 1,000 per region), the executor's workers are (``--executor-workers``; default: the
worker cores divided among the servers, so every worker core runs one, as concurrent Lambdas would). The
servers start with ``OMP_WAIT_POLICY=PASSIVE`` (``--omp-wait-policy``): several servers share the server
cores, and OpenMP threads that spin between a server's many small operations take the cores the other
servers need (on 16 cores, 2 servers: 3.8 -> 2.4 server CPU-s per epoch; docs/dorylus-pipeline-benchmark.md).

Where the tensor work runs (the pipeline's premise): on AWS the executors' tensor ops run on Lambda's CPUs,
not the graph servers'; here the executor workers are processes on the same machine. So by default the
benchmark gives them cores of their own, the way Lambdas would: every graph server runs on
``--server-cores`` (default: the first half of the cores this process may use; 2 cores: core 0) and its
executor workers on ``--worker-cores`` (default: the other half; 2 cores: core 1), set with
``os.sched_setaffinity`` for every thread (threads started later inherit it). That is the model of
"tensor work elsewhere"; the 20 ms round trip stays. Beside it the benchmark still measures the
shared-cores setting (no pinning: servers and workers on all cores, as before), where the workers' tensor
work competes with the servers and the pipeline has less to overlap.

One round measures five configurations, each in fresh processes: with own cores,
``DorylusStrategy(staleness=None)`` (synchronous: GA in one product per layer), ``staleness=0``
(per-interval GA -> AV pipeline, GAT: AE -> GA: the server's GA of one interval overlaps the requests of
others) and
``staleness=1`` (also bounded-stale ghost exchange); with shared cores, synchronous and ``staleness=1``.
The epoch time is the median over ``--epochs`` epochs after ``--warmup``, each epoch counted as its slowest
server's. ``--rounds R`` runs the configurations R times, interleaved (round ``r`` starts with
configuration ``r mod 5``), and takes each configuration's median over rounds: on a shared machine the load
drifts within the minutes one configuration takes, and one round compares configurations that ran under
different loads.

``--profile`` also prints, per configuration and server, the CPU seconds per thread kind and (last measured
epoch) the seconds the server was blocked in ``executor.wait`` and every wait stage (op, requests, first
submit to last result): where an epoch waits. Every run prints the CPU seconds per epoch on the server cores
and on the worker cores (synchronous and staleness 1, own cores) and the bound the busier set puts on
``async_speedup``: a staleness-1 epoch cannot be shorter than its busiest cores' work, whatever it
overlaps. Every configuration also prints its peak memory per graph server (the server + its workers).

Every server records its CPU seconds per epoch (its threads and its executor workers', from ``/proc``), so
every run prints the own-cores bound; and the wall time each own-cores mode needs to reach the synchronous
run's final loss (epochs needed x its median epoch; ``inf`` if it never does within the run).

The last line printed is ``async_speedup=<sync / staleness=1, own cores> s0_speedup=<sync / staleness=0,
own cores> shared_cores_async_speedup=<sync / staleness=1, shared cores> bound=<the own-cores bound on
async_speedup> time_to_loss_speedup=<sync's time to its final loss / the faster pipelined mode's>``.
"""

# Only the standard library at module level: the parent process only launches workers and prints.
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

try:  # imported by the tests, the checkout on sys.path
    from benchmarks._harness import (
        free_port,
        kill_groups,
        peak_memory_mib,
        pin,
        rank_env,
        stat_cpu_seconds,
        watch,
    )
except ImportError:  # run as a script: its own directory is first on sys.path
    from _harness import free_port, kill_groups, peak_memory_mib, pin, rank_env, stat_cpu_seconds, watch

REPO_ROOT = Path(__file__).resolve().parents[1]
LR, WEIGHT_DECAY = 0.01, 5e-4
MODES = {"sync": None, "s0": 0, "s1": 1}
#: The configurations one round runs (mode/cores): the three modes with the executor workers on cores of
#: their own (the default: tensor work elsewhere, as on Lambdas), and sync / staleness 1 on shared cores.
CONFIGS = ("sync/own", "s0/own", "s1/own", "sync/shared", "s1/shared")
#: ``--huge-pages``: glibc (2.35+) then madvises the regions it maps as transparent huge pages (where the
#: kernel's THP setting is ``madvise`` or ``always``): a fresh 64 MiB buffer written once took 800 page faults
#: and 16 ms of CPU here instead of 15,600 and 57 ms.
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
#: How close (relative) a mode's loss must come to the synchronous final loss to count as reaching it.
LOSS_TOLERANCE = 1e-4


def make_delayed_executor(inner: Any, latency_s: float, max_in_flight: int = 256) -> Any:
    """``inner`` (a ``TensorOpExecutor``) with ``latency_s`` of round trip added to every request.

    A request waits ``latency_s`` on one of ``max_in_flight`` threads (the network), then runs on ``inner``
    (its worker processes); its future resolves when ``inner``'s result is back.
    """
    from concurrent.futures import Future, ThreadPoolExecutor

    from lightning_dorylus.executors import TensorOpExecutor

    class DelayedExecutor(TensorOpExecutor):
        def __init__(self) -> None:
            self.inner, self.latency_s = inner, latency_s
            self._pool: ThreadPoolExecutor | None = None

        def start(self) -> None:
            self.inner.start()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_in_flight, thread_name_prefix="lambda-rtt")

        def submit(self, request: Any) -> Future:
            self.start()
            assert self._pool is not None
            return self._pool.submit(self._call, request)

        def _call(self, request: Any) -> Any:
            time.sleep(self.latency_s)
            return self.inner.submit(request).result()

        def close(self) -> None:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None
            self.inner.close()

    return DelayedExecutor()


# --------------------------------------------------------------------------- workers
def run_prepare(args: argparse.Namespace) -> dict[str, Any]:
    """Generate (or read from the cache) the graph and its partitions; not timed."""
    from lightning_dorylus.data import DorylusDataModule
    from lightning_dorylus.data.synthetic import powerlaw_graph

    data = powerlaw_graph(
        num_nodes=args.nodes,
        avg_degree=args.avg_degree,
        num_features=args.features,
        num_classes=args.classes,
        seed=args.seed,
        cache_dir=Path(args.cache_dir) / "graphs",
    )
    datamodule = DorylusDataModule(
        data,
        num_parts=args.servers,
        partitioner=args.partitioner,
        interval_size=args.interval_size,
        cache_dir=Path(args.cache_dir) / "partitions",
        seed=args.seed,
    )
    datamodule.prepare_data()
    return {
        "nodes": int(data.num_nodes),
        "edges": int(data.num_edges),
        "partition_dir": str(datamodule.resolved_partition_dir()),
    }


def run_server(args: argparse.Namespace) -> dict[str, Any]:
    """One graph server (rank from ``LOCAL_RANK``) in mode ``--mode``; its per-epoch seconds and losses."""
    from datetime import timedelta

    import lightning.pytorch as pl
    import torch

    from lightning_dorylus import DorylusStrategy
    from lightning_dorylus.data import DorylusDataModule
    from lightning_dorylus.executors import LocalPoolExecutor
    from lightning_dorylus.models import GAT, GCN

    torch.set_num_threads(args.threads_per_server)

    class EpochTimer(pl.Callback):
        def __init__(self, profiler: Any = None, pool: Any = None) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []
            self.profiler, self.profile, self.pool = profiler, [], pool
            self.cpu: list[dict[str, Any]] = []  # per epoch: CPU s of server + workers, and per thread kind
            self._cpu = 0.0
            self._start = 0.0

        def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if self.profiler is not None:
                self.profiler.start_epoch(trainer.current_epoch)
            self._start = time.perf_counter()
            self._cpu = self._cpu_seconds()  # always: the own-cores bound of the summary line needs it
            self._threads = self._thread_cpu()

        def _thread_cpu(self) -> dict[str, float]:
            """CPU seconds so far per thread kind of this server (name without its number) and its workers."""
            import threading

            names = {t.native_id: t.name for t in threading.enumerate()}
            out: dict[str, float] = {}
            tasks = [(f"/proc/self/task/{tid}", "") for tid in os.listdir("/proc/self/task")]
            for pid in self.pool.worker_pids if self.pool is not None else []:
                tasks += [(f"/proc/{pid}/task/{tid}", "worker:") for tid in os.listdir(f"/proc/{pid}/task")]
            for path, prefix in tasks:
                try:
                    with open(f"{path}/stat") as f:
                        stat = f.read()
                except OSError:
                    continue
                name = names.get(int(path.rsplit("/", 1)[1])) if not prefix else None
                name = prefix + (name or stat[stat.index("(") + 1 : stat.rindex(")")]).rstrip("0123456789_-")
                out[name] = out.get(name, 0.0) + stat_cpu_seconds(stat)
            return out

        def _cpu_seconds(self) -> float:
            """CPU seconds of this server and its executor's worker processes so far (Linux /proc)."""
            total = time.process_time()
            for pid in self.pool.worker_pids if self.pool is not None else []:
                with open(f"/proc/{pid}/stat") as f:
                    total += stat_cpu_seconds(f.read())
            return total

        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.times.append(time.perf_counter() - self._start)
            cpu = self._cpu_seconds() - self._cpu
            threads = {k: v - self._threads.get(k, 0.0) for k, v in self._thread_cpu().items()}
            self.cpu.append({"cpu_s": cpu, "threads": threads})
            if self.profiler is not None:
                row = self.profiler.end_epoch(self.times[-1])
                stages = [(s["op"], s["requests"], round(s["wall_s"], 4)) for s in row["stages"]]
                self.profile.append({"epoch_s": row["epoch_s"], "blocked_s": row["blocked_s"], "cpu_s": cpu,
                                     "stages": stages, "threads": threads})
            self.losses.append(float(trainer.callback_metrics.get("train_loss", float("nan"))))

    inner = LocalPoolExecutor(num_workers=args.executor_workers)
    if args.cores == "own":  # tensor work elsewhere: the workers get cores no graph server runs on
        pin(os.getpid(), args.server_cores)
        inner.start()
        for pid in inner.worker_pids:
            pin(pid, args.worker_cores)
    worker_affinity = sorted({c for pid in inner.worker_pids for c in os.sched_getaffinity(pid)})
    executor = make_delayed_executor(inner, args.latency_ms / 1000.0)
    if args.profile:  # where the server blocks on tensor ops (executor.wait), per op and stage
        from lightning_dorylus.value import TimedExecutor

        executor = TimedExecutor(executor, workers=args.executor_workers)
    timer = EpochTimer(executor if args.profile else None, inner)
    strategy = DorylusStrategy(
        executor=executor, timeout=timedelta(seconds=args.timeout), staleness=MODES[args.mode]
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.servers,
        strategy=strategy,
        max_epochs=args.warmup + args.epochs,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    torch.manual_seed(args.seed)
    if args.model == "gat":  # per interval in the engine: AE of one interval out while GA of another runs
        model: pl.LightningModule = GAT(args.features, args.hidden, args.classes, heads=args.heads,
                                        out_heads=1, dropout=args.dropout, lr=LR, weight_decay=WEIGHT_DECAY)
    else:
        model = GCN(
            args.features,
            args.hidden,
            args.classes,
            num_layers=2,
            dropout=args.dropout,
            lr=LR,
            weight_decay=WEIGHT_DECAY,
        )
    try:
        trainer.fit(model, datamodule=DorylusDataModule(args.partition_dir))
        memory = peak_memory_mib()  # while the executor's workers are alive: the server + its workers
    finally:
        executor.close()
    return {"rank": trainer.global_rank, "peak_total_mib": memory["peak_total_mib"],
            "epoch_times": timer.times[args.warmup :], "losses": timer.losses,
            "profile": timer.profile[args.warmup :], "cpu": timer.cpu[args.warmup :],
            "affinity": sorted(os.sched_getaffinity(0)),
            "worker_affinity": worker_affinity}


# --------------------------------------------------------------------------- launching
def launch(
    args: argparse.Namespace, worker: str, workdir: Path, num_procs: int = 1, config: str = "sync/own",
    tag: str = "",
) -> list[dict[str, Any]]:
    """Run ``num_procs`` fresh processes of ``worker`` (torchrun-style env) in configuration ``config``
    (mode/cores); their JSON results.

    Raises:
        RuntimeError: if a worker fails or runs past ``--timeout``; its output tail is in the message.
    """
    mode, cores = config.split("/")
    port = free_port()
    forwarded = [
        f"--{k.replace('_', '-')}" if v is True else
        f"--{k.replace('_', '-')}={','.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items()
        if k not in ("worker", "result", "mode", "cores", "rounds") and v is not False
    ]
    procs = []
    for rank in range(num_procs):
        env = rank_env(dict(os.environ, PYTHONUNBUFFERED="1"), rank, num_procs, port)
        if args.omp_wait_policy != "inherit":  # read by OpenMP when the process loads it: set at launch
            env["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
        if args.huge_pages:  # read by glibc when the process starts: set at launch
            env["GLIBC_TUNABLES"] = HUGE_PAGES_TUNABLE
        name = f"{worker}{mode}{cores}{tag}-{rank}"
        result, log = workdir / f"{name}.json", workdir / f"{name}.log"
        command = [sys.executable, str(Path(__file__).resolve()), f"--worker={worker}", f"--result={result}",
                   f"--mode={mode}", f"--cores={cores}", *forwarded]
        with open(log, "w") as log_file:
            proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                    cwd=REPO_ROOT, start_new_session=True)
        procs.append((proc, result, log))
    try:  # fails at the first failure: one failed server would leave its peer waiting in a collective
        failure = watch([proc for proc, _, _ in procs], args.timeout, tick=lambda: 0.2)
    finally:
        kill_groups([proc for proc, _, _ in procs])
    for proc, _, log in procs:
        if proc.returncode not in (0, -9):
            raise RuntimeError(f"{worker} worker exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
    if failure:
        tail = procs[0][2].read_text()[-3000:]
        raise RuntimeError(f"{worker} ran past --timeout ({args.timeout} s):\n{tail}")
    return [json.loads(result.read_text()) for _, result, _ in procs]


def job_epoch(servers: list[dict[str, Any]]) -> float:
    """Median over epochs of the slowest server's epoch time (an epoch ends when its last server ends it)."""
    return statistics.median(max(epoch) for epoch in zip(*(s["epoch_times"] for s in servers)))


def round_order(round_index: int) -> list[str]:
    """The configurations of round ``round_index``, rotated so each one leads a round in turn."""
    configs = list(CONFIGS)
    shift = round_index % len(configs)
    return configs[shift:] + configs[:shift]


def report(
    graph: dict[str, Any],
    results: dict[str, list[dict[str, Any]]],
    args: argparse.Namespace,
    rounds: list[dict[str, list[dict[str, Any]]]] | None = None,
) -> None:
    """The table, then the summary line (always last).

    ``results`` is the first round's (losses and ``--profile`` come from it); with ``rounds`` (every round's
    results) a configuration's epoch time is the median of its per-round epoch times.
    """
    rounds = rounds or [results]
    omp_policy = (os.environ.get("OMP_WAIT_POLICY", "unset") if args.omp_wait_policy == "inherit"
                  else args.omp_wait_policy)
    tunables = HUGE_PAGES_TUNABLE if args.huge_pages else os.environ.get("GLIBC_TUNABLES", "unset")
    print(
        f"graph: {graph['nodes']:,} vertices, {graph['edges']:,} directed edges; "
        f"{args.model.upper()}{f' ({args.heads} heads)' if args.model == 'gat' else ''}, "
        f"{args.servers} graph servers, "
        f"{args.executor_workers} executor worker(s) each, {args.latency_ms:g} ms per request, "
        f"interval size {args.interval_size}, OMP_WAIT_POLICY {omp_policy}, "
        f"GLIBC_TUNABLES {tunables}; "
        f"load average {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)"
    )
    own = results.get("sync/own", [{}])[0]
    print(f"own cores: graph servers on {own.get('affinity')}, executor workers on "
          f"{own.get('worker_affinity')} (as run); shared cores: all on {sorted(os.sched_getaffinity(0))}")
    print(f"{'configuration':<36}{'s/epoch':>10}{'loss':>16}{'peak MiB/server':>17}")
    epochs = {}
    for config, servers in results.items():
        mode, cores = config.split("/")
        epochs[config] = statistics.median(job_epoch(one[config]) for one in rounds)
        losses = servers[0]["losses"]
        label = f"staleness={MODES[mode]}, {cores} cores"
        peak = max(s.get("peak_total_mib", float("nan")) for s in servers)  # server + its workers
        print(f"{label:<36}{epochs[config]:>10.3f}{losses[0]:>8.3f}->{losses[-1]:.3f}{peak:>17,.0f}")
    if len(rounds) > 1:
        for index, one in enumerate(rounds):
            times = "  ".join(f"{config} {job_epoch(one[config]):.3f}" for config in round_order(index))
            print(f"round {index} (s/epoch, in the order run): {times}")
    if args.profile:
        for mode, servers in results.items():  # mode: the configuration, mode/cores
            for server in servers:
                epochs_run = server["cpu"]
                kinds = sorted({k for e in epochs_run for k in e["threads"]})
                mean = {k: sum(e["threads"].get(k, 0.0) for e in epochs_run) / len(epochs_run) for k in kinds}
                print(f"threads {mode} rank {server['rank']} (CPU s per epoch, mean of {len(epochs_run)}): "
                      f"total {sum(e['cpu_s'] for e in epochs_run) / len(epochs_run):.3f} "
                      + " ".join(f"{k}={v:.3f}" for k, v in sorted(mean.items(), key=lambda kv: -kv[1]) if v))
                last = server["profile"][-1]
                print(f"profile {mode} rank {server['rank']}: epoch {last['epoch_s']:.3f} s, blocked on the "
                      f"executor {last['blocked_s']:.3f} s, CPU (server + its workers) "
                      f"{last['cpu_s']:.3f} s; stages (op, requests, first submit to last result s):")
                for stage in last["stages"]:
                    print(f"    {stage}")
    bound = float("nan")
    if all(server.get("cpu") for server in results["s1/own"]):
        s1_servers, s1_workers = core_seconds(results["s1/own"])
        floor = max(s1_servers / len(args.server_cores), s1_workers / len(args.worker_cores))
        for config in ("sync/own", "s1/own"):
            on_servers, on_workers = core_seconds(results[config])
            print(f"cores {config}: CPU s per epoch, graph servers {on_servers:.3f} on {args.server_cores}, "
                  f"executor workers {on_workers:.3f} on {args.worker_cores} (epoch {epochs[config]:.3f} s)")
        bound = epochs["sync/own"] / floor
        print(f"own-cores bound: a staleness-1 epoch needs at least {floor:.3f} s (its busiest core set), so "
              f"async_speedup <= {bound:.2f} whatever it overlaps")
    ttl = time_to_loss({config: results[config][0]["losses"] for config in ("sync/own", "s0/own", "s1/own")},
                       epochs)
    print(f"time to the synchronous run's final loss {ttl['target']:.3f} (epochs needed x median s/epoch, "
          "own cores): " + "  ".join(
              f"{config} {t:.3f} s ({n} epochs)" if math.isfinite(t) else
              f"{config} inf (never reached: {results[config][0]['losses'][-1]:.3f} after {n} epochs)"
              for config, (t, n) in ttl["modes"].items()))
    print(f"async_speedup={epochs['sync/own'] / epochs['s1/own']:.2f} "
          f"s0_speedup={epochs['sync/own'] / epochs['s0/own']:.2f} "
          f"shared_cores_async_speedup={epochs['sync/shared'] / epochs['s1/shared']:.2f} "
          f"bound={bound:.2f} time_to_loss_speedup={ttl['speedup']:.2f}")


def time_to_loss(losses: dict[str, list[float]], epochs: dict[str, float]) -> dict[str, Any]:
    """Wall time each own-cores mode needs to reach the synchronous run's final loss, and the speedup.

    ``losses``: per configuration the training loss of every epoch (warm-up included: the loss a step
    reaches does not depend on how long its epoch took); ``epochs``: the median seconds per epoch. A mode
    reaches the target at the first epoch whose loss is ``<=`` it; its time is the epochs up to and
    including that one times its median epoch (the warm-up's wall time holds one-off set-up, not training).
    A mode that never reaches it takes ``inf``. "Reaches" allows :data:`LOSS_TOLERANCE` (relative): staleness
    0 computes the synchronous values with sums in another order, so its float32 loss may differ in the last
    bits. ``speedup`` = the synchronous time / the faster pipelined mode's (``0`` if neither reaches it).
    """
    target = losses["sync/own"][-1]
    limit = target + LOSS_TOLERANCE * abs(target)
    modes: dict[str, tuple[float, int]] = {}
    for config, trace in losses.items():
        reached = next((k + 1 for k, loss in enumerate(trace) if loss <= limit), None)
        modes[config] = (reached * epochs[config], reached) if reached is not None else (math.inf, len(trace))
    best = min(modes["s0/own"][0], modes["s1/own"][0])
    speedup = modes["sync/own"][0] / best if math.isfinite(best) else 0.0
    return {"target": target, "modes": modes, "speedup": speedup}


def core_seconds(servers: list[dict[str, Any]]) -> tuple[float, float]:
    """Mean CPU seconds per epoch of all graph servers' own threads (main, dispatchers, gloo, the benchmark's
    latency threads: the server cores with own cores) and of all their executor workers (the worker cores),
    from the per-thread CPU seconds every server records per epoch."""
    on_servers = on_workers = 0.0
    for server in servers:
        epochs_run = server["cpu"]
        workers = sum(v for e in epochs_run for k, v in e["threads"].items() if k.startswith("worker:"))
        on_workers += workers / len(epochs_run)
        on_servers += (sum(e["cpu_s"] for e in epochs_run) - workers) / len(epochs_run)
    return on_servers, on_workers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1_000_000)
    parser.add_argument("--avg-degree", type=float, default=20.5)
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--model", choices=["gcn", "gat"], default="gcn")
    parser.add_argument("--hidden", type=int, default=16, help="hidden width (GAT: per head)")
    parser.add_argument("--heads", type=int, default=2, help="GAT: heads of the first layer")
    parser.add_argument("--classes", type=int, default=16)
    parser.add_argument("--dropout", type=float, default=0.5)
    parser.add_argument("--epochs", type=int, default=3, help="measured epochs (after --warmup)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured epochs first")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the 3 configurations N times, interleaved; median per configuration")
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--executor-workers", type=int, default=0,
                        help="local executor workers per server (0: worker cores // servers, at least 1)")
    parser.add_argument("--threads-per-server", type=int, default=0, help="default: cores // servers")
    parser.add_argument("--interval-size", type=int, default=8192)
    parser.add_argument("--latency-ms", type=float, default=20.0, help="injected round trip per request")
    parser.add_argument("--partitioner", default="metis")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=str(REPO_ROOT / ".cache" / "dorylus"))
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per configuration")
    parser.add_argument("--omp-wait-policy", choices=["passive", "active", "inherit"], default="passive",
                        help="OMP_WAIT_POLICY of the graph servers (passive: idle OpenMP threads sleep "
                             "rather than spin, so servers sharing cores do not burn each other's; inherit: "
                             "this process's environment)")
    parser.add_argument("--huge-pages", action="store_true",
                        help=f"start the graph servers (and so their executor workers) with GLIBC_TUNABLES="
                             f"{HUGE_PAGES_TUNABLE}: glibc asks for transparent huge pages on the buffers it "
                             "maps, which the strategy's mmap_threshold makes every buffer of 1 MiB or more "
                             "(docs/dorylus-pipeline-benchmark.md, 'Huge pages')")
    parser.add_argument("--profile", action="store_true",
                        help="also print, per configuration and server, the seconds blocked on the executor")
    parser.add_argument("--worker", choices=["prepare", "server"], help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--server-cores", type=_core_list, default=None,
                        help="own-cores configurations: the graph servers' cores (default: the first half of "
                             "this process's cores; 2 cores: 0)")
    parser.add_argument("--worker-cores", type=_core_list, default=None,
                        help="own-cores configurations: the executor workers' cores (default: the other "
                             "half; 2 cores: 1)")
    parser.add_argument("--mode", choices=sorted(MODES), default="sync", help=argparse.SUPPRESS)
    parser.add_argument("--cores", choices=["own", "shared"], default="own", help=argparse.SUPPRESS)
    parser.add_argument("--partition-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in (
        "nodes",
        "features",
        "hidden",
        "heads",
        "classes",
        "epochs",
        "rounds",
        "servers",
        "interval_size",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.latency_ms < 0:
        parser.error(f"--latency-ms must be >= 0, got {args.latency_ms}")
    available = sorted(os.sched_getaffinity(0))
    if len(available) < 2 and (args.server_cores is None or args.worker_cores is None):
        parser.error(f"own cores need at least 2 cores, this process may run on {available}; "
                     "give --server-cores and --worker-cores")
    if args.server_cores is None:
        args.server_cores = available[: len(available) // 2]
    if args.worker_cores is None:
        args.worker_cores = [c for c in available if c not in args.server_cores]
    for name in ("server_cores", "worker_cores"):
        outside = sorted(set(getattr(args, name)) - set(available))
        if outside or not getattr(args, name):
            flag = f"--{name.replace('_', '-')}"
            parser.error(f"{flag}={getattr(args, name)}: expected cores among {available}")
    if args.executor_workers < 0:
        parser.error(f"--executor-workers must be >= 1 (0: one per worker core and server), got "
                     f"{args.executor_workers}")
    if args.executor_workers == 0:  # Lambda's many concurrent functions: every worker core busy
        args.executor_workers = max(1, len(args.worker_cores) // args.servers)
    if args.threads_per_server == 0 and args.worker == "server":  # its share of the cores it runs on
        cores = len(args.server_cores) if args.cores == "own" else len(available)
        args.threads_per_server = max(1, cores // args.servers)
    return args


def _core_list(text: str) -> list[int]:
    try:
        cores = sorted({int(c) for c in text.split(",") if c.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated core numbers, got {text!r}") from None
    if not cores or min(cores) < 0:
        raise argparse.ArgumentTypeError(f"expected core numbers >= 0, got {text!r}")
    return cores


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        run = {"prepare": run_prepare, "server": run_server}[args.worker]
        Path(args.result).write_text(json.dumps(run(args)))
        return
    with tempfile.TemporaryDirectory(prefix="dorylus_pipeline_") as tmp:
        workdir = Path(tmp)
        (graph,) = launch(args, "prepare", workdir)
        args.partition_dir = graph["partition_dir"]
        rounds = []
        for index in range(args.rounds):
            results = {
                config: launch(args, "server", workdir, args.servers, config=config, tag=f"r{index}")
                for config in round_order(index)
            }
            rounds.append({config: results[config] for config in CONFIGS})
    report(graph, rounds[0], args, rounds)


if __name__ == "__main__":
    main()
