"""Seconds per training epoch and peak memory: PyG full-batch GCN vs Dorylus graph servers.

    python benchmarks/dorylus_epoch.py                                  # 1M vertices, 20M edges (minutes)
    python benchmarks/dorylus_epoch.py --nodes 5000 --epochs 1          # CI size (seconds)

Both sides train the same 2-layer GCN (``features -> hidden -> classes``, ReLU, dropout) full-batch on
the same generated power-law graph:

(a) ``pyg``: ``torch_geometric.nn.GCNConv`` in one process, in its most efficient form: the adjacency is a
    ``torch.sparse_csr`` ``adj_t`` (no per-edge message tensor) with ``cached=True`` normalisation.
(b) ``dorylus``: ``Trainer(strategy="dorylus")`` with ``--servers`` graph servers (one process each, launched
    by this script the way ``torchrun`` would: ``LOCAL_RANK``/``WORLD_SIZE`` in the environment) and the
    ``local`` executor (a pool of worker processes per server, bytes over pipes).

Every measured configuration runs in a fresh process (this script with ``--worker``), so peaks never mix;
workers report JSON files. Epoch time is the median over ``--epochs`` epochs after ``--warmup`` epochs
(for Dorylus: the slowest server's time of each epoch). Peak memory is the kernel's high-water mark
(``VmHWM``) of each process; a graph server's peak adds its executor workers' high-water marks (an upper
bound of what the server and its workers hold at one moment). See docs/dorylus-benchmark.md.

The last line printed is
``vs_pyg=<(b)/(a) epoch time> mem_per_server_vs_pyg=<(b) peak per server / (a) peak>``.
"""

# Only the standard library at module level: the parent process only launches workers and prints, and each
# worker imports just what it measures (the PyG worker never imports Lightning or lightning_dorylus).
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
LR, WEIGHT_DECAY = 0.01, 5e-4  # Adam, the same on both sides (the GCN recipe's values)


# --------------------------------------------------------------------------- memory (Linux /proc)
def _status_kib(pid: int | str, field: str) -> int:
    """One ``kB`` field (``VmHWM``, ``VmRSS``) of ``/proc/<pid>/status``; 0 if the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children, grandchildren, ...), found through ``/proc/*/stat``."""
    parent_of: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        # The command name (field 2) may hold spaces and parentheses: fields resume after the last ')'.
        parent_of[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        children = [child for child, parent in parent_of.items() if parent == current]
        found.extend(children)
        frontier.extend(children)
    return found


def peak_memory_mib() -> dict[str, float]:
    """This process's high-water RSS and that of its live descendants (executor workers), in MiB.

    Call it while the workers are still alive (before the executor is closed).
    """
    workers = _descendants(os.getpid())
    worker_kib = [_status_kib(pid, "VmHWM") for pid in workers]
    own = _status_kib(os.getpid(), "VmHWM")
    return {
        "peak_self_mib": own / 1024,
        "peak_workers_mib": sum(worker_kib) / 1024,
        "num_workers": len(workers),
        "peak_total_mib": (own + sum(worker_kib)) / 1024,
    }


# --------------------------------------------------------------------------- graph + cache
def graph_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The arguments of ``powerlaw_graph`` this run uses (its cache key)."""
    return {
        "num_nodes": args.nodes,
        "avg_degree": args.avg_degree,
        "num_features": args.features,
        "num_classes": args.classes,
        "seed": args.seed,
    }


def generated_graph(args: argparse.Namespace):  # -> torch_geometric.data.Data
    """The generated power-law graph, generated once and then read from ``--cache-dir``."""
    from lightning_dorylus.data.synthetic import powerlaw_graph

    return powerlaw_graph(**graph_kwargs(args), cache_dir=Path(args.cache_dir) / "graphs")


def pyg_cache_file(args: argparse.Namespace) -> Path:
    key = "_".join(f"{k}{v}" for k, v in graph_kwargs(args).items())
    return Path(args.cache_dir) / "pyg" / f"powerlaw_{key}.safetensors"


def run_prepare(args: argparse.Namespace) -> dict[str, Any]:
    """Generate the graph, PyG's CSR adjacency and the Dorylus partitions into the cache (not timed).

    Returns the graph's size and the partition directory the graph servers then read (each only its part).
    """
    import torch
    from safetensors.torch import save_file

    data = generated_graph(args)
    target = pyg_cache_file(args)
    if not target.exists():
        # adj_t[dst, src] = 1: PyG's transposed adjacency, so adj_t @ x aggregates messages at their targets.
        adj_t = torch.sparse_coo_tensor(
            data.edge_index.flip(0), torch.ones(data.num_edges), (data.num_nodes, data.num_nodes)
        ).coalesce().to_sparse_csr()
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        save_file(
            {
                "crow": adj_t.crow_indices().contiguous(),
                "col": adj_t.col_indices().contiguous(),
                "x": data.x.contiguous(),
                "y": data.y.contiguous(),
                "train_mask": data.train_mask.contiguous(),
            },
            str(tmp),
        )
        tmp.rename(target)
    from lightning_dorylus.data import DorylusDataModule

    datamodule = DorylusDataModule(
        data,
        num_parts=args.servers,
        partitioner=args.partitioner,
        interval_size=args.interval_size,
        cache_dir=Path(args.cache_dir) / "partitions",
        seed=args.seed,
    )
    datamodule.prepare_data()
    return {"nodes": int(data.num_nodes), "edges": int(data.num_edges),
            "partition_dir": str(datamodule.resolved_partition_dir())}


# --------------------------------------------------------------------------- (a) PyG full-batch
def run_pyg(args: argparse.Namespace) -> dict[str, Any]:
    """Train PyG's GCNConv full-batch in this process; per-epoch seconds and peak memory."""
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from torch_geometric.nn import GCNConv

    torch.manual_seed(args.seed)
    tensors = load_file(str(pyg_cache_file(args)))
    n = tensors["x"].shape[0]
    # adj_t[dst, src] = 1; GCNConv adds self loops and normalises it once (cached=True).
    crow, col = tensors.pop("crow"), tensors.pop("col")
    adj_t = torch.sparse_csr_tensor(crow, col, torch.ones(col.numel()), size=(n, n))
    del crow, col
    x, y, train_mask = tensors["x"], tensors["y"], tensors["train_mask"]

    class PyGGCN(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = GCNConv(args.features, args.hidden, cached=True)
            self.conv2 = GCNConv(args.hidden, args.classes, cached=True)

        def forward(self, x: torch.Tensor, adj_t: torch.Tensor) -> torch.Tensor:
            x = F.dropout(x, p=args.dropout, training=self.training)
            x = self.conv1(x, adj_t).relu()
            x = F.dropout(x, p=args.dropout, training=self.training)
            return self.conv2(x, adj_t)

    model = PyGGCN()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    num_train = int(train_mask.sum())
    times, losses = [], []
    for _ in range(args.warmup + args.epochs):
        start = time.perf_counter()
        model.train()
        optimizer.zero_grad()
        out = model(x, adj_t)
        loss = F.cross_entropy(out[train_mask], y[train_mask], reduction="sum") / num_train
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    return {"epoch_times": times[args.warmup:], "losses": losses, **peak_memory_mib()}


# --------------------------------------------------------------------------- (b) Dorylus graph servers
def run_dorylus_server(args: argparse.Namespace) -> dict[str, Any]:
    """One graph server (rank from ``LOCAL_RANK``): ``Trainer(strategy="dorylus")`` with a timing callback."""
    from datetime import timedelta

    import lightning.pytorch as pl
    import torch
    from typing_extensions import override

    from lightning_dorylus import DorylusStrategy
    from lightning_dorylus.data import DorylusDataModule
    from lightning_dorylus.models import GCN

    torch.set_num_threads(args.threads_per_server)

    class EpochTimer(pl.Callback):
        """Per-epoch wall time of this server, and its peak memory while its executor workers still live."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []
            self.memory: dict[str, float] = {}
            self._start = 0.0

        @override
        def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self._start = time.perf_counter()

        @override
        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.times.append(time.perf_counter() - self._start)
            loss = trainer.callback_metrics.get("train_loss")
            self.losses.append(float(loss) if loss is not None else float("nan"))

        @override
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.memory = peak_memory_mib()

    timer = EpochTimer()
    strategy = DorylusStrategy(
        executor="local",
        executor_options={"num_workers": args.executor_workers},
        timeout=timedelta(seconds=args.timeout),
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.servers, strategy=strategy, max_epochs=args.warmup + args.epochs,
        callbacks=[timer], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )
    model = GCN(args.features, args.hidden, args.classes, num_layers=2, dropout=args.dropout, lr=LR,
                weight_decay=WEIGHT_DECAY)
    # The partition directory, not the graph: each server reads only its own partition from disk.
    trainer.fit(model, datamodule=DorylusDataModule(args.partition_dir))
    return {"rank": trainer.global_rank, "epoch_times": timer.times[args.warmup:], "losses": timer.losses,
            **timer.memory}


# --------------------------------------------------------------------------- launching workers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_command(args: argparse.Namespace, worker: str, result: Path) -> list[str]:
    forwarded = [f"--{name.replace('_', '-')}={value}" for name, value in vars(args).items()
                 if name not in ("worker", "result")]
    script = str(Path(__file__).resolve())
    return [sys.executable, script, f"--worker={worker}", f"--result={result}", *forwarded]


def launch(args: argparse.Namespace, worker: str, workdir: Path, num_procs: int = 1) -> list[dict[str, Any]]:
    """Run ``num_procs`` fresh processes of ``worker`` (with torchrun-style env when > 1); their JSON results.

    Raises:
        RuntimeError: if a worker fails or runs past ``--timeout``; its output tail is in the message.
    """
    port = _free_port()
    procs = []
    for rank in range(num_procs):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if worker == "dorylus":
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(num_procs),
                       NODE_RANK="0", LOCAL_RANK=str(rank))
        result, log = workdir / f"{worker}{rank}.json", workdir / f"{worker}{rank}.log"
        with open(log, "w") as log_file:
            proc = subprocess.Popen(_worker_command(args, worker, result), stdout=log_file,
                                    stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT, start_new_session=True)
        procs.append((proc, result, log))
    deadline = time.monotonic() + args.timeout
    try:
        # Poll all of them: when one graph server fails, its peer would otherwise wait in a collective.
        while any(proc.poll() is None for proc, _, _ in procs):
            for proc, _, log in procs:
                if proc.poll() not in (None, 0):
                    raise RuntimeError(
                        f"{worker} worker exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
                    )
            if time.monotonic() > deadline:
                tail = procs[0][2].read_text()[-3000:]
                raise RuntimeError(f"{worker} worker ran past --timeout ({args.timeout} s):\n{tail}")
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


def report(graph: dict[str, Any], pyg: dict[str, Any], servers: list[dict[str, Any]]) -> None:
    """Print the table, then the one-line summary (always the last line)."""
    pyg_epoch = statistics.median(pyg["epoch_times"])
    # An epoch of the job ends when its slowest graph server ends it.
    dorylus_epoch = statistics.median(max(epoch) for epoch in zip(*(s["epoch_times"] for s in servers)))
    per_server = max(s["peak_total_mib"] for s in servers)
    print(f"graph: {graph['nodes']:,} vertices, {graph['edges']:,} directed edges")
    print(f"{'configuration':<34}{'s/epoch':>10}{'peak MiB':>10}{'loss':>14}  (peak: process + workers)")
    losses = f"{pyg['losses'][0]:.3f}->{pyg['losses'][-1]:.3f}"
    print(f"{'(a) PyG GCNConv, 1 process':<34}{pyg_epoch:>10.3f}{pyg['peak_total_mib']:>10.0f}{losses:>14}")
    for s in sorted(servers, key=lambda s: s["rank"]):
        label = f"(b) Dorylus server {s['rank']}/{len(servers)}"
        losses = f"{s['losses'][0]:.3f}->{s['losses'][-1]:.3f}"  # the global loss, the same on every server
        print(f"{label:<34}{statistics.median(s['epoch_times']):>10.3f}{s['peak_total_mib']:>10.0f}{losses:>14}"
              f"  ({s['peak_self_mib']:.0f} + {s['peak_workers_mib']:.0f} in {s['num_workers']} workers)")
    label = "(b) Dorylus job (slowest server)"
    print(f"{label:<34}{dorylus_epoch:>10.3f}{per_server:>10.0f}{'':>14}  (max per server)")
    memory_ratio = per_server / pyg["peak_total_mib"]
    print(f"vs_pyg={dorylus_epoch / pyg_epoch:.2f} mem_per_server_vs_pyg={memory_ratio:.2f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1_000_000)
    parser.add_argument("--avg-degree", type=float, default=20.5,
                        help="edge entries per vertex before dedup (20.5: >= 20M edges at 1M vertices)")
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--classes", type=int, default=16)
    parser.add_argument("--dropout", type=float, default=0.5)
    parser.add_argument("--epochs", type=int, default=3, help="measured epochs (after --warmup)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured epochs first")
    parser.add_argument("--servers", type=int, default=2, help="Dorylus graph servers (processes)")
    parser.add_argument("--executor-workers", type=int, default=1, help="local executor workers per server")
    parser.add_argument("--threads-per-server", type=int, default=0,
                        help="torch threads per graph server (default: cores // servers)")
    parser.add_argument("--interval-size", type=int, default=8192,
                        help="vertices per interval (8192 x 128 float32 = 4 MiB: inside a Lambda payload)")
    parser.add_argument("--partitioner", default="metis", help="metis | bfs | contiguous | random")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=str(REPO_ROOT / ".cache" / "dorylus"))
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per measured configuration")
    parser.add_argument("--worker", choices=["prepare", "pyg", "dorylus"], help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--partition-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("nodes", "features", "hidden", "classes", "epochs", "servers", "executor_workers",
                 "interval_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.threads_per_server == 0:
        args.threads_per_server = max(1, (os.cpu_count() or 1) // args.servers)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        run = {"prepare": run_prepare, "pyg": run_pyg, "dorylus": run_dorylus_server}[args.worker]
        Path(args.result).write_text(json.dumps(run(args)))
        return
    with tempfile.TemporaryDirectory(prefix="dorylus_epoch_") as tmp:
        workdir = Path(tmp)
        (graph,) = launch(args, "prepare", workdir)
        args.partition_dir = graph["partition_dir"]
        (pyg,) = launch(args, "pyg", workdir)
        servers = launch(args, "dorylus", workdir, num_procs=args.servers)
    report(graph, pyg, servers)


if __name__ == "__main__":
    main()
