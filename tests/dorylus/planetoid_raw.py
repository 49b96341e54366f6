"""Write a small synthetic graph in PyG's raw Planetoid format (the 8 ``ind.<name>.*`` files).

Only Cora's raw files ship with the project and nothing is downloaded, so the "any Planetoid graph by name"
path is tested on a graph written here under another name (e.g. ``CiteSeer``): the same files PyG's
``read_planetoid_data`` reads (scipy CSR features, one-hot labels, an adjacency dict, pickled, plus the
``test.index`` text file), with the public split layout: ``num_train`` labelled vertices first, then the 500
validation vertices, then unlabelled ones, then ``num_test`` test vertices.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import scipy.sparse as sp

NUM_VAL = 500  # read_planetoid_data's fixed validation block after the training vertices


def write_planetoid_raw(
    root: Path, name: str, num_features: int, num_classes: int, num_train: int = 30, num_test: int = 100,
    num_unlabelled: int = 20, avg_degree: int = 4, seed: int = 0,
) -> Path:
    """Writes ``<root>/<name>/raw/ind.<name.lower()>.*``; returns the raw folder.

    Features are sparse, class-dependent (each class owns a block of feature columns) and edges mostly join
    vertices of one class, so a GCN learns it; vertex count = num_train + 500 + num_unlabelled + num_test.
    """
    rng = np.random.default_rng(seed)
    num_all = num_train + NUM_VAL + num_unlabelled  # allx / ally rows: everything but the test vertices
    n = num_all + num_test
    labels = rng.integers(0, num_classes, n)
    block = max(1, num_features // num_classes)
    features = (rng.random((n, num_features)) < 0.05).astype(np.float32)
    for v in range(n):
        start = (labels[v] * block) % num_features
        features[v, start + rng.integers(0, block, 3) % block] = 1.0
    onehot = np.eye(num_classes, dtype=np.int64)[labels]
    graph: dict[int, list[int]] = {v: [] for v in range(n)}
    for v in range(n):
        same = np.flatnonzero(labels == labels[v])
        for u in rng.choice(same, avg_degree // 2, replace=False):
            if u != v:
                graph[v].append(int(u))
                graph[int(u)].append(v)

    raw = root / name / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    prefix = f"ind.{name.lower()}"
    test_rows = np.arange(num_all, n)
    items = {
        "x": sp.csr_matrix(features[:num_train]),
        "y": onehot[:num_train],
        "allx": sp.csr_matrix(features[:num_all]),
        "ally": onehot[:num_all],
        "tx": sp.csr_matrix(features[test_rows]),
        "ty": onehot[test_rows],
        "graph": graph,
    }
    for suffix, value in items.items():
        with open(raw / f"{prefix}.{suffix}", "wb") as f:
            pickle.dump(value, f)
    (raw / f"{prefix}.test.index").write_text("".join(f"{v}\n" for v in rng.permutation(test_rows)))
    return raw
