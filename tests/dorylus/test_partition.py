"""Partitioning: every edge once, consistent ghost maps, degrees, intervals, cache reuse, bad input."""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
import warnings

import numpy as np
import pytest
import torch
from torch_geometric.data import Data

import lightning_dorylus.data.cache as cache_module
from lightning_dorylus.data import (
    DorylusDataModule,
    GraphPartition,
    build_partitions,
    edge_cut,
    load_graph,
    load_partition,
    partition_graph,
    partition_nodes,
    partition_to_cache,
    read_meta,
    save_graph,
)
from lightning_dorylus.data.partitioner import bfs_partition
from lightning_dorylus.data.prune import prune_cache
from lightning_dorylus.data.synthetic import powerlaw_graph
from lightning_dorylus.data.validation import coalesce, graph_tensors

PARTITIONERS = ["metis", "bfs", "contiguous", "random"]


def random_graph(num_nodes: int = 60, num_edges: int = 300, num_features: int = 5, seed: int = 0) -> Data:
    """A random directed graph without self loops or duplicates, with labels and masks."""
    gen = torch.Generator().manual_seed(seed)
    edge_index = torch.randint(0, num_nodes, (2, num_edges), generator=gen)
    edge_index = edge_index[:, edge_index[0] != edge_index[1]]
    edge_index = torch.unique(edge_index, dim=1)
    return Data(
        edge_index=edge_index,
        x=torch.randn(num_nodes, num_features, generator=gen),
        y=torch.randint(0, 3, (num_nodes,), generator=gen),
        train_mask=torch.rand(num_nodes, generator=gen) < 0.3,
        val_mask=torch.rand(num_nodes, generator=gen) < 0.3,
        test_mask=torch.rand(num_nodes, generator=gen) < 0.3,
        num_nodes=num_nodes,
    )


def edge_set(edge_index: torch.Tensor) -> list[tuple[int, int]]:
    return sorted(map(tuple, edge_index.t().tolist()))


def global_edges(parts: list[GraphPartition]) -> list[tuple[int, int]]:
    """All partitions' local edges mapped back to global ids (duplicates kept, so doubles would show)."""
    edges = []
    for part in parts:
        ids = torch.cat([part.local_nodes, part.ghost_nodes])
        src, dst = part.edge_index
        edges.append(torch.stack([ids[src], part.local_nodes[dst]]))
    return edge_set(torch.cat(edges, dim=1))


@pytest.mark.parametrize("partitioner", PARTITIONERS)
@pytest.mark.parametrize("num_parts", [1, 2, 3, 5])
def test_every_edge_in_exactly_one_partition(partitioner: str, num_parts: int) -> None:
    data = random_graph()
    parts = partition_graph(data, num_parts, partitioner=partitioner, interval_size=7)
    assert [p.part_id for p in parts] == list(range(num_parts))
    assert global_edges(parts) == edge_set(data.edge_index)
    for part in parts:  # each edge sits with the owner of its destination
        assert part.num_parts == num_parts and part.num_global_nodes == data.num_nodes
        assert bool((part.edge_index[1] < part.n_local).all())
        assert bool((part.edge_index[0] < part.n_local + part.n_ghost).all())


@pytest.mark.parametrize("partitioner", PARTITIONERS)
def test_local_vertices_partition_the_graph_in_global_order(partitioner: str) -> None:
    data = random_graph()
    parts = partition_graph(data, 4, partitioner=partitioner)
    owned = torch.cat([p.local_nodes for p in parts])
    torch.testing.assert_close(torch.sort(owned).values, torch.arange(data.num_nodes))
    for part in parts:
        torch.testing.assert_close(part.local_nodes, torch.sort(part.local_nodes).values)
    assert max(p.n_local for p in parts) - min(p.n_local for p in parts) <= 0.1 * data.num_nodes


@pytest.mark.parametrize("partitioner", PARTITIONERS)
def test_ghost_maps_are_consistent(partitioner: str) -> None:
    data = random_graph()
    parts = partition_graph(data, 4, partitioner=partitioner)
    owner_of = torch.empty(data.num_nodes, dtype=torch.long)
    for part in parts:
        owner_of[part.local_nodes] = part.part_id
    for q in parts:
        # Ghosts are exactly the remote sources of q's edges, grouped by ascending owner.
        src_global = torch.cat([q.local_nodes, q.ghost_nodes])[q.edge_index[0]]
        remote = torch.unique(src_global[owner_of[src_global] != q.part_id])
        torch.testing.assert_close(torch.sort(q.ghost_nodes).values, remote)
        torch.testing.assert_close(q.ghost_owner, owner_of[q.ghost_nodes])
        assert bool((q.ghost_owner[1:] >= q.ghost_owner[:-1]).all())
        assert q.recv_ptr.tolist() == [0, *torch.bincount(q.ghost_owner, minlength=4).cumsum(0).tolist()]
        assert q.send_index[q.part_id].numel() == 0
        for p in parts:
            held = q.ghost_nodes[q.recv_ptr[p.part_id] : q.recv_ptr[p.part_id + 1]]
            torch.testing.assert_close(held, p.local_nodes[p.send_index[q.part_id]])


def test_in_degree_is_global() -> None:
    data = random_graph()
    degree = torch.bincount(data.edge_index[1], minlength=data.num_nodes)
    for part in partition_graph(data, 3):
        torch.testing.assert_close(part.in_degree, degree[torch.cat([part.local_nodes, part.ghost_nodes])])


def test_local_csr_and_transpose() -> None:
    data = random_graph()
    for part in partition_graph(data, 3):
        dst = part.edge_index[1]
        assert bool((dst[1:] >= dst[:-1]).all()), "edges must be sorted by dst"
        counts = torch.bincount(dst, minlength=part.n_local)
        assert part.dst_ptr.tolist() == [0, *counts.cumsum(0).tolist()]
        src_ptr, src_perm = part.src_csr()
        assert src_ptr.numel() == part.n_local + part.n_ghost + 1
        src = part.edge_index[0]
        for v in range(part.n_local + part.n_ghost):
            out_edges = src_perm[src_ptr[v] : src_ptr[v + 1]]
            torch.testing.assert_close(torch.sort(out_edges).values, (src == v).nonzero().view(-1))


def test_intervals_cover_local_vertices() -> None:
    data = random_graph(num_nodes=101)
    for part in partition_graph(data, 2, interval_size=16):
        bounds = [part.interval(i) for i in range(part.num_intervals)]
        assert bounds[0][0] == 0 and bounds[-1][1] == part.n_local
        assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
        assert all(end - start == 16 for start, end in bounds[:-1])
        assert 0 < bounds[-1][1] - bounds[-1][0] <= 16
        edges = [part.interval_edges(i) for i in range(part.num_intervals)]
        assert edges[0][0] == 0 and edges[-1][1] == part.num_edges
        for (start, end), (e_a, e_b) in zip(bounds, edges):
            dst = part.edge_index[1, e_a:e_b]
            assert bool(((dst >= start) & (dst < end)).all())
        with pytest.raises(IndexError, match=f"interval index {part.num_intervals} is out of range"):
            part.interval(part.num_intervals)


def test_features_labels_masks_follow_local_order() -> None:
    data = random_graph()
    parts = partition_graph(data, 3)
    for part in parts:
        torch.testing.assert_close(part.x, data.x[part.local_nodes])
        torch.testing.assert_close(part.y, data.y[part.local_nodes])
        for name in ("train_mask", "val_mask", "test_mask"):
            torch.testing.assert_close(getattr(part, name), getattr(data, name)[part.local_nodes])
        assert part.num_train_global == int(data.train_mask.sum())
    assert sum(int(p.train_mask.sum()) for p in parts) == int(data.train_mask.sum())


def test_missing_labels_and_masks_default() -> None:
    data = random_graph()
    data = Data(edge_index=data.edge_index, x=data.x, num_nodes=data.num_nodes)
    (part,) = partition_graph(data, 1)
    assert bool((part.y == -1).all()) and not bool(part.train_mask.any()) and part.num_train_global == 0


def test_single_partition_is_the_whole_graph() -> None:
    data = random_graph()
    (part,) = partition_graph(data, 1)
    assert part.n_ghost == 0 and part.recv_ptr.tolist() == [0, 0]
    torch.testing.assert_close(part.local_nodes, torch.arange(data.num_nodes))
    torch.testing.assert_close(part.edge_index, coalesce(data.edge_index, data.num_nodes))


def test_to_moves_every_tensor() -> None:
    part = partition_graph(random_graph(), 2)[1]
    moved = part.to("meta")
    assert moved is not part and part.x.device.type == "cpu"
    tensors = [getattr(moved, f) for f in vars(moved) if isinstance(getattr(moved, f), torch.Tensor)]
    assert len(tensors) == 13 and all(t.device.type == "meta" for t in tensors)
    assert all(t.device.type == "meta" for t in moved.send_index)
    assert moved.part_id == 1 and moved.n_local == part.n_local


def test_self_loops_are_removed_with_a_warning_and_duplicates_kept() -> None:
    """Self loops go (the layers add their own); each copy of a duplicate edge stays, as PyG counts them,
    next to its other copies, with its weight, and counted in the in-degrees."""
    data = random_graph()
    clean = data.edge_index
    data.edge_index = torch.cat([clean, clean[:, :4], torch.tensor([[3, 7], [3, 7]])], dim=1)
    data.edge_weight = torch.arange(data.edge_index.size(1), dtype=torch.float64)
    data.edge_weight[-2:] = 1.0  # self loops of weight 1 may go
    with pytest.warns(UserWarning, match=r"had 2 self loops; they were removed"):
        parts = partition_graph(data, 2)
    kept = torch.cat([clean, clean[:, :4]], dim=1)
    assert global_edges(parts) == edge_set(kept)
    weights = {}
    for part in parts:
        ids = torch.cat([part.local_nodes, part.ghost_nodes])
        src, dst = ids[part.edge_index[0]], part.local_nodes[part.edge_index[1]]
        same = (src[1:] == src[:-1]) & (dst[1:] == dst[:-1])
        assert int(same.sum()) == sum(int(((src == a) & (dst == b)).sum()) - 1
                                      for a, b in set(zip(src.tolist(), dst.tolist()))), "copies adjacent"
        for a, b, w in zip(src.tolist(), dst.tolist(), part.edge_weight.tolist()):
            weights.setdefault((a, b), []).append(w)
        degree = torch.bincount(kept[1], minlength=data.num_nodes)[ids]
        assert torch.equal(part.in_degree, degree)
        summed = torch.zeros(data.num_nodes, dtype=torch.float64).index_add_(
            0, kept[1], data.edge_weight[:-2])
        assert torch.equal(part.weighted_in_degree, summed[ids])
    expected = {}
    for (a, b), w in zip(kept.t().tolist(), data.edge_weight[:-2].tolist()):
        expected.setdefault((a, b), []).append(w)
    assert {k: sorted(v) for k, v in weights.items()} == {k: sorted(v) for k, v in expected.items()}


def test_removed_edges_are_warned_about_on_cached_runs_too(tmp_path) -> None:
    """The partitioning run stores the count in meta.json; a run that reads the cache warns the same."""
    data = random_graph()
    extra = [data.edge_index[:, :4], torch.tensor([[3, 7], [3, 7]])]  # 4 duplicates (kept), 2 self loops
    data.edge_index = torch.cat([data.edge_index, *extra], dim=1)
    for _ in ("partitions", "reads the cache"):
        with pytest.warns(UserWarning, match="had 2 self loops; they were removed"):
            target = partition_to_cache(data, 2, "contiguous", cache_dir=tmp_path)
    removed = json.loads((target / "meta.json").read_text())["removed_edges"]
    assert removed == {"self_loops": 2}
    clean = random_graph()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean graph: no warning on either run
        partition_to_cache(clean, 2, "contiguous", cache_dir=tmp_path / "clean")
        partition_to_cache(clean, 2, "contiguous", cache_dir=tmp_path / "clean")


def test_metis_cuts_fewer_edges_than_random_on_a_clustered_graph() -> None:
    data = powerlaw_graph(3000, 10, 4, 6, seed=1)
    cuts = {p: edge_cut(data.edge_index, partition_nodes(data.edge_index, 3000, 4, p)) for p in PARTITIONERS}
    assert cuts["metis"] < 0.5 * cuts["random"], cuts
    assert cuts["metis"] < cuts["bfs"], cuts


def test_fallback_without_pymetis(monkeypatch: pytest.MonkeyPatch) -> None:
    data = random_graph()
    monkeypatch.setitem(sys.modules, "pymetis", None)  # makes `import pymetis` raise ImportError
    with pytest.warns(UserWarning, match="needs pymetis.*falling back to partitioner='bfs'"):
        assignment = partition_nodes(data.edge_index, data.num_nodes, 3, "metis")
    torch.testing.assert_close(assignment, bfs_partition(data.edge_index, data.num_nodes, 3))
    with pytest.warns(UserWarning, match="falling back"):
        parts = partition_graph(data, 3)
    assert global_edges(parts) == edge_set(data.edge_index)


def test_partitioners_are_deterministic() -> None:
    data = random_graph()
    for name in PARTITIONERS:
        a = partition_nodes(data.edge_index, data.num_nodes, 3, name, seed=5)
        torch.testing.assert_close(a, partition_nodes(data.edge_index, data.num_nodes, 3, name, seed=5))


@pytest.mark.parametrize(
    ("change", "kwargs", "match"),
    [
        ("edge_oob", {}, r"edge_index contains node index 2712 but num_nodes is 2708"),
        ("edge_neg", {}, r"edge_index contains negative node index -1"),
        ("edge_shape", {}, r"edge_index must have shape \(2, E\), got \(3, 4\)"),
        ("x_nan", {}, r"x contains 3 non-finite values \(NaN/inf\), the first at node 4"),
        ("x_none", {}, r"data.x is None; expected node features of shape \(num_nodes=2708, F\)"),
        ("x_int", {}, r"x must be a floating point tensor, got dtype torch.int64"),
        ("mask_size", {}, r"val_mask has shape \(2700,\) but expected \(2708,\)"),
        ("mask_dtype", {}, r"train_mask is an integer tensor of 2708 zeros and ones: it may be a 0/1 mask "
                           r"or the vertex indices 0 and 1, so it is not guessed: "
                           r".*index_to_mask\(index, size=2708\)"),
        ("y_float", {}, r"y must hold integer class labels, got dtype torch.float32"),
        ("none", {"num_parts": 3000}, r"num_parts \(3000\) is greater than the number of vertices \(2708\)"),
        ("none", {"num_parts": 0}, r"num_parts \(0\) must be an integer >= 1"),
        ("none", {"partitioner": "kway"}, r"partitioner='kway' is not supported; expected one of \['metis'"),
        ("none", {"interval_size": 0}, r"interval_size \(0\) must be an integer >= 1"),
    ],
)
def test_bad_input_is_named(change: str, kwargs: dict, match: str) -> None:
    data = random_graph(num_nodes=2708, num_edges=2000)
    if change == "edge_oob":
        data.edge_index = torch.cat([data.edge_index, torch.tensor([[0], [2712]])], dim=1)
    elif change == "edge_neg":
        data.edge_index = torch.cat([data.edge_index, torch.tensor([[-1], [5]])], dim=1)
    elif change == "edge_shape":
        data.edge_index = torch.zeros(3, 4, dtype=torch.long)
    elif change == "x_nan":
        data.x[4, 0], data.x[4, 1], data.x[9, 2] = float("nan"), float("inf"), float("-inf")
    elif change == "x_none":
        data.x = None
    elif change == "x_int":
        data.x = torch.zeros(2708, 3, dtype=torch.long)
    elif change == "mask_size":
        data.val_mask = torch.zeros(2700, dtype=torch.bool)
    elif change == "mask_dtype":
        data.train_mask = torch.zeros(2708, dtype=torch.long)
    elif change == "y_float":
        data.y = data.y.float()
    args = {"num_parts": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        partition_graph(data, **args)


def test_more_parts_than_vertices() -> None:
    data = random_graph(num_nodes=8, num_edges=20)
    with pytest.raises(ValueError, match=r"num_parts \(10\) is greater than the number of vertices \(8\)"):
        partition_graph(data, 10)


def assert_same_partition(a: GraphPartition, b: GraphPartition) -> None:
    for name, value in vars(a).items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(getattr(b, name), value, rtol=0, atol=0, msg=name)
        elif name == "send_index":
            assert len(b.send_index) == len(value)
            for got, want in zip(b.send_index, value):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
        else:
            assert getattr(b, name) == value, name


def test_cache_round_trip_and_layout(tmp_path) -> None:
    data = random_graph()
    directory = partition_to_cache(data, 3, "metis", interval_size=8, seed=0, cache_dir=tmp_path)
    assert directory.parent == tmp_path and directory.name.endswith("-metis-p3-i8-s0")
    assert sorted(p.name for p in tmp_path.iterdir()) == [directory.name], "no temporary leftovers"
    assert sorted(p.name for p in directory.iterdir()) == [
        "meta.json",
        "part_0.safetensors",
        "part_1.safetensors",
        "part_2.safetensors",
    ]
    meta = read_meta(directory)
    in_memory = partition_graph(data, 3, "metis", interval_size=8, seed=0)
    assert meta["num_nodes"] == 60 and meta["num_parts"] == 3 and meta["num_classes"] == 3
    assert meta["num_edges"] == data.edge_index.size(1)
    assert meta["edge_cut"] == sum(p.n_ghost and int((p.edge_index[0] >= p.n_local).sum()) for p in in_memory)
    for k in range(3):
        assert_same_partition(in_memory[k], load_partition(directory, k))
    with pytest.raises(ValueError, match=r"part_id \(3\) must lie in \[0, 3\)"):
        load_partition(directory, 3)


def test_cache_is_reused_without_repartitioning(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = random_graph()
    first = partition_to_cache(data, 2, cache_dir=tmp_path)

    def fail(*args, **kwargs):
        raise AssertionError("the cache should have been reused")

    monkeypatch.setattr(cache_module, "partition_graph", fail)
    again = random_graph()  # an equal graph built anew: same content hash
    assert partition_to_cache(again, 2, cache_dir=tmp_path) == first
    with pytest.raises(AssertionError, match="should have been reused"):
        partition_to_cache(again, 3, cache_dir=tmp_path)  # other options are another partitioning


def test_cache_is_invalidated_when_the_graph_changes(tmp_path) -> None:
    data = random_graph()
    first = partition_to_cache(data, 2, cache_dir=tmp_path)
    data.x[0, 0] += 1.0
    second = partition_to_cache(data, 2, cache_dir=tmp_path)
    assert second != first
    parts = [load_partition(second, k) for k in range(2)]
    (owner,) = [p for p in parts if int(p.local_nodes[0]) == 0]  # vertex 0 comes first in its owner
    torch.testing.assert_close(owner.x[0, 0], data.x[0, 0])
    data.edge_index = data.edge_index[:, 1:]
    assert partition_to_cache(data, 2, cache_dir=tmp_path) not in (first, second)


def test_damaged_cache_is_rebuilt(tmp_path) -> None:
    data = random_graph()
    directory = partition_to_cache(data, 2, cache_dir=tmp_path)
    (directory / "part_1.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="is not a complete lightning_dorylus partition directory"):
        read_meta(directory)
    with pytest.warns(UserWarning, match=r"cannot be used \(.*part_1.safetensors is missing\); rebuilding"):
        assert partition_to_cache(data, 2, cache_dir=tmp_path) == directory
    assert json.loads((directory / "meta.json").read_text())["num_parts"] == 2
    assert load_partition(directory, 1).part_id == 1


def test_graph_file_round_trip(tmp_path) -> None:
    data = random_graph()
    save_graph(data, tmp_path / "g.safetensors")
    loaded = load_graph(tmp_path / "g.safetensors")
    assert loaded.num_nodes == data.num_nodes
    for name in ("edge_index", "x", "y", "train_mask", "val_mask", "test_mask"):
        torch.testing.assert_close(getattr(loaded, name), getattr(data, name))
    with pytest.raises(FileNotFoundError, match=r"graph file .* does not exist"):
        load_graph(tmp_path / "missing.safetensors")


def test_empty_partition_is_reported_and_still_consistent() -> None:
    data = random_graph(num_nodes=20, num_edges=60)
    assignment = torch.tensor([0] * 10 + [2] * 10)  # partition 1 owns nothing
    with pytest.warns(UserWarning, match=r"partitions \[1\] own no vertices \(3 parts, 20 vertices\)"):
        parts = build_partitions(graph_tensors(data), assignment, 3, interval_size=4)
    assert parts[1].n_local == 0 and parts[1].num_edges == 0 and parts[1].num_intervals == 0
    assert global_edges(parts) == edge_set(data.edge_index)
    with pytest.raises(
        ValueError, match=r"assignment values must lie in \[0, 2\) \(num_parts\), got \[0, 2\]"
    ):
        build_partitions(graph_tensors(data), assignment, 2)


def test_numpy_integers_and_bfloat16_features(tmp_path) -> None:
    data = random_graph()
    data.x = data.x.to(torch.bfloat16)
    directory = partition_to_cache(data, np.int64(2), "metis", interval_size=np.int64(8), cache_dir=tmp_path)
    assert read_meta(directory)["num_parts"] == 2 and directory.name.endswith("-p2-i8-s0")
    part = load_partition(directory, 0)
    assert part.x.dtype == torch.bfloat16
    torch.testing.assert_close(part.x, data.x[part.local_nodes])


def test_old_partitionings_are_pruned_by_age_then_size(tmp_path) -> None:
    """``partition_to_cache(max_age_s=..., max_bytes=...)`` deletes other partitionings unused for too long,
    then the least recently used beyond the size bound; never the one in use nor one used within the grace
    period, nor a folder that is not a partitioning."""
    data = random_graph()
    dirs = [partition_to_cache(data, 2, "contiguous", seed=s, cache_dir=tmp_path) for s in range(4)]
    size = sum(f.stat().st_size for f in dirs[0].iterdir())
    day, now = 86400.0, time.time()
    for directory, age in zip(dirs, (40 * day, 3 * day, 2 * day, 0.0), strict=True):
        os.utime(directory / "meta.json", (now - age, now - age))
    (tmp_path / "notes").mkdir()  # not a partitioning: never touched
    # the age bound: seed 0, unused for 40 days, goes; the others stay (no size bound)
    assert prune_cache(tmp_path, dirs[3], max_age_s=30 * day, max_bytes=None, now=now) == [dirs[0]]
    # the size bound (room for 2 partitionings): the one in use, then the most recent (seed 2) stays
    assert prune_cache(tmp_path, dirs[3], max_age_s=None, max_bytes=2 * size, now=now) == [dirs[1]]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == sorted(
        [dirs[2].name, dirs[3].name, "notes"])
    # within the grace period nothing goes, whatever the bounds
    os.utime(dirs[2] / "meta.json", (now - 60, now - 60))
    assert prune_cache(tmp_path, dirs[3], max_age_s=1.0, max_bytes=1, now=now) == []
    # a cache hit refreshes the last use; the DataModule's default bound is 30 days
    partition_to_cache(data, 2, "contiguous", seed=2, cache_dir=tmp_path, max_age_s=1.0)
    assert now - (dirs[2] / "meta.json").stat().st_mtime < 60 and dirs[3].exists()
    with pytest.raises(ValueError, match=r"cache_max_bytes=0: expected None \(no bound\) or a number > 0"):
        DorylusDataModule(data, cache_dir=tmp_path, cache_max_bytes=0)
