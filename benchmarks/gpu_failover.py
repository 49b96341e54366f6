"""A lost peer on NCCL, on one GPU: a real 2 x 2 Bamboo job survives a SIGKILLed worker and ends equal to the
same job run without the kill.

    python benchmarks/gpu_failover.py                                  # a CUDA machine: backend nccl
    python benchmarks/gpu_failover.py --device cpu --backend gloo      # the same scenario on CPU
    python benchmarks/gpu_failover.py --device cpu --backend nccl-like # CPU, with NCCL's failure rules

Four workers (2 stages x 2 pipelines, ``recovery="replica"``) train a small MLP with dropout under Bamboo's
supervisor (:class:`~lightning_bamboo.control.supervisor.Supervisor`, the one a plain ``python train.py``
starts). Member 3 SIGKILLs itself in the forward of step ``--kill-step`` (its communication under way); the
survivors fail over and finish. The same job without the kill is the reference: ``exact`` is whether every
survivor's final parameters equal the reference's (float64 on CPU: rtol 1e-9; float32 master weights under
``bf16-mixed`` on CUDA: rtol 1e-5, since the summation order of a fused stage may differ).

On CUDA the four workers share the one GPU, each with its own ``NCCL_HOSTID`` (NCCL then treats them as
separate hosts and uses its socket transport, as torchft's ``train_ddp.py`` example does) and
``NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo``; ``bf16-mixed``; dropout masks drawn on the GPU (keyed by step,
so the aborted step's replay draws them again: a different mask would show in the parameters). Two more
runs there: (a) the same kill with torch's default NCCL error handling (``BAMBOO_NCCL_ENV=0``: what the
workers' environment prevents; its survivors lost are ``default_env_survivors_lost``), and (b) when the
bundled NCCL is 2.30 or newer, the job with ``NCCL_MULTI_RANK_GPU_ENABLE=1`` and no host ids (reported in
the JSON, not in the line). On CPU (a) is ``skipped``.

``failover_s`` is from the kill to the next step a survivor completes (the aborted step replayed included);
``step_s`` the median failure-free step of the reference. Last line, exactly::

    backend=<nccl|gloo|nccl-like> nccl_version=<v|none> exact=<true|false> failover_s=<s> step_s=<s>
    survivors_lost=<n> default_env_survivors_lost=<n|skipped>

(one line). ``--out FILE`` writes the JSON with every run's details; ``--keep-workdir`` keeps the runs'
directory.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

WORKERS, STAGES, MICROBATCHES, WIDTH, BATCH = 4, 2, 2, 16, 16
KILLED = 3  # the member SIGKILLed mid-step


# ------------------------------------------------------------------------------------------------ the worker
def worker(args: argparse.Namespace) -> None:
    """One member of the job: train, record each step's end, die at the kill step if it is the victim, and
    write its final stages (``torch.save`` of tensors, read back with ``weights_only=True``)."""
    member = int(os.environ["BAMBOO_MEMBER"])
    cuda = args.device == "cuda"
    if cuda:
        os.environ["BAMBOO_LOCAL_RANK"] = "0"  # four workers on the one GPU
        if args.host_ids:
            os.environ["NCCL_HOSTID"] = f"bamboo-bench-host-{member}"
    import torch
    import torch.nn.functional as F
    from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_bamboo.strategy import BambooStrategy

    dtype = torch.float64 if not cuda else torch.float32

    class Net(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            layers: list[nn.Module] = []
            for _ in range(4):
                layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Dropout(0.25)]
            layers.append(nn.Linear(WIDTH, 1))
            self.pipeline = nn.Sequential(*layers).to(dtype)

        def pipeline_inputs(self, batch: Any) -> Any:
            return batch[0]

        def pipeline_loss(self, outputs: Any, batch: Any) -> Any:
            return F.mse_loss(outputs.float(), batch[1].float())

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.pipeline_loss(self.pipeline(self.pipeline_inputs(batch)), batch)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=0.01)

    class Steps(Callback):
        """Each completed step's wall time (appended); the victim's kill time (written, then renamed)."""

        def __init__(self, out: Path) -> None:
            self.file = out / f"steps-member{member}.txt"
            self.forwards = 0

        def on_train_batch_end(self, trainer: Trainer, *rest: Any) -> None:
            with self.file.open("a") as f:
                f.write(f"{trainer.global_step} {time.time():.6f}\n")

        def on_step_phase(self, trainer: Trainer, pl_module: Any, phase: str, step: int, member: int,
                          microbatch: int | None = None, **payload: Any) -> None:
            if member != KILLED or step != args.kill_step or phase != "forward":
                return
            self.forwards += 1
            if self.forwards == 2:  # the second micro-batch's forward: the step's communication under way
                tmp = args.out / ".killed"
                tmp.write_text(f"{time.time():.6f}")
                tmp.rename(args.out / "killed")
                os.kill(os.getpid(), signal.SIGKILL)

    seed_everything(7)
    model = Net()
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(BATCH * args.steps, WIDTH, generator=generator, dtype=torch.float64)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    data = DataLoader(TensorDataset(x.to(dtype), y.to(dtype)), batch_size=BATCH, shuffle=False)
    strategy = BambooStrategy(num_stages=STAGES, num_microbatches=MICROBATCHES, recovery="replica",
                              process_group_backend=args.backend, timeout=60)
    trainer = Trainer(
        accelerator="cuda" if cuda else "cpu", devices=1, strategy=strategy, max_steps=args.steps,
        precision="bf16-mixed" if cuda else None, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Steps(args.out)],
    )
    trainer.fit(model, train_dataloaders=data)
    final = {name: p.detach().cpu().clone() for name, p in model.named_parameters() if not p.is_meta}
    torch.save(final, args.out / f".final-member{member}.pt")
    (args.out / f".final-member{member}.pt").rename(args.out / f"final-member{member}.pt")


# ------------------------------------------------------------------------------------------------ the driver
def run_job(out: Path, args: argparse.Namespace, kill: bool, env: dict[str, str], timeout: float,
            host_ids: bool = True) -> dict[str, Any]:
    """One job under Bamboo's supervisor (in this process, on a thread); its workers killed by PID if it
    outlives ``timeout``. Returns its record: exit codes, finals, step times, kill time."""
    from lightning_bamboo.control.supervisor import Supervisor

    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--out", str(out), "--device",
               args.device, "--backend", args.backend, "--steps", str(args.steps),
               "--kill-step", str(args.kill_step if kill else -1), *([] if host_ids else ["--no-host-ids"])]
    saved = dict(os.environ)
    os.environ.update(env)  # the workers get this process's environment when they start
    lines: list[str] = []
    result: dict[str, int] = {}
    start = time.time()
    try:
        sup = Supervisor(command, WORKERS, hang_timeout=10.0, backend=args.backend, preload=False,
                         log=lambda *a, **k: lines.append(" ".join(map(str, a))))
        thread = threading.Thread(target=lambda: result.update(rc=sup.run()), name="bench-supervisor",
                                  daemon=True)
        thread.start()
        thread.join(timeout)
        timed_out = thread.is_alive()
        if timed_out:
            for member in sup.live_members():
                sup.kill(member)
            sup.stop_all()
            thread.join(30)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    codes = {m: w.proc.poll() for m, w in sup.workers.items()}
    (out / "supervisor.log").write_text("\n".join(lines))
    return {"rc": result.get("rc"), "timed_out": timed_out, "wall_s": time.time() - start,
            "exit_codes": codes, "finals": sorted(p.name for p in out.glob("final-member*.pt"))}


def step_times(out: Path, member: int) -> list[tuple[int, float]]:
    path = out / f"steps-member{member}.txt"
    if not path.exists():
        return []
    return [(int(a), float(b)) for a, b in (line.split() for line in path.read_text().splitlines())]


def compare(run: Path, reference: Path, rtol: float) -> tuple[bool, float]:
    """Whether every survivor's final parameters equal the reference's (the same names in some member);
    and the largest relative difference."""
    import torch

    ref: dict[str, Any] = {}
    for path in reference.glob("final-member*.pt"):
        ref.update(torch.load(path, weights_only=True))
    worst, covered = 0.0, set()
    for path in run.glob("final-member*.pt"):
        for name, value in torch.load(path, weights_only=True).items():
            if value.is_meta or name not in ref:
                continue
            expected = ref[name].to(value.dtype)
            diff = ((value - expected).abs() / expected.abs().clamp_min(1e-12)).max().item()
            worst = max(worst, diff)
            covered.add(name)
    return bool(covered) and covered == set(ref) and worst <= rtol, worst


def survivors_lost(record: dict[str, Any]) -> int:
    """Members other than the victim that did not finish (no final file, or a non-zero exit)."""
    finals = set(record["finals"])
    return sum(1 for m, code in record["exit_codes"].items()
               if m != KILLED and (code != 0 or f"final-member{m}.pt" not in finals))


def nccl_version() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return None
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when present")
    parser.add_argument("--backend", choices=["nccl", "gloo", "nccl-like"], default=None,
                        help="default: nccl on cuda, gloo on cpu")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--kill-step", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="the JSON with every run's details")
    parser.add_argument("--keep-workdir", action="store_true",
                        help="keep the runs' directory (events, logs, final states); removed by default")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-host-ids", dest="host_ids", action="store_false", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.out = Path(args.out)
        worker(args)
        return 0
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device; use --device cpu")
    if args.backend == "nccl" and args.device != "cuda":
        parser.error("--backend nccl needs --device cuda; on CPU use --backend nccl-like (NCCL's failure "
                     "rules)")
    if not 0 < args.kill_step < args.steps - 1:
        parser.error(f"--kill-step must be between 1 and --steps - 2 ({args.steps - 2}), got "
                     f"{args.kill_step}")
    cuda = args.device == "cuda"
    base = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    if cuda:
        base.update({"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo"})
    tmp = Path(tempfile.mkdtemp(prefix="gpu_failover-"))
    try:
        return measure(args, tmp, base, cuda, torch.__version__)
    finally:
        if not args.keep_workdir:
            shutil.rmtree(tmp, ignore_errors=True)


def measure(args: argparse.Namespace, tmp: Path, base: dict[str, str], cuda: bool, torch_version: str) -> int:
    """The reference and failover runs (and, on CUDA, the default-environment and multi-rank runs) in
    ``tmp``; prints the summary line and writes ``args.out``."""
    import torch

    runs: dict[str, Any] = {}
    runs["reference"] = run_job(tmp / "reference", args, kill=False, env=base, timeout=120)
    runs["failover"] = run_job(tmp / "failover", args, kill=True, env=base, timeout=120)
    rtol = 1e-5 if cuda else 1e-9
    exact, worst = compare(tmp / "failover", tmp / "reference", rtol)
    reference_steps = [t for _, t in step_times(tmp / "reference", 0)]
    step_s = statistics.median(b - a for a, b in itertools.pairwise(reference_steps[1:]))  # after warm-up
    killed_file = tmp / "failover" / "killed"
    killed_at = float(killed_file.read_text()) if killed_file.exists() else None
    after = [t for m in range(WORKERS) if m != KILLED for _, t in step_times(tmp / "failover", m)
             if killed_at is not None and t > killed_at]
    failover_s = min(after) - killed_at if after and killed_at is not None else float("nan")
    lost = survivors_lost(runs["failover"])
    default_lost: int | str = "skipped"
    if cuda:
        runs["default_env"] = run_job(tmp / "default_env", args, kill=True, timeout=120,
                                      env={**base, "BAMBOO_NCCL_ENV": "0"})
        default_lost = survivors_lost(runs["default_env"])
        version = torch.cuda.nccl.version()
        if isinstance(version, tuple) and version >= (2, 30):
            runs["multi_rank_gpu"] = run_job(tmp / "multi_rank_gpu", args, kill=True, timeout=120,
                                             env={**base, "NCCL_MULTI_RANK_GPU_ENABLE": "1"}, host_ids=False)
            runs["multi_rank_gpu"]["exact"], _ = compare(tmp / "multi_rank_gpu", tmp / "reference", rtol)
            runs["multi_rank_gpu"]["survivors_lost"] = survivors_lost(runs["multi_rank_gpu"])
    nccl = nccl_version() or "none"
    summary = {"backend": args.backend, "device": args.device, "torch": torch_version,
               "nccl_version": nccl, "exact": exact, "max_rel_diff": worst, "rtol": rtol,
               "failover_s": failover_s, "step_s": step_s, "survivors_lost": lost,
               "default_env_survivors_lost": default_lost, "runs": runs,
               "workdir": str(tmp) if args.keep_workdir else None, "load_average": os.getloadavg()}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2, default=str))
    print(f"backend={args.backend} nccl_version={nccl} exact={str(exact).lower()} "
          f"failover_s={failover_s:.3f} step_s={step_s:.3f} survivors_lost={lost} "
          f"default_env_survivors_lost={default_lost}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
