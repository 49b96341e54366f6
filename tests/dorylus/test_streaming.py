"""Streamed preparation of a ChunkedGraph: the partitions it writes, the errors it gives, training on them,
preparing under a memory limit below the graph's size, and an interrupted preparation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from lightning_dorylus.data import DorylusDataModule, load_partition
from lightning_dorylus.data.build import build_partitions
from lightning_dorylus.data.cache import is_complete
from lightning_dorylus.data.chunked import ChunkedGraph, ChunkedGraphError
from lightning_dorylus.data.stream_assign import assign_vertices
from lightning_dorylus.data.streaming import load_edge_weight, prepare_streamed
from lightning_dorylus.data.validation import GraphTensors, graph_tensors
from tests.dorylus.scripts.exact_run import INTERVAL_SIZE, make_graph
from tests.dorylus.scripts.launch import run_script
from tests.dorylus.scripts.streamed_run import write_chunks
from tests.dorylus.test_strategy import EPOCHS, reference
from tests.process import REPO, launch_env

FIELDS = ("local_nodes", "ghost_nodes", "ghost_owner", "recv_ptr", "edge_index", "dst_ptr", "in_degree", "x",
          "y", "train_mask", "val_mask", "test_mask", "interval_ptr")


def assert_same_parts(directory: Path, expected: list, parts: list[int]) -> None:
    for k in parts:
        got, want = load_partition(directory, k), expected[k]
        for name in FIELDS:
            assert torch.equal(getattr(got, name), getattr(want, name)), (k, name)
        assert len(got.send_index) == len(want.send_index)
        for a, b in zip(got.send_index, want.send_index, strict=True):
            assert torch.equal(a, b)
        assert got.num_train_global == want.num_train_global


@pytest.mark.parametrize("partitioner", ["fennel", "hash", "range"])
@pytest.mark.parametrize("num_parts", [2, 3])
def test_streamed_partitions_equal_the_in_memory_build(tmp_path, partitioner: str, num_parts: int) -> None:
    """Same assignment -> the same partitions, field by field, as ``build_partitions`` on the whole graph."""
    data = make_graph()
    graph = write_chunks(data, tmp_path / "g")
    out = prepare_streamed(graph, num_parts, partitioner, INTERVAL_SIZE, cache_dir=tmp_path / "cache")
    assignment = torch.from_numpy(assign_vertices(graph, num_parts, partitioner).astype(np.int64))
    expected = build_partitions(graph_tensors(data), assignment, num_parts, INTERVAL_SIZE)
    assert_same_parts(out, expected, list(range(num_parts)))
    meta = json.loads((out / "meta.json").read_text())
    assert meta["num_edges"] == data.edge_index.size(1)
    assert 0 < meta["edge_cut"] < meta["num_edges"]
    assert load_edge_weight(out, 0) is None


def test_fennel_cuts_fewer_edges_than_hash_on_a_clustered_graph(tmp_path) -> None:
    gen = np.random.default_rng(0)
    n, blocks = 2000, 4
    src = gen.integers(0, n, 20000)
    same = gen.random(src.size) < 0.9
    dst = np.where(same, (src // (n // blocks)) * (n // blocks) + gen.integers(0, n // blocks, src.size),
                   gen.integers(0, n, src.size))
    perm = gen.permutation(n)  # ids carry no locality
    edges = np.stack([perm[src], perm[dst]])[:, src != dst]
    np.save(tmp_path / "e.npy", np.concatenate([edges, edges[::-1]], axis=1))
    np.save(tmp_path / "x.npy", np.zeros((n, 2), dtype=np.float32))
    graph = ChunkedGraph(edges=["e.npy"], x="x.npy", root=tmp_path)
    cut = {}
    for method in ("fennel", "hash"):
        out = prepare_streamed(graph, 4, method, cache_dir=tmp_path / "c")
        meta = json.loads((out / "meta.json").read_text())
        cut[method] = meta["edge_cut"] / meta["num_edges"]
        if method == "fennel":  # capped; a hash is balanced in expectation only
            assert max(p["n_local"] for p in meta["parts"].values()) <= 1.05 * n / 4 + 1
    assert cut["fennel"] < 0.6 * cut["hash"], cut


def test_duplicates_are_kept_self_loops_dropped_and_weights_carried(tmp_path) -> None:
    edges = np.array([[0, 1, 1, 2, 3, 2, 0], [1, 0, 0, 2, 0, 3, 3]], dtype=np.int64)  # (1, 0) twice; (2, 2)
    weight = np.arange(7, dtype=np.float32) + 1
    np.save(tmp_path / "e.npy", edges)
    np.save(tmp_path / "w.npy", weight)
    np.save(tmp_path / "x.npy", np.eye(4, dtype=np.float16))
    graph = ChunkedGraph(edges=["e.npy"], x="x.npy", edge_weight=["w.npy"], root=tmp_path)
    with pytest.warns(UserWarning, match="1 self loops"):
        out = prepare_streamed(graph, 2, "range", cache_dir=tmp_path / "c")
    seen = {}
    for k in range(2):
        part = load_partition(out, k)
        assert part.x.dtype == torch.float32
        ids = torch.cat([part.local_nodes, part.ghost_nodes])
        pairs = torch.stack([ids[part.edge_index[0]], part.local_nodes[part.edge_index[1]]]).t().tolist()
        for (s, d), w in zip(pairs, load_edge_weight(out, k).tolist(), strict=True):
            seen.setdefault((s, d), []).append(w)
        if k == 0:  # vertex 0's in-degree counts (1, 0) twice and (3, 0) once
            assert int(part.in_degree[0]) == 3
    assert seen == {(0, 1): [1.0], (1, 0): [2.0, 3.0], (3, 0): [5.0], (2, 3): [6.0], (0, 3): [7.0]}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"edges": "e.npy"}, r"edges='e.npy' is one path"),
        ({"edges": ["missing.npy"]}, r"edges\[0\]='missing.npy'.*does not exist"),
        ({"edges": ["bad_shape.npy"]}, r"edges\[0\].*expected \[2, E_i\]"),
        ({"edges": ["out_of_range.npy"]}, r"edges\[0\].*ids in \[0, 9\] but x has 4 rows"),
        ({"edge_weight": ["w.npy", "w.npy"]}, r"edge_weight lists 2 files but edges lists 1"),
        ({"x": "e.npy"}, r"x: .*dtype int64; expected float16"),
        ({"train": "float_split.npy"}, r"train: .*expected an \[N\] bool mask or an integer index"),
        ({"train": "idx.npy"}, r"train selects 2 vertices without a label"),
    ],
)
def test_bad_files_are_named(tmp_path, change: dict, match: str) -> None:
    np.save(tmp_path / "e.npy", np.array([[0, 1], [1, 2]], dtype=np.int64))
    np.save(tmp_path / "bad_shape.npy", np.zeros((3, 2), dtype=np.int64))
    np.save(tmp_path / "out_of_range.npy", np.array([[0, 9], [1, 2]], dtype=np.int64))
    np.save(tmp_path / "w.npy", np.ones(2, dtype=np.float32))
    np.save(tmp_path / "x.npy", np.zeros((4, 3), dtype=np.float32))
    np.save(tmp_path / "float_split.npy", np.zeros(4, dtype=np.float32))
    np.save(tmp_path / "idx.npy", np.array([0, 1]))
    kwargs = {"edges": ["e.npy"], "x": "x.npy", "root": tmp_path, **change}
    with pytest.raises(ChunkedGraphError, match=match):
        ChunkedGraph(**kwargs).validate()


def test_metis_on_a_chunked_graph_is_refused_with_the_fix(tmp_path) -> None:
    graph = write_chunks(make_graph(), tmp_path / "g")
    with pytest.raises(ValueError, match=r"partitioner='metis' cannot partition a ChunkedGraph.*fennel"):
        DorylusDataModule(graph)


def test_datamodule_without_trainer_prepares_and_loads(tmp_path) -> None:
    graph = write_chunks(make_graph(), tmp_path / "g")
    datamodule = DorylusDataModule(graph, num_parts=1, partitioner="hash", interval_size=INTERVAL_SIZE,
                                   cache_dir=tmp_path / "c")
    datamodule.setup("fit")
    whole = partition_whole(make_graph())
    for name in FIELDS:
        assert torch.equal(getattr(datamodule.partition, name), getattr(whole, name)), name
    assert datamodule.num_features == 12 and datamodule.num_classes == 4


def partition_whole(data) -> object:
    graph: GraphTensors = graph_tensors(data)
    return build_partitions(graph, torch.zeros(graph.num_nodes, dtype=torch.long), 1, INTERVAL_SIZE)[0]


def test_one_machine_builds_only_its_partitions(tmp_path) -> None:
    data = make_graph()
    graph = write_chunks(data, tmp_path / "g")
    out = prepare_streamed(graph, 4, "fennel", INTERVAL_SIZE, cache_dir=tmp_path / "c", parts=[2, 3])
    assert is_complete(out)
    assert sorted(p.name for p in out.glob("part_*")) == ["part_2.safetensors", "part_3.safetensors"]
    assignment = torch.from_numpy(assign_vertices(graph, 4, "fennel").astype(np.int64))
    assert_same_parts(out, build_partitions(graph_tensors(data), assignment, 4, INTERVAL_SIZE), [2, 3])
    with pytest.raises(FileNotFoundError, match=r"holds partitions \[2, 3\] of this machine, not partition"):
        load_partition(out, 0)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("servers", [2, 3])
def test_streamed_partitions_train_equal_to_auto(tmp_path, servers: int) -> None:
    """float64 GCN on 2 and 3 graph servers from a streamed (Fennel) preparation == one process, ``auto``."""
    graph_dir = tmp_path / "g"
    write_chunks(make_graph(), graph_dir)
    run_script("streamed_run.py", [str(tmp_path), str(graph_dir), "--servers", str(servers),
                                   "--epochs", str(EPOCHS)], timeout=400, cwd=tmp_path, nprocs=servers)
    result = json.loads((tmp_path / "result.json").read_text())
    assert all(json.loads((tmp_path / f"ghosts_rank{r}.json").read_text()) > 0 for r in range(servers))
    expected, expected_weights = reference("gcn")
    torch.testing.assert_close(torch.tensor(result["losses"], dtype=torch.float64),
                               torch.tensor(expected["losses"], dtype=torch.float64), rtol=1e-9, atol=1e-11)
    assert result["val_acc"] == pytest.approx(expected["val_acc"], abs=1e-12)
    for rank in range(servers):
        weights = load_file(str(tmp_path / f"weights_rank{rank}.safetensors"))
        for name, value in expected_weights.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-9, atol=1e-11)


_PREPARE = """
import sys
from pathlib import Path
from lightning_dorylus.data.chunked import ChunkedGraph
from lightning_dorylus.data.streaming import prepare_streamed
root = Path(sys.argv[1])
graph = ChunkedGraph(edges=sorted(p.name for p in root.glob("e*.npy")), x="x.npy", root=root)
print(prepare_streamed(graph, 3, "fennel", cache_dir=root / "cache"))
"""


def random_chunks(directory: Path, n: int, e: int, chunks: int, features: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    gen = np.random.default_rng(1)
    for i in range(chunks):
        np.save(directory / f"e{i:02d}.npy", gen.integers(0, n, (2, e // chunks), dtype=np.int64))
    np.save(directory / "x.npy", gen.standard_normal((n, features), dtype=np.float32))


def test_an_interrupted_preparation_is_detected_and_redone(tmp_path) -> None:
    random_chunks(tmp_path, 100_000, 4_000_000, 8, 4)
    proc = subprocess.Popen([sys.executable, "-c", _PREPARE, str(tmp_path)], env=launch_env(), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not list((tmp_path / "cache").glob(".*.tmp/src_0.bin")):  # bucketing has begun
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the preparation never started bucketing"
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    visible = [p for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")]
    assert visible == [], "a killed preparation left a directory readers would take as a partitioning"
    leftovers = list((tmp_path / "cache").glob(".*.tmp"))
    assert leftovers
    graph = ChunkedGraph(edges=sorted(p.name for p in tmp_path.glob("e*.npy")), x="x.npy", root=tmp_path)
    out = prepare_streamed(graph, 3, "fennel", cache_dir=tmp_path / "cache")
    assert is_complete(out) and not any(p.exists() for p in leftovers)
    meta = json.loads((out / "meta.json").read_text())
    assert sum(p["edges"] for p in meta["parts"].values()) == meta["num_edges"]
    assert sum(load_partition(out, k).num_edges for k in range(3)) == meta["num_edges"]


@pytest.mark.netns
def test_preparation_under_a_memory_limit_below_the_graph(tmp_path) -> None:
    """A cgroup smaller than the graph's files (and than the whole-graph preparation needs) still prepares."""
    from benchmarks._cgroups import MemoryCgroup, available, sweep

    if available() is not None:
        pytest.fail(available())
    sweep()
    random_chunks(tmp_path, 400_000, 6_000_000, 12, 64)  # 96 MB of edges + 102 MB of features
    graph_bytes = sum(p.stat().st_size for p in tmp_path.glob("*.npy"))
    baseline = 460 << 20  # the interpreter with torch, Lightning and PyG imported (~435 MB resident)
    limit = baseline + (160 << 20)
    assert limit - baseline < graph_bytes
    with MemoryCgroup("prep-test", limit) as cgroup:
        cmd = cgroup.wrap([sys.executable, "-c", _PREPARE, str(tmp_path)])
        done = subprocess.run(cmd, env=launch_env(), cwd=REPO, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout + done.stderr
        assert cgroup.oom_kills() == 0
    out = Path(done.stdout.strip().splitlines()[-1])
    assert is_complete(out)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["num_edges"] > 5_900_000
