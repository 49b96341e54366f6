"""The largest graph PyG trains in one machine of M GiB against the largest Dorylus trains across K of them.

K "machines" are network namespaces on a private bridge, each in its own cgroup v1 memory cgroup of
``--limit-gib`` (:mod:`benchmarks._cgroups`). The generator writes the benchmark's default graph (the
power-law, homophilous graph of ``dorylus_epoch.py``: average degree 20.5, 128 features, 16 classes) as
``.npy`` chunks, never whole. Doubling the vertex count from ``--start-nodes``, each size is tried:

- PyG: one process in one machine loads the chunks into one ``edge_index`` (what a PyG user holds) and
  trains one full-graph epoch of a 2-layer ``GCNConv`` (hidden 16) from fixed initial weights;
- Dorylus: on every machine one preparing process builds that machine's partitions from the shared chunk
  files (``prepare_streamed``: streaming assignment, buckets on the machine's own disk), then one
  ``torchrun`` per machine starts its graph servers, which read only their partition and train one epoch
  from the same initial weights.

An OOM kill (or any failure) inside a machine is the answer "did not fit" for that side at that size. Where
both fit, the initial losses must agree (the same model and weights on the same graph). Doubling stops for
a side at its first miss. The last line::

    machines=<K> limit_gib=<M> pyg_max_edges=<n> dorylus_max_edges=<n> scale_ratio=<dorylus/pyg>
    prep_peak_gib=<max over preparing processes> server_peak_gib=<max> epoch_s=<Dorylus at its largest>

The peaks are of ``RssAnon`` (sampled every 20 ms): what a process holds itself. ``ru_maxrss`` also counts
the pages of the memory-mapped chunk files, which the kernel drops under the cgroup's limit instead of
killing; it is kept in the JSON (``rss_peak_gib``) and can exceed the limit of a run that fitted.

Every namespace, veth, bridge and cgroup is named ``h48...`` and removed at the end, also on failure;
leftovers of a killed run (dead creator PID) are removed at the start. Needs root::

    sudo .venv/bin/python benchmarks/dorylus_scale.py --machines 2 --limit-gib 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import _cgroups  # noqa: E402

LR, WEIGHT_DECAY = 0.01, 5e-4
GIB = 1 << 30
_NS = re.compile(r"^h48-(\d+)-m\d+$")
_LINK = re.compile(r"^h48[bv](\d+)(?:m\d+)?$")


# --------------------------------------------------------------------------- the chunked generator
def generate(directory: Path, num_nodes: int, avg_degree: float, features: int, classes: int, seed: int,
             pairs_per_chunk: int = 1 << 22) -> dict[str, Any]:
    """Writes the power-law graph (``synthetic.powerlaw_graph``'s model) as chunk files; O(N) memory.

    Each chunk draws ``pairs_per_chunk`` undirected pairs and stores both directions; self loops are dropped,
    duplicate pairs kept (PyG's message passing counts them). Features: class centroid + N(0, 3^2) noise,
    float32; splits 10/10/20 %.
    """
    import numpy as np

    directory.mkdir(parents=True, exist_ok=True)
    done = directory / "graph.json"
    if done.is_file():
        return json.loads(done.read_text())
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, num_nodes)
    weight = np.minimum((1.0 - rng.random(num_nodes)) ** (-1.0 / 1.5), num_nodes**0.5)  # Pareto, exponent 2.5
    by_class = np.argsort(y, kind="stable")
    cum = np.cumsum(weight[by_class])
    del weight
    class_end = cum[np.cumsum(np.bincount(y, minlength=classes)) - 1]
    class_start = np.concatenate([[0.0], class_end[:-1]])
    total = cum[-1]
    num_pairs = int(num_nodes * avg_degree / 2)
    names, edges = [], 0
    for i, a in enumerate(range(0, num_pairs, pairs_per_chunk)):
        k = min(pairs_per_chunk, num_pairs - a)
        src = by_class[np.minimum(np.searchsorted(cum, rng.random(k) * total, side="right"), num_nodes - 1)]
        same = rng.random(k) < 0.8
        lo = np.where(same, class_start[y[src]], 0.0)
        hi = np.where(same, class_end[y[src]], total)
        dst = by_class[np.minimum(np.searchsorted(cum, lo + rng.random(k) * (hi - lo), side="right"),
                                  num_nodes - 1)]
        keep = src != dst
        src, dst = src[keep], dst[keep]
        chunk = np.stack([np.concatenate([src, dst]), np.concatenate([dst, src])])
        names.append(f"edges_{i:04d}.npy")
        np.save(directory / names[-1], chunk)
        edges += chunk.shape[1]
    centroids = rng.standard_normal((classes, features)).astype(np.float32)
    x = np.lib.format.open_memmap(directory / "x.npy", mode="w+", dtype=np.float32,
                                  shape=(num_nodes, features))
    step = 1 << 18
    for a in range(0, num_nodes, step):
        b = min(num_nodes, a + step)
        x[a:b] = centroids[y[a:b]] + 3.0 * rng.standard_normal((b - a, features), dtype=np.float32)
    x.flush()
    del x
    np.save(directory / "y.npy", y)
    order = rng.permutation(num_nodes)
    bounds = np.cumsum([0, round(0.1 * num_nodes), round(0.1 * num_nodes), round(0.2 * num_nodes)])
    for split, a, b in zip(("train", "val", "test"), bounds[:-1], bounds[1:], strict=True):
        np.save(directory / f"{split}.npy", np.sort(order[a:b]))
    info = {"num_nodes": num_nodes, "num_edges": edges, "edges": names, "features": features,
            "classes": classes}
    tmp = directory / ".graph.json.tmp"
    tmp.write_text(json.dumps(info))
    os.replace(tmp, done)
    return info


def chunked_graph(directory: Path):
    from lightning_dorylus.data.chunked import ChunkedGraph

    info = json.loads((directory / "graph.json").read_text())
    return ChunkedGraph(edges=info["edges"], x="x.npy", y="y.npy", train="train.npy", val="val.npy",
                        test="test.npy", root=directory)


def initial_weights(features: int, hidden: int, classes: int, seed: int) -> dict[str, Any]:
    """Glorot-uniform weights, zero biases (as ``dorylus_epoch.py``); layout ``(in, out)``."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for i, (w_in, w_out) in enumerate([(features, hidden), (hidden, classes)]):
        bound = math.sqrt(6.0 / (w_in + w_out))
        weights[f"convs.{i}.weight"] = torch.rand(w_in, w_out, generator=generator) * (2 * bound) - bound
        weights[f"convs.{i}.bias"] = torch.zeros(w_out)
    return weights


def peak_gib() -> float:
    """Peak resident set (``ru_maxrss``), the pages of memory-mapped chunk files included."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


class AnonPeak:
    """Samples ``RssAnon`` (memory the process holds itself, which the kernel cannot drop as it drops the
    clean pages of mapped files) every 20 ms in a thread; ``peak_gib`` is the largest sample."""

    def __init__(self) -> None:
        import threading

        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                self.peak = max(self.peak, int(line.split()[1]) * 1024)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self._sample()

    def peak_gib(self) -> float:
        self._sample()
        return self.peak / GIB


def write_result(path: Path, result: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)


# --------------------------------------------------------------------------- workers
def worker_pyg(args: argparse.Namespace) -> dict[str, Any]:
    """PyG's way: the whole graph in memory, 2-layer GCNConv, one full-graph epoch."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch_geometric.nn import GCNConv

    torch.set_num_threads(args.threads)
    anon = AnonPeak()
    graph = chunked_graph(Path(args.graph))
    edge_index = torch.from_numpy(np.concatenate([np.asarray(e) for _, e, _ in graph.chunks()], axis=1))
    edge_index = edge_index[:, edge_index[0] != edge_index[1]]
    x = torch.from_numpy(np.load(graph.path("x.npy")))
    y = torch.from_numpy(graph.labels())
    train = torch.from_numpy(graph.mask("train"))
    init = initial_weights(args.features, args.hidden, args.classes, args.seed)
    convs = torch.nn.ModuleList([GCNConv(args.features, args.hidden), GCNConv(args.hidden, args.classes)])
    with torch.no_grad():
        for i, conv in enumerate(convs):
            conv.lin.weight.copy_(init[f"convs.{i}.weight"].t())
            conv.bias.copy_(init[f"convs.{i}.bias"])

    def loss() -> torch.Tensor:
        h = F.relu(convs[0](x, edge_index))
        out = convs[1](h, edge_index)
        return F.cross_entropy(out[train], y[train])

    with torch.no_grad():
        initial = float(loss())
    optimizer = torch.optim.Adam(convs.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    start = time.perf_counter()
    optimizer.zero_grad()
    value = loss()
    value.backward()
    optimizer.step()
    return {"initial_loss": initial, "epoch_s": time.perf_counter() - start, "loss": float(value),
            "rss_peak_gib": peak_gib(), "peak_gib": anon.peak_gib()}


def worker_prep(args: argparse.Namespace) -> dict[str, Any]:
    """One machine's preparation: its own partitions, from the shared chunks, into its own disk."""
    from lightning_dorylus.data.streaming import prepare_streamed

    anon = AnonPeak()
    parts = [int(p) for p in args.parts.split(",")]
    start = time.perf_counter()
    out = prepare_streamed(chunked_graph(Path(args.graph)), args.num_parts, args.partitioner,
                           args.interval_size, args.seed, Path(args.cache), parts=parts,
                           restreams=args.restreams)
    return {"partition_dir": str(out), "prep_s": time.perf_counter() - start, "rss_peak_gib": peak_gib(),
            "peak_gib": anon.peak_gib()}


def worker_server(args: argparse.Namespace) -> dict[str, Any]:
    """One graph server under torchrun: reads only its partition, trains one epoch from the weights."""
    from datetime import timedelta

    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F

    from lightning_dorylus import DorylusStrategy
    from lightning_dorylus.data import DorylusDataModule
    from lightning_dorylus.models import GCN

    torch.set_num_threads(args.threads)
    anon = AnonPeak()
    state: dict[str, Any] = {}

    class Timer(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            pl_module.eval()
            with torch.no_grad():
                logits = pl_module(pl_module.graph(batch))
                mask = batch.train_mask
                loss = F.cross_entropy(logits[mask], batch.y[mask], reduction="sum") / batch.num_train_global
                state["initial_loss"] = float(trainer.strategy.reduce(loss, reduce_op="sum"))
            pl_module.train()
            state["start"] = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            state["epoch_s"] = time.perf_counter() - state["start"]

    trainer = pl.Trainer(
        accelerator="cpu", devices=args.servers_per_machine, num_nodes=args.machines,
        strategy=DorylusStrategy(executor="inline", timeout=timedelta(seconds=args.timeout)), max_epochs=1,
        callbacks=[Timer()], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )
    model = GCN(args.features, args.hidden, args.classes, num_layers=2, dropout=0.0, lr=LR,
                weight_decay=WEIGHT_DECAY)
    model.load_state_dict(initial_weights(args.features, args.hidden, args.classes, args.seed))
    trainer.fit(model, datamodule=DorylusDataModule(args.partition_dir))
    return {"rank": trainer.global_rank, "initial_loss": state.get("initial_loss"),
            "epoch_s": state.get("epoch_s"), "rss_peak_gib": peak_gib(), "peak_gib": anon.peak_gib()}


# --------------------------------------------------------------------------- machines
def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=60)


def sweep_leftovers() -> None:
    """Removes h48 namespaces, links and cgroups whose creating process is dead (an earlier killed run)."""
    _cgroups.sweep()
    for name in _run(["ip", "netns", "list"]).stdout.split():
        match = _NS.match(name)
        if match and not _cgroups._alive(int(match.group(1))):
            _kill_namespace(name)
            _run(["ip", "netns", "del", name], check=False)
    for line in _run(["ip", "-o", "link", "show"]).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        match = _LINK.match(name)
        if match and not _cgroups._alive(int(match.group(1))):
            _run(["ip", "link", "del", name], check=False)


def _kill_namespace(name: str) -> None:
    for pid in _run(["ip", "netns", "pids", name], check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


class Machines:
    """K network namespaces on one bridge (``10.232.<k>.0/24``), each with a memory cgroup of ``limit``."""

    def __init__(self, count: int, limit_bytes: int) -> None:
        pid = os.getpid()
        self.bridge = f"h48b{pid}"
        self.names = [f"h48-{pid}-m{i}" for i in range(count)]
        self.veths = [f"h48v{pid}m{i}" for i in range(count)]
        used = _run(["ip", "-o", "addr"]).stdout
        third = next(k for k in range(20, 250) if f"10.232.{k}." not in used)
        self.addresses = [f"10.232.{third}.{10 + i}" for i in range(count)]
        self.cgroups: list[_cgroups.MemoryCgroup] = []
        try:
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            _run(["ip", "addr", "add", f"10.232.{third}.1/24", "dev", self.bridge])
            _run(["ip", "link", "set", self.bridge, "up"])
            for i, (ns, veth) in enumerate(zip(self.names, self.veths, strict=True)):
                _run(["ip", "netns", "add", ns])
                _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}p"])
                _run(["ip", "link", "set", f"{veth}p", "netns", ns])
                _run(["ip", "link", "set", veth, "master", self.bridge, "up"])
                inside = ["ip", "netns", "exec", ns]
                _run([*inside, "ip", "link", "set", f"{veth}p", "name", "eth0"])
                _run([*inside, "ip", "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0"])
                _run([*inside, "ip", "link", "set", "eth0", "up"])
                _run([*inside, "ip", "link", "set", "lo", "up"])
                self.cgroups.append(_cgroups.MemoryCgroup(f"m{i}", limit_bytes))
        except BaseException:
            self.close()
            raise

    def command(self, i: int, cmd: list[str]) -> list[str]:
        """``cmd`` run in machine ``i``: its namespace and its memory cgroup."""
        # cgroup first: `ip netns exec` remounts /sys for the namespace, hiding the cgroup files
        return self.cgroups[i].wrap(["ip", "netns", "exec", self.names[i], *cmd])

    def close(self) -> None:
        for ns in self.names:
            _kill_namespace(ns)
        for cgroup in self.cgroups:
            cgroup.close()
        for ns in self.names:
            _run(["ip", "netns", "del", ns], check=False)
        for veth in self.veths:
            _run(["ip", "link", "del", veth], check=False)
        _run(["ip", "link", "del", self.bridge], check=False)


def run_in(machines: Machines, index: int, cmd: list[str], log: Path, timeout: float,
           env: dict[str, str]) -> subprocess.Popen[str]:
    handle = log.open("w")
    proc = subprocess.Popen(machines.command(index, cmd), stdout=handle, stderr=subprocess.STDOUT, env=env,
                            text=True, start_new_session=True, cwd=REPO)
    proc.log = handle  # type: ignore[attr-defined]
    proc.deadline = time.monotonic() + timeout  # type: ignore[attr-defined]
    return proc


def wait_all(procs: list[subprocess.Popen[str]]) -> list[int]:
    """Exit codes; a process past its deadline is killed (its session) and reads as SIGKILL; once one
    fails the others get 10 s before they are killed too (they would wait for it at a barrier)."""
    failed_at = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        for p in procs:
            if p.poll() is None and (now > p.deadline or (failed_at and now - failed_at > 10)):  # type: ignore
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
        time.sleep(0.2)
    for p in procs:
        p.log.close()  # type: ignore[attr-defined]
    return [p.returncode for p in procs]


def worker_cmd(args: argparse.Namespace, worker: str, result: Path, **extra: Any) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), f"--worker={worker}", f"--result={result}",
           f"--machines={args.machines}", f"--features={args.features}", f"--hidden={args.hidden}",
           f"--classes={args.classes}", f"--seed={args.seed}", f"--threads={args.threads}",
           f"--servers-per-machine={args.servers_per_machine}", f"--timeout={args.timeout}",
           f"--partitioner={args.partitioner}", f"--restreams={args.restreams}",
           f"--interval-size={args.interval_size}"]
    return cmd + [f"--{k.replace('_', '-')}={v}" for k, v in extra.items()]


def base_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "eth0"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK"):
        env.pop(name, None)
    return env


def outcome(code: int, cgroup: _cgroups.MemoryCgroup, oom_before: int, log: Path) -> str:
    """``"ok"``, or ``"oom"`` (the machine's OOM killer struck: "did not fit"); any other failure is a bug
    of the run, raised with the log's tail, never counted as an answer."""
    if code == 0:
        return "ok"
    if cgroup.oom_kills() > oom_before or code in (-9, 137):
        return "oom"
    tail = log.read_text()[-4000:]
    raise RuntimeError(f"a worker failed (exit {code}) without an OOM kill; {log}:\n{tail}")


def try_pyg(args: argparse.Namespace, machines: Machines, graph: Path, work: Path) -> dict[str, Any]:
    result = work / "pyg.json"
    oom = machines.cgroups[0].oom_kills()
    proc = run_in(machines, 0, worker_cmd(args, "pyg", result, graph=graph), work / "pyg.log", args.timeout,
                  base_env())
    (code,) = wait_all([proc])
    status = outcome(code, machines.cgroups[0], oom, work / "pyg.log")
    return {"status": status, **(json.loads(result.read_text()) if status == "ok" else {})}


def try_dorylus(args: argparse.Namespace, machines: Machines, graph: Path, work: Path) -> dict[str, Any]:
    from lightning_dorylus.data.streaming import node_parts

    k, s = args.machines, args.servers_per_machine
    env = base_env()
    ooms = [c.oom_kills() for c in machines.cgroups]
    procs = []
    for i in range(k):
        disk = work / f"m{i}"
        disk.mkdir(parents=True, exist_ok=True)
        parts = ",".join(str(p) for p in node_parts(i, s, k * s))
        cmd = worker_cmd(args, "prep", disk / "prep.json", graph=graph, cache=disk / "cache", parts=parts,
                         num_parts=k * s)
        procs.append(run_in(machines, i, cmd, disk / "prep.log", args.timeout, env))
    codes = wait_all(procs)
    statuses = [outcome(c, machines.cgroups[i], ooms[i], work / f"m{i}" / "prep.log")
                for i, c in enumerate(codes)]
    if any(st != "ok" for st in statuses):
        return {"status": "oom", "stage": "prepare", "machines": statuses}
    preps = [json.loads((work / f"m{i}" / "prep.json").read_text()) for i in range(k)]
    ooms = [c.oom_kills() for c in machines.cgroups]
    procs = []
    port = 29400 + os.getpid() % 500
    for i in range(k):
        disk = work / f"m{i}"
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(k), "--nproc-per-node",
                    str(s), "--node-rank", str(i), "--master-addr", machines.addresses[0], "--master-port",
                    str(port), "--local-addr", machines.addresses[i], "--max-restarts", "0"]
        cmd = torchrun + worker_cmd(args, "server", disk / "server_{rank}.json",
                                    partition_dir=preps[i]["partition_dir"])[1:]
        procs.append(run_in(machines, i, cmd, disk / "servers.log", args.timeout, env))
    codes = wait_all(procs)
    statuses = [outcome(c, machines.cgroups[i], ooms[i], work / f"m{i}" / "servers.log")
                for i, c in enumerate(codes)]
    if any(st != "ok" for st in statuses):
        return {"status": "oom", "stage": "train", "machines": statuses,
                "prep_peak_gib": max(p["peak_gib"] for p in preps)}
    servers = [json.loads(p.read_text()) for i in range(k) for p in (work / f"m{i}").glob("server_*.json")]
    return {"status": "ok", "prep_peak_gib": max(p["peak_gib"] for p in preps),
            "prep_s": max(p["prep_s"] for p in preps),
            "server_peak_gib": max(r["peak_gib"] for r in servers),
            "epoch_s": max(r["epoch_s"] for r in servers), "initial_loss": servers[0]["initial_loss"]}


def search(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(args.workdir)
    runs: list[dict[str, Any]] = []
    pyg_max = dorylus_max = 0
    best: dict[str, Any] = {}
    prep_peak = server_peak = 0.0
    machines = Machines(args.machines, int(args.limit_gib * GIB))
    try:
        nodes, pyg_open, dorylus_open = args.start_nodes, True, True
        while (pyg_open or dorylus_open) and nodes <= args.max_nodes:
            graph = root / f"graph_n{nodes}"
            info = generate(graph, nodes, args.avg_degree, args.features, args.classes, args.seed)
            run: dict[str, Any] = {"nodes": nodes, "edges": info["num_edges"]}
            work = root / f"run_n{nodes}"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            if pyg_open:
                run["pyg"] = try_pyg(args, machines, graph, work)
                pyg_open = run["pyg"]["status"] == "ok"
                pyg_max = info["num_edges"] if pyg_open else pyg_max
            if dorylus_open:
                run["dorylus"] = try_dorylus(args, machines, graph, work)
                dorylus_open = run["dorylus"]["status"] == "ok"
                if dorylus_open:
                    dorylus_max, best = info["num_edges"], run["dorylus"]
                    prep_peak = max(prep_peak, best["prep_peak_gib"])
                    server_peak = max(server_peak, best["server_peak_gib"])
                    reference = run.get("pyg", {}).get("initial_loss")
                    if reference is not None:
                        same = math.isclose(best["initial_loss"], reference, rel_tol=1e-4)
                        run["initial_loss_equal"] = same
                        if not run["initial_loss_equal"]:
                            raise RuntimeError(f"initial losses differ at {nodes} vertices: Dorylus "
                                               f"{best['initial_loss']} against PyG {reference}")
            runs.append(run)
            print(json.dumps(run), flush=True)
            if not args.keep_graphs:
                shutil.rmtree(graph, ignore_errors=True)
            shutil.rmtree(work, ignore_errors=True)
            nodes *= 2
    finally:
        machines.close()
    return {"runs": runs, "pyg_max_edges": pyg_max, "dorylus_max_edges": dorylus_max,
            "prep_peak_gib": prep_peak, "server_peak_gib": server_peak, "epoch_s": best.get("epoch_s")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--machines", type=int, default=4)
    parser.add_argument("--limit-gib", type=float, default=5.0, help="memory cgroup of each machine")
    parser.add_argument("--servers-per-machine", type=int, default=1)
    parser.add_argument("--start-nodes", type=int, default=250_000)
    parser.add_argument("--max-nodes", type=int, default=64_000_000)
    parser.add_argument("--avg-degree", type=float, default=20.5)
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--classes", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--partitioner", default="fennel", help="fennel | hash | range")
    parser.add_argument("--restreams", type=int, default=1, help="Fennel's restreaming passes")
    parser.add_argument("--interval-size", type=int, default=8192)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per process")
    parser.add_argument("--workdir", default="/tmp/h48-dorylus-scale")
    parser.add_argument("--keep-graphs", action="store_true")
    parser.add_argument("--json", default="", help="also write the runs here")
    parser.add_argument("--worker", choices=["pyg", "prep", "server"], help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    for hidden in ("graph", "cache", "parts", "partition-dir"):
        parser.add_argument(f"--{hidden}", default="", help=argparse.SUPPRESS)
    parser.add_argument("--num-parts", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.worker:
        result = {"pyg": worker_pyg, "prep": worker_prep, "server": worker_server}[args.worker](args)
        write_result(Path(args.result.format(rank=os.environ.get("RANK", "0"))), result)
        return
    problem = _cgroups.available()
    if problem is not None or shutil.which("ip") is None:
        sys.exit(f"dorylus_scale.py: {problem or 'iproute2 (ip) is missing'}")
    sweep_leftovers()
    found = search(args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **found}, indent=1))
    ratio = found["dorylus_max_edges"] / found["pyg_max_edges"] if found["pyg_max_edges"] else float("inf")
    epoch = found["epoch_s"]
    print(f"machines={args.machines} limit_gib={args.limit_gib:g} pyg_max_edges={found['pyg_max_edges']} "
          f"dorylus_max_edges={found['dorylus_max_edges']} scale_ratio={ratio:.2f} "
          f"prep_peak_gib={found['prep_peak_gib']:.2f} server_peak_gib={found['server_peak_gib']:.2f} "
          f"epoch_s={epoch if epoch is None else f'{epoch:.2f}'}")


if __name__ == "__main__":
    main()
