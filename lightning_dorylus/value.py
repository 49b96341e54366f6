"""Value report: time and dollars per epoch of CPU-only graph servers vs graph servers + Lambdas.

    python benchmarks/dorylus_epoch.py --op-times run.json ...        # measure a run
    python -m lightning_dorylus.value run.json --plot value.png       # price it

The input is a run's *measured* op times (written by ``benchmarks/dorylus_epoch.py --op-times``, which wraps
each graph server's executor in :class:`TimedExecutor`): per graph server and epoch, the epoch's wall time,
the time the server sat blocked on tensor ops, and every tensor-op stage (one ``executor.map`` call: its op,
number of per-interval requests, summed and largest per-request service time, bytes in and out).

From it the report models one epoch of two deployments of the same ``P`` graph servers (the model and its
assumptions are spelled out in ``docs/dorylus-value.md``):

* **CPU-only**: tensor ops run on the graph servers, one after another, as measured:
  ``T = G + Σ service``, where ``G`` is the server's epoch time outside tensor ops (graph work, exchange,
  loss, optimizer). Cost ``P * server $/h * T``.
* **servers + Lambdas**: every stage's requests run on up to ``concurrency`` Lambdas at once
  (``ceil(n / concurrency)`` waves of the stage's slowest request, each plus ``latency``); with
  ``overlap`` (Dorylus's bounded-asynchronous pipeline hiding tensor work behind graph work) the tensor part
  ``L`` overlaps ``G``: ``T = max(G, L) + (1 - overlap) * min(G, L)``. Cost: the servers for ``T``, plus
  Lambda GB-seconds (billed duration = service time, scaled by the Lambda's vCPU share) and requests.

Value is Dorylus's performance per dollar, ``1 / (T * C)`` (``T`` seconds and ``C`` dollars per epoch).

Beside them the report prints the row users weigh Dorylus against first, PyG on one GPU (:class:`GpuServer`:
measured elsewhere, scaled to the run's edges, priced per GPU-hour), and the crossover: the largest graph
one GPU's memory holds, and how efficient k GPUs would have to be for Dorylus to be cheaper beyond it.
"""

from __future__ import annotations

import argparse
import json
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torch import Tensor
from typing_extensions import override

from lightning_dorylus.executors.base import TensorOpExecutor, TensorOpRequest

FORMAT = "dorylus-op-times/1"
LAMBDA_FULL_VCPU_MB = 1769  # AWS Lambda: one full vCPU at 1,769 MB; CPU share scales with memory below it


# --------------------------------------------------------------------------- measuring
class TimedExecutor(TensorOpExecutor):
    """Wraps an executor and records, per epoch, every tensor-op request and every ``map`` stage.

    A request's *service time* is the time its executor spent on it: from when it could start (submitted,
    and a worker free) to its result. With ``workers`` workers taking requests in order (the ``local``
    pool's queue) that is replayed exactly for one worker and estimated for more (each request starts when
    the earliest-free of ``workers`` simulated workers is free). It includes the wire encoding and pipe
    transfer, as a Lambda's billed duration includes decoding its payload.

    Args:
        inner: The executor that runs the ops (started and closed through this wrapper).
        workers: How many requests ``inner`` runs at once (the local pool's ``num_workers``).
    """

    def __init__(self, inner: TensorOpExecutor, workers: int | None = None) -> None:
        self.inner = inner
        self.workers = workers if workers is not None else int(getattr(inner, "num_workers", 1))
        if self.workers < 1:
            raise ValueError(f"workers={self.workers} must be >= 1")
        self.epochs: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._epoch = -1
        self._requests: list[dict[str, Any]] = []
        self._index: dict[int, int] = {}  # id(future) -> its request's row in _requests
        self._stages: list[dict[str, Any]] = []
        self._blocked = 0.0

    @override
    def start(self) -> None:
        self.inner.start()

    @override
    def close(self) -> None:
        self.inner.close()

    def start_epoch(self, epoch: int) -> None:
        """Forget what was recorded so far and record for ``epoch``."""
        with self._lock:
            self._epoch, self._requests, self._stages, self._blocked = epoch, [], [], 0.0
            self._index = {}

    @override
    def submit(self, request: TensorOpRequest) -> Future[dict[str, Tensor]]:
        record = {"op": request.op, "submitted": time.perf_counter(), "done": math.nan,
                  "bytes_in": sum(t.numel() * t.element_size() for t in request.tensors.values()),
                  "bytes_out": 0}
        future = self.inner.submit(request)
        record["submit_s"] = time.perf_counter() - record["submitted"]  # an inline executor works in submit
        with self._lock:
            self._index[id(future)] = len(self._requests)
            self._requests.append(record)

        def finished(f: Future[dict[str, Tensor]]) -> None:
            record["done"] = time.perf_counter()
            if f.exception() is None:
                record["bytes_out"] = sum(t.numel() * t.element_size() for t in f.result().values())

        future.add_done_callback(finished)
        return future

    @override
    def wait(self, futures: Any, timeout: float | None = None) -> list[dict[str, Tensor]]:
        """The graph server blocked on these requests (submitting them, then waiting): one stage."""
        start = time.perf_counter()
        outs = super().wait(futures, timeout)
        end = time.perf_counter()
        with self._lock:
            rows = [self._index[id(f)] for f in futures if id(f) in self._index]
            self._blocked += end - start + sum(self._requests[i]["submit_s"] for i in rows)
            first = min((self._requests[i]["submitted"] for i in rows), default=start)
            self._stages.append({"rows": rows, "wall_s": end - first})  # first submission to last result
        return outs

    def end_epoch(self, epoch_seconds: float) -> dict[str, Any]:
        """Close the epoch: per-request service times, per-stage and per-op sums; appended to ``epochs``."""
        with self._lock:
            requests, stages = list(self._requests), list(self._stages)
            epoch, blocked = self._epoch, self._blocked
        service = replay_service_times([r["submitted"] for r in requests], [r["done"] for r in requests],
                                       self.workers)
        ops: dict[str, dict[str, float]] = {}
        for record, seconds in zip(requests, service):
            op = ops.setdefault(record["op"], {"count": 0, "service_s": 0.0, "bytes_in": 0, "bytes_out": 0})
            op["count"] += 1
            op["service_s"] += seconds
            op["bytes_in"] += record["bytes_in"]
            op["bytes_out"] += record["bytes_out"]
        stage_rows = []
        for stage in stages:
            part = stage["rows"]
            times = [service[i] for i in part]
            stage_rows.append({
                "op": requests[part[0]]["op"] if part else "",
                "requests": len(part), "wall_s": stage["wall_s"],
                "service_sum_s": sum(times), "service_max_s": max(times, default=0.0),
                "bytes_in": sum(requests[i]["bytes_in"] for i in part),
                "bytes_out": sum(requests[i]["bytes_out"] for i in part),
            })
        row = {"epoch": epoch, "epoch_s": epoch_seconds, "blocked_s": blocked, "ops": ops,
               "stages": stage_rows}
        self.epochs.append(row)
        return row


def replay_service_times(submitted: list[float], done: list[float], workers: int) -> list[float]:
    """Service time of each request of a FIFO queue served by ``workers`` workers.

    A request starts when it was submitted and a worker is free; it ends when its result arrived. Exact for
    one worker (each worker takes the next request the moment it is free); an estimate for more.
    """
    free = [-math.inf] * workers
    out = [0.0] * len(submitted)
    for i in sorted(range(len(submitted)), key=lambda i: done[i]):
        w = min(range(workers), key=free.__getitem__)
        start = max(submitted[i], free[w])
        out[i] = max(0.0, done[i] - start)
        free[w] = done[i]
    return out


# --------------------------------------------------------------------------- pricing
@dataclass(frozen=True)
class Prices:
    """Prices in US dollars. Defaults: AWS us-east-1 on-demand c5.2xlarge and x86 Lambda."""

    server_per_hour: float = 0.34
    lambda_per_gb_s: float = 0.0000166667
    lambda_per_million_requests: float = 0.20


@dataclass(frozen=True)
class LambdaModel:
    """How the tensor ops would run on Lambdas (see ``docs/dorylus-value.md`` for why these defaults).

    Args:
        memory_mb: Lambda memory; its vCPU share is ``min(1, memory_mb / 1769)`` of one measured core.
        latency_s: Round trip added to every wave of requests (invoke + payload transfer).
        concurrency: Lambdas one graph server runs at once; ``0`` = one per request of a stage.
        overlap: Fraction in ``[0, 1]`` of the shorter of graph and tensor time hidden behind the longer
            (0: every op a barrier, as the synchronous engine; 1: Dorylus's pipeline at its ideal).
    """

    memory_mb: int = LAMBDA_FULL_VCPU_MB
    latency_s: float = 0.020
    concurrency: int = 0
    overlap: float = 0.0

    def __post_init__(self) -> None:
        if self.memory_mb < 128:
            raise ValueError(f"memory_mb={self.memory_mb}: Lambda memory is at least 128 MB")
        if self.latency_s < 0:
            raise ValueError(f"latency_s={self.latency_s} must be >= 0")
        if self.concurrency < 0:
            raise ValueError(f"concurrency={self.concurrency} must be >= 0 (0: one Lambda per request)")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"overlap={self.overlap} must be in [0, 1]")

    @property
    def slowdown(self) -> float:
        """How much slower than one measured core a Lambda of this size runs the op."""
        return max(1.0, LAMBDA_FULL_VCPU_MB / self.memory_mb)


@dataclass(frozen=True)
class Deployment:
    """Modelled seconds and dollars of one epoch of one deployment."""

    name: str
    epoch_s: float
    server_dollars: float
    lambda_dollars: float
    lambda_requests: float
    lambda_gb_s: float

    @property
    def dollars(self) -> float:
        return self.server_dollars + self.lambda_dollars

    @property
    def value(self) -> float:
        """Dorylus's value: performance per dollar, ``1 / (T * C)`` per epoch."""
        return 1.0 / (self.epoch_s * self.dollars)

    def row(self) -> dict[str, float | str]:
        return {**asdict(self), "dollars": self.dollars, "value": self.value}


@dataclass(frozen=True)
class GpuServer:
    """PyG full-graph training on one GPU: the row users weigh Dorylus against (measured elsewhere, not here).

    Defaults: issue 31's measurement of PyG ``GCNConv`` (CSR ``adj_t``, the same graph, model and optimizer as
    ``benchmarks/dorylus_epoch.py``'s defaults) on one NVIDIA H200 of a 16-core machine: 0.020 s per epoch,
    peak 4.1 GiB (``edge_index`` instead: 0.067 s, 5.4 GiB). Price: one GPU's share of an 8-GPU AWS
    on-demand instance, p5.48xlarge (8 x H100 80 GB) at $98.32/h (``docs/dorylus-value.md`` cites the pages).

    Args:
        name: The row's label.
        epoch_s: Measured seconds per epoch on ``graph_edges`` edges; other graphs scale it by edges.
        graph_nodes: Vertices of the measured graph.
        graph_edges: Directed edges of the measured graph.
        peak_gib: Measured peak GPU memory on that graph; scaled by edges (at the measured graph's degree).
        memory_gib: The GPU's memory (80: H100, 141: H200): the largest graph one GPU trains full-graph.
        per_hour: Dollars per GPU-hour.
    """

    name: str = "one GPU, PyG (elsewhere)"
    epoch_s: float = 0.020
    graph_nodes: int = 1_000_000
    graph_edges: int = 20_265_688
    peak_gib: float = 4.1
    memory_gib: float = 80.0
    per_hour: float = 98.32 / 8

    def __post_init__(self) -> None:
        for name in ("epoch_s", "graph_nodes", "graph_edges", "peak_gib", "memory_gib"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if self.per_hour < 0:
            raise ValueError(f"per_hour={self.per_hour} must be >= 0")

    @property
    def max_edges(self) -> float:
        """Edges of the largest graph (at the measured graph's degree) whose peak fits in the GPU's memory."""
        return self.graph_edges * self.memory_gib / self.peak_gib

    def deployment(self, edges: int) -> Deployment:
        """One epoch on a graph of ``edges`` edges (time scaled linearly by edges from the measurement)."""
        epoch = self.epoch_s * edges / self.graph_edges
        return Deployment(self.name, epoch, self.per_hour / 3600.0 * epoch, 0.0, 0.0, 0.0)


def crossover(report: dict[str, Any], gpu: GpuServer) -> dict[str, Any]:
    """Where one GPU stops being an option, and what Dorylus costs against GPUs per edge and epoch.

    Below ``gpu.max_edges`` one GPU trains the graph; beyond it the GPU option needs ``k`` GPUs. Per edge and
    epoch both sides cost about the same at any size (each scales linearly: more graph servers, more GPUs),
    so past one GPU's memory Dorylus (its cheaper deployment of the run) is the cheaper way to train only if
    ``k`` GPUs reach less than ``break_even_efficiency`` of ``k`` times one GPU's speed (scaled by edges).
    """
    edges = report["graph"].get("edges")
    if not edges:
        raise ValueError("the run names no graph size ('graph': {'edges': ...}); the crossover needs it")
    dorylus = min(report["deployments"], key=lambda d: d["dollars"])
    gpu_row = gpu.deployment(edges)
    bytes_per_edge = gpu.peak_gib * 2**30 / gpu.graph_edges
    return {
        "dorylus": dorylus["name"],
        "gpu_faster": dorylus["epoch_s"] / gpu_row.epoch_s,
        "gpu_cheaper": dorylus["dollars"] / gpu_row.dollars,
        "bytes_per_edge": bytes_per_edge,  # at the measured graph's degree: its vertices' bytes included
        "bytes_per_vertex": gpu.peak_gib * 2**30 / gpu.graph_nodes,  # the same peak, its edges included
        "max_edges": gpu.max_edges,
        "max_nodes": gpu.graph_nodes * gpu.memory_gib / gpu.peak_gib,
        "break_even_efficiency": gpu_row.dollars / dorylus["dollars"],
    }


def load_run(path: str | Path) -> dict[str, Any]:
    """Read and check a ``dorylus-op-times/1`` file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"op-times file {str(path)!r} does not exist (write one with "
                                "benchmarks/dorylus_epoch.py --op-times PATH)")
    run = json.loads(path.read_text())
    if not isinstance(run, dict) or run.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is not a {FORMAT!r} file (its 'format' is "
                         f"{run.get('format') if isinstance(run, dict) else type(run).__name__!r})")
    if not run.get("epochs"):
        raise ValueError(f"{str(path)!r} has no measured epochs")
    return run


def _server_means(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Per graph server: the mean over its measured epochs of G, the stages (by position) and op totals."""
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for epoch in run["epochs"]:
        by_rank.setdefault(int(epoch["rank"]), []).append(epoch)
    servers = []
    for rank, epochs in sorted(by_rank.items()):
        n = len(epochs)
        stage_count = min(len(e["stages"]) for e in epochs)
        stages = []
        for i in range(stage_count):
            rows = [e["stages"][i] for e in epochs]
            stages.append({key: (sum(r[key] for r in rows) / n if key != "op" else rows[0]["op"])
                           for key in ("op", "requests", "wall_s", "service_sum_s", "service_max_s")})
        servers.append({
            "rank": rank,
            "epoch_s": sum(e["epoch_s"] for e in epochs) / n,
            "graph_s": sum(e["epoch_s"] - e["blocked_s"] for e in epochs) / n,
            "blocked_s": sum(e["blocked_s"] for e in epochs) / n,
            "stages": stages,
        })
    return servers


def price(run: dict[str, Any], prices: Prices = Prices(), lambdas: LambdaModel = LambdaModel(),
          gpu: GpuServer | None = None) -> dict[str, Any]:
    """Model one epoch of the run as CPU-only servers and as servers + Lambdas; the report's figures. With
    ``gpu`` (and the run's graph size known) also one GPU's row (``"gpu"``) and the ``"crossover"``."""
    servers = _server_means(run)
    count = len(servers)
    server_per_s = prices.server_per_hour / 3600.0
    cpu_times, lambda_times, requests, gb_s = [], [], 0.0, 0.0
    for server in servers:
        tensor_cpu = sum(s["service_sum_s"] for s in server["stages"])
        cpu_times.append(server["graph_s"] + tensor_cpu)
        tensor_lambda = 0.0
        for stage in server["stages"]:
            n = stage["requests"]
            waves = 1 if lambdas.concurrency == 0 else math.ceil(n / lambdas.concurrency)
            tensor_lambda += waves * (stage["service_max_s"] * lambdas.slowdown + lambdas.latency_s)
            requests += n
            gb_s += stage["service_sum_s"] * lambdas.slowdown * lambdas.memory_mb / 1024.0
        g = server["graph_s"]
        lambda_times.append(max(g, tensor_lambda) + (1.0 - lambdas.overlap) * min(g, tensor_lambda))
    cpu_epoch, lambda_epoch = max(cpu_times), max(lambda_times)  # the job waits for its slowest server
    cpu = Deployment("CPU-only graph servers", cpu_epoch, count * server_per_s * cpu_epoch, 0.0, 0.0, 0.0)
    lambda_dollars = gb_s * prices.lambda_per_gb_s + requests * prices.lambda_per_million_requests / 1e6
    with_lambdas = Deployment("graph servers + Lambdas", lambda_epoch, count * server_per_s * lambda_epoch,
                              lambda_dollars, requests, gb_s)
    report = {
        "graph": run.get("graph", {}), "model": run.get("model", {}), "servers": count,
        "measured": [{k: v for k, v in s.items() if k != "stages"} | {"stages": len(s["stages"])}
                     for s in servers],
        "prices": asdict(prices), "lambda_model": asdict(lambdas),
        "deployments": [cpu.row(), with_lambdas.row()],
        "speedup": cpu.epoch_s / with_lambdas.epoch_s,
        "value_ratio": with_lambdas.value / cpu.value,
    }
    if gpu is not None and report["graph"].get("edges"):
        report["gpu"] = {**gpu.deployment(report["graph"]["edges"]).row(), "model": asdict(gpu)}
        report["crossover"] = crossover(report, gpu)
    return report


def format_report(report: dict[str, Any]) -> str:
    """The report as text (the last line is the summary ``value_ratio=... speedup=...``)."""
    graph, lam = report["graph"], report["lambda_model"]
    lines = [
        f"graph: {graph.get('nodes', '?'):,} vertices, {graph.get('edges', '?'):,} directed edges; "
        f"{report['servers']} graph servers",
        "measured per server (mean of epochs): " + "; ".join(
            f"server {m['rank']}: epoch {m['epoch_s']:.3f} s = graph {m['graph_s']:.3f} s + tensor ops "
            f"{m['blocked_s']:.3f} s ({m['stages']} stages)" for m in report["measured"]),
        f"Lambda model: {lam['memory_mb']} MB, {lam['latency_s'] * 1000:.0f} ms per wave, concurrency "
        f"{lam['concurrency'] or 'one per request'}, overlap {lam['overlap']:.2f}; prices "
        f"${report['prices']['server_per_hour']}/h per server, ${report['prices']['lambda_per_gb_s']}/GB-s, "
        f"${report['prices']['lambda_per_million_requests']}/M requests",
        f"{'deployment':<26}{'s/epoch':>9}{'$/epoch':>12}{'servers $':>12}{'Lambda $':>12}"
        f"{'requests':>10}{'GB-s':>9}{'value 1/(T*C)':>15}",
    ]
    for d in [*report["deployments"], *([report["gpu"]] if "gpu" in report else [])]:
        lines.append(f"{d['name']:<26}{d['epoch_s']:>9.3f}{d['dollars']:>12.3e}{d['server_dollars']:>12.3e}"
                     f"{d['lambda_dollars']:>12.3e}{d['lambda_requests']:>10.0f}{d['lambda_gb_s']:>9.3f}"
                     f"{d['value']:>15.4g}")
    if "crossover" in report:
        c, g = report["crossover"], report["gpu"]["model"]
        lines += [
            f"GPU row: {g['epoch_s']} s/epoch on {g['graph_edges']:,} edges, peak {g['peak_gib']} GiB, "
            f"${g['per_hour']:.2f}/GPU-h, scaled by edges (measured elsewhere; docs/dorylus-value.md)",
            f"on this graph one GPU is {c['gpu_faster']:.0f}x faster per epoch and {c['gpu_cheaper']:.1f}x "
            f"cheaper than the {c['dorylus']}",
            f"crossover: one {g['memory_gib']:g} GiB GPU holds up to {c['max_edges'] / 1e6:,.0f}M edges / "
            f"{c['max_nodes'] / 1e6:,.1f}M vertices ({c['bytes_per_edge']:.0f} B per edge at the measured "
            f"degree); beyond it Dorylus is cheaper only if k GPUs reach < {c['break_even_efficiency']:.0%} "
            "of k x one GPU's speed",
        ]
    lines.append(f"value_ratio={report['value_ratio']:.2f} speedup={report['speedup']:.2f}")
    return "\n".join(lines)


def plot(run: dict[str, Any], prices: Prices, lambdas: LambdaModel, path: str | Path) -> None:
    """Seconds, dollars and value per epoch of both deployments, and the value ratio against overlap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = price(run, prices, lambdas)
    names = ["CPU-only", "+ Lambdas"]
    deployments = report["deployments"]
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    for ax, key, title in zip(axes, ("epoch_s", "dollars", "value"),
                              ("seconds per epoch", "dollars per epoch", "value 1/(T x C)")):
        ax.bar(names, [d[key] for d in deployments], color=["tab:gray", "tab:orange"])
        ax.set_title(title)
    overlaps = [i / 10 for i in range(11)]
    ratios = [price(run, prices, LambdaModel(lambdas.memory_mb, lambdas.latency_s, lambdas.concurrency, o)
                    )["value_ratio"] for o in overlaps]
    axes[3].plot(overlaps, ratios, marker="o")
    axes[3].axhline(1.0, color="gray", linewidth=0.8)
    axes[3].set_xlabel("overlap of graph and tensor work")
    axes[3].set_title("value ratio (+ Lambdas / CPU-only)")
    graph = report["graph"]
    fig.suptitle(f"{graph.get('nodes', '?'):,} vertices, {graph.get('edges', '?'):,} edges, "
                 f"{report['servers']} graph servers; Lambda {lambdas.memory_mb} MB, "
                 f"{lambdas.latency_s * 1000:.0f} ms, overlap {lambdas.overlap:.1f}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m lightning_dorylus.value",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("op_times", help="JSON written by benchmarks/dorylus_epoch.py --op-times")
    parser.add_argument("--server-per-hour", type=float, default=Prices.server_per_hour,
                        help="dollars per graph-server hour (default: c5.2xlarge on demand)")
    parser.add_argument("--lambda-per-gb-s", type=float, default=Prices.lambda_per_gb_s)
    parser.add_argument("--lambda-per-million-requests", type=float,
                        default=Prices.lambda_per_million_requests)
    parser.add_argument("--lambda-memory-mb", type=int, default=LambdaModel.memory_mb)
    parser.add_argument("--lambda-latency-ms", type=float, default=LambdaModel.latency_s * 1000)
    parser.add_argument("--lambda-concurrency", type=int, default=0,
                        help="Lambdas per graph server at once (0: one per request of a stage)")
    parser.add_argument("--overlap", type=float, default=0.0,
                        help="0: synchronous (tensor ops are barriers); 1: fully hidden behind graph work")
    parser.add_argument("--gpu-epoch-s", type=float, default=GpuServer.epoch_s,
                        help="PyG's seconds per epoch on one GPU for --gpu-graph-edges (default: an H200's)")
    parser.add_argument("--gpu-graph-edges", type=int, default=GpuServer.graph_edges)
    parser.add_argument("--gpu-graph-nodes", type=int, default=GpuServer.graph_nodes)
    parser.add_argument("--gpu-peak-gib", type=float, default=GpuServer.peak_gib,
                        help="PyG's peak GPU memory on that graph (GiB)")
    parser.add_argument("--gpu-memory-gib", type=float, default=GpuServer.memory_gib,
                        help="the GPU's memory (80: H100, 141: H200)")
    parser.add_argument("--gpu-per-hour", type=float, default=GpuServer.per_hour,
                        help="dollars per GPU-hour (default: p5.48xlarge on demand / 8)")
    parser.add_argument("--plot", default="", help="save a plot here (PNG)")
    parser.add_argument("--json", default="", help="write the report's figures here")
    args = parser.parse_args(argv)
    for name in ("server_per_hour", "lambda_per_gb_s", "lambda_per_million_requests"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    prices = Prices(args.server_per_hour, args.lambda_per_gb_s, args.lambda_per_million_requests)
    try:
        lambdas = LambdaModel(args.lambda_memory_mb, args.lambda_latency_ms / 1000, args.lambda_concurrency,
                              args.overlap)
        gpu = GpuServer(epoch_s=args.gpu_epoch_s, graph_nodes=args.gpu_graph_nodes,
                        graph_edges=args.gpu_graph_edges, peak_gib=args.gpu_peak_gib,
                        memory_gib=args.gpu_memory_gib, per_hour=args.gpu_per_hour)
        run = load_run(args.op_times)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    report = price(run, prices, lambdas, gpu)
    if args.plot:
        plot(run, prices, lambdas, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(format_report(report))  # the summary line last
    return report


if __name__ == "__main__":
    main()
