"""benchmarks/dorylus_epoch.py: memory accounting, the summary line, and the whole benchmark at CI size."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.process import REPO as REPO_ROOT
from tests.process import run_process

SCRIPT = REPO_ROOT / "benchmarks" / "dorylus_epoch.py"
SUMMARY = re.compile(r"^vs_pyg=\d+\.\d\d mem_per_server_vs_pyg=\d+\.\d\d$")


def load_benchmark():
    spec = importlib.util.spec_from_file_location("dorylus_epoch", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_peak_memory_counts_live_descendants() -> None:
    """A child holding 64 MiB (as an executor worker would) is added to the parent's peak."""
    bench = load_benchmark()
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]);"
         " print('ready', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        memory = bench.peak_memory_mib()
    finally:
        child.kill()
        child.wait()
    assert memory["num_workers"] >= 1
    assert memory["peak_workers_mib"] >= 64
    assert memory["peak_total_mib"] == pytest.approx(memory["peak_self_mib"] + memory["peak_workers_mib"])


def test_report_uses_the_slowest_server_per_epoch(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_benchmark()
    pyg = {"epoch_times": [1.0, 2.0, 3.0], "peak_total_mib": 1000.0, "losses": [2.0, 1.0]}
    server = {"peak_self_mib": 300.0, "peak_workers_mib": 100.0, "num_workers": 2, "losses": [2.0, 1.5]}
    servers = [
        {**server, "rank": 0, "epoch_times": [2.0, 1.0, 1.0], "peak_total_mib": 400.0},
        {**server, "rank": 1, "epoch_times": [1.0, 3.0, 5.0], "peak_total_mib": 700.0},
    ]
    bench.report({"nodes": 10, "edges": 20}, pyg, servers)
    lines = capsys.readouterr().out.strip().splitlines()
    # per-epoch max over servers: [2, 3, 5] -> median 3; PyG median 2; worst server 700 MiB of 1000.
    assert lines[-1] == "vs_pyg=1.50 mem_per_server_vs_pyg=0.70"


def test_bad_arguments_name_the_value(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_benchmark()
    with pytest.raises(SystemExit):
        bench.parse_args(["--servers", "0"])
    assert "--servers must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.multiprocess
def test_benchmark_ci_size(tmp_path: Path) -> None:
    """The benchmark end to end on a 5k-vertex graph: PyG, then 2 graph servers; the exact summary line."""
    command = [
        sys.executable, str(SCRIPT), "--nodes", "5000", "--avg-degree", "10", "--features", "32",
        "--epochs", "1", "--warmup", "1", "--interval-size", "1024", "--cache-dir", str(tmp_path / "cache"),
        "--timeout", "240",
    ]
    output = run_process(command, timeout=420, cwd=REPO_ROOT).stdout
    lines = output.strip().splitlines()
    assert SUMMARY.match(lines[-1]), lines[-1]
    assert any(line.startswith("(a) PyG GCNConv") for line in lines), output
    assert sum(line.startswith("(b) Dorylus server") for line in lines) == 2, output


@pytest.mark.multiprocess
def test_a_failing_worker_is_reported_with_its_output(tmp_path: Path) -> None:
    """A worker that cannot run (no partition directory) fails the launch with its own error message."""
    bench = load_benchmark()
    args = bench.parse_args(["--nodes", "100", "--timeout", "120", "--cache-dir", str(tmp_path / "cache"),
                             "--partition-dir", str(tmp_path / "missing")])
    with pytest.raises(RuntimeError, match=r"(?s)dorylus worker exited with 1:.*missing"):
        bench.launch(args, "dorylus", tmp_path, num_procs=2)
