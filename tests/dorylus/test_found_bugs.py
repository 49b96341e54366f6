"""Regressions for what a user's own graph or model broke (the dsweep sweep), each in one process.

Each test names the input that used to fail late (deep in an executor op, in the cache hash, or with a NaN
loss) or be dropped silently, and checks the early error or warning that now names the argument.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch_geometric.transforms as T
from lightning.pytorch import Trainer
from torch_geometric.data import Data

from lightning_dorylus import GAT, GCN, DorylusStrategy, GraphSAGE
from lightning_dorylus.data import DorylusDataModule, partition_graph
from lightning_dorylus.data.build import build_partitions
from lightning_dorylus.data.cache import graph_hash, partition_to_cache
from lightning_dorylus.data.validation import graph_tensors
from lightning_dorylus.executors import build_executor
from lightning_dorylus.graph import GhostExchange
from lightning_dorylus.nn import DorylusLayer
from lightning_dorylus.nn.base import DorylusRuntime
from tests.dorylus.scripts.exact_run import loader

N = 12


def small_graph(**fields) -> Data:
    """A 12-vertex ring (both directions) with labels 0..2 and train/val/test masks."""
    src = torch.arange(N)
    ring = torch.stack([torch.cat([src, (src + 1) % N]), torch.cat([(src + 1) % N, src])])
    train = torch.zeros(N, dtype=torch.bool)
    train[:6] = True
    data = Data(x=torch.randn(N, 4, generator=torch.Generator().manual_seed(0)), edge_index=ring,
                y=torch.arange(N) % 3, train_mask=train, val_mask=~train, test_mask=~train)
    for name, value in fields.items():
        setattr(data, name, value)
    return data


def test_float64_features_with_a_float32_model_name_both_dtypes() -> None:
    """Was: ValueError from the executor's numpy op (``{'z': 'float64', 'weight': 'float32'}``)."""
    [part] = partition_graph(small_graph(x=torch.randn(N, 4, dtype=torch.float64)), 1)
    for model in (GCN(4, 8, 3), GAT(4, 2, 3, heads=2), GraphSAGE(4, 8, 3)):
        with pytest.raises(TypeError, match=r"features x are torch.float64 but \w+'s parameters are "
                                            r"torch.float32: .*model.double\(\)"):
            model.training_step(part, 0)
    model = GCN(4, 8, 3).double()  # what the message asks for: trains
    model.train()
    assert model(model.graph(part)).dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_features_are_refused_naming_x(dtype: torch.dtype) -> None:
    """Was: ``NotImplementedError: "addmm_out_sparse_csr_impl_mkl" not implemented for 'Half'`` in GA."""
    [part] = partition_graph(small_graph(x=torch.randn(N, 4).to(dtype)), 1)
    model = GCN(4, 8, 3).to(dtype)
    with pytest.raises(TypeError, match=rf"features x are {dtype}: .*use float32 or float64 features"):
        model.training_step(part, 0)


def test_model_built_for_other_feature_width_names_in_channels() -> None:
    """Was: a shape error from the op (``z (12, 4) @ weight (5, 8)``) not naming the model argument."""
    [part] = partition_graph(small_graph(), 1)
    for model in (GCN(5, 8, 3), GAT(5, 2, 3), GraphSAGE(5, 8, 3)):
        with pytest.raises(ValueError, match=r"\(in_channels=5\) but the partition's features x have 4 "
                                             r"columns: .*in_channels=datamodule.num_features"):
            model.training_step(part, 0)


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_features_are_refused_naming_x(layout: str, tmp_path: Path) -> None:
    """Was: ``RuntimeError: unsupported memory format option Contiguous`` from the cache's graph hash."""
    data = small_graph()
    data.x = data.x.to_sparse() if layout == "coo" else data.x.to_sparse_csr()
    match = r"x is a sparse tensor \(layout torch.sparse_\w+\); .*data.x = data.x.to_dense\(\)"
    with pytest.raises(ValueError, match=match):
        DorylusDataModule(data, cache_dir=tmp_path)
    with pytest.raises(ValueError, match=match):
        partition_to_cache(data, 1, cache_dir=tmp_path)
    with pytest.raises(ValueError, match=match):
        graph_hash(data)


def test_featureless_graph_fails_at_construction_and_one_hot_degree_fixes_it(tmp_path: Path) -> None:
    """Was: ``AttributeError: 'NoneType' object has no attribute 'size'`` from ``num_features``."""
    with pytest.raises(ValueError, match=r"data.x is None; .*featureless graph .*OneHotDegree"):
        DorylusDataModule(small_graph(x=None, num_nodes=N), cache_dir=tmp_path)
    datamodule = DorylusDataModule(
        small_graph(x=None, num_nodes=N), cache_dir=tmp_path, transform=T.OneHotDegree(2)
    )
    assert datamodule.num_features == 3


def test_missing_labels_fail_in_num_classes(tmp_path: Path) -> None:
    """Was: ``num_classes == 0``, a 0-wide model, then ``argmax(): Expected reduction dim 1 ...``."""
    unlabeled = small_graph(y=None, train_mask=None, val_mask=None, test_mask=None)  # masks need labels
    datamodule = DorylusDataModule(unlabeled, cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"data.y is None: num_classes needs integer class labels"):
        _ = datamodule.num_classes


def test_masks_selecting_unlabeled_vertices_and_bad_labels_are_named() -> None:
    """Was: ``IndexError: Target -1 is out of bounds`` from cross_entropy during training."""
    y = torch.arange(N) % 3
    y[7] = -1
    with pytest.raises(ValueError, match=r"val_mask selects 1 vertices without a label .* first at node 7"):
        partition_graph(small_graph(y=y), 1)
    y[7] = -2
    with pytest.raises(ValueError, match=r"y contains -2; expected class labels >= 0, or -1 for unlabeled"):
        partition_graph(small_graph(y=y), 1)
    [part] = partition_graph(small_graph(y=None, train_mask=None, val_mask=None, test_mask=None), 1)
    assert bool((part.y == -1).all())  # unlabeled and unselected: still fine


def test_empty_train_mask_raises_instead_of_a_nan_loss() -> None:
    """Was: ``train_loss = nan`` every epoch (0 / num_train_global == 0), training on silently."""
    [part] = partition_graph(small_graph(train_mask=torch.zeros(N, dtype=torch.bool)), 1)
    with pytest.raises(ValueError, match=r"train_mask selects no vertex in the whole graph"):
        GCN(4, 8, 3).training_step(part, 0)


def test_empty_val_mask_warns_that_val_acc_is_not_measured(tmp_path: Path) -> None:
    """Was: ``val_acc`` logged as 0.0 without a word (a ModelCheckpoint on it then picks epoch 0)."""
    [part] = partition_graph(small_graph(val_mask=None), 1)
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match=r"\['val_acc'\]: the mask selects no vertex in the whole graph, so "
                                         r"the accuracy is logged as 0.0"):
        [metrics] = trainer.validate(GCN(4, 8, 3), loader(part), verbose=False)
    assert metrics["val_acc"] == 0.0


@pytest.mark.parametrize("field", ["edge_attr"])
def test_edge_attributes_are_reported_as_ignored(field: str, tmp_path: Path) -> None:
    """Was: ``edge_attr`` dropped without a word (``edge_weight`` is used now: test_pyg_data.py)."""
    data = small_graph()
    setattr(data, field, torch.rand(data.edge_index.size(1)))
    match = rf"data.{field} is ignored: no Dorylus layer .* reads edge features"
    with pytest.warns(UserWarning, match=match):
        datamodule = DorylusDataModule(data, cache_dir=tmp_path)
    assert getattr(data, field) is not None  # the caller's graph is not changed
    assert graph_hash(datamodule.data) == graph_hash(small_graph())  # same partitions as without it
    with pytest.warns(UserWarning, match=match):
        partition_graph(data, 1)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: GCN(4, 8, 3, dropout=1.5), r"dropout=1.5 must be in \[0, 1\)"),
        (lambda: GraphSAGE(4, 8, 3, dropout=-0.1), r"dropout=-0.1 must be in \[0, 1\)"),
        (lambda: GCN(4, 0, 3), r"hidden_channels=0 must be an integer >= 1"),
        (lambda: GraphSAGE(4, -1, 3), r"hidden_channels=-1 must be an integer >= 1"),
        (lambda: GCN(4, 8, 0), r"out_channels=0 must be an integer >= 1"),
        (lambda: GCN(4, 8, 3, num_layers=2.5), r"num_layers=2.5 must be >= 1 \(an integer\)"),
        (lambda: GAT(4, 8, 3, out_heads=0), r"out_heads=0 must be an integer >= 1"),
    ],
)
def test_bad_model_arguments_are_named(build, match: str) -> None:
    """Were: accepted (dropout 1.5 scales by -2; width 0 fails in an op) or a TypeError from list maths."""
    with pytest.raises(ValueError, match=match):
        build()


class NoPeerExchange(GhostExchange):
    """SC of a partition with no ghosts: its own rows only (the real exchange would still call its peers)."""

    def fill_ghosts(self, h_local: torch.Tensor, partition, layer: int = 0, epoch: int = 0) -> torch.Tensor:
        assert partition.n_ghost == 0
        return h_local


@pytest.mark.parametrize("model_name", ["gat", "gcn", "sage"])
def test_partition_that_owns_no_vertex_runs_forward_and_backward(model_name: str) -> None:
    """Was (GAT): ``cannot reshape tensor of 0 elements into shape [0, -1]`` on the server of an empty
    partition (``build_partitions`` warns about it and allows it). Checked on 2 servers by the sweep."""
    data = small_graph()
    with pytest.warns(UserWarning, match=r"partitions \[1\] own no vertices"):
        parts = build_partitions(graph_tensors(data), torch.zeros(N, dtype=torch.long), 2)
    empty = parts[1]
    assert empty.n_local == 0 and empty.n_ghost == 0
    model = {"gat": lambda: GAT(4, 2, 3, heads=2, out_heads=2), "gcn": lambda: GCN(4, 8, 3),
             "sage": lambda: GraphSAGE(4, 8, 3)}[model_name]()
    executor = build_executor("inline")
    executor.start()
    runtime = DorylusRuntime(executor=executor, exchange=NoPeerExchange())
    try:
        for index, layer in enumerate(m for m in model.modules() if isinstance(m, DorylusLayer)):
            layer.attach(runtime, index)
        out = model(model.graph(empty))
        assert out.shape == (0, 3)
        out.sum().backward()  # zero gradients, still one per parameter (the all-reduce needs them)
        assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    finally:
        executor.close()


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-true"])
def test_half_and_mixed_precision_are_refused_by_the_strategy(precision: str, tmp_path: Path) -> None:
    """Was: ``NotImplementedError: "addmm_out_sparse_csr_impl_mkl" not implemented for 'BFloat16'`` in GA."""
    [part] = partition_graph(small_graph(), 1)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=DorylusStrategy(executor="inline"),
                      precision=precision, max_epochs=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path)
    try:
        with pytest.raises(ValueError, match=rf"Trainer\(precision='{precision}'\) is not supported by "
                                             r"DorylusStrategy: .*use one of \['32-true', '64-true'\]"):
            trainer.fit(GCN(4, 8, 3), loader(part))
    finally:  # a 1-process group was created in this (pytest) process
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_cpu_autocast_is_refused_by_the_model() -> None:
    """The same under ``strategy="auto"`` (no DorylusStrategy to check the precision setting)."""
    [part] = partition_graph(small_graph(), 1)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError, match=r"CPU autocast is on"):
        GCN(4, 8, 3).training_step(part, 0)
