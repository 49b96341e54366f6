"""A PyG user's data as PyG treats it: ``edge_weight`` in GCN's normalisation, duplicate edges counted per
copy, index-tensor masks, multi-label targets trained with BCE-with-logits.

The 2-server cases train ``scripts/pyg_data_run.py`` (float64 GCN, 5 epochs, one launch for every case) and
compare per-epoch losses and final weights with the same model written with PyG's own ``GCNConv`` (and,
for multi-label targets, with ``strategy="auto"``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torch_geometric.nn as pyg_nn
from lightning.pytorch import Trainer
from safetensors.torch import load_file
from torch_geometric.data import Data
from torch_geometric.utils import index_to_mask

from lightning_dorylus import GAT, GCN
from lightning_dorylus.data import (
    DorylusDataModule,
    graph_hash,
    load_partition,
    partition_graph,
    partition_to_cache,
)
from lightning_dorylus.graph import GraphCache, structure
from lightning_dorylus.nn import GATConv, GCNConv, SAGEConv
from tests.dorylus.scripts.exact_run import INTERVAL_SIZE, NUM_FEATURES, loader, make_graph
from tests.dorylus.scripts.launch import run_script
from tests.dorylus.scripts.pyg_data_run import CASES, NUM_LABELS, fit, make_case_graph, make_case_model
from tests.process import REPO, launch_env, run_process, run_ranks

EPOCHS = 5


def pyg_reference(case: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The case's GCN written with PyG's ``GCNConv`` (``edge_weight`` passed, duplicates as given), started
    from the Dorylus model's initial weights, trained full-graph with the same Adam; per-epoch losses and
    the final weights under the Dorylus model's names."""
    data = make_case_graph(case)
    model = make_case_model(case)
    conv1, conv2 = (pyg_nn.GCNConv(c.in_channels, c.out_channels).double() for c in model.convs)
    with torch.no_grad():
        for ours, theirs in zip(model.convs, (conv1, conv2)):
            theirs.lin.weight.copy_(ours.weight.T)
            theirs.bias.copy_(ours.bias)
    params = [*conv1.parameters(), *conv2.parameters()]
    optimizer = torch.optim.Adam(params, lr=0.05, weight_decay=5e-4)
    train = index_to_mask(data.train_mask, data.num_nodes) if data.train_mask.dtype != torch.bool \
        else data.train_mask
    weight = getattr(data, "edge_weight", None)
    losses = []
    for _ in range(EPOCHS):
        optimizer.zero_grad()
        out = conv2(F.relu(conv1(data.x, data.edge_index, weight)), data.edge_index, weight)
        if case == "multilabel":
            loss = F.binary_cross_entropy_with_logits(out[train], data.y[train].double())
        else:
            loss = F.cross_entropy(out[train], data.y[train])
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    weights = {"convs.0.weight": conv1.lin.weight.T, "convs.0.bias": conv1.bias,
               "convs.1.weight": conv2.lin.weight.T, "convs.1.bias": conv2.bias}
    return losses, {k: v.detach().clone() for k, v in weights.items()}


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case trained on 2 graph servers in one launch; the output folder (one sub-folder per case)."""
    out = tmp_path_factory.mktemp("pyg_data2")
    run_script("pyg_data_run.py", [str(out), "--servers", "2", "--epochs", str(EPOCHS)],
               timeout=300 + 60 * len(CASES), cwd=out, nprocs=2)
    return out


def _assert_run_equals(out: Path, losses: list[float], weights: dict[str, torch.Tensor]) -> None:
    result = json.loads((out / "result.json").read_text())
    assert all(g > 0 for g in result["ghosts"]), "both partitions need ghosts, or SC is not exercised"
    torch.testing.assert_close(torch.tensor(result["losses"], dtype=torch.float64),
                               torch.tensor(losses, dtype=torch.float64), rtol=1e-9, atol=1e-11)
    replicas = [load_file(str(out / f"weights_rank{r}.safetensors")) for r in range(2)]
    for name, value in replicas[1].items():  # the replicas never diverge
        torch.testing.assert_close(value, replicas[0][name], rtol=0, atol=0)
    assert set(replicas[0]) == set(weights)
    for name, value in weights.items():
        torch.testing.assert_close(replicas[0][name], value, rtol=1e-9, atol=1e-11)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("case", ["weighted", "duplicates", "weighted-duplicates"])
def test_two_servers_train_as_pyg_gcnconv(two_servers: Path, case: str) -> None:
    """Weighted edges (PyG's ``gcn_norm`` with ``edge_weight``, self loops of weight 1) and duplicate edges
    (every copy in the degree and the sum): 2 graph servers' losses and weights equal PyG's ``GCNConv``
    trained on the whole graph, float64, to rounding; and the data really changes the run."""
    losses, weights = pyg_reference(case)
    _assert_run_equals(two_servers / case, losses, weights)
    # make_graph() is the graph without the weights and with the copies merged: its loss differs
    assert abs(losses[0] - _pyg_first_loss(make_graph())) > 1e-4


def _pyg_first_loss(data: Data) -> float:
    """Epoch-0 loss of the PyG reference GCN on ``data`` (no weights)."""
    model = make_case_model("weighted")
    conv1, conv2 = (pyg_nn.GCNConv(c.in_channels, c.out_channels).double() for c in model.convs)
    with torch.no_grad():
        for ours, theirs in zip(model.convs, (conv1, conv2)):
            theirs.lin.weight.copy_(ours.weight.T)
            theirs.bias.copy_(ours.bias)
    out = conv2(F.relu(conv1(data.x, data.edge_index)), data.edge_index)
    return float(F.cross_entropy(out[data.train_mask], data.y[data.train_mask]))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_servers_train_multi_label_targets_as_auto_and_pyg(two_servers: Path, tmp_path: Path) -> None:
    """``y`` of shape ``(N, 5)`` 0/1 with index-tensor masks: BCE-with-logits on 2 graph servers equals
    ``strategy="auto"`` on one partition and PyG's ``GCNConv`` with ``BCEWithLogitsLoss``, float64."""
    [whole] = partition_graph(make_case_graph("multilabel"), 1, partitioner="metis",
                              interval_size=INTERVAL_SIZE)
    model = make_case_model("multilabel")
    _, recorder = fit(model, [whole], EPOCHS, "auto", 1)
    auto_weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _assert_run_equals(two_servers / "multilabel", recorder.losses, auto_weights)
    losses, weights = pyg_reference("multilabel")
    torch.testing.assert_close(torch.tensor(recorder.losses), torch.tensor(losses), rtol=1e-9, atol=1e-11)
    for name, value in weights.items():
        torch.testing.assert_close(auto_weights[name], value, rtol=1e-9, atol=1e-11)


def _weighted_graph() -> Data:
    data = make_case_graph("weighted-duplicates")
    data.edge_index = data.edge_index.clone()
    return data


@pytest.mark.parametrize("order", ["gather_first", "weight_first"])
@pytest.mark.parametrize("num_parts", [1, 2])
def test_weighted_gcn_conv_with_duplicates_matches_pyg(order: str, num_parts: int) -> None:
    """One layer, forward and every gradient, per partition: PyG's ``GCNConv(x, edge_index, edge_weight)``
    on the whole graph (duplicates as given), rows of this partition."""
    data = _weighted_graph()
    for part in partition_graph(data, num_parts, partitioner="random", interval_size=INTERVAL_SIZE):
        assert part.edge_weight is not None and part.weighted_in_degree is not None
        conv = GCNConv(NUM_FEATURES, 5, activation="none", order=order).double()
        ref = pyg_nn.GCNConv(NUM_FEATURES, 5).double()
        with torch.no_grad():
            ref.lin.weight.copy_(conv.weight.T)
            conv.bias.copy_(torch.randn(5, dtype=torch.float64))
            ref.bias.copy_(conv.bias)
        ctx = GraphCache().context(part)
        full = torch.cat([part.local_nodes, part.ghost_nodes])
        h = data.x.clone().requires_grad_()
        h_ref = data.x.clone().requires_grad_()
        rows = h[full] if num_parts > 1 else h[part.local_nodes]
        if num_parts > 1:  # no ghost exchange in one process: aggregate [local; ghost] rows directly
            adj = ctx.gcn(torch.float64).adj
            out = adj @ (rows @ conv.weight) + conv.bias
        else:
            out = conv(rows, ctx)
        out_ref = ref(h_ref, data.edge_index, data.edge_weight)[part.local_nodes]
        torch.testing.assert_close(out, out_ref)
        out.square().sum().backward()
        out_ref.square().sum().backward()
        touched = h_ref.grad.abs().sum(1) > 0
        if num_parts == 1:
            torch.testing.assert_close(h.grad, h_ref.grad)
            torch.testing.assert_close(conv.weight.grad, ref.lin.weight.grad.T)
        else:
            torch.testing.assert_close(h.grad[touched], h_ref.grad[touched])


def test_duplicate_edges_count_as_pyg_counts_them() -> None:
    """A duplicated edge: PyG's ``GCNConv`` adds each copy to the degree and passes a message per copy (so
    it is not PyG's ``coalesce``d graph); the Dorylus adjacency holds one entry of the summed weight, equal
    to PyG's dense operator; the by-sort path (copies not next to each other) gives the same matrix."""
    x = torch.eye(4, dtype=torch.float64)
    edge_index = torch.tensor([[0, 0, 0, 1, 2], [1, 1, 1, 2, 3]])  # 0 -> 1 three times
    data = Data(x=x, edge_index=edge_index)
    [part] = partition_graph(data, 1)
    assert part.in_degree.tolist() == [0, 3, 1, 1]
    ref = pyg_nn.GCNConv(4, 4, bias=False).double()
    with torch.no_grad():
        ref.lin.weight.copy_(torch.eye(4))
    dense = ref(x, edge_index)  # x = W = I: PyG's operator Â itself
    built = structure.gcn_adjacency(part, torch.float64)
    torch.testing.assert_close(built.adj.to_dense(), dense)
    assert built.adj.values().numel() == 3 + 4  # one entry per distinct edge, plus the self loops
    torch.testing.assert_close(built.adj.to_dense()[1, 0], torch.tensor(3 / (2.0 * 1.0), dtype=torch.float64))
    scattered = dataclasses.replace(part, edge_index=part.edge_index[:, [0, 3, 1, 4, 2]])  # copies apart
    again = structure.gcn_adjacency(scattered, torch.float64)
    torch.testing.assert_close(again.adj.to_dense(), built.adj.to_dense())
    torch.testing.assert_close(again.adj_t.to_dense(), built.adj.to_dense().T)
    assert not torch.allclose(ref(x, torch.tensor([[0, 1, 2], [1, 2, 3]])), dense)  # merged: another Â


def test_index_masks_are_converted_as_index_to_mask() -> None:
    """LongTensor masks give the partitions of the bool masks ``index_to_mask`` makes; refused where
    ambiguous (N zeros and ones) or out of range, naming ``index_to_mask``."""
    data = make_graph()
    as_index = data.clone()
    for name in ("train_mask", "val_mask", "test_mask"):
        setattr(as_index, name, getattr(data, name).nonzero().view(-1))
    for got, expected in zip(partition_graph(as_index, 2), partition_graph(data, 2)):
        for name in ("train_mask", "val_mask", "test_mask"):
            assert torch.equal(getattr(got, name), getattr(expected, name))
        assert got.num_train_global == expected.num_train_global
    repeated = data.clone()
    repeated.train_mask = torch.cat([data.train_mask.nonzero().view(-1)] * 2).int()  # repeats, int32
    assert torch.equal(partition_graph(repeated, 1)[0].train_mask, data.train_mask)
    ambiguous = data.clone()
    ambiguous.val_mask = data.val_mask.long()
    with pytest.raises(ValueError, match=r"val_mask is an integer tensor of 240 zeros and ones: it may be a "
                                         r"0/1 mask or the vertex indices 0 and 1.*data.val_mask.bool\(\).*"
                                         r"index_to_mask\(index, size=240\)"):
        DorylusDataModule(ambiguous)
    out_of_range = data.clone()
    out_of_range.test_mask = torch.tensor([0, 240])
    with pytest.raises(ValueError, match=r"test_mask holds vertex indices in \[0, 240\] but the graph has "
                                         r"240 vertices.*index_to_mask"):
        DorylusDataModule(out_of_range)


def test_edge_weight_is_checked_cached_and_hashed(tmp_path: Path) -> None:
    """Bad weights are refused naming the fix; the weights are part of the cache key and round-trip
    through the partition cache; GAT (as PyG's ``GATConv``) does not read them."""
    data = make_case_graph("weighted")
    bad = [
        (torch.ones(3), r"edge_weight has shape \(3,\) but expected \(num_edges=\d+,\)"),
        (torch.ones(data.edge_index.size(1), dtype=torch.long), r"edge_weight must be a floating point"),
        (torch.full((data.edge_index.size(1),), float("nan")), r"edge_weight contains \d+ non-finite"),
        (torch.full((data.edge_index.size(1),), -1.0), r"negative GCN degree"),
    ]
    for weight, match in bad:
        changed = data.clone()
        changed.edge_weight = weight
        with pytest.raises(ValueError, match=match):
            DorylusDataModule(changed, cache_dir=tmp_path)
    looped = data.clone()
    looped.edge_index = torch.cat([data.edge_index, torch.tensor([[4], [4]])], dim=1)
    looped.edge_weight = torch.cat([data.edge_weight, torch.tensor([2.5], dtype=torch.float64)])
    with pytest.raises(ValueError, match=r"1 self loops a weight other than 1.*remove_self_loops"):
        partition_graph(looped, 1)
    assert graph_hash(data) != graph_hash(make_graph())
    target = partition_to_cache(data, 2, "metis", INTERVAL_SIZE, cache_dir=tmp_path)
    for part_id, built in enumerate(partition_graph(data, 2, "metis", INTERVAL_SIZE)):
        loaded = load_partition(target, part_id)
        assert torch.equal(loaded.edge_weight, built.edge_weight)
        assert torch.equal(loaded.weighted_in_degree, built.weighted_in_degree)
    [part] = partition_graph(data, 1)
    plain = dataclasses.replace(part, edge_weight=None, weighted_in_degree=None)
    gat = GAT(NUM_FEATURES, 4, 4, heads=2, dropout=0.0).double().eval()
    with torch.no_grad(), pytest.warns(UserWarning, match=r"GATConv does not read data.edge_weight \(PyG's "
                                                          r"GATConv takes none\)"):
        torch.testing.assert_close(gat(gat.graph(part)), gat(gat.graph(plain)))
    with pytest.raises(ValueError, match="edge_weight and weighted_in_degree go together"):
        dataclasses.replace(part, weighted_in_degree=None)


def test_multi_label_targets_are_checked_and_counted(tmp_path: Path) -> None:
    """``y`` of shape ``(N, C)``: ``num_classes`` is ``C``; values outside ``[0, 1]`` and a wrong
    ``num_classes`` or model width are refused naming the fix; micro-F1 is logged for validation."""
    data = make_case_graph("multilabel")
    datamodule = DorylusDataModule(data, cache_dir=tmp_path)
    assert datamodule.num_classes == NUM_LABELS
    [part] = partition_graph(data, 1)
    assert part.multi_label and part.y.dtype == torch.float32 and part.y.shape == (240, NUM_LABELS)
    with pytest.raises(ValueError, match=r"holds 5 multi-label targets per vertex .* but num_classes is 4"):
        DorylusDataModule(data, cache_dir=tmp_path, num_classes=4)
    bad = data.clone()
    bad.y = data.y * 2
    with pytest.raises(ValueError, match=r"y\[\d+, \d+\] = 2.0: BCE-with-logits targets lie in \[0, 1\]"):
        DorylusDataModule(bad, cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"gives \(4,\) outputs per vertex but y holds 5 multi-label "):
        GCN(NUM_FEATURES, 8, 4).double().training_step(part, 0)
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path)
    model = make_case_model("multilabel")
    [metrics] = trainer.validate(model, loader(part), verbose=False)
    with torch.no_grad():
        pred = model(model.graph(part)) > 0
    target, mask = part.y > 0.5, part.val_mask
    tp = (pred[mask] & target[mask]).sum()
    f1 = 2 * tp / (2 * tp + (pred[mask] & ~target[mask]).sum() + (~pred[mask] & target[mask]).sum())
    predicted = model.predict_step(part, 0)  # 0/1 per vertex and label, as the strategy gathers rows
    assert predicted.dtype == torch.long and torch.equal(predicted, pred.long())
    assert 0 < float(f1) < 1 and metrics["val_f1"] == pytest.approx(float(f1), rel=1e-6)  # logged as float32


@pytest.mark.parametrize("layer", ["sage", "gat"])
def test_sage_and_gat_count_duplicates_as_pyg_and_ignore_edge_weight(layer: str) -> None:
    """Duplicate edges (and their weights): PyG's ``SAGEConv`` averages over every copy and its ``GATConv``
    softmaxes over every copy, and neither takes ``edge_weight``; the Dorylus layers' forward and gradients
    equal them on one partition of 4 intervals."""
    data = make_case_graph("weighted-duplicates")
    [part] = partition_graph(data, 1, interval_size=64)
    ctx = GraphCache().context(part)
    if layer == "sage":
        conv = SAGEConv(NUM_FEATURES, 5, activation="none").double()
        ref = pyg_nn.SAGEConv(NUM_FEATURES, 5, aggr="mean").double()
        with torch.no_grad():
            ref.lin_l.weight.copy_(conv.weight_l.T)
            ref.lin_l.bias.copy_(conv.bias)
            ref.lin_r.weight.copy_(conv.weight_r.T)
        pairs = [(conv.weight_l, ref.lin_l.weight), (conv.weight_r, ref.lin_r.weight)]
    else:
        conv = GATConv(NUM_FEATURES, 4, heads=2).double()
        ref = pyg_nn.GATConv(NUM_FEATURES, 4, heads=2).double()
        with torch.no_grad():
            ref.lin.weight.copy_(conv.weight.T)
            ref.att_src.copy_(conv.att_src[None])
            ref.att_dst.copy_(conv.att_dst[None])
            ref.bias.copy_(conv.bias)
        pairs = [(conv.weight, ref.lin.weight)]
    x = data.x[part.local_nodes].clone().requires_grad_()
    x_ref = data.x.clone().requires_grad_()
    out, out_ref = conv(x, ctx), ref(x_ref, data.edge_index)[part.local_nodes]
    torch.testing.assert_close(out, out_ref)
    out.square().sum().backward()
    out_ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad[part.local_nodes])
    for ours, theirs in pairs:
        torch.testing.assert_close(ours.grad, theirs.grad.T)
    with torch.no_grad():  # and the copies matter: PyG on the coalesced graph differs
        merged = torch.unique(data.edge_index, dim=1)
        assert not torch.allclose(ref(data.x, merged)[part.local_nodes], out_ref)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_multilabel_example_trains_on_two_servers_as_alone(tmp_path: Path) -> None:
    """``docs/examples/multilabel.py`` (int64 0/1 targets, OGB-style index splits, weighted edges) runs as
    its docstring says, and 2 graph servers log what one process logs (float32: loss to rounding)."""
    script = [sys.executable, str(REPO / "docs" / "examples" / "multilabel.py"), "--epochs", "20"]
    env = launch_env({"XDG_CACHE_HOME": str(tmp_path / "xdg-cache")})
    alone = run_process([*script, "--devices", "1"], timeout=300, cwd=tmp_path, env=env).stdout
    two = run_ranks([*script, "--devices", "2"], 2, timeout=400, cwd=tmp_path, env=env).stdout
    lines = [re.search(r"train_loss=.*", out) for out in (alone, two)]
    assert all(lines), (alone[-2000:], two[-2000:])
    found = [dict(re.findall(r"(\w+)=([\d.]+)", line.group(0))) for line in lines]  # type: ignore[union-attr]
    assert float(found[0]["train_loss"]) == pytest.approx(float(found[1]["train_loss"]), abs=2e-6)
    assert found[0]["val_f1"] == found[1]["val_f1"] and found[0]["test_f1"] == found[1]["test_f1"]
    assert float(found[0]["val_f1"]) > 0.5  # it learns (0 without a positive prediction)
