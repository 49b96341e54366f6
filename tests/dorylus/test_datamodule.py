"""DorylusDataModule: option checks, one partition per rank, no DistributedSampler, Cora.

Run as a script (``python test_datamodule.py OUT_DIR CACHE_DIR``) this file is the worker of the two-process
test: Lightning's launcher re-runs it once per rank.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch_geometric.transforms as T
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.connectors.data_connector import _process_dataloader
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch.utils.data import DataLoader, DistributedSampler
from torch_geometric.data import Data

from lightning_dorylus.data import (
    DorylusDataModule,
    GraphPartition,
    PartitionLoader,
    load_planetoid,
    partition_graph,
    partition_to_cache,
    save_graph,
)
from lightning_dorylus.data.synthetic import powerlaw_graph
from tests.process import DATA, run_ranks

PLANETOID_ROOT = DATA / "planetoid"


def small_graph() -> Data:
    return powerlaw_graph(300, 6, 5, 3, seed=0)


def fake_trainer(rank: int, world_size: int, others: torch.Tensor | None = None) -> SimpleNamespace:
    """The attributes of a Trainer that the DataModule reads. Its ``all_gather`` answers as if every other
    rank sent ``others`` (default: what this rank sends, i.e. the same graph everywhere)."""

    def all_gather(local: torch.Tensor) -> torch.Tensor:
        rows = [local if others is None or r == rank else others for r in range(world_size)]
        return torch.stack(rows)

    strategy = SimpleNamespace(root_device=torch.device("cpu"), all_gather=all_gather)
    return SimpleNamespace(global_rank=rank, world_size=world_size, strategy=strategy)


def assert_same_partition(a: GraphPartition, b: GraphPartition) -> None:
    for name, value in vars(a).items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(getattr(b, name), value), name
        elif name == "send_index":
            assert all(torch.equal(x, y) for x, y in zip(a.send_index, b.send_index, strict=True))
        else:
            assert getattr(b, name) == value, name


def test_each_rank_gets_its_partition(tmp_path) -> None:
    data = small_graph()
    expected = partition_graph(data, 3, "metis", interval_size=32)
    rank_zero = DorylusDataModule(data, partitioner="metis", interval_size=32, cache_dir=tmp_path)
    rank_zero.trainer = fake_trainer(0, 3)
    rank_zero.prepare_data()  # Lightning: local rank 0 only, then a barrier before setup
    for rank in range(3):
        datamodule = DorylusDataModule(data, partitioner="metis", interval_size=32, cache_dir=tmp_path)
        datamodule.trainer = fake_trainer(rank, 3)
        datamodule.setup("fit")
        loaders = (datamodule.train_dataloader(), datamodule.val_dataloader(), datamodule.test_dataloader())
        for loader in loaders:
            assert isinstance(loader, PartitionLoader) and len(loader) == 1
            (batch,) = list(loader)  # once per epoch
            assert batch.part_id == rank and batch.num_parts == 3
            assert_same_partition(expected[rank], batch)
        assert next(iter(datamodule.train_dataloader())) is datamodule.partition  # same object every epoch


def test_setup_without_trainer_partitions_itself(tmp_path) -> None:
    data = small_graph()
    datamodule = DorylusDataModule(data, num_parts=1, cache_dir=tmp_path)
    datamodule.setup("fit")
    (batch,) = list(datamodule.train_dataloader())
    assert batch.n_local == 300 and batch.n_ghost == 0 and batch.num_parts == 1
    assert datamodule.num_features == 5 and datamodule.num_classes == 3


def test_partition_directory_and_graph_file_inputs(tmp_path) -> None:
    data = small_graph()
    directory = partition_to_cache(data, 2, "bfs", interval_size=50, cache_dir=tmp_path)
    from_dir = DorylusDataModule(directory)
    assert (from_dir.num_parts, from_dir.partitioner, from_dir.interval_size) == (2, "bfs", 50)
    assert from_dir.num_features == 5 and from_dir.num_classes == 3
    from_dir.trainer = fake_trainer(1, 2)
    from_dir.setup("fit")
    assert_same_partition(partition_graph(data, 2, "bfs", interval_size=50)[1], from_dir.partition)
    with pytest.raises(ValueError, match=r"num_parts \(4\) does not match the 2 partitions in"):
        DorylusDataModule(directory, num_parts=4)

    save_graph(data, tmp_path / "graph.safetensors")
    from_file = DorylusDataModule(tmp_path / "graph.safetensors", num_parts=1, cache_dir=tmp_path)
    from_file.setup("fit")
    assert from_file.partition.num_edges == data.edge_index.size(1)


def test_transform_is_applied_once_before_partitioning(tmp_path) -> None:
    data = small_graph()
    calls = []

    def normalize(graph: Data) -> Data:
        calls.append(graph.num_nodes)
        return T.NormalizeFeatures()(graph)

    datamodule = DorylusDataModule(data, num_parts=1, cache_dir=tmp_path, transform=normalize)
    datamodule.setup("fit")
    datamodule.setup("test")
    assert calls == [300]  # once, at construction: the partitions hold the transformed graph
    expected = T.NormalizeFeatures()(data.clone()).x
    assert torch.equal(datamodule.partition.x[: datamodule.partition.n_local],
                       expected[datamodule.partition.local_nodes])
    assert not torch.equal(data.x, expected), "the caller's graph is left as it was"
    plain = DorylusDataModule(data, num_parts=1, cache_dir=tmp_path)
    assert plain.resolved_partition_dir() != datamodule.resolved_partition_dir()  # cached apart

    directory = partition_to_cache(data, 1, "bfs", interval_size=50, cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"cannot apply to the partition directory .* already built"):
        DorylusDataModule(directory, transform=normalize)
    with pytest.raises(TypeError, match=r"transform must be a callable Data -> Data .* got 'normalize'"):
        DorylusDataModule(data, transform="normalize")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"partitioner": "kway"}, ValueError, r"partitioner='kway' is not supported; expected one of"),
        ({"interval_size": 0}, ValueError, r"interval_size \(0\) must be an integer >= 1"),
        ({"num_parts": 0}, ValueError, r"num_parts \(0\) must be None \(= trainer.world_size\) or an"),
        ({"data": 3}, TypeError, r"data must be a torch_geometric Data, .* got int"),
        ({"data": "/no/such/graph"}, FileNotFoundError, r"data='/no/such/graph' is neither a partition"),
    ],
)
def test_options_are_checked_up_front(kwargs: dict, error: type, match: str) -> None:
    args = {"data": small_graph(), **kwargs}
    with pytest.raises(error, match=match):
        DorylusDataModule(**args)


def _with(**fields) -> Data:
    data = small_graph()
    for name, value in fields.items():
        setattr(data, name, value)
    return data


def _labels(vertex: int, label: int) -> torch.Tensor:
    y = small_graph().y.clone()
    y[vertex] = label
    return y


def _nan_features() -> torch.Tensor:
    x = small_graph().x.clone()
    x[17, 2] = float("nan")
    return x


FIRST_TRAIN = int(small_graph().train_mask.nonzero()[0, 0])


@pytest.mark.parametrize(
    ("fields", "kwargs", "match"),
    [
        ({"y": _labels(5, -3)}, {}, r"y contains -3; expected class labels >= 0, or -1 for unlabeled "
                                    r"vertices \(the first bad label is y\[5\] = -3\)"),
        ({"y": _labels(8, 3)}, {"num_classes": 3}, r"y\[8\] = 3 but num_classes is 3: class labels must lie "
                                                   r"in \[0, 3\) .* Pass num_classes=4 or fix the labels"),
        ({"y": _labels(FIRST_TRAIN, -1)}, {}, rf"train_mask selects 1 vertices without a label .* first at "
                                              rf"node {FIRST_TRAIN}: .* data.train_mask &= data.y >= 0"),
        ({"x": _nan_features()}, {}, r"x contains 1 non-finite values \(NaN/inf\), the first at node 17 "
                                     r"\(x\[17, 2\] = nan\): .* torch.nan_to_num"),
        ({}, {"num_classes": 0}, r"num_classes \(0\) must be None \(= max\(y\) \+ 1\) or an integer >= 1"),
    ],
)
def test_the_graph_is_checked_when_the_datamodule_is_built(fields: dict, kwargs: dict, match: str,
                                                            tmp_path) -> None:
    """In every process, before any graph server starts (was: inside fit, on rank 0 only)."""
    with pytest.raises(ValueError, match=match):
        DorylusDataModule(_with(**fields), cache_dir=tmp_path, **kwargs)
    assert not any(tmp_path.iterdir()), "nothing hashed or partitioned"


def test_num_classes_is_taken_and_checked_against_a_partition_directory(tmp_path) -> None:
    datamodule = DorylusDataModule(small_graph(), cache_dir=tmp_path, num_classes=5)
    assert datamodule.num_classes == 5  # a model may predict classes no vertex has
    directory = partition_to_cache(small_graph(), 1, "bfs", cache_dir=tmp_path)
    match = r"num_classes \(2\) is below the 3 classes .* pass num_classes >= 3"
    with pytest.raises(ValueError, match=match):
        DorylusDataModule(directory, num_classes=2)


def test_a_cache_dir_that_is_a_file_is_named(tmp_path) -> None:
    (tmp_path / "cache").write_text("")
    with pytest.raises(NotADirectoryError, match=r"cache_dir='.*/cache' is an existing file, not a dir"):
        DorylusDataModule(small_graph(), cache_dir=tmp_path / "cache")
    match = r"cache_dir='.*/cache/sub' lies under '.*/cache', which is an existing file"
    with pytest.raises(NotADirectoryError, match=match):
        DorylusDataModule(small_graph(), cache_dir=tmp_path / "cache" / "sub")
    with pytest.raises(NotADirectoryError, match=r"is an existing file"):
        partition_to_cache(small_graph(), 1, cache_dir=tmp_path / "cache")


def test_world_size_must_match_num_parts(tmp_path) -> None:
    datamodule = DorylusDataModule(small_graph(), num_parts=2, cache_dir=tmp_path)
    datamodule.trainer = fake_trainer(0, 4)
    match = r"num_parts \(2\) != world_size \(4\): .* set devices \* num_nodes = 2 or num_parts = 4"
    with pytest.raises(ValueError, match=match):
        datamodule.setup("fit")
    unattached = DorylusDataModule(small_graph(), cache_dir=tmp_path)
    with pytest.raises(RuntimeError, match="num_parts is None and no Trainer is attached"):
        unattached.setup("fit")
    with pytest.raises(RuntimeError, match=r"setup\(\) has not run yet"):
        unattached.train_dataloader()


def test_missing_cache_on_a_rank_is_reported(tmp_path) -> None:
    datamodule = DorylusDataModule(small_graph(), cache_dir=tmp_path)
    datamodule.trainer = fake_trainer(1, 2)  # prepare_data never ran
    with pytest.raises(FileNotFoundError, match=r"incomplete on rank 1: prepare_data\(\) must run first"):
        datamodule.setup("fit")


def test_lightning_does_not_inject_a_distributed_sampler() -> None:
    trainer = Trainer(accelerator="cpu", strategy="ddp", devices=2, logger=False)  # not launched
    assert trainer._accelerator_connector.is_distributed
    plain = _process_dataloader(trainer, TrainerFn.FITTING, RunningStage.TRAINING, DataLoader(list(range(4))))
    assert isinstance(plain.sampler, DistributedSampler)  # what would happen to a map-style DataLoader
    loader = PartitionLoader(partition_graph(small_graph(), 1)[0])
    for stage in (RunningStage.TRAINING, RunningStage.VALIDATING):
        assert _process_dataloader(trainer, TrainerFn.FITTING, stage, loader) is loader


class _Recorder(LightningModule):
    """A linear model on the partition's features that records what each step received."""

    def __init__(self, num_features: int, num_classes: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(num_features, num_classes)
        self.seen: list[tuple[str, int, int]] = []

    def training_step(self, batch: GraphPartition, batch_idx: int) -> torch.Tensor:
        self.seen.append(("train", batch.part_id, batch.n_local))
        logits = self.lin(batch.x)
        return torch.nn.functional.cross_entropy(logits[batch.train_mask], batch.y[batch.train_mask])

    def validation_step(self, batch: GraphPartition, batch_idx: int) -> None:
        self.seen.append(("val", batch.part_id, batch.n_local))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_single_process_fit_sees_the_whole_graph_once_per_epoch(tmp_path) -> None:
    data = small_graph()
    datamodule = DorylusDataModule(data, cache_dir=tmp_path)  # num_parts = trainer.world_size = 1
    model = _Recorder(datamodule.num_features, datamodule.num_classes)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule)
    assert trainer.global_step == 3
    assert model.seen == [("train", 0, 300), ("val", 0, 300)] * 3


def test_cora_loads_and_partitions(tmp_path) -> None:
    dataset = load_planetoid(PLANETOID_ROOT, "Cora", processed_root=tmp_path / "processed")
    data = dataset[0]
    assert (data.num_nodes, data.edge_index.size(1), data.x.size(1)) == (2708, 10556, 1433)
    assert dataset.num_classes == 7
    masks = (data.train_mask, data.val_mask, data.test_mask)
    assert [int(mask.sum()) for mask in masks] == [140, 500, 1000]
    datamodule = DorylusDataModule(dataset, partitioner="metis", cache_dir=tmp_path / "cache")
    datamodule.trainer = fake_trainer(0, 2)
    datamodule.prepare_data()
    sizes = []
    for rank in range(2):
        datamodule.trainer = fake_trainer(rank, 2)
        datamodule.setup("fit")
        sizes.append((datamodule.partition.n_local, datamodule.partition.num_edges))
        assert datamodule.partition.num_train_global == 140
    assert sum(n for n, _ in sizes) == 2708 and sum(e for _, e in sizes) == 10556
    assert "DorylusDataModule(data=Data(x=[2708, 1433]" in repr(datamodule)
    assert "partitioner='metis'" in repr(datamodule)
    assert "GraphPartition(part_id=1, num_parts=2" in str(datamodule)


def test_planetoid_processing_waits_for_the_process_holding_the_lock(tmp_path) -> None:
    """Graph servers started together (torchrun, ``tests.process.run_ranks``) all load the graph: while
    another process holds the processing lock (it is writing the processed file), a loader writes and reads
    nothing; once released, it loads the graph. (Without the lock, two servers started together once read
    the other's half-written file: "PytorchStreamReader failed reading zip archive".)"""
    import threading

    from filelock import FileLock

    from lightning_dorylus.data.planetoid import processing_lock

    processed = tmp_path / "processed"
    lock = processing_lock(processed, "Cora")
    lock.parent.mkdir(parents=True)
    loaded: list = []
    with FileLock(lock):  # stands for the other process, in the middle of processing
        loader = threading.Thread(
            target=lambda: loaded.append(load_planetoid(PLANETOID_ROOT, "Cora", processed_root=processed))
        )
        loader.start()
        loader.join(timeout=1.0)
        assert loader.is_alive() and not loaded, "loaded while another process held the lock"
        assert not (processed / "Cora" / "processed").exists(), "processed while the lock was held"
    loader.join(timeout=60)
    assert not loader.is_alive()
    assert loaded[0][0].num_nodes == 2708
    assert (processed / "Cora" / "processed" / "data.pt").is_file()


def test_planetoid_never_downloads(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"missing from .*Cora/raw; lightning_dorylus never download"):
        load_planetoid(tmp_path, "Cora", processed_root=tmp_path)
    with pytest.raises(ValueError, match=r"name='Reddit' is not a Planetoid graph"):
        load_planetoid(tmp_path, "Reddit")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_each_load_their_own_partition(tmp_path) -> None:
    # both ranks started together (an external launcher): rank 1 reaches the data module as early as rank 0
    run_ranks([sys.executable, __file__, str(tmp_path / "out"), str(tmp_path / "cache")], 2, timeout=240)
    expected = partition_graph(small_graph(), 2)
    for rank in range(2):
        result = json.loads((tmp_path / "out" / f"rank{rank}.json").read_text())
        n_local = expected[rank].n_local
        assert result["seen"] == [["train", rank, n_local], ["val", rank, n_local]] * 2
        assert result["local_nodes"] == expected[rank].local_nodes.tolist()
        assert result["global_step"] == 2
    assert len(list((tmp_path / "cache").iterdir())) == 1, "partitioned once, by rank 0"


def _worker(out_dir: Path, cache_dir: Path) -> None:
    """Two-process DDP fit (gloo): every rank writes which partition its steps received."""
    from lightning.pytorch.strategies import DDPStrategy

    torch.set_num_threads(1)
    datamodule = DorylusDataModule(small_graph(), cache_dir=cache_dir)  # num_parts = world_size = 2
    model = _Recorder(datamodule.num_features, datamodule.num_classes)
    strategy = DDPStrategy(process_group_backend="gloo", timeout=datetime.timedelta(seconds=60))
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "seen": model.seen,
        "local_nodes": datamodule.partition.local_nodes.tolist(),
        "global_step": trainer.global_step,
    }
    (out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), Path(sys.argv[2]))
