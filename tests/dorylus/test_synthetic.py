"""Synthetic power-law graphs: simple undirected, homophilous, heavy-tailed, learnable, cached."""

from __future__ import annotations

import pytest
import torch
from torch_geometric.data import Data
from torch_geometric.utils import scatter

import lightning_dorylus.data.synthetic as synthetic
from lightning_dorylus.data.synthetic import edge_homophily, powerlaw_graph


def nearest_centroid_accuracy(data: Data, features: torch.Tensor) -> float:
    """Test accuracy of a nearest-class-centroid classifier fitted on the training vertices."""
    num_classes = int(data.y.max()) + 1
    train = data.train_mask
    centroids = torch.stack([features[train & (data.y == c)].mean(0) for c in range(num_classes)])
    prediction = torch.cdist(features, centroids).argmin(1)
    return float((prediction[data.test_mask] == data.y[data.test_mask]).float().mean())


def test_simple_undirected_graph() -> None:
    data = powerlaw_graph(2000, 12, 8, 4, seed=3)
    src, dst = data.edge_index
    assert not bool((src == dst).any()), "no self loops"
    keys = dst * data.num_nodes + src
    assert torch.unique(keys).numel() == keys.numel(), "no duplicate edges"
    reverse = torch.sort(src * data.num_nodes + dst).values
    torch.testing.assert_close(torch.sort(keys).values, reverse)  # every edge has its reverse
    assert 0.8 * 2000 * 12 < data.edge_index.size(1) <= 2000 * 12


def test_homophily_and_power_law_degrees() -> None:
    data = powerlaw_graph(5000, 10, 8, 5, seed=0)
    assert 0.75 < edge_homophily(data.edge_index, data.y) < 0.9
    degree = torch.bincount(data.edge_index[1], minlength=data.num_nodes).float()
    assert degree.max() > 8 * degree.mean(), "heavy tail: hubs far above the mean degree"
    assert float(degree.median()) < float(degree.mean()), "right-skewed degree distribution"


def test_masks_features_labels() -> None:
    data = powerlaw_graph(1000, 6, 16, 4, seed=1, split=(0.2, 0.1, 0.3))
    assert data.x.shape == (1000, 16) and data.x.dtype == torch.float32
    assert data.y.shape == (1000,) and set(data.y.tolist()) == {0, 1, 2, 3}
    masks = torch.stack([data.train_mask, data.val_mask, data.test_mask])
    assert masks.sum(1).tolist() == [200, 100, 300]
    assert int(masks.sum(0).max()) == 1, "masks are disjoint"


def test_labels_are_learnable_from_neighbourhoods() -> None:
    data = powerlaw_graph(4000, 10, 16, 4, seed=2)
    src, dst = data.edge_index
    degree = torch.bincount(dst, minlength=data.num_nodes).unsqueeze(1)
    neighbour_sum = scatter(data.x[src], dst, 0, dim_size=data.num_nodes, reduce="sum")
    mean_with_self = (neighbour_sum + data.x) / (degree + 1)
    own = nearest_centroid_accuracy(data, data.x)
    neighbourhood = nearest_centroid_accuracy(data, mean_with_self)
    assert own < 0.85 and neighbourhood > own + 0.15, (own, neighbourhood)


def test_deterministic_per_seed() -> None:
    a, b = powerlaw_graph(500, 6, 4, 3, seed=7), powerlaw_graph(500, 6, 4, 3, seed=7)
    for name in ("edge_index", "x", "y", "train_mask"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name))
    c = powerlaw_graph(500, 6, 4, 3, seed=8)
    assert not torch.equal(a.y, c.y)


def test_cached_on_disk(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = powerlaw_graph(800, 6, 4, 3, seed=0, cache_dir=tmp_path)
    (path,) = tmp_path.iterdir()
    assert path.name.startswith("powerlaw-n800-d6-f4-c3-s0") and path.suffix == ".safetensors"

    def fail(*args, **kwargs):
        raise AssertionError("the cached graph should have been loaded")

    monkeypatch.setattr(synthetic.torch, "Generator", fail)
    again = powerlaw_graph(800, 6, 4, 3, seed=0, cache_dir=tmp_path)
    for name in ("edge_index", "x", "y", "train_mask", "val_mask", "test_mask"):
        torch.testing.assert_close(getattr(again, name), getattr(first, name))
    with pytest.raises(AssertionError, match="should have been loaded"):
        powerlaw_graph(800, 6, 4, 3, seed=1, cache_dir=tmp_path)


def test_fifty_thousand_vertices() -> None:
    data = powerlaw_graph(50_000, 20, 16, 8, seed=0)
    assert data.num_nodes == 50_000 and 0.85 * 50_000 * 20 < data.edge_index.size(1) <= 50_000 * 20


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_nodes": 1}, r"num_nodes \(1\) must be >= 2"),
        ({"avg_degree": 0}, r"avg_degree \(0\) must lie in \(0, num_nodes=100\)"),
        ({"num_features": 0}, r"num_features \(0\) must be >= 1"),
        ({"num_classes": 101}, r"num_classes \(101\) must lie in \[1, num_nodes=100\]"),
        ({"homophily": 1.5}, r"homophily \(1.5\) must lie in \[0, 1\]"),
        ({"exponent": 2.0}, r"exponent \(2.0\) must be > 2"),
        ({"split": (0.5, 0.5, 0.5)}, r"split \(0.5, 0.5, 0.5\) must be three fractions"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    args = {"num_nodes": 100, "avg_degree": 4, "num_features": 4, "num_classes": 3, **kwargs}
    with pytest.raises(ValueError, match=match):
        powerlaw_graph(**args)
