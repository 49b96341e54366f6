"""benchmarks/dorylus_tta.py: the mini-batch sampler's recipe, the summary ratios, a whole run at CI size."""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.process import REPO as REPO_ROOT
from tests.process import run_process

SCRIPT = REPO_ROOT / "benchmarks" / "dorylus_tta.py"
SUMMARY = re.compile(r"^minibatch_vs_fullgraph=\S+ dorylus2_vs_pyg_full=\S+ staleness1_vs_sync=\S+ "
                     r"staleness1_vs_sync_latency=\S+$")


def load_benchmark():
    spec = importlib.util.spec_from_file_location("dorylus_tta", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sampler_draws_up_to_fanout_distinct_in_neighbours_seeds_first() -> None:
    """NeighborLoader's recipe: per hop at most ``fanout`` in-edges of each frontier vertex, no edge twice,
    only edges of the graph, every vertex of a hop's frontier with fewer in-edges keeps them all."""
    bench = load_benchmark()
    gen = torch.Generator().manual_seed(0)
    n = 300
    src = torch.randint(0, n, (6000,), generator=gen)
    dst = torch.randint(0, n, (6000,), generator=gen)
    key = torch.unique(dst * n + src)
    edge_index = torch.stack([key % n, key // n])
    edges = set(map(tuple, edge_index.t().tolist()))
    in_degree = torch.bincount(edge_index[1], minlength=n)
    sampler = bench.NeighborSampler(edge_index, n, (3, 2), gen)
    seeds = torch.tensor([5, 17, 42])
    nodes, sub = sampler.sample(seeds)
    assert nodes[:3].tolist() == seeds.tolist() and nodes.unique().numel() == nodes.numel()
    sampled = [(int(nodes[a]), int(nodes[b])) for a, b in sub.t().tolist()]
    assert set(sampled) <= edges and len(set(sampled)) == len(sampled)
    per_seed = {s: sum(1 for _, b in sampled if b == s) for s in seeds.tolist()}
    assert per_seed == {s: min(3, int(in_degree[s])) for s in seeds.tolist()}
    assert all(count <= 3 for count in torch.bincount(sub[1]).tolist())


def test_summary_ratios_take_the_best_full_graph_form_and_medians_over_rounds() -> None:
    bench = load_benchmark()

    def runs(*fits: float) -> list[dict[str, float]]:
        return [{"fit_s": f, "launch_s": f + 1, "startup_s": 1.0, "peak_total_mib": 100.0} for f in fits]

    by_config = {"pyg-csr-t1": runs(4.0, 6.0, 5.0), "pyg-ei-t1": runs(8.0, 8.0, 8.0),
                 "minibatch-t1": runs(2.0, 1.0, 3.0), "minibatch-t2": runs(4.0, 4.0, 4.0),
                 "d2-sync": runs(10.0, 10.0, 10.0),
                 "d2-s1": runs(12.0, 12.0, 12.0), "d2-sync-lat": runs(20.0, 20.0, 20.0),
                 "d2-s1-lat": runs(math.inf, math.inf, 15.0)}
    s = bench.summary(by_config)
    assert s["best_full"] == "pyg-csr-t1" and s["best_minibatch"] == "minibatch-t1"
    assert s["minibatch_vs_fullgraph"] == pytest.approx(2.0 / 5.0)
    assert s["dorylus2_vs_pyg_full"] == pytest.approx(2.0)
    assert s["staleness1_vs_sync"] == pytest.approx(1.2)
    assert s["staleness1_vs_sync_latency"] == math.inf  # never reached the target in 2 of 3 rounds


def test_benchmark_ci_size_prints_the_summary_line_last(tmp_path: Path) -> None:
    """Prepare, then PyG (both adjacency forms), mini-batch and Dorylus 2 servers sync / staleness 1 with and
    without the round trip, on a 600-vertex graph; every configuration has a row and the summary is last."""
    command = [sys.executable, str(SCRIPT), "--nodes", "600", "--avg-degree", "8", "--features", "16",
               "--classes", "4", "--hidden", "8", "--target", "0.3", "--max-epochs", "3", "--rounds", "1",
               "--servers", "2", "--pyg-threads", "1", "--latency-ms", "5", "--cache-dir", str(tmp_path),
               "--timeout", "300", "--json", str(tmp_path / "runs.json")]
    lines = run_process(command, timeout=900, cwd=REPO_ROOT).stdout.strip().splitlines()
    assert SUMMARY.match(lines[-1]), lines[-1]
    table = next(i for i, line in enumerate(lines) if line.startswith("configuration"))
    rows = [line.split()[0] for line in lines[table + 1 : -1] if not line.startswith("startup ")]
    assert rows == ["pyg-csr-t1", "pyg-ei-t1", "minibatch-t1", "d2-sync", "d2-sync-lat", "d2-s1", "d2-s1-lat"]
    # where each Dorylus job's time before its first epoch went
    assert [line.split()[1].rstrip(":") for line in lines if line.startswith("startup ")] == rows[3:]
    assert any("mini-batch sampler: " in line for line in lines[:table]), lines
    saved = [sys.executable, str(SCRIPT), "--from-json", str(tmp_path / "runs.json")]
    again = run_process(saved, timeout=120, cwd=REPO_ROOT).stdout.strip().splitlines()
    assert again[-1] == lines[-1]  # the saved runs give the same report
