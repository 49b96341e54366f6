"""Time to a target validation accuracy: mini-batch, PyG full-graph, one GPU, Dorylus; one generated graph.

    python benchmarks/dorylus_tta.py                                   # 100k vertices, 3 rounds (an hour)
    python benchmarks/dorylus_tta.py --nodes 3000 --target 0.5 --rounds 1 --max-epochs 6   # CI size

The graph is :func:`lightning_dorylus.data.synthetic.powerlaw_graph`: a degree-corrected stochastic block
model (power-law degrees, 80 % of edges inside a class) whose features are the class centroid plus strong
noise, so one vertex's features are a weak signal and its neighbourhood's mean a strong one. Every
configuration trains the same 2-layer GCN (``features -> hidden -> classes``, ReLU, dropout 0.5, Adam lr
0.01, weight decay 5e-4) from the same initial weights (Glorot, zero bias; written once by ``prepare``) and
stops at the first epoch after which the validation accuracy reaches ``--target``:

* ``pyg-<adj>-t<k>``: PyG ``GCNConv(cached=True)`` full-graph in one process with ``k`` threads and the
  adjacency as ``edge_index`` (``ei``) or as a ``torch.sparse_csr`` ``adj_t`` (``csr``; its backward's
  transpose cached, as torch-sparse's ``SparseTensor`` does). The report takes the best of these.
* ``minibatch-t<k>``: PyG's usual mini-batch recipe (``NeighborLoader``: fanout [10, 10], batch 1024 shuffled
  train seeds, ``GCNConv`` on the sampled subgraph, loss on the seeds). ``NeighborLoader`` needs pyg-lib or
  torch-sparse; where neither imports, the sampler is this file's torch re-implementation of the same
  recipe (uniform sampling without replacement of up to ``fanout`` in-neighbours per vertex and hop, the
  sampled edges only, seeds first). The report says which ran. Validation is full-graph inference, as
  PyG's examples do it. ``k`` threads as above; the report takes the best (on a loaded 2-core machine one
  thread was 10x faster per batch than two: OpenMP threads spin at the barriers of many small ops).
* ``gpu``: the best full-graph PyG form on one CUDA device (skipped where ``torch.cuda`` has none).
* ``d<n>-<mode>[-lat]``: ``Trainer(strategy=DorylusStrategy(staleness=...))`` on ``n`` graph servers (one
  process each, launched the way ``torchrun`` would), ``mode`` ``sync`` (``staleness=None``) or ``s1``
  (``staleness=1``; ``--modes`` adds others, ``s2`` for ``staleness=2``), the ``local`` executor; ``-lat``
  adds ``--latency-ms`` of round trip to every tensor-op request (``dorylus_pipeline.make_delayed_executor``:
  the way a Lambda invocation would), the latency the pipeline exists to hide.

Each configuration runs in fresh processes; ``--rounds`` rounds run every configuration once, round ``r``
starting with configuration ``r mod n`` (interleaved: the load of a shared machine drifts), and the
figures are medians over rounds. Per run: the epochs to the target, ``fit`` seconds (the training epochs
up to the target; validation is not counted for anyone) and ``launch`` seconds (process start to the
target, validation excluded: imports, graph load, Dorylus's graph check and process group included), the
validation accuracy of every epoch, test accuracy at the target (full-graph PyG runs and mini-batch) and
peak memory (``VmHWM``; for Dorylus, of all servers and their executor workers summed).

The last line printed is ``minibatch_vs_fullgraph=<s/s> dorylus2_vs_pyg_full=<s/s> staleness1_vs_sync=<s/s>
staleness1_vs_sync_latency=<s/s>``: ratios of median fit-to-target seconds (mini-batch / best PyG
full-graph; Dorylus 2 servers synchronous / best PyG full-graph; 2 servers ``staleness=1`` / synchronous,
without and with the round trip). A configuration that never reaches the target counts as ``inf``.
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
    from benchmarks._harness import free_port, kill_groups, peak_memory_mib, rank_env, watch
except ImportError:  # run as a script: its own directory is first on sys.path
    from _harness import free_port, kill_groups, peak_memory_mib, rank_env, watch  # type: ignore[no-redef]

REPO_ROOT = Path(__file__).resolve().parents[1]
LR, WEIGHT_DECAY, DROPOUT = 0.01, 5e-4, 0.5
FANOUT, BATCH_SIZE = (10, 10), 1024


# --------------------------------------------------------------------------- configurations
def configurations(args: argparse.Namespace) -> list[str]:
    """Every configuration one round runs, in the order of round 0."""
    configs = [f"pyg-{adj}-t{t}" for adj in ("csr", "ei") for t in args.pyg_threads]
    configs += [f"minibatch-t{t}" for t in args.pyg_threads]
    if args.gpu:
        configs.append("gpu")
    for servers in args.servers:
        for mode in args.modes:
            configs.append(f"d{servers}-{mode}")
            if args.latency_ms > 0:
                configs.append(f"d{servers}-{mode}-lat")
    if args.configs:
        unknown = sorted(set(args.configs) - set(configs))
        if unknown:
            raise SystemExit(f"--configs: unknown {unknown}; this run's configurations are {configs}")
        configs = [c for c in configs if c in args.configs]
    return configs


def round_order(configs: list[str], round_index: int) -> list[str]:
    shift = round_index % len(configs)
    return configs[shift:] + configs[:shift]


# --------------------------------------------------------------------------- files written once
def cache_paths(args: argparse.Namespace) -> dict[str, Path]:
    key = f"n{args.nodes}_d{args.avg_degree:g}_f{args.features}_c{args.classes}_s{args.seed}"
    root = Path(args.cache_dir)
    return {"graphs": root / "graphs", "partitions": root / "partitions",
            "init": root / "init" / f"gcn2_{key}_h{args.hidden}.safetensors"}


def generated_graph(args: argparse.Namespace):  # -> torch_geometric.data.Data
    from lightning_dorylus.data.synthetic import powerlaw_graph

    return powerlaw_graph(num_nodes=args.nodes, avg_degree=args.avg_degree, num_features=args.features,
                          num_classes=args.classes, seed=args.seed, cache_dir=cache_paths(args)["graphs"])


def run_prepare(args: argparse.Namespace) -> dict[str, Any]:
    """The graph, the initial weights and every server count's partitions (not timed)."""
    import math as m

    import torch
    from safetensors.torch import save_file

    from lightning_dorylus.data import DorylusDataModule

    data = generated_graph(args)
    init = cache_paths(args)["init"]
    if not init.exists():
        generator = torch.Generator().manual_seed(args.seed)
        weights = {}
        for i, (w_in, w_out) in enumerate([(args.features, args.hidden), (args.hidden, args.classes)]):
            bound = m.sqrt(6.0 / (w_in + w_out))  # Glorot uniform: both libraries' GCNConv init
            weights[f"convs.{i}.weight"] = torch.rand(w_in, w_out, generator=generator) * (2 * bound) - bound
            weights[f"convs.{i}.bias"] = torch.zeros(w_out)
        init.parent.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(init.with_suffix(".tmp")))
        init.with_suffix(".tmp").rename(init)
    partition_dirs = {}
    for servers in args.servers:
        datamodule = DorylusDataModule(data, num_parts=servers, partitioner="metis", interval_size=8192,
                                       cache_dir=cache_paths(args)["partitions"], seed=args.seed)
        datamodule.prepare_data()
        partition_dirs[str(servers)] = str(datamodule.resolved_partition_dir())
    try:
        import torch_geometric.loader  # noqa: F401
        from torch_geometric.typing import WITH_PYG_LIB, WITH_TORCH_SPARSE
        neighbor_loader = bool(WITH_PYG_LIB or WITH_TORCH_SPARSE)
    except ImportError:
        neighbor_loader = False
    return {"nodes": int(data.num_nodes), "edges": int(data.num_edges),
            "partition_dirs": partition_dirs, "neighbor_loader": neighbor_loader,
            "gpu": torch.cuda.is_available()}


# --------------------------------------------------------------------------- PyG side (one process)
def pyg_model(args: argparse.Namespace, cached: bool):  # -> torch.nn.Module
    """PyG's 2-layer GCN with the shared initial weights (``lin.weight`` is Dorylus's weight transposed)."""
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from torch_geometric.nn import GCNConv

    class PyGGCN(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = GCNConv(args.features, args.hidden, cached=cached)
            self.conv2 = GCNConv(args.hidden, args.classes, cached=cached)

        def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
            x = F.dropout(x, p=DROPOUT, training=self.training)
            x = self.conv1(x, adj).relu()
            x = F.dropout(x, p=DROPOUT, training=self.training)
            return self.conv2(x, adj)

    model = PyGGCN()
    init = load_file(str(cache_paths(args)["init"]))
    with torch.no_grad():
        for i, conv in enumerate((model.conv1, model.conv2)):
            conv.lin.weight.copy_(init[f"convs.{i}.weight"].t())
            conv.bias.copy_(init[f"convs.{i}.bias"])
    return model


def symmetric_csr(edge_index, num_nodes: int):  # -> torch.Tensor (sparse CSR)
    """``adj_t[dst, src] = 1`` as ``torch.sparse_csr``, its autograd backward multiplying by ``adj_t`` itself
    (the generated graph is symmetric and ``gcn_norm`` keeps it so: the transpose torch would rebuild every
    backward is the matrix itself, what torch-sparse's cached ``SparseTensor`` transpose gives PyG)."""
    import torch

    return torch.sparse_coo_tensor(edge_index.flip(0), torch.ones(edge_index.size(1)),
                                   (num_nodes, num_nodes)).coalesce().to_sparse_csr()


def _install_cached_transpose() -> None:
    """``GCNConv.message_and_aggregate`` for a sparse ``adj_t``: its backward reuses ``adj_t`` (symmetric)."""
    import torch
    from torch_geometric.nn import GCNConv

    class SymmetricSpMM(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
            ctx.adj = adj
            return torch.sparse.mm(adj, x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            return torch.sparse.mm(ctx.adj, grad.contiguous()), None

    def message_and_aggregate(self: Any, adj_t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return SymmetricSpMM.apply(x, adj_t)

    GCNConv.message_and_aggregate = message_and_aggregate  # this worker process's own PyG, nobody else's


def accuracy(out, y, mask) -> float:
    return float((out[mask].argmax(-1) == y[mask]).float().mean())


def run_pyg(args: argparse.Namespace) -> dict[str, Any]:
    """Full-graph PyG (``--adj``, ``--threads``; ``--device cuda`` for the GPU row) to the target."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data = generated_graph(args)
    device = torch.device(args.device)
    x, y = data.x.to(device), data.y.to(device)
    masks = {k: getattr(data, f"{k}_mask").to(device) for k in ("train", "val", "test")}
    if args.adj == "csr":
        _install_cached_transpose()
        adj = symmetric_csr(data.edge_index, data.num_nodes).to(device)
    else:
        adj = data.edge_index.to(device)
    model = pyg_model(args, cached=True).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    trace = Trace(args)
    for _epoch in range(args.max_epochs):
        trace.start_epoch()
        model.train()
        optimizer.zero_grad()
        out = model(x, adj)
        F.cross_entropy(out[masks["train"]], y[masks["train"]]).backward()
        optimizer.step()
        sync()
        trace.end_epoch()
        model.eval()
        with torch.no_grad():
            out = model(x, adj)
        if trace.validated(accuracy(out, y, masks["val"]), lambda o=out: accuracy(o, y, masks["test"])):
            break
    return {**trace.result(), **peak_memory_mib()}


class Trace:
    """Per-epoch seconds and validation accuracy of one run, and where it reached the target."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.target, self.launched = args.target, args.launched_at
        self.first_start = 0.0
        self.epochs: list[float] = []
        self.val: list[float] = []
        self.test = float("nan")
        self.reached: int | None = None
        self._start = 0.0

    def start_epoch(self) -> None:
        self._start = time.perf_counter()
        if not self.epochs:
            self.first_start = time.time()

    def end_epoch(self) -> None:
        self.epochs.append(time.perf_counter() - self._start)

    def validated(self, val_acc: float, test_acc: Any = None) -> bool:
        """Record this epoch's validation accuracy; True (stop) once it reaches the target."""
        self.val.append(val_acc)
        if self.reached is None and val_acc >= self.target:
            self.reached = len(self.val)
            self.test = test_acc() if test_acc is not None else float("nan")
        return self.reached is not None

    def result(self) -> dict[str, Any]:
        fit = sum(self.epochs[: self.reached]) if self.reached else math.inf
        return {"epoch_s": self.epochs, "val_acc": self.val, "epochs_to_target": self.reached,
                "fit_s": fit, "startup_s": self.first_start - self.launched,
                "launch_s": self.first_start - self.launched + fit, "test_acc": self.test}


# --------------------------------------------------------------------------- mini-batch (one process)
class NeighborSampler:
    """PyG ``NeighborLoader``'s recipe in torch: per hop, up to ``fanout`` distinct in-neighbours of every
    frontier vertex drawn uniformly without replacement; the batch's subgraph holds the sampled edges only,
    its vertices numbered seeds first, then each hop's new vertices (as PyG relabels them)."""

    def __init__(self, edge_index, num_nodes: int, fanout: tuple[int, ...], generator) -> None:
        import torch

        order = torch.argsort(edge_index[1], stable=True)  # CSC: incoming edges grouped by destination
        self.src = edge_index[0][order]
        self.ptr = torch.zeros(num_nodes + 1, dtype=torch.long)
        self.ptr[1:] = torch.cumsum(torch.bincount(edge_index[1], minlength=num_nodes), 0)
        self.num_nodes, self.fanout, self.generator = num_nodes, fanout, generator

    def sample(self, seeds):  # -> (node ids, edge_index over them)
        import torch

        nodes, frontier = seeds, seeds
        index = torch.full((self.num_nodes,), -1, dtype=torch.long)
        index[seeds] = torch.arange(seeds.numel())
        rows, cols = [], []
        for k in self.fanout:
            start, deg = self.ptr[frontier], self.ptr[frontier + 1] - self.ptr[frontier]
            owner = torch.repeat_interleave(torch.arange(frontier.numel()), deg)
            offset = torch.arange(owner.numel()) - torch.repeat_interleave(torch.cumsum(deg, 0) - deg, deg)
            # a random rank within each vertex's incoming edges: keep ranks < k (without replacement)
            key = owner.double() + torch.rand(owner.numel(), generator=self.generator, dtype=torch.float64)
            perm = torch.argsort(key)
            rank = torch.empty_like(perm)
            rank[perm] = torch.arange(perm.numel()) - torch.repeat_interleave(torch.cumsum(deg, 0) - deg,
                                                                             deg)
            keep = rank < k
            src = self.src[start[owner[keep]] + offset[keep]]
            dst = frontier[owner[keep]]
            new = torch.unique(src[index[src] < 0])
            new = new[torch.randperm(new.numel(), generator=self.generator)]  # no id order leaks in
            index[new] = torch.arange(nodes.numel(), nodes.numel() + new.numel())
            nodes = torch.cat([nodes, new])
            rows.append(index[src])
            cols.append(index[dst])
            frontier = new
        return nodes, torch.stack([torch.cat(rows), torch.cat(cols)])


def run_minibatch(args: argparse.Namespace) -> dict[str, Any]:
    """Mini-batch GCN (fanout [10, 10], batch 1024) to the target; full-graph validation."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data = generated_graph(args)
    generator = torch.Generator().manual_seed(args.seed)
    train_ids = data.train_mask.nonzero().view(-1)
    loader = None
    if args.sampler == "pyg":
        from torch_geometric.loader import NeighborLoader

        loader = NeighborLoader(data, num_neighbors=list(FANOUT), batch_size=BATCH_SIZE,
                                input_nodes=train_ids, shuffle=True)
    sampler = NeighborSampler(data.edge_index, data.num_nodes, FANOUT, generator)
    model = pyg_model(args, cached=False)  # a new subgraph every batch: no cached normalisation
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    full = pyg_model(args, cached=True)  # the same weights, evaluated full-graph
    trace = Trace(args)
    for _epoch in range(args.max_epochs):
        trace.start_epoch()
        model.train()
        batches = loader if loader is not None else (
            train_ids[perm] for perm in torch.randperm(train_ids.numel(), generator=generator)
            .split(BATCH_SIZE))
        for batch in batches:
            if loader is not None:
                x, edge_index, y, size = batch.x, batch.edge_index, batch.y, batch.batch_size
            else:
                nodes, edge_index = sampler.sample(batch)
                x, y, size = data.x[nodes], data.y[nodes], batch.numel()
            optimizer.zero_grad()
            out = model(x, edge_index)[:size]
            F.cross_entropy(out, y[:size]).backward()
            optimizer.step()
        trace.end_epoch()
        full.load_state_dict(model.state_dict())
        full.eval()
        with torch.no_grad():
            out = full(data.x, data.edge_index)
        if trace.validated(accuracy(out, data.y, data.val_mask), lambda o=out: accuracy(o, data.y,
                                                                                         data.test_mask)):
            break
    return {**trace.result(), **peak_memory_mib(), "sampler": args.sampler}


# --------------------------------------------------------------------------- Dorylus (one process per server)
def run_dorylus(args: argparse.Namespace) -> dict[str, Any]:
    """One graph server (rank from ``LOCAL_RANK``): fit to the target, validation after every epoch."""
    from datetime import timedelta

    import lightning.pytorch as pl
    import torch
    from safetensors.torch import load_file

    from lightning_dorylus import DorylusStrategy
    from lightning_dorylus.data import DorylusDataModule
    from lightning_dorylus.executors import LocalPoolExecutor
    from lightning_dorylus.models import GCN

    try:
        from benchmarks.dorylus_pipeline import make_delayed_executor
    except ImportError:
        from dorylus_pipeline import make_delayed_executor  # type: ignore[no-redef]

    torch.manual_seed(args.seed)
    trace = Trace(args)
    phases = {"imports_s": time.time() - args.launched_at}

    class ToTarget(pl.Callback):
        """Times training epochs (validation excluded) and stops every server once val_acc reaches the
        target (the logged val_acc is global, so all servers stop at the same epoch)."""

        def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            phases["fit_start_s"] = time.time() - args.launched_at  # process group up, model broadcast

        def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            trace.start_epoch()
            self.validation = 0.0

        def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self._val_start = time.perf_counter()

        def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.validation += time.perf_counter() - self._val_start
            if trainer.sanity_checking:
                return
            if trace.validated(float(trainer.callback_metrics["val_acc"])):
                trainer.should_stop = True

        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            trace.end_epoch()
            trace.epochs[-1] -= self.validation

    inner = LocalPoolExecutor(num_workers=args.executor_workers)
    executor = make_delayed_executor(inner, args.latency_ms / 1000.0) if args.latency else inner
    strategy = DorylusStrategy(executor=executor, timeout=timedelta(seconds=args.timeout),
                               staleness=None if args.mode == "sync" else int(args.mode[1:]))
    trainer = pl.Trainer(accelerator="cpu", devices=args.num_servers, strategy=strategy,
                         max_epochs=args.max_epochs, callbacks=[ToTarget()], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    model = GCN(args.features, args.hidden, args.classes, num_layers=2, dropout=DROPOUT, lr=LR,
                weight_decay=WEIGHT_DECAY)
    model.load_state_dict(load_file(str(cache_paths(args)["init"])))
    try:
        trainer.fit(model, datamodule=DorylusDataModule(args.partition_dir))
        memory = peak_memory_mib()  # while the executor's workers are alive: the server + its workers
    finally:
        executor.close()
    return {"rank": trainer.global_rank, **trace.result(), **memory, "phases": phases}


# --------------------------------------------------------------------------- launching
def _command(args: argparse.Namespace, worker: str, result: Path, extra: list[str]) -> list[str]:
    forwarded = [f"--nodes={args.nodes}", f"--avg-degree={args.avg_degree}", f"--features={args.features}",
                 f"--classes={args.classes}", f"--hidden={args.hidden}", f"--seed={args.seed}",
                 f"--target={args.target}", f"--max-epochs={args.max_epochs}",
                 f"--cache-dir={args.cache_dir}",
                 f"--latency-ms={args.latency_ms}", f"--timeout={args.timeout}",
                 f"--servers={','.join(map(str, args.servers))}", f"--launched-at={time.time()}"]
    return [sys.executable, str(Path(__file__).resolve()), f"--worker={worker}", f"--result={result}",
            *forwarded, *extra]


def launch(args: argparse.Namespace, worker: str, workdir: Path, name: str, extra: list[str],
           num_procs: int = 1) -> list[dict[str, Any]]:
    """Run ``num_procs`` fresh processes of ``worker`` (torchrun-style env); their JSON results.

    Raises:
        RuntimeError: if one fails or runs past ``--timeout``; its output tail is in the message.
    """
    port = free_port()
    procs = []
    for rank in range(num_procs):
        env = rank_env(dict(os.environ, PYTHONUNBUFFERED="1"), rank, num_procs, port)
        result, log = workdir / f"{name}-{rank}.json", workdir / f"{name}-{rank}.log"
        with open(log, "w") as log_file:
            procs.append((subprocess.Popen(_command(args, worker, result, extra), stdout=log_file,
                                           stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
                                           start_new_session=True), result, log))
    try:  # fails at the first failure: one failed server would leave its peer waiting in a collective
        failure = watch([proc for proc, _, _ in procs], args.timeout, tick=lambda: 0.05)
    finally:
        kill_groups([proc for proc, _, _ in procs])
    for proc, _, log in procs:
        if failure or proc.returncode != 0:
            raise RuntimeError(f"{name} failed ({failure or proc.returncode}):\n{log.read_text()[-3000:]}")
    return [json.loads(result.read_text()) for _, result, _ in procs]


def run_config(args: argparse.Namespace, config: str, graph: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """One run of ``config`` in fresh processes; for Dorylus the job's (slowest server, memory summed)."""
    if config.startswith("pyg-"):
        _, adj, threads = config.split("-")
        (run,) = launch(args, "pyg", workdir, config, [f"--adj={adj}", f"--threads={threads[1:]}"])
        return run
    if config == "gpu":
        (run,) = launch(args, "pyg", workdir, config, [f"--adj={args.gpu_adj}", "--device=cuda",
                                                       f"--threads={max(args.pyg_threads)}"])
        return run
    if config.startswith("minibatch-"):
        sampler = "pyg" if graph["neighbor_loader"] else "torch"
        (run,) = launch(args, "minibatch", workdir, config, [f"--threads={config.split('-t')[1]}",
                                                             f"--sampler={sampler}"])
        return run
    servers, mode, *latency = config.split("-")
    n = int(servers[1:])
    workers = max(1, len(os.sched_getaffinity(0)) // n)
    extra = [f"--num-servers={n}", f"--mode={mode}", f"--partition-dir={graph['partition_dirs'][str(n)]}",
             f"--executor-workers={workers}", *(["--latency"] if latency else [])]
    runs = launch(args, "dorylus", workdir, config, extra, num_procs=n)
    epochs = [max(e) for e in zip(*(r["epoch_s"] for r in runs))]  # an epoch ends with its slowest server
    reached = runs[0]["epochs_to_target"]
    fit = sum(epochs[:reached]) if reached else math.inf
    startup = max(r["startup_s"] for r in runs)
    return {"epoch_s": epochs, "val_acc": runs[0]["val_acc"], "epochs_to_target": reached, "fit_s": fit,
            "startup_s": startup, "launch_s": startup + fit, "test_acc": float("nan"),
            "peak_total_mib": sum(r["peak_total_mib"] for r in runs),
            "phases": {k: max(r.get("phases", {}).get(k, math.nan) for r in runs) for k in
                       ("imports_s", "fit_start_s")}}


# --------------------------------------------------------------------------- report
def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in runs) for key in ("fit_s", "launch_s", "startup_s",
                                                                     "peak_total_mib")}


def summary(by_config: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The summary line's ratios from the median fit-to-target seconds per configuration."""
    fit = {config: medians(runs)["fit_s"] for config, runs in by_config.items()}
    full = [c for c in fit if c.startswith("pyg-")]
    best = min(full, key=fit.__getitem__) if full else None
    minibatch = [c for c in fit if c.startswith("minibatch-")]
    best_minibatch = min(minibatch, key=fit.__getitem__) if minibatch else None

    def ratio(a: str | None, b: str | None) -> float:
        if a not in fit or b not in fit:
            return math.nan
        return fit[a] / fit[b] if math.isfinite(fit[b]) else math.nan

    return {"best_full": best, "best_minibatch": best_minibatch, "fit_s": fit,
            "minibatch_vs_fullgraph": ratio(best_minibatch, best),
            "dorylus2_vs_pyg_full": ratio("d2-sync", best),
            "staleness1_vs_sync": ratio("d2-s1", "d2-sync"),
            "staleness1_vs_sync_latency": ratio("d2-s1-lat", "d2-sync-lat")}


def report(args: argparse.Namespace, graph: dict[str, Any], by_config: dict[str, list[dict[str, Any]]],
           loads: list[list[float]]) -> dict[str, Any]:
    s = summary(by_config)
    sampler = "PyG NeighborLoader" if graph["neighbor_loader"] else (
        "torch re-implementation of NeighborLoader's recipe (pyg-lib / torch-sparse not installed)")
    print(f"graph: degree-corrected SBM, {graph['nodes']:,} vertices, {graph['edges']:,} directed edges, "
          f"{args.features} features, {args.classes} classes; 2-layer GCN hidden {args.hidden}; "
          f"target val acc {args.target}; {args.rounds} round(s), medians; mini-batch sampler: {sampler}; "
          f"{os.cpu_count()} CPUs, load average per round {[round(load[0], 1) for load in loads]}")
    if not graph["gpu"]:
        print("gpu: skipped (no CUDA device here)")
    print(f"{'configuration':<18}{'epochs':>7}{'fit s':>9}{'launch s':>10}{'startup s':>10}{'s/epoch':>9}"
          f"{'test acc':>9}{'peak MiB':>10}  val acc per epoch (round 0)")
    for config, runs in by_config.items():
        m = medians(runs)
        epochs = [r["epochs_to_target"] for r in runs]
        per_epoch = statistics.median(statistics.median(r["epoch_s"]) for r in runs)
        tests = [r["test_acc"] for r in runs if not math.isnan(r["test_acc"])]
        test = f"{statistics.median(tests):.3f}" if tests else "-"
        best = ("  (best full-graph)" if config == s["best_full"] else
                "  (best mini-batch)" if config == s["best_minibatch"] else "")
        val = " ".join(f"{v:.2f}" for v in runs[0]["val_acc"])
        print(f"{config:<18}{'/'.join(str(e) for e in epochs):>7}{m['fit_s']:>9.2f}{m['launch_s']:>10.2f}"
              f"{m['startup_s']:>10.2f}{per_epoch:>9.3f}{test:>9}{m['peak_total_mib']:>10.0f}  {val}{best}")
    for config, runs in by_config.items():  # where a Dorylus job's time before its first epoch goes
        phased = [r["phases"] for r in runs if "phases" in r]
        if phased:
            imports = statistics.median(p["imports_s"] for p in phased)
            fit_start = statistics.median(p["fit_start_s"] for p in phased)
            first = statistics.median(r["startup_s"] for r in runs if "phases" in r)
            print(f"startup {config}: process start -> imports done {imports:.2f} s -> fit start (process "
                  f"group, executor, partition read and checked) {fit_start:.2f} s -> first epoch "
                  f"{first:.2f} s (slowest server, median)")
    print(f"minibatch_vs_fullgraph={s['minibatch_vs_fullgraph']:.2f} "
          f"dorylus2_vs_pyg_full={s['dorylus2_vs_pyg_full']:.2f} "
          f"staleness1_vs_sync={s['staleness1_vs_sync']:.2f} "
          f"staleness1_vs_sync_latency={s['staleness1_vs_sync_latency']:.2f}")
    return s


def _modes(text: str) -> list[str]:
    modes = text.split(",")
    for mode in modes:
        if mode != "sync" and not (mode[:1] == "s" and mode[1:].isdigit()):
            raise argparse.ArgumentTypeError(f"a mode is sync or s<staleness> (s1, s2), got {mode!r}")
    return modes


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=100_000)
    parser.add_argument("--avg-degree", type=float, default=24.0,
                        help="edge entries per vertex before dedup (24: about 2.4M edges at 100k vertices)")
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--classes", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--target", type=float, default=0.85, help="validation accuracy to reach")
    parser.add_argument("--max-epochs", type=int, default=60, help="a run that has not reached it stops here")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--servers", type=_int_list, default=[1, 2], help="Dorylus server counts")
    parser.add_argument("--modes", type=_modes, default=["sync", "s1"],
                        help="Dorylus modes: sync (staleness=None) and sS (staleness=S), comma-separated")
    parser.add_argument("--latency-ms", type=float, default=20.0,
                        help="round trip added to every request in the -lat configurations (0: none run)")
    parser.add_argument("--pyg-threads", type=_int_list, default=None,
                        help="PyG full-graph thread counts (default: 1 and the cores this process may use)")
    parser.add_argument("--gpu-adj", choices=["csr", "ei"], default="csr")
    parser.add_argument("--configs", type=lambda t: t.split(","), default=None,
                        help="run only these configurations (comma-separated names as in the table)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=str(REPO_ROOT / ".cache" / "dorylus"))
    parser.add_argument("--json", default="", help="write every run and the summary here")
    parser.add_argument("--from-json", default="",
                        help="print the report of a --json file (all the runs it holds); runs nothing")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per configuration run")
    for hidden in ("--worker", "--result", "--adj", "--device", "--sampler", "--mode", "--partition-dir"):
        parser.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--num-servers", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--executor-workers", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--latency", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--launched-at", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("nodes", "features", "classes", "hidden", "max_epochs", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0.0 < args.target <= 1.0:
        parser.error(f"--target must be in (0, 1], got {args.target}")
    if args.pyg_threads is None:
        usable = len(os.sched_getaffinity(0))
        args.pyg_threads = sorted({1, usable})
    args.launched_at = args.launched_at or time.time()
    args.gpu = False
    return args


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    if args.worker is not None:
        run = {"prepare": run_prepare, "pyg": run_pyg, "minibatch": run_minibatch,
               "dorylus": run_dorylus}[args.worker]
        if args.device is None:
            args.device = "cpu"
        Path(args.result).write_text(json.dumps(run(args)))
        return None
    if args.from_json:  # e.g. a run cut short: its JSON holds every run it finished
        saved = json.loads(Path(args.from_json).read_text())
        for key in ("features", "classes", "hidden", "target"):
            setattr(args, key, saved["args"][key])
        args.rounds = max(len(runs) for runs in saved["runs"].values())
        return report(args, saved["graph"], {c: r for c, r in saved["runs"].items() if r}, saved["loads"])
    with tempfile.TemporaryDirectory(prefix="dorylus_tta_") as tmp:
        workdir = Path(tmp)
        (graph,) = launch(args, "prepare", workdir, "prepare", [])
        args.gpu = graph["gpu"]
        configs = configurations(args)
        by_config: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
        loads = []
        for index in range(args.rounds):
            loads.append(list(os.getloadavg()))
            for config in round_order(configs, index):
                run = run_config(args, config, graph, workdir)
                by_config[config].append(run)
                if args.json:  # after every run: a long benchmark cut short keeps what it measured
                    write_json(Path(args.json), args, graph, loads, by_config, None)
                print(f"round {index} {config}: {run['epochs_to_target']} epochs, fit {run['fit_s']:.2f} s, "
                      f"launch {run['launch_s']:.2f} s, load {os.getloadavg()[0]:.1f}", flush=True)
    s = report(args, graph, by_config, loads)
    if args.json:
        write_json(Path(args.json), args, graph, loads, by_config, s)
    return s


def write_json(path: Path, args: argparse.Namespace, graph: dict[str, Any], loads: list[list[float]],
               by_config: dict[str, list[dict[str, Any]]], summary_figures: dict[str, Any] | None) -> None:
    """Every run so far (and the summary once there is one), written atomically."""
    out = {"args": {k: v for k, v in vars(args).items() if k not in ("worker", "result")},
           "graph": graph, "loads": loads, "runs": by_config, "summary": summary_figures}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    tmp.rename(path)


if __name__ == "__main__":
    main()
