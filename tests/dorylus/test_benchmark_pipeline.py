"""benchmarks/dorylus_pipeline.py: the injected latency, the summary line, and the whole run at tiny size."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_dorylus.executors import InlineExecutor, TensorOpRequest
from tests.process import REPO as REPO_ROOT
from tests.process import run_process

SCRIPT = REPO_ROOT / "benchmarks" / "dorylus_pipeline.py"
SUMMARY = re.compile(r"^async_speedup=\d+\.\d\d s0_speedup=\d+\.\d\d shared_cores_async_speedup=\d+\.\d\d "
                     r"bound=\d+\.\d\d time_to_loss_speedup=\d+\.\d\d$")


def load_benchmark():
    spec = importlib.util.spec_from_file_location("dorylus_pipeline", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_delayed_executor_adds_the_round_trip_to_every_request_concurrently() -> None:
    bench = load_benchmark()
    executor = bench.make_delayed_executor(InlineExecutor(), latency_s=0.2)
    z, w = torch.ones(4, 3), torch.ones(3, 2)
    start = time.perf_counter()
    futures = [
        executor.submit(TensorOpRequest("apply_vertex.forward", {"z": z, "weight": w})) for _ in range(8)
    ]
    outs = [f.result() for f in futures]
    elapsed = time.perf_counter() - start
    executor.close()
    assert all(torch.equal(o["h"], torch.full((4, 2), 3.0)) for o in outs)
    assert 0.2 <= elapsed < 1.6  # every request waited 0.2 s, all 8 at the same time


def test_report_prints_sync_over_stale_ratios_last(capsys: pytest.CaptureFixture[str]) -> None:
    """The summary line: the three ratios, the own-cores bound from the servers' CPU seconds, and the time to
    the synchronous final loss (staleness 1 never reaches it here: inf, and the line says so)."""
    bench = load_benchmark()
    args = bench.parse_args(["--server-cores", "0", "--worker-cores", "1"])
    # per server and epoch: 1.0 CPU-s in its own threads, 0.5 in its executor worker's
    cpu = {"cpu_s": 1.5, "threads": {"MainThread": 1.0, "worker:python": 0.5}}

    def servers(times_a: list[float], times_b: list[float], losses: tuple = (2.0, 1.0)) -> list[dict]:
        return [
            {"rank": 0, "epoch_times": times_a, "losses": list(losses), "cpu": [cpu] * len(times_a)},
            {"rank": 1, "epoch_times": times_b, "losses": list(losses), "cpu": [cpu] * len(times_b)},
        ]

    results = {
        "sync/own": servers([3.0, 1.0, 3.0], [1.0, 3.0, 1.0]),  # slowest per epoch: 3, 3, 3
        "s0/own": servers([2.0], [1.0]),
        "s1/own": servers([1.5], [1.0], losses=(2.0, 1.5)),
        "sync/shared": servers([2.0], [1.0]),
        "s1/shared": servers([2.5], [1.0]),
    }
    bench.report({"nodes": 10, "edges": 20}, results, args)
    lines = capsys.readouterr().out.strip().splitlines()
    # bound: staleness 1's busiest core set is the servers' core, 2 x 1.0 CPU-s: 3.0 / 2.0; time to loss 1.0:
    # sync 2 epochs x 3.0 s, staleness 0 2 x 2.0 s, staleness 1 never
    assert lines[-1] == ("async_speedup=2.00 s0_speedup=1.50 shared_cores_async_speedup=0.80 bound=1.50 "
                         "time_to_loss_speedup=1.50")
    assert lines[-2] == ("time to the synchronous run's final loss 1.000 (epochs needed x median s/epoch, "
                         "own cores): sync/own 6.000 s (2 epochs)  s0/own 4.000 s (2 epochs)  s1/own inf "
                         "(never reached: 1.500 after 2 epochs)")


def test_time_to_loss_takes_the_faster_pipelined_mode_and_tolerates_rounding() -> None:
    bench = load_benchmark()
    epochs = {"sync/own": 2.0, "s0/own": 1.5, "s1/own": 1.0}
    # staleness 0 ends 1e-6 above the synchronous loss (sums in another order): it reaches it; staleness 1
    # reaches it one epoch later than sync, but its epochs are half as long
    losses = {"sync/own": [3.0, 2.0, 1.0], "s0/own": [3.0, 2.0, 1.000001], "s1/own": [3.0, 2.5, 1.5, 0.9]}
    ttl = bench.time_to_loss(losses, epochs)
    assert ttl["modes"] == {"sync/own": (6.0, 3), "s0/own": (4.5, 3), "s1/own": (4.0, 4)}
    assert ttl["speedup"] == pytest.approx(1.5)
    never = bench.time_to_loss({**losses, "s0/own": [3.0, 2.0, 1.1], "s1/own": [3.0, 2.0, 1.2]}, epochs)
    assert never["modes"]["s0/own"][0] == never["modes"]["s1/own"][0] == float("inf")
    assert never["speedup"] == 0.0


def test_rounds_rotate_the_order_and_report_the_median_per_configuration(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bench = load_benchmark()
    configs = ["sync/own", "s0/own", "s1/own", "sync/shared", "s1/shared"]
    rotations = [configs[r:] + configs[:r] for r in range(5)]
    assert [bench.round_order(r) for r in range(6)] == [*rotations, configs]
    args = bench.parse_args(["--rounds", "3"])

    def one(*times: float) -> dict:
        return {config: [{"rank": 0, "epoch_times": [t], "losses": [2.0, 1.0], "cpu": []}]
                for config, t in zip(configs, times)}

    # medians: sync/own 4, s0/own 2, s1/own 1.5, sync/shared 3, s1/shared 2
    rounds = [one(3.0, 2.0, 1.0, 3.0, 1.0), one(9.0, 1.0, 1.5, 2.0, 2.0), one(4.0, 4.0, 2.0, 6.0, 3.0)]
    bench.report({"nodes": 10, "edges": 20}, rounds[0], args, rounds)
    lines = capsys.readouterr().out.strip().splitlines()
    # no CPU seconds recorded: no bound (nan); the losses are the first round's, the epochs the medians
    assert lines[-1] == ("async_speedup=2.67 s0_speedup=2.00 shared_cores_async_speedup=1.50 bound=nan "
                         "time_to_loss_speedup=2.67")
    assert lines[-3] == ("round 2 (s/epoch, in the order run): s1/own 2.000  sync/shared 6.000  "
                         "s1/shared 3.000  sync/own 4.000  s0/own 4.000")


def test_rounds_below_one_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_benchmark().parse_args(["--rounds", "0"])
    assert "--rounds must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.slow  # 11 fresh processes (prepare + 5 configurations x 2 servers): ~2 min quiet, 5+ loaded
@pytest.mark.multiprocess
def test_benchmark_tiny_size_prints_the_summary_line(tmp_path: Path) -> None:
    """The whole benchmark (prepare, then 5 configurations x 2 graph servers) on a 600-vertex graph; the
    own-cores servers and executor workers ran on the cores they were given."""
    command = [
        sys.executable,
        str(SCRIPT),
        "--nodes",
        "600",
        "--avg-degree",
        "6",
        "--features",
        "8",
        "--hidden",
        "8",
        "--classes",
        "4",
        "--epochs",
        "1",
        "--warmup",
        "0",
        "--interval-size",
        "128",
        "--latency-ms",
        "5",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--timeout",
        "240",
    ]
    lines = run_process(command, timeout=600, cwd=REPO_ROOT).stdout.strip().splitlines()
    assert SUMMARY.match(lines[-1]), lines[-1]
    table = next(i for i, line in enumerate(lines) if line.startswith("configuration"))
    assert [line.split("  ")[0] for line in lines[table + 1 : table + 6]] == [
        "staleness=None, own cores", "staleness=0, own cores", "staleness=1, own cores",
        "staleness=None, shared cores", "staleness=1, shared cores"]
    cores = sorted(os.sched_getaffinity(0))
    servers, workers = cores[: len(cores) // 2], cores[len(cores) // 2 :]
    pinned = f"own cores: graph servers on {servers}, executor workers on {workers} (as run)"
    assert pinned in lines[table - 1], lines
    # every run: the own-cores bound from the servers' CPU seconds, and each mode's time to the sync loss
    assert lines[-3].startswith("own-cores bound: a staleness-1 epoch needs at least"), lines
    assert lines[-2].startswith("time to the synchronous run's final loss"), lines
    assert "sync/own " in lines[-2] and "s0/own " in lines[-2] and "s1/own " in lines[-2], lines


@pytest.mark.parametrize("huge_pages", [False, True])
def test_huge_pages_start_the_servers_with_glibcs_tunable(
    huge_pages: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--huge-pages`` must reach the servers at exec (glibc reads its tunables once, at start-up); without
    it the servers keep this process's environment."""
    bench = load_benchmark()
    started: list[dict[str, str]] = []

    class Started:
        returncode = 0

        def __init__(self, command: list[str], env: dict[str, str], **_: object) -> None:
            started.append(env)
            result = next(arg.split("=", 1)[1] for arg in command if arg.startswith("--result="))
            Path(result).write_text("{}")

    # the benchmark's own reference to the module, not subprocess.Popen itself (other threads may start one)
    monkeypatch.setattr(bench, "subprocess", SimpleNamespace(Popen=Started, STDOUT=subprocess.STDOUT))
    monkeypatch.setattr(bench, "watch", lambda *_args, **_kwargs: False)
    monkeypatch.setattr(bench, "kill_groups", lambda _procs: None)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    args = bench.parse_args(["--servers", "2", *(["--huge-pages"] if huge_pages else [])])
    assert bench.launch(args, "server", tmp_path, num_procs=2) == [{}, {}]
    assert [env.get("GLIBC_TUNABLES") for env in started] == (
        [bench.HUGE_PAGES_TUNABLE] * 2 if huge_pages else [None, None])
