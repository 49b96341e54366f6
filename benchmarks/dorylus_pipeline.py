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
not capped (Lambda's 1,000 per region), the executor's workers are (``--executor-workers``).

One run measures three configurations, each in fresh processes: ``DorylusStrategy(staleness=None)``
(synchronous, layer by layer), ``staleness=0`` (per-interval GA -> AV pipeline, GAT: AE -> GA: the
server's GA of one interval overlaps the requests of others) and ``staleness=1`` (also bounded-stale
ghost exchange). The epoch time is the median over ``--epochs`` epochs after ``--warmup``, each epoch
counted as its slowest server's. ``--rounds R`` runs the three configurations R times, interleaved (round
``r`` starts with configuration ``r mod 3``), and takes each configuration's median over rounds: on a
shared machine the load drifts within the minutes one configuration takes, and one round compares
configurations that ran under different loads.

``--profile`` also prints, per configuration and server (last measured epoch), the seconds the server was
blocked in ``executor.wait``, the CPU seconds of the server and its executor workers, and every wait stage
(op, requests, first submit to last result): where an epoch waits.

The last line printed is ``async_speedup=<sync / staleness=1 epoch s> s0_speedup=<sync / staleness=0>``.
"""

# Only the standard library at module level: the parent process only launches workers and prints.
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
LR, WEIGHT_DECAY = 0.01, 5e-4
MODES = {"sync": None, "s0": 0, "s1": 1}


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
def _stat_cpu_seconds(stat: str) -> float:
    """User + system CPU seconds from the text of a ``/proc/<pid>[/task/<tid>]/stat`` file."""
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
            self._cpu = 0.0
            self._start = 0.0

        def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if self.profiler is not None:
                self.profiler.start_epoch(trainer.current_epoch)
            self._start = time.perf_counter()
            if self.profiler is not None:
                self._cpu = self._cpu_seconds()
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
                out[name] = out.get(name, 0.0) + _stat_cpu_seconds(stat)
            return out

        def _cpu_seconds(self) -> float:
            """CPU seconds of this server and its executor's worker processes so far (Linux /proc)."""
            total = time.process_time()
            for pid in self.pool.worker_pids if self.pool is not None else []:
                with open(f"/proc/{pid}/stat") as f:
                    total += _stat_cpu_seconds(f.read())
            return total

        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.times.append(time.perf_counter() - self._start)
            if self.profiler is not None:
                row = self.profiler.end_epoch(self.times[-1])
                stages = [(s["op"], s["requests"], round(s["wall_s"], 4)) for s in row["stages"]]
                cpu = self._cpu_seconds() - self._cpu
                threads = {k: v - self._threads.get(k, 0.0) for k, v in self._thread_cpu().items()}
                self.profile.append({"epoch_s": row["epoch_s"], "blocked_s": row["blocked_s"], "cpu_s": cpu,
                                     "stages": stages, "threads": threads})
            self.losses.append(float(trainer.callback_metrics.get("train_loss", float("nan"))))

    inner = LocalPoolExecutor(num_workers=args.executor_workers)
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
    finally:
        executor.close()
    return {"rank": trainer.global_rank, "epoch_times": timer.times[args.warmup :], "losses": timer.losses,
            "profile": timer.profile[args.warmup :]}


# --------------------------------------------------------------------------- launching
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    args: argparse.Namespace, worker: str, workdir: Path, num_procs: int = 1, mode: str = "", tag: str = ""
) -> list[dict[str, Any]]:
    """Run ``num_procs`` fresh processes of ``worker`` (torchrun-style env when > 1); their JSON results.

    Raises:
        RuntimeError: if a worker fails or runs past ``--timeout``; its output tail is in the message.
    """
    port = _free_port()
    forwarded = [
        f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}"
        for k, v in vars(args).items()
        if k not in ("worker", "result", "mode", "rounds") and v is not False
    ]
    procs = []
    for rank in range(num_procs):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE=str(num_procs),
            NODE_RANK="0",
            LOCAL_RANK=str(rank),
        )
        name = f"{worker}{mode}{tag}-{rank}"
        result, log = workdir / f"{name}.json", workdir / f"{name}.log"
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            f"--worker={worker}",
            f"--result={result}",
            f"--mode={mode or 'sync'}",
            *forwarded,
        ]
        with open(log, "w") as log_file:
            proc = subprocess.Popen(
                command,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO_ROOT,
                start_new_session=True,
            )
        procs.append((proc, result, log))
    deadline = time.monotonic() + args.timeout
    try:
        while any(proc.poll() is None for proc, _, _ in procs):
            for proc, _, log in procs:  # one failed server would leave its peer waiting in a collective
                if proc.poll() not in (None, 0):
                    raise RuntimeError(
                        f"{worker} worker exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{worker} ran past --timeout ({args.timeout} s):\n{procs[0][2].read_text()[-3000:]}"
                )
            time.sleep(0.2)
        for proc, _, log in procs:
            if proc.returncode != 0:
                raise RuntimeError(
                    f"{worker} worker exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
                )
    finally:
        for proc, _, _ in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return [json.loads(result.read_text()) for _, result, _ in procs]


def job_epoch(servers: list[dict[str, Any]]) -> float:
    """Median over epochs of the slowest server's epoch time (an epoch ends when its last server ends it)."""
    return statistics.median(max(epoch) for epoch in zip(*(s["epoch_times"] for s in servers)))


def round_order(round_index: int) -> list[str]:
    """The configurations of round ``round_index``, rotated so each one leads a round in turn."""
    modes = list(MODES)
    shift = round_index % len(modes)
    return modes[shift:] + modes[:shift]


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
    print(
        f"graph: {graph['nodes']:,} vertices, {graph['edges']:,} directed edges; "
        f"{args.model.upper()}{f' ({args.heads} heads)' if args.model == 'gat' else ''}, "
        f"{args.servers} graph servers, "
        f"{args.executor_workers} executor worker(s) each, {args.latency_ms:g} ms per request, "
        f"interval size {args.interval_size}; load average {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)"
    )
    print(f"{'configuration':<26}{'s/epoch':>10}{'loss':>16}")
    epochs = {}
    for mode, servers in results.items():
        epochs[mode] = statistics.median(job_epoch(one[mode]) for one in rounds)
        losses = servers[0]["losses"]
        print(
            f"{'staleness=' + str(MODES[mode]):<26}{epochs[mode]:>10.3f}{losses[0]:>8.3f}->{losses[-1]:.3f}"
        )
    if len(rounds) > 1:
        for index, one in enumerate(rounds):
            times = "  ".join(f"{mode} {job_epoch(one[mode]):.3f}" for mode in round_order(index))
            print(f"round {index} (s/epoch, in the order run): {times}")
    if args.profile:
        for mode, servers in results.items():
            for server in servers:
                epochs_run = server["profile"]
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
    print(f"async_speedup={epochs['sync'] / epochs['s1']:.2f} s0_speedup={epochs['sync'] / epochs['s0']:.2f}")


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
    parser.add_argument("--executor-workers", type=int, default=1, help="local executor workers per server")
    parser.add_argument("--threads-per-server", type=int, default=0, help="default: cores // servers")
    parser.add_argument("--interval-size", type=int, default=8192)
    parser.add_argument("--latency-ms", type=float, default=20.0, help="injected round trip per request")
    parser.add_argument("--partitioner", default="metis")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=str(REPO_ROOT / ".cache" / "dorylus"))
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per configuration")
    parser.add_argument("--profile", action="store_true",
                        help="also print, per configuration and server, the seconds blocked on the executor")
    parser.add_argument("--worker", choices=["prepare", "server"], help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=sorted(MODES), default="sync", help=argparse.SUPPRESS)
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
        "executor_workers",
        "interval_size",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.latency_ms < 0:
        parser.error(f"--latency-ms must be >= 0, got {args.latency_ms}")
    if args.threads_per_server == 0:
        args.threads_per_server = max(1, (os.cpu_count() or 1) // args.servers)
    return args


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
                mode: launch(args, "server", workdir, num_procs=args.servers, mode=mode, tag=f"r{index}")
                for mode in round_order(index)
            }
            rounds.append({mode: results[mode] for mode in MODES})
    report(graph, rounds[0], args, rounds)


if __name__ == "__main__":
    main()
