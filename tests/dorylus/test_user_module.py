"""A user's own LightningModule (``docs/examples/own_gcn.py``'s ``UserGCN``: Dorylus ``GCNConv`` layers, the
usual local-mean ``F.cross_entropy(out[train_mask], y[train_mask])``, no NodeClassifier) trains on 2 and 3
graph servers exactly what it trains under ``strategy="auto"`` (float64, SGD and Adam, global-id dropout),
logs the whole graph's loss, and ``trainer.predict`` returns the whole graph in global vertex order on every
rank. Also: the user layer ``GINConv`` on the user op ``gin.mlp`` (local executor, ghosts), a control run that
sums local means unweighted (``loss_reduction="sum"``) and so trains another model, and the warning for
``F.dropout``.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from safetensors.torch import load_file
from torch_geometric.nn import norm as pyg_norm

from lightning_dorylus import GCN, DorylusStrategy
from lightning_dorylus.data import partition_graph
from lightning_dorylus.dropout_check import TorchDropoutCheck, torch_dropout_message
from lightning_dorylus.loss_share import resolve_loss_reduction, train_share
from lightning_dorylus.nn.norm import GraphBatchNorm, check_vertex_norms, convert_batchnorm, revert_batchnorm
from lightning_dorylus.predict import gather_vertex_rows
from tests.dorylus.scripts.exact_run import INTERVAL_SIZE, NUM_CLASSES, make_graph
from tests.dorylus.scripts.launch import run_script

CASES = {
    "gcn-sgd": {"model": "gcn", "optimizer": "sgd", "dropout": 0.0, "executor": "local"},
    "gcn-adam-dropout": {"model": "gcn", "optimizer": "adam", "dropout": 0.5, "executor": "inline"},
    "gin-adam": {"model": "gin", "optimizer": "adam", "dropout": 0.0, "executor": "local"},
    "gcn-adam-pipelined": {"model": "gcn", "optimizer": "adam", "dropout": 0.5, "executor": "local",
                           "staleness": 0},
    "gcn-sgd-sum": {"model": "gcn", "optimizer": "sgd", "dropout": 0.0, "executor": "inline",
                    "loss_reduction": "sum"},
    "torch-dropout": {"model": "torch_dropout", "optimizer": "sgd", "dropout": 0.5, "executor": "inline"},
    "batchnorm-adam": {"model": "batchnorm", "optimizer": "adam", "dropout": 0.5, "executor": "inline",
                       "first_part": 90},  # BatchNorm1d, servers of 90 and 150 vertices
}
SERVER_CASES = {2: list(CASES), 3: ["gcn-sgd", "gcn-adam-dropout"]}


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory):
    """``launches(servers)`` -> (output folder, printed output); each server count launched once."""
    done: dict[int, tuple[Path, str] | AssertionError] = {}

    def get(servers: int) -> tuple[Path, str]:
        if servers not in done:
            out = tmp_path_factory.mktemp(f"user{servers}")
            (out / "cases.json").write_text(json.dumps({n: CASES[n] for n in SERVER_CASES[servers]}))
            try:
                printed = run_script("user_module_run.py", [str(out), "--servers", str(servers), "--cases",
                                                            str(out / "cases.json")],
                                     timeout=300 + 60 * len(SERVER_CASES[servers]), cwd=out, nprocs=servers)
                done[servers] = (out, printed)
            except AssertionError as failed:
                done[servers] = failed
        result = done[servers]
        if isinstance(result, AssertionError):
            raise result
        return result

    return get


def reference(case: dict) -> tuple[list[float], dict[str, torch.Tensor], torch.Tensor]:
    """The same module under strategy="auto" on the whole graph: losses, weights, predictions."""
    from tests.dorylus.scripts.user_module_run import build_model, fit

    partitions = partition_graph(make_graph(), 1, partitioner="metis", interval_size=INTERVAL_SIZE)
    model = build_model(case)
    _, losses, predictions = fit(model, partitions, "auto", devices=1)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, predictions


def load_run(folder: Path, servers: int) -> tuple[list[float], list[dict], list[torch.Tensor]]:
    losses = json.loads((folder / "result.json").read_text())["losses"]
    weights = [load_file(str(folder / f"weights_rank{r}.safetensors")) for r in range(servers)]
    predictions = [load_file(str(folder / f"predictions_rank{r}.safetensors"))["predictions"]
                   for r in range(servers)]
    return losses, weights, predictions


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(("servers", "name"), [
    (2, "gcn-sgd"), (2, "gcn-adam-dropout"), (2, "gin-adam"), (2, "gcn-adam-pipelined"),
    (2, "batchnorm-adam"), (3, "gcn-sgd"), (3, "gcn-adam-dropout"),
])
def test_user_module_with_local_mean_loss_trains_what_auto_trains(launches, servers: int, name: str) -> None:
    folder, _ = launches(servers)
    losses, weights, predictions = load_run(folder / name, servers)
    expected_losses, expected_weights, expected_predictions = reference(CASES[name])
    assert len(losses) == 3
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(expected_losses, dtype=torch.float64), rtol=1e-9, atol=1e-11)
    for replica in weights:
        assert set(replica) == set(expected_weights)
        for key, value in expected_weights.items():
            torch.testing.assert_close(replica[key], value, rtol=1e-9, atol=1e-11)
    # predict: (num_nodes, C) probabilities in global vertex order, the same on every rank, as "auto"
    assert expected_predictions.shape == (make_graph().num_nodes, NUM_CLASSES)
    for got in predictions:
        assert got.shape == expected_predictions.shape
        torch.testing.assert_close(got, expected_predictions, rtol=1e-9, atol=1e-11)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_local_means_summed_unweighted_train_another_model(launches) -> None:
    """The control: ``loss_reduction="sum"`` with a local-mean loss counts each server's mean once, i.e. the
    whole-graph gradient times about 2: the first layer moves further than under "auto"."""
    folder, _ = launches(2)
    _, weights, _ = load_run(folder / "gcn-sgd-sum", 2)
    _, expected, _ = reference(CASES["gcn-sgd-sum"])
    _, exact, _ = load_run(folder / "gcn-sgd", 2)
    start = reference({**CASES["gcn-sgd"]})[1]  # same start: same seed, same updates
    torch.testing.assert_close(exact[0]["conv1.weight"], start["conv1.weight"], rtol=1e-9, atol=1e-11)
    initial = _initial_weights(CASES["gcn-sgd"])["conv1.weight"]
    moved_sum = (weights[0]["conv1.weight"] - initial).norm()
    moved_auto = (expected["conv1.weight"] - initial).norm()
    assert moved_sum > 1.5 * moved_auto, (float(moved_sum), float(moved_auto))


def _initial_weights(case: dict) -> dict[str, torch.Tensor]:
    from tests.dorylus.scripts.user_module_run import build_model

    return {k: v.detach().clone() for k, v in build_model(case).state_dict().items()}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_torch_dropout_in_a_user_model_is_named_with_the_fix(launches) -> None:
    _, printed = launches(2)
    assert printed.count("torch.nn.functional.dropout (or an nn.Dropout module) ran in training mode under "
                         "DorylusStrategy with 2 graph servers") == 1  # rank 0, once, the first step only
    assert "use lightning_dorylus.nn.dropout.row_dropout(x, graph.partition.local_nodes, p, self.training, " \
           "key)" in printed


def test_dropout_check_warns_once_on_training_dropout_only() -> None:
    x = torch.randn(4, 3)
    check = TorchDropoutCheck(world_size=2)
    with warnings.catch_warnings(record=True) as caught, check:
        warnings.simplefilter("always")
        F.dropout(x, 0.5, training=False)
        F.dropout(x, 0.0, training=True)
        torch.nn.Dropout(0.5).eval()(x)
        assert check.caught is None
        torch.nn.Dropout(0.3)(x)
        F.dropout(x, 0.5, training=True)
    assert check.caught == "dropout"
    assert [str(w.message) for w in caught] == [torch_dropout_message("dropout", 2)]
    assert "trains a different model than strategy='auto'" in str(caught[0].message)


def test_gathered_rows_are_in_global_order_in_one_process() -> None:
    rows = torch.tensor([[30.0], [10.0], [20.0]])
    torch.testing.assert_close(gather_vertex_rows(rows, torch.tensor([2, 0, 1]), 3),
                               torch.tensor([[10.0], [20.0], [30.0]]))
    match = (r"predict_step on graph server 0 returned a tensor of shape \(2, \.\.\.\) \(dim 2\); "
             r"DorylusStrategy gathers one row per owned vertex: expected \(3, \.\.\.\)")
    with pytest.raises(ValueError, match=match):
        gather_vertex_rows(rows[:2], torch.tensor([2, 0, 1]), 3)
    with pytest.raises(ValueError, match=r"the graph servers own 3 vertices \(1 of 4 missing, 0 owned twice"):
        gather_vertex_rows(rows, torch.tensor([2, 0, 1]), 4)


def test_train_share_and_a_server_without_train_vertices() -> None:
    parts = partition_graph(make_graph(), 2, partitioner="metis", interval_size=INTERVAL_SIZE)
    shares = [train_share(p, 0) for p in parts]
    assert sum(shares) == pytest.approx(1.0) and all(0 < s < 1 for s in shares)
    parts[0].train_mask[:] = False
    match = (r"graph server 0 owns no train vertex, so a mean over its train vertices is 0 / 0 .* set "
             r"loss_reduction='sum' \(as NodeClassifier\)")
    with pytest.raises(ValueError, match=match):
        train_share(parts[0], 0)


def test_loss_reduction_comes_from_the_module_or_the_strategy() -> None:
    gcn = GCN(4, 3, 2)
    assert gcn.dorylus_loss_reduction == "sum"

    def resolved(strategy: DorylusStrategy, module: LightningModule) -> str:
        return resolve_loss_reduction(module, strategy.options.loss_reduction)

    plain = LightningModule()
    assert resolved(DorylusStrategy(executor="inline"), plain) == "mean"
    assert resolved(DorylusStrategy(executor="inline"), gcn) == "sum"
    assert resolved(DorylusStrategy(executor="inline", loss_reduction="sum"), plain) == "sum"
    with pytest.raises(ValueError, match=r"DorylusStrategy\(loss_reduction='mean'\) but GCN."
                                         r"dorylus_loss_reduction='sum': the module says what its loss is"):
        resolved(DorylusStrategy(executor="inline", loss_reduction="mean"), gcn)
    with pytest.raises(ValueError, match=r"loss_reduction='avg': expected 'mean' \(a mean over the "
                                         r"partition's train vertices\), 'sum'"):
        DorylusStrategy(loss_reduction="avg")  # type: ignore[arg-type]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))


def test_batchnorm_case_runs_on_partitions_of_unequal_size() -> None:
    """The BatchNorm1d case is exact with servers of different row counts (the counts are all-reduced)."""
    from tests.dorylus.scripts.user_module_run import make_partitions

    assert [p.n_local for p in make_partitions(CASES["batchnorm-adam"], 2)] == [90, 150]


def test_batchnorm_is_converted_for_the_fit_and_given_back() -> None:
    """The strategy swaps ``torch.nn`` batch norms for ``GraphBatchNorm`` in setup, sharing the parameter and
    buffer tensors (optimizer and state_dict unchanged), and gives the user's classes back in teardown."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.ReLU(),
                                torch.nn.Sequential(torch.nn.BatchNorm2d(2)))
    before = model.state_dict(keep_vars=True)
    converted = convert_batchnorm(model)
    assert converted is model
    assert type(model[1]) is GraphBatchNorm and type(model[3][0]) is GraphBatchNorm
    assert all(value is before[key] for key, value in model.state_dict(keep_vars=True).items())
    x = torch.randn(7, 4)
    torch.testing.assert_close(model[1](x), torch.nn.functional.batch_norm(x, None, None, model[1].weight,
                                                                             model[1].bias, True))
    assert model[1].num_batches_tracked == 1  # one process: BatchNorm's own update
    revert_batchnorm(model)
    assert type(model[1]) is torch.nn.BatchNorm1d and type(model[3][0]) is torch.nn.BatchNorm2d
    assert all(value is before[key] for key, value in model.state_dict(keep_vars=True).items())
    own = torch.nn.Sequential(GraphBatchNorm(4))  # the user's own GraphBatchNorm stays one
    assert type(revert_batchnorm(own)[0]) is GraphBatchNorm


@pytest.mark.parametrize(("layer", "instead"), [
    (pyg_norm.GraphNorm(4), r"torch.nn.BatchNorm1d"),
    (pyg_norm.LayerNorm(4, mode="graph"), r"LayerNorm\(mode='node'\)"),
    (pyg_norm.PairNorm(), r"torch.nn.BatchNorm1d"),
    (pyg_norm.InstanceNorm(4), r"torch.nn.BatchNorm1d"),
])
def test_norms_over_a_graphs_vertices_are_refused_naming_the_layer(layer: torch.nn.Module, instead: str
                                                                   ) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), layer)
    name = type(layer).__name__
    message = rf"Sequential\.1 \(torch_geometric\.\S+\.{name}\) takes statistics over the vertices.*"
    message += rf"Use .*{instead}"
    with pytest.raises(TypeError, match=message):
        check_vertex_norms(model)
    check_vertex_norms(torch.nn.Sequential(pyg_norm.LayerNorm(4, mode="node"), pyg_norm.BatchNorm(4)))
