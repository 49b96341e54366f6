"""benchmarks/dorylus_epoch.py: memory accounting, the summary line, and the whole benchmark at CI size."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.process import REPO as REPO_ROOT
from tests.process import run_process

SCRIPT = REPO_ROOT / "benchmarks" / "dorylus_epoch.py"
SUMMARY = re.compile(r"^vs_pyg=\d+\.\d\d mem_per_server_vs_pyg=\d+\.\d\d mem_total_vs_pyg=\d+\.\d\d$")


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


def test_report_uses_the_slowest_server_per_epoch_and_the_best_pyg_threads(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bench = load_benchmark()
    pyg = {"epoch_times_by_threads": {"1": [1.0, 2.0, 3.0], "2": [4.0, 4.0, 4.0]}, "peak_total_mib": 1000.0,
           "losses": [2.0, 1.0], "initial_loss": 2.5}
    server = {"peak_self_mib": 300.0, "peak_workers_mib": 100.0, "num_workers": 2, "losses": [2.0, 1.5],
              "initial_loss": 2.5}
    traffic = {"features": 3 << 30, "csr": 1 << 30, "activations": 0, "gradients": 1 << 29}
    servers = [
        {**server, "rank": 0, "epoch_times": [2.0, 1.0, 1.0], "peak_total_mib": 400.0, "cpu_s": 1.25,
         "worker_cpu_s": 0.5, "bytes": traffic},
        {**server, "rank": 1, "epoch_times": [1.0, 3.0, 5.0], "peak_total_mib": 700.0, "cpu_s": 1.5,
         "worker_cpu_s": 0.25, "bytes": traffic},
    ]
    bench.report({"nodes": 10, "edges": 20, "stream_bytes_per_s": 9 * 2**30}, pyg, servers)
    lines = capsys.readouterr().out.strip().splitlines()
    # 4.5 GiB per epoch at 9 GiB/s: 0.5 s
    assert lines[-3] == ("(b) server 0: CPU 1.250 s/epoch (+ 0.500 in its executor workers); must move "
                         "4,608 MiB/epoch (features 3,072, csr 1,024, activations 0, gradients 512) = "
                         "memory-traffic bound 0.500 s at 9.7 GB/s")
    assert lines[-2].startswith("(b) server 1: CPU 1.500 s/epoch (+ 0.250 in its executor workers)")
    # per-epoch max over servers: [2, 3, 5] -> median 3; PyG's best (1 thread) median 2; worst server 700 MiB
    # of 1000, both servers 1100 MiB.
    assert lines[-1] == "vs_pyg=1.50 mem_per_server_vs_pyg=0.70 mem_total_vs_pyg=1.10"
    assert [line.endswith("best") for line in lines if line.startswith("(a)")] == [True, False]


def test_pyg_threads_default_to_powers_of_two_up_to_the_usable_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_benchmark()
    for cores, expected in ((1, [1]), (2, [1, 2]), (6, [1, 2, 4, 6]), (16, [1, 2, 4, 8, 16])):
        monkeypatch.setattr(bench.os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert bench.parse_args([]).pyg_threads == expected, cores
    assert bench.parse_args(["--pyg-threads", "3"]).pyg_threads == [3]


def test_epoch_bytes_count_each_array_once_per_use() -> None:
    """The memory-traffic model by hand: 10 local + 4 ghost vertices, 30 adjacency entries, 8 -> 2 -> 3."""
    bench = load_benchmark()
    traffic = bench.memory_bound.gcn_epoch_bytes(10, 4, 30, features=8, hidden=2, classes=3)
    assert traffic["features"] == 4 * 10 * 8 * 4  # X read and its rows written, forward and ∇W
    assert traffic["csr"] == 2 * (11 * 4 + 30 * 8) + 2 * (15 * 4 + 30 * 8)  # Â twice, Âᵀ twice
    # per layer: SC writes and GA reads 14 rows, GA writes 10, the AV's rows in and out over the wire
    layer1 = 4 * (14 * 2 + 14 * 2 + 10 * 2 + 10 * (0 + 2))
    layer2 = 4 * (14 * 2 + 14 * 2 + 10 * 2 + 10 * (2 + 3))
    assert traffic["activations"] == traffic["gradients"] == layer1 + layer2


def test_turns_alternate_pyg_thread_counts_and_the_dorylus_job() -> None:
    bench = load_benchmark()
    args = bench.parse_args(["--epochs", "2", "--warmup", "1", "--servers", "3", "--pyg-threads", "1,2"])
    assert bench.interleaved_turns(args) == [
        ("pyg", 0, 1), ("pyg", 1, 1), ("dorylus", 0, 3),
        ("pyg", 2, 1), ("pyg", 3, 1), ("dorylus", 1, 3),
        ("pyg", 4, 1), ("pyg", 5, 1), ("dorylus", 2, 3),
    ]


def test_bad_arguments_name_the_value(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_benchmark()
    with pytest.raises(SystemExit):
        bench.parse_args(["--servers", "0"])
    assert "--servers must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--pyg-threads", "1,0"])
    assert "expected thread counts >= 1, got '1,0'" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.multiprocess
def test_benchmark_ci_size(tmp_path: Path) -> None:
    """The benchmark end to end on a 5k-vertex graph, PyG and 2 graph servers taking turns; no dropout, so
    both sides train the same model from the same weights: equal initial and per-epoch losses."""
    op_times = tmp_path / "ops.json"
    command = [
        sys.executable, str(SCRIPT), "--nodes", "5000", "--avg-degree", "10", "--features", "32",
        "--epochs", "2", "--warmup", "1", "--interval-size", "1024", "--cache-dir", str(tmp_path / "cache"),
        "--dropout", "0", "--pyg-threads", "1,2", "--timeout", "240", "--op-times", str(op_times),
    ]
    output = run_process(command, timeout=420, cwd=REPO_ROOT).stdout
    lines = output.strip().splitlines()
    assert SUMMARY.match(lines[-1]), lines[-1]
    rows = [line.split() for line in lines if line.startswith(("(a) PyG GCNConv", "(b) Dorylus server"))]
    assert len(rows) == 4, output  # PyG with 1 and 2 threads, then 2 servers
    # columns: ... s/epoch, peak MiB, loss0 (initial weights), first->last training loss
    pyg_row = rows[0][rows[0].index("thr") + 1:]
    initial, trained = {pyg_row[2]}, {pyg_row[3]}
    for row in rows[2:]:
        initial.add(row[6])
        trained.add(row[7])
    assert len(initial) == 1 and len(trained) == 1, output
    traffic = [line for line in lines if line.startswith("(b) server ")]
    assert [line.split(":")[0] for line in traffic] == ["(b) server 0", "(b) server 1"], output
    assert all("memory-traffic bound" in line and " GB/s" in line for line in traffic), output
    run = json.loads(op_times.read_text())
    assert run["format"] == "dorylus-op-times/1"
    assert sorted({e["rank"] for e in run["epochs"]}) == [0, 1] and len(run["epochs"]) == 4
    assert all(e["stages"] and e["blocked_s"] <= e["epoch_s"] for e in run["epochs"])


@pytest.mark.multiprocess
def test_a_failing_worker_is_reported_with_its_output(tmp_path: Path) -> None:
    """A worker that cannot run (nothing prepared: no initial weights, no partitions) fails the launch with
    its own error message."""
    bench = load_benchmark()
    args = bench.parse_args(["--nodes", "100", "--timeout", "120", "--cache-dir", str(tmp_path / "cache"),
                             "--partition-dir", str(tmp_path / "missing")])
    expected = r"(?s)dorylus worker exited with 1:.*FileNotFoundError.*gcn2_f128_h16_c16_seed0"
    with pytest.raises(RuntimeError, match=expected):
        bench.launch(args, "dorylus", tmp_path, num_procs=2)
