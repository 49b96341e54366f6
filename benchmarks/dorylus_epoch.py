"""Seconds per training epoch and peak memory: PyG full-batch GCN at its best vs Dorylus graph servers.

    python benchmarks/dorylus_epoch.py                                  # 1M vertices, 20M edges (minutes)
    python benchmarks/dorylus_epoch.py --nodes 5000 --epochs 2          # CI size (seconds)

Both sides train the same 2-layer GCN (``features -> hidden -> classes``, ReLU, dropout) full-batch on
the same generated power-law graph, from the same initial weights (written once by the ``prepare`` step;
both sides print the loss of those weights before training, which must agree):

(a) ``pyg``: ``torch_geometric.nn.GCNConv(cached=True)`` in one process, in its fastest form here: the
    adjacency is a ``torch.sparse_csr`` ``adj_t`` (no per-edge message tensor), and the transpose its
    backward needs is built once and cached (as torch-sparse's ``SparseTensor`` does; ``torch.sparse.mm``'s
    own backward rebuilds it every call). Thread counts ``--pyg-threads`` are swept; the best is reported.
(b) ``dorylus``: ``Trainer(strategy="dorylus")`` with ``--servers`` graph servers (one process each, launched
    by this script the way ``torchrun`` would: ``LOCAL_RANK``/``WORLD_SIZE`` in the environment) and the
    ``local`` executor (a pool of worker processes per server, bytes over pipes).

All measured processes run at once but take turns, one epoch at a time (PyG with each thread count, then
the Dorylus job, round after round), so a change of machine load hits every configuration alike. Each turn
is granted by this script through files in a turn directory; nobody computes while another configuration
holds the turn. Workers report JSON files. Epoch time is the median over ``--epochs`` epochs after
``--warmup`` epochs (for Dorylus: the slowest server's time of each epoch). Peak memory is the kernel's
high-water mark (``VmHWM``) of each process; a graph server's peak adds its executor workers' high-water
marks (an upper bound of what the server and its workers hold at one moment). See docs/dorylus-benchmark.md.

``--op-times PATH`` writes the Dorylus servers' measured per-epoch op times (the input of
``python -m lightning_dorylus.value``).

The last line printed is
``vs_pyg=<(b)/(a) epoch time> mem_per_server_vs_pyg=<(b) peak per server / (a) peak>
mem_total_vs_pyg=<(b) peaks of all servers summed / (a) peak>``.
"""

# Only the standard library at module level: the parent process only launches workers and prints, and each
# worker imports just what it measures (the PyG worker never imports Lightning or lightning_dorylus).
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

try:  # imported by the tests, the checkout on sys.path
    from benchmarks import _harness
    from benchmarks import _memory_bound as memory_bound
    from benchmarks._harness import free_port, kill_groups, peak_memory_mib, rank_env, watch
except ImportError:  # run as a script: its own directory is first on sys.path
    import _harness  # type: ignore[no-redef]
    import _memory_bound as memory_bound  # type: ignore[no-redef]
    from _harness import free_port, kill_groups, peak_memory_mib, rank_env, watch

REPO_ROOT = Path(__file__).resolve().parents[1]
LR, WEIGHT_DECAY = 0.01, 5e-4  # Adam, the same on both sides (the GCN recipe's values)


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


def init_weights_file(args: argparse.Namespace) -> Path:
    """Where the initial weights both sides start from are kept (keyed by the model's shape and seed)."""
    key = f"f{args.features}_h{args.hidden}_c{args.classes}_seed{args.seed}"
    return Path(args.cache_dir) / "init" / f"gcn2_{key}.safetensors"


def initial_weights(args: argparse.Namespace) -> dict[str, Any]:
    """Glorot-uniform weights and zero biases (both libraries' GCNConv init), drawn from ``--seed``.

    Layout ``(in, out)`` as Dorylus's ``GCNConv.weight``; PyG's ``lin.weight`` is the transpose.
    """
    import math

    import torch

    generator = torch.Generator().manual_seed(args.seed)
    weights = {}
    for i, (w_in, w_out) in enumerate([(args.features, args.hidden), (args.hidden, args.classes)]):
        bound = math.sqrt(6.0 / (w_in + w_out))
        weights[f"convs.{i}.weight"] = torch.rand(w_in, w_out, generator=generator) * (2 * bound) - bound
        weights[f"convs.{i}.bias"] = torch.zeros(w_out)
    return weights


def run_prepare(args: argparse.Namespace) -> dict[str, Any]:
    """Generate the graph, PyG's CSR adjacency, the initial weights and the Dorylus partitions (not timed).

    Returns the graph's size, the partition directory the graph servers then read (each only its part) and
    this machine's stream bandwidth (one thread's large copy: the memory-traffic bound's rate).
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
    init = init_weights_file(args)
    if not init.exists():
        init.parent.mkdir(parents=True, exist_ok=True)
        save_file(initial_weights(args), str(init.with_suffix(".tmp")))
        init.with_suffix(".tmp").rename(init)
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
    # measured here, alone (the measured processes start after this one ends): the memory-traffic bound's rate
    return {"nodes": int(data.num_nodes), "edges": int(data.num_edges),
            "partition_dir": str(datamodule.resolved_partition_dir()),
            "stream_bytes_per_s": memory_bound.stream_bandwidth()}


# --------------------------------------------------------------------------- turns (interleaving)
class Turns:
    """A worker's side of the turn-taking: wait for ``<name>.<k>.go``, work, write ``<name>.<k>.done<rank>``.

    With no turn directory (a worker run by hand) every turn is granted at once.
    """

    def __init__(self, directory: str, name: str, rank: int = 0, timeout: float = 3600.0) -> None:
        self.directory = Path(directory) if directory else None
        self.name, self.rank, self.timeout = name, rank, timeout

    def wait(self, turn: int) -> None:
        """Block until turn ``turn`` is granted (polls every millisecond; not inside any timed region)."""
        if self.directory is None:
            return
        go = self.directory / f"{self.name}.{turn}.go"
        parent, deadline = os.getppid(), time.monotonic() + self.timeout
        while not go.exists():
            if os.getppid() != parent or time.monotonic() > deadline:
                raise RuntimeError(f"turn {go.name} was never granted (the benchmark's parent is gone or "
                                   f"--timeout {self.timeout} s passed)")
            time.sleep(0.001)

    def done(self, turn: int) -> None:
        if self.directory is not None:
            (self.directory / f"{self.name}.{turn}.done{self.rank}").touch()


# --------------------------------------------------------------------------- (a) PyG full-batch
def run_pyg(args: argparse.Namespace) -> dict[str, Any]:
    """Train PyG's GCNConv full-batch in this process, one epoch per turn, cycling through the thread counts.

    Returns per-thread-count epoch seconds, the loss of the initial weights, training losses, peak memory.
    """
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from torch_geometric.nn import GCNConv

    class CachedTransposeSpMM(torch.autograd.Function):
        """``adj @ x`` whose backward multiplies by a transpose built once, not by one rebuilt every call."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, adj: torch.Tensor,
                    adj_transposed: torch.Tensor) -> torch.Tensor:
            ctx.adj_transposed = adj_transposed
            return torch.sparse.mm(adj, x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
            return torch.sparse.mm(ctx.adj_transposed, grad.contiguous()), None, None

    transposes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def cached_transpose(adj: torch.Tensor) -> torch.Tensor:
        """``adjᵀ`` as CSR, computed on first use; ``adj`` itself when it is symmetric (undirected graphs)."""
        if id(adj) not in transposes:
            adj_transposed = adj.t().to_sparse_csr()
            if (torch.equal(adj_transposed.crow_indices(), adj.crow_indices())
                    and torch.equal(adj_transposed.col_indices(), adj.col_indices())
                    and torch.equal(adj_transposed.values(), adj.values())):
                adj_transposed = adj  # symmetric: the transpose costs no memory
            transposes[id(adj)] = (adj, adj_transposed)  # holding adj keeps its id from being reused
        return transposes[id(adj)][1]

    class CachedGCNConv(GCNConv):
        """PyG's ``GCNConv`` with the sparse product's transpose cached (what torch-sparse would give it)."""

        def message_and_aggregate(self, adj_t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return CachedTransposeSpMM.apply(x, adj_t, cached_transpose(adj_t))

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
            conv = CachedGCNConv if args.pyg_transpose == "cached" else GCNConv
            self.conv1 = conv(args.features, args.hidden, cached=True)
            self.conv2 = conv(args.hidden, args.classes, cached=True)

        def forward(self, x: torch.Tensor, adj_t: torch.Tensor) -> torch.Tensor:
            x = F.dropout(x, p=args.dropout, training=self.training)
            x = self.conv1(x, adj_t).relu()
            x = F.dropout(x, p=args.dropout, training=self.training)
            return self.conv2(x, adj_t)

    model = PyGGCN()
    init = load_file(str(init_weights_file(args)))
    with torch.no_grad():
        for i, conv in enumerate((model.conv1, model.conv2)):
            conv.lin.weight.copy_(init[f"convs.{i}.weight"].t())
            conv.bias.copy_(init[f"convs.{i}.bias"])
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    num_train = int(train_mask.sum())

    def loss_of(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out[train_mask], y[train_mask], reduction="sum") / num_train

    model.eval()
    with torch.no_grad():  # also builds the cached normalisation (not timed)
        initial_loss = float(loss_of(model(x, adj_t)))
    turns = Turns(args.turn_dir, "pyg", timeout=args.timeout)
    threads = args.pyg_threads
    times: dict[str, list[float]] = {str(t): [] for t in threads}
    losses = []
    for epoch in range(args.warmup + args.epochs):
        # One training step per round, as Dorylus: every thread count times the same step from the same
        # state (restored between them, untimed); the last one's step is kept.
        start_state = (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()))
        for i, num_threads in enumerate(threads):
            if i > 0:
                model.load_state_dict(start_state[0])
                optimizer.load_state_dict(start_state[1])
            torch.set_num_threads(num_threads)
            turn = epoch * len(threads) + i
            turns.wait(turn)
            start = time.perf_counter()
            model.train()
            optimizer.zero_grad()
            loss = loss_of(model(x, adj_t))
            loss.backward()
            optimizer.step()
            times[str(num_threads)].append(time.perf_counter() - start)
            turns.done(turn)
        losses.append(float(loss.detach()))
    return {"epoch_times_by_threads": {t: v[args.warmup:] for t, v in times.items()},
            "initial_loss": initial_loss, "losses": losses, **peak_memory_mib()}


# --------------------------------------------------------------------------- (b) Dorylus graph servers
def run_dorylus_server(args: argparse.Namespace) -> dict[str, Any]:
    """One graph server (rank from ``LOCAL_RANK``): ``Trainer(strategy="dorylus")`` with a timing callback."""
    from datetime import timedelta

    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from typing_extensions import override

    from lightning_dorylus import DorylusStrategy
    from lightning_dorylus.data import DorylusDataModule
    from lightning_dorylus.executors import build_executor
    from lightning_dorylus.models import GCN
    from lightning_dorylus.value import TimedExecutor

    torch.set_num_threads(args.threads_per_server)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    executor = TimedExecutor(build_executor("local", num_workers=args.executor_workers))

    class EpochTimer(pl.Callback):
        """Per-epoch wall time of this server (one turn each), loss of the initial weights, peak memory."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []
            self.initial_loss = float("nan")
            self.memory: dict[str, float] = {}
            self.turns = Turns(args.turn_dir, "dorylus", rank=rank, timeout=args.timeout)
            self._start = 0.0
            self._untimed = 0.0
            self.cpu: list[tuple[float, float]] = []  # per epoch: CPU s of this server, of its workers
            self._cpu = (0.0, 0.0)

        def _cpu_now(self) -> tuple[float, float]:
            """CPU seconds so far of this server process (all its threads) and of its executor workers."""
            workers = _harness.descendants(os.getpid())
            return time.process_time(), sum(_harness.cpu_seconds(pid) for pid in workers)

        @override
        def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.turns.wait(trainer.current_epoch)
            executor.start_epoch(trainer.current_epoch)
            self._untimed = 0.0
            self._cpu = self._cpu_now()
            self._start = time.perf_counter()

        @override
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                                 batch_idx: int) -> None:
            if trainer.current_epoch > 0 or batch_idx > 0:
                return
            start = time.perf_counter()  # the loss of the initial weights, as PyG's; not part of the epoch
            pl_module.eval()
            with torch.no_grad():
                logits = pl_module(pl_module.graph(batch))
                mask = batch.train_mask
                loss = F.cross_entropy(logits[mask], batch.y[mask], reduction="sum") / batch.num_train_global
                self.initial_loss = float(trainer.strategy.reduce(loss, reduce_op="sum"))
            pl_module.train()
            executor.start_epoch(trainer.current_epoch)  # forget the eval forward's ops
            self._untimed = time.perf_counter() - start

        @override
        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.times.append(time.perf_counter() - self._start - self._untimed)
            now = self._cpu_now()
            self.cpu.append((now[0] - self._cpu[0], now[1] - self._cpu[1]))
            executor.end_epoch(self.times[-1])
            loss = trainer.callback_metrics.get("train_loss")
            self.losses.append(float(loss) if loss is not None else float("nan"))
            self.turns.done(trainer.current_epoch)

        @override
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.memory = peak_memory_mib()

    timer = EpochTimer()
    strategy = DorylusStrategy(executor=executor, timeout=timedelta(seconds=args.timeout))
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.servers, strategy=strategy, max_epochs=args.warmup + args.epochs,
        callbacks=[timer], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )
    model = GCN(args.features, args.hidden, args.classes, num_layers=2, dropout=args.dropout, lr=LR,
                weight_decay=WEIGHT_DECAY)
    model.load_state_dict(load_file(str(init_weights_file(args))))
    datamodule = DorylusDataModule(args.partition_dir)
    try:
        # The partition directory, not the graph: each server reads only its own partition from disk.
        trainer.fit(model, datamodule=datamodule)
    finally:
        executor.close()
    cpu = timer.cpu[args.warmup:]
    return {"rank": trainer.global_rank, "epoch_times": timer.times[args.warmup:], "losses": timer.losses,
            "initial_loss": timer.initial_loss, "op_epochs": executor.epochs[args.warmup:], **timer.memory,
            "cpu_s": statistics.mean(c[0] for c in cpu), "worker_cpu_s": statistics.mean(c[1] for c in cpu),
            "bytes": memory_bound.partition_bytes(datamodule.partition, args.features, args.hidden,
                                                  args.classes)}


# --------------------------------------------------------------------------- launching workers
def _worker_command(args: argparse.Namespace, worker: str, result: Path) -> list[str]:
    forwarded = []
    for name, value in vars(args).items():
        if name in ("worker", "result") or value is None:
            continue
        if isinstance(value, bool):  # store_true flags
            forwarded.extend([f"--{name.replace('_', '-')}"] if value else [])
            continue
        if isinstance(value, list):
            value = ",".join(str(v) for v in value)
        forwarded.append(f"--{name.replace('_', '-')}={value}")
    script = str(Path(__file__).resolve())
    return [sys.executable, script, f"--worker={worker}", f"--result={result}", *forwarded]


def launch(args: argparse.Namespace, worker: str, workdir: Path, num_procs: int = 1) -> list[dict[str, Any]]:
    """Run ``num_procs`` fresh processes of ``worker`` (with torchrun-style env when > 1); their JSON results.

    Raises:
        RuntimeError: if a worker fails or runs past ``--timeout``; its output tail is in the message.
    """
    return launch_together(args, [(worker, num_procs)], workdir)[worker]


def launch_together(args: argparse.Namespace, groups: list[tuple[str, int]], workdir: Path,
                    turns: list[tuple[str, int, int]] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Start every group ``(worker, num_procs)`` at once, grant ``turns`` one by one, collect the results.

    A turn ``(name, index, acks)`` is granted by creating ``<turn dir>/<name>.<index>.go`` and is over when
    ``acks`` processes have written their ``.done<rank>`` file; only then is the next one granted.

    Raises:
        RuntimeError: if a worker fails or the run outlives ``--timeout``; its output tail is in the message.
    """
    procs = []
    for worker, num_procs in groups:
        port = free_port()
        for rank in range(num_procs):
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            if worker == "dorylus":
                env = rank_env(env, rank, num_procs, port)
            result, log = workdir / f"{worker}{rank}.json", workdir / f"{worker}{rank}.log"
            with open(log, "w") as log_file:
                proc = subprocess.Popen(_worker_command(args, worker, result), stdout=log_file,
                                        stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
                                        start_new_session=True)
            procs.append((worker, proc, result, log))
    pending = list(turns or [])
    granted = [False]
    turn_dir = Path(args.turn_dir) if args.turn_dir else workdir

    def grant_turns() -> float:
        """Grant the next turn once every process of the current one has acknowledged it."""
        while pending:
            name, index, acks = pending[0]
            if not granted[0]:
                (turn_dir / f"{name}.{index}.go").touch()
                granted[0] = True
            if not all((turn_dir / f"{name}.{index}.done{r}").exists() for r in range(acks)):
                return 0.002
            pending.pop(0)
            granted[0] = False
        return 0.2

    try:
        # Fails as soon as one fails: when one graph server fails, its peer would wait in a collective.
        failure = watch([proc for _, proc, _, _ in procs], args.timeout, tick=grant_turns)
        # what ended on its own, before the rest is killed (a SIGKILL here is the kernel's OOM killer)
        died = [(w, proc.returncode, log) for w, proc, _, log in procs if proc.poll() not in (None, 0)]
    finally:
        kill_groups([proc for _, proc, _, _ in procs])
    if failure and died:
        worker, code, log = died[0]
        how = "was SIGKILLed (out of memory?)" if code == -9 else f"exited with {code}"
        raise RuntimeError(f"{worker} worker {how}:\n{log.read_text()[-3000:]}")
    if failure:
        worker, _, _, log = procs[0]
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"{worker} worker ran past --timeout ({args.timeout} s):\n{tail}")
    results: dict[str, list[dict[str, Any]]] = {worker: [] for worker, _ in groups}
    for worker, _, result, _ in procs:
        results[worker].append(json.loads(result.read_text()))
    return results


def interleaved_turns(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """Round after round: one PyG epoch per thread count, then one Dorylus epoch (all servers)."""
    turns = []
    for epoch in range(args.warmup + args.epochs):
        for i in range(len(args.pyg_threads)):
            turns.append(("pyg", epoch * len(args.pyg_threads) + i, 1))
        turns.append(("dorylus", epoch, args.servers))
    return turns


def summarize(pyg: dict[str, Any], servers: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of the report: best PyG thread count, the job's epoch (slowest server), memory ratios."""
    by_threads = {t: statistics.median(v) for t, v in pyg["epoch_times_by_threads"].items()}
    best_threads = min(by_threads, key=by_threads.__getitem__)
    # An epoch of the job ends when its slowest graph server ends it.
    dorylus_epoch = statistics.median(max(epoch) for epoch in zip(*(s["epoch_times"] for s in servers)))
    per_server = max(s["peak_total_mib"] for s in servers)
    total = sum(s["peak_total_mib"] for s in servers)
    return {
        "pyg_epoch_by_threads": by_threads, "pyg_best_threads": best_threads,
        "pyg_epoch": by_threads[best_threads], "dorylus_epoch": dorylus_epoch,
        "mem_per_server_mib": per_server, "mem_total_mib": total, "pyg_mem_mib": pyg["peak_total_mib"],
        "vs_pyg": dorylus_epoch / by_threads[best_threads],
        "mem_per_server_vs_pyg": per_server / pyg["peak_total_mib"],
        "mem_total_vs_pyg": total / pyg["peak_total_mib"],
    }


def report(graph: dict[str, Any], pyg: dict[str, Any], servers: list[dict[str, Any]]) -> dict[str, Any]:
    """Print the table, then the one-line summary (always the last line); returns the summary figures."""
    s = summarize(pyg, servers)
    print(f"graph: {graph['nodes']:,} vertices, {graph['edges']:,} directed edges")
    print(f"{'configuration':<36}{'s/epoch':>9}{'peak MiB':>10}{'loss0':>8}{'loss':>14}  "
          "(loss0: initial weights, no dropout; peak: process + workers)")
    losses = f"{pyg['losses'][0]:.3f}->{pyg['losses'][-1]:.3f}"
    for threads, epoch in s["pyg_epoch_by_threads"].items():
        best = "  best" if threads == s["pyg_best_threads"] else ""
        label = f"(a) PyG GCNConv, 1 process, {threads} thr"
        print(f"{label:<36}{epoch:>9.3f}{pyg['peak_total_mib']:>10.0f}{pyg['initial_loss']:>8.4f}{losses:>14}"
              f"{best}")
    for server in sorted(servers, key=lambda server: server["rank"]):
        label = f"(b) Dorylus server {server['rank']}/{len(servers)}"
        losses = f"{server['losses'][0]:.3f}->{server['losses'][-1]:.3f}"  # the global loss, same on all
        print(f"{label:<36}{statistics.median(server['epoch_times']):>9.3f}{server['peak_total_mib']:>10.0f}"
              f"{server['initial_loss']:>8.4f}{losses:>14}  ({server['peak_self_mib']:.0f} + "
              f"{server['peak_workers_mib']:.0f} in {server['num_workers']} workers)")
    label = "(b) Dorylus job (slowest server)"
    print(f"{label:<36}{s['dorylus_epoch']:>9.3f}{s['mem_per_server_mib']:>10.0f}{'':>8}{'':>14}  "
          f"(max per server; all servers: {s['mem_total_mib']:.0f} MiB)")
    if "stream_bytes_per_s" in graph and all("bytes" in server for server in servers):
        for line in memory_bound.describe(servers, graph["stream_bytes_per_s"]):
            print(f"(b) {line}")
    print(f"vs_pyg={s['vs_pyg']:.2f} mem_per_server_vs_pyg={s['mem_per_server_vs_pyg']:.2f} "
          f"mem_total_vs_pyg={s['mem_total_vs_pyg']:.2f}")
    return s


def _thread_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated thread counts, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected thread counts >= 1, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1_000_000)
    parser.add_argument("--avg-degree", type=float, default=20.5,
                        help="edge entries per vertex before dedup (20.5: >= 20M edges at 1M vertices)")
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--classes", type=int, default=16)
    parser.add_argument("--dropout", type=float, default=0.5)
    parser.add_argument("--epochs", type=int, default=5, help="measured epochs (after --warmup)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured epochs first")
    parser.add_argument("--servers", type=int, default=2, help="Dorylus graph servers (processes)")
    parser.add_argument("--executor-workers", type=int, default=1, help="local executor workers per server")
    parser.add_argument("--threads-per-server", type=int, default=0,
                        help="torch threads per graph server (default: cores // servers)")
    parser.add_argument("--pyg-threads", type=_thread_list, default=None,
                        help="PyG thread counts to sweep, comma-separated (default: the powers of two up "
                             "to the cores this process may use, and that count)")
    parser.add_argument("--pyg-transpose", choices=["cached", "per-call"], default="cached",
                        help="cached: the backward's transposed adjacency is built once (default); per-call: "
                             "torch.sparse.mm's own backward, which rebuilds it every epoch")
    parser.add_argument("--interval-size", type=int, default=8192,
                        help="vertices per interval (8192 x 128 float32 = 4 MiB: inside a Lambda payload)")
    parser.add_argument("--partitioner", default="metis", help="metis | bfs | contiguous | random")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=str(REPO_ROOT / ".cache" / "dorylus"))
    parser.add_argument("--op-times", default="",
                        help="write the Dorylus servers' measured op times here (lightning_dorylus.value)")
    parser.add_argument("--only", choices=["pyg", "dorylus"], default=None,
                        help="measure one side alone (a graph too large for both at once); no summary line")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per measured configuration")
    parser.add_argument("--worker", choices=["prepare", "pyg", "dorylus"], help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--partition-dir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--turn-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("nodes", "features", "hidden", "classes", "epochs", "servers", "executor_workers",
                 "interval_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if not 0.0 <= args.dropout < 1.0:
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}")
    cores = os.cpu_count() or 1
    if args.threads_per_server == 0:
        args.threads_per_server = max(1, cores // args.servers)
    if args.pyg_threads is None:  # PyG at its best: every power of two up to the cores it may use, and those
        usable = len(os.sched_getaffinity(0))
        args.pyg_threads = sorted({2**k for k in range(usable.bit_length()) if 2**k <= usable} | {usable})
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
        args.turn_dir = str(workdir)
        if args.only is not None:
            count = 1 if args.only == "pyg" else args.servers
            rounds = (args.warmup + args.epochs) * (len(args.pyg_threads) if args.only == "pyg" else 1)
            turns = [(args.only, k, count) for k in range(rounds)]
            results = launch_together(args, [(args.only, count)], workdir, turns)
        else:
            results = launch_together(args, [("pyg", 1), ("dorylus", args.servers)], workdir,
                                      interleaved_turns(args))
    if args.op_times and "dorylus" in results:
        write_op_times(Path(args.op_times), args, graph, results["dorylus"])
    if args.only is not None:
        report_one_side(graph, args.only, results[args.only])
        return
    report(graph, results["pyg"][0], results["dorylus"])


def write_op_times(path: Path, args: argparse.Namespace, graph: dict[str, Any],
                   servers: list[dict[str, Any]]) -> None:
    """The measured run, as ``lightning_dorylus.value`` reads it (see ``docs/dorylus-value.md``)."""
    run = {
        "format": "dorylus-op-times/1",
        "graph": {"nodes": graph["nodes"], "edges": graph["edges"]},
        "model": {"name": "GCN", "layers": 2, "features": args.features, "hidden": args.hidden,
                  "classes": args.classes},
        "servers": args.servers,
        "threads_per_server": args.threads_per_server,
        "executor": {"name": "local", "num_workers": args.executor_workers},
        "interval_size": args.interval_size,
        "epochs": [
            {"rank": server["rank"], **epoch} for server in sorted(servers, key=lambda s: s["rank"])
            for epoch in server["op_epochs"]
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run, indent=1))


def report_one_side(graph: dict[str, Any], side: str, results: list[dict[str, Any]]) -> None:
    """One side's figures alone (``--only``): the other side was not run, so there is no ratio."""
    print(f"graph: {graph['nodes']:,} vertices, {graph['edges']:,} directed edges")
    if side == "pyg":
        (pyg,) = results
        for threads, times in pyg["epoch_times_by_threads"].items():
            print(f"(a) PyG GCNConv, {threads} thr: {statistics.median(times):.3f} s/epoch, peak "
                  f"{pyg['peak_total_mib']:.0f} MiB, loss0 {pyg['initial_loss']:.4f}, loss "
                  f"{pyg['losses'][0]:.3f}->{pyg['losses'][-1]:.3f}")
        return
    epoch = statistics.median(max(e) for e in zip(*(s["epoch_times"] for s in results)))
    for server in sorted(results, key=lambda server: server["rank"]):
        median = statistics.median(server["epoch_times"])
        print(f"(b) Dorylus server {server['rank']}/{len(results)}: {median:.3f} s/epoch, peak "
              f"{server['peak_total_mib']:.0f} MiB ({server['peak_self_mib']:.0f} + "
              f"{server['peak_workers_mib']:.0f} in workers), loss0 {server['initial_loss']:.4f}, loss "
              f"{server['losses'][0]:.3f}->{server['losses'][-1]:.3f}")
    print(f"dorylus_epoch_s={epoch:.3f} mem_per_server_mib={max(s['peak_total_mib'] for s in results):.0f} "
          f"mem_total_mib={sum(s['peak_total_mib'] for s in results):.0f} (PyG not run: --only dorylus)")


if __name__ == "__main__":
    main()
