"""Partition caches are checked against their manifest: each corruption from issue 22 is found and named.

Was: a partition file with scaled features trained at loss 84.9 instead of 2.09, a flipped bit gave a NaN
loss every epoch, a swapped edge trained on another graph, and a truncated file raised a bare
``SafetensorError: incomplete metadata`` on every later run until the folder was deleted by hand.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lightning_dorylus.data import (
    CorruptCacheError,
    DorylusDataModule,
    load_graph,
    load_partition,
    partition_graph,
    partition_to_cache,
    read_meta,
    save_graph,
)
from lightning_dorylus.data.synthetic import powerlaw_graph
from tests.dorylus.test_datamodule import assert_same_partition, fake_trainer, small_graph


def _rewrite(path: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Rewrites a partition file as a user editing it would: a valid safetensors file, other content."""
    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata=metadata)


def scale_features(path: Path) -> None:
    _rewrite(path, lambda t: t.__setitem__("x", t["x"] * 40.0))


def swap_an_edge(path: Path) -> None:
    def swap(tensors: dict[str, torch.Tensor]) -> None:
        edges = tensors["edge_index"].clone()
        edges[0, [0, -1]] = edges[0, [-1, 0]]  # two edges exchange their sources
        tensors["edge_index"] = edges

    _rewrite(path, swap)


def flip_a_bit(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-9] ^= 0x40  # inside the last tensor's data, past the header
    path.write_bytes(bytes(raw))


def truncate(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])


CORRUPTIONS = {
    "scaled_features": (scale_features, r"part_1.safetensors has changed since it was written: sha256"),
    "flipped_bit": (flip_a_bit, r"part_1.safetensors has changed since it was written: sha256"),
    "swapped_edge": (swap_an_edge, r"part_1.safetensors has changed since it was written: sha256"),
    "truncated": (truncate, r"part_1.safetensors is truncated: \d+ bytes, the manifest says \d+"),
}


def _partitioned(tmp_path: Path) -> tuple[DorylusDataModule, Path]:
    datamodule = DorylusDataModule(small_graph(), partitioner="bfs", interval_size=32, cache_dir=tmp_path)
    datamodule.trainer = fake_trainer(0, 2)
    datamodule.prepare_data()
    return datamodule, datamodule.resolved_partition_dir()


def test_the_manifest_records_every_partition_file(tmp_path: Path) -> None:
    _, directory = _partitioned(tmp_path)
    files = read_meta(directory)["files"]
    assert sorted(files) == ["part_0.safetensors", "part_1.safetensors"]
    for name, entry in files.items():
        assert entry["bytes"] == (directory / name).stat().st_size
        assert re.fullmatch(r"[0-9a-f]{64}", entry["sha256"])


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_damaged_file_is_named_at_load(corruption: str, tmp_path: Path) -> None:
    damage, match = CORRUPTIONS[corruption]
    _, directory = _partitioned(tmp_path)
    damage(directory / "part_1.safetensors")
    load_partition(directory, 0)  # the intact file still loads
    with pytest.raises(CorruptCacheError, match=match) as caught:
        load_partition(directory, 1)
    assert caught.value.path == directory / "part_1.safetensors"
    assert f"Delete {directory} and partition the graph again" in str(caught.value)


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_with_the_graph_the_cache_is_rebuilt_once_with_a_warning(corruption: str, tmp_path: Path) -> None:
    damage, match = CORRUPTIONS[corruption]
    datamodule, directory = _partitioned(tmp_path)
    damage(directory / "part_1.safetensors")
    rebuilt = f"partition cache {re.escape(str(directory))} cannot be used \\(.*{match}.*\\); rebuilding it"
    with pytest.warns(UserWarning, match=rebuilt):
        datamodule.prepare_data()  # the next run: rank 0, before any graph server loads its partition
    expected = partition_graph(small_graph(), 2, "bfs", interval_size=32)
    for rank in range(2):
        datamodule.trainer = fake_trainer(rank, 2)
        datamodule.setup("fit")
        assert_same_partition(expected[rank], datamodule.partition)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every later run: no warning, nothing rebuilt
        datamodule.prepare_data()
    assert sorted(p.name for p in tmp_path.iterdir()) == [directory.name], "no leftovers of the old copy"


def test_damage_after_prepare_data_fails_setup_naming_the_file(tmp_path: Path) -> None:
    datamodule, directory = _partitioned(tmp_path)
    scale_features(directory / "part_1.safetensors")
    datamodule.trainer = fake_trainer(1, 2)
    match = r"part_1.safetensors has changed .* DorylusDataModule\(graph, \.\.\.\) rebuilds a damaged cache"
    with pytest.raises(CorruptCacheError, match=match):
        datamodule.setup("fit")


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_partition_directory_without_its_graph_says_how_to_rebuild(corruption: str, tmp_path: Path) -> None:
    damage, match = CORRUPTIONS[corruption]
    directory = partition_to_cache(small_graph(), 2, "bfs", interval_size=32, cache_dir=tmp_path)
    damage(directory / "part_1.safetensors")
    datamodule = DorylusDataModule(directory)  # no graph to rebuild from
    datamodule.trainer = fake_trainer(1, 2)
    datamodule.prepare_data()
    with pytest.raises(CorruptCacheError, match=match):
        datamodule.setup("fit")


def test_a_damaged_or_old_manifest_is_rebuilt(tmp_path: Path) -> None:
    datamodule, directory = _partitioned(tmp_path)
    meta = json.loads((directory / "meta.json").read_text())
    (directory / "meta.json").write_text(json.dumps(meta)[:40])  # cut mid-way
    with pytest.warns(UserWarning, match=r"meta.json is not a valid partition manifest \(JSONDecodeError"):
        datamodule.prepare_data()
    meta["format_version"] = 1
    del meta["files"]
    (directory / "meta.json").write_text(json.dumps(meta))  # what lightning_dorylus wrote before checksums
    with pytest.raises(FileNotFoundError, match=r"written in format version 1; this lightning_dorylus reads "
                                                r"version 2 .* Delete "):
        read_meta(directory)
    with pytest.warns(UserWarning, match=r"format version 1; .* rebuilding it from the graph"):
        datamodule.prepare_data()
    assert read_meta(directory)["format_version"] == 2


def test_a_truncated_graph_file_is_named_and_the_synthetic_cache_regenerates(tmp_path: Path) -> None:
    graph = powerlaw_graph(300, 6, 5, 3, seed=0, cache_dir=tmp_path)
    (path,) = tmp_path.glob("powerlaw-*.safetensors")
    truncate(path)
    with pytest.raises(CorruptCacheError, match=rf"{re.escape(str(path))} cannot be read as safetensors"):
        load_graph(path)
    with pytest.warns(UserWarning, match=r"cannot be read as safetensors .*; generating the graph again"):
        again = powerlaw_graph(300, 6, 5, 3, seed=0, cache_dir=tmp_path)
    assert torch.equal(again.x, graph.x) and torch.equal(again.edge_index, graph.edge_index)
    assert torch.equal(load_graph(path).x, graph.x), "the regenerated graph replaced the damaged file"
    save_graph(graph, tmp_path / "g.safetensors")
    assert load_graph(tmp_path / "g.safetensors").num_nodes == 300


def test_graphs_that_differ_per_process_are_named_in_process(tmp_path: Path) -> None:
    """Rank 1's view of a 2-process setup whose rank 0 built another split (its digests gathered)."""
    import torch_geometric.transforms as T

    from lightning_dorylus.data.fingerprint import check_same_graph

    def split(seed: int) -> DorylusDataModule:
        torch.manual_seed(seed)
        graph = T.RandomNodeSplit(num_val=30, num_test=60)(small_graph())
        return DorylusDataModule(graph, partitioner="bfs", cache_dir=tmp_path)

    rank0, rank1 = split(0), split(1)
    rank0.trainer = fake_trainer(0, 2)
    rank0.prepare_data()
    sent: list[torch.Tensor] = []
    strategy = fake_trainer(0, 2).strategy
    strategy.all_gather = lambda local: sent.append(local) or local.unsqueeze(0)  # what rank 0 sends
    check_same_graph(strategy, rank0.graph_digest(), rank0._fingerprint)
    rank1.trainer = fake_trainer(1, 2, others=sent[0])
    match = (r"the input graph differs between processes \(train_mask, val_mask, test_mask differ\): "
             r"rank\(s\) \[1\] built another graph than rank 0 .* unseeded split \(T.RandomNodeSplit")
    with pytest.raises(ValueError, match=match):
        rank1.setup("fit")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("split", r"the input graph differs between processes \(train_mask, val_mask, test_mask differ\): "
                  r"rank\(s\) \[1\] built another graph than rank 0"),
        ("num_parts", r"num_parts \(3\) != world_size \(2\): .* set devices \* num_nodes = 3 or "
                      r"num_parts = 2"),
        ("same", None),
    ],
)
def test_two_graph_servers_name_a_graph_that_differs_and_a_wrong_num_parts(
    case: str, match: str | None, tmp_path: Path
) -> None:
    from tests.dorylus.scripts.launch import run_script

    out, cache = tmp_path / "out", tmp_path / "cache"
    run_script("graph_check_run.py", [str(out), str(cache), case], timeout=240, cwd=tmp_path, nprocs=2)
    for rank in range(2):
        result = json.loads((out / f"rank{rank}.json").read_text())
        if match is None:
            assert result == {"global_step": 1}
        else:
            assert re.search(match, result["error"]), result
    if case == "num_parts":
        assert not cache.exists() or not any(cache.iterdir()), "nothing partitioned for the wrong count"
