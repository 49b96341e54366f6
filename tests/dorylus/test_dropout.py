"""Dropout masks keyed by global ids: uncorrelated across servers, new every epoch, partition-independent.

The bug this guards against: with ``torch``'s generator and ``seed_everything``, every graph server drew the
same mask for its local row ``i``. Now a mask entry hashes (seed, epoch, step, site, global id), so servers
differ (they hold different vertices), epochs differ, and any partitioning reproduces the one-process masks.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import binom

from lightning_dorylus import GAT, GCN
from lightning_dorylus.data import GraphPartition, partition_graph
from lightning_dorylus.graph import GraphCache
from lightning_dorylus.nn import dropout as D
from tests.dorylus.scripts.exact_run import INTERVAL_SIZE, NUM_CLASSES, NUM_FEATURES, make_graph


def _reference_hash(key: int, row_id: int, col: int) -> int:
    """The mask hash in plain Python integers (the tensor code relies on wrapping int64/int32 arithmetic)."""
    m64, m32 = (1 << 64) - 1, (1 << 32) - 1
    z = (row_id * D._GOLDEN64 + key + D._GOLDEN64) & m64
    z = ((z ^ (z >> 30)) * D._MIX64[0]) & m64
    z = ((z ^ (z >> 27)) * D._MIX64[1]) & m64
    h = ((z ^ (z >> 31)) + col * D._GOLDEN32) & m32
    h = ((h ^ (h >> 16)) * D._MIX32[0]) & m32
    h = ((h ^ (h >> 13)) * D._MIX32[1]) & m32
    return D._signed(h ^ (h >> 16), 32)


def test_tensor_hash_matches_the_integer_reference() -> None:
    key = D.dropout_key(7, 3, 4, 1)
    rows = torch.tensor([0, 5, 2**40 + 3, 123_456_789])
    cols = torch.tensor([0, 1, 2, 1000])
    got = D.entry_hashes(key, rows, torch.arange(4), cols).tolist()
    assert got == [_reference_hash(key, int(r), int(c)) for r, c in zip(rows, cols)]


@pytest.mark.parametrize("p", [0.0, 0.3, 0.5, 0.6, 1.0])  # 0.6: 1 / (1 - p) rounds
def test_chunked_cpu_masks_equal_the_whole_tensor_hash(p: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU path hashes a few rows at a time in numpy; every entry (and product) is the torch path's."""
    monkeypatch.setattr(D, "CHUNK_ENTRIES", 40)  # 40 // 7 = 5 rows per chunk: 203 rows end in a partial one
    key, ids = D.dropout_key(9, 2, 1), torch.arange(203) * 2**33 + 5
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        expected = D._device_mask(ids, 7, p, key, dtype)
        assert torch.equal(D.dropout_mask(ids, 7, p, key, dtype), expected)
        if p == 0.0:  # row_dropout returns x itself
            continue
        x = torch.randn(203, 7, dtype=torch.float64).to(dtype)
        x[0, :3] = torch.tensor([-1.0, float("inf"), float("nan")], dtype=dtype)  # -0, nan: bit for bit
        got = D.row_dropout(x, ids, p, True, key)
        assert got.view(torch.int16 if dtype == torch.bfloat16 else dtype).numpy().tobytes() \
            == (x * expected).view(torch.int16 if dtype == torch.bfloat16 else dtype).numpy().tobytes()


def _partitions(parts: int, sparse: bool = False) -> list[GraphPartition]:
    data = make_graph()
    if sparse:  # bag-of-words-like: about 5 % nonzero, so feature_dropout takes the nonzeros-only path
        gen = torch.Generator().manual_seed(1)
        data.x = data.x * (torch.rand(data.x.shape, generator=gen, dtype=torch.float64) < 0.05)
    return partition_graph(data, parts, partitioner="metis", interval_size=INTERVAL_SIZE)


def _to_global(parts: list[GraphPartition], rows: list[torch.Tensor]) -> torch.Tensor:
    out = torch.empty(sum(p.n_local for p in parts), *rows[0].shape[1:], dtype=rows[0].dtype)
    for part, r in zip(parts, rows):
        out[part.local_nodes] = r
    return out


@pytest.mark.parametrize("sparse", [False, True])
def test_feature_and_row_masks_do_not_depend_on_the_partitioning(sparse: bool) -> None:
    key = D.dropout_key(0, 2, 2, 0)
    [whole] = _partitions(1, sparse)
    ctx = GraphCache().context(whole)
    assert (ctx.feature_nonzeros() is not None) == sparse
    expected = D.feature_dropout(ctx, 0.5, True, key)
    three = _partitions(3, sparse)
    got = [D.feature_dropout(GraphCache().context(p), 0.5, True, key) for p in three]
    torch.testing.assert_close(_to_global(three, got), expected, rtol=0, atol=0)
    # The correlated-dropout bug: local row i of every server had the same mask. Now they differ.
    n = min(p.n_local for p in three)
    hidden = [D.row_dropout(torch.ones(p.n_local, 16, dtype=torch.float64), p.local_nodes, 0.5, True, key)
              for p in three]
    assert not torch.equal(hidden[0][:n] != 0, hidden[1][:n] != 0)
    whole_hidden = D.row_dropout(torch.ones(whole.n_local, 16, dtype=torch.float64), whole.local_nodes, 0.5,
                                 True, key)
    torch.testing.assert_close(_to_global(three, hidden), whole_hidden, rtol=0, atol=0)


def test_sparse_and_dense_paths_draw_the_same_mask() -> None:
    [part] = _partitions(1, sparse=True)
    key = D.dropout_key(5, 1)
    sparse = D.feature_dropout(GraphCache().context(part), 0.3, True, key)
    dense = D.row_dropout(part.x, part.local_nodes, 0.3, True, key)
    torch.testing.assert_close(sparse, dense, rtol=0, atol=0)


def test_attention_masks_follow_global_edges() -> None:
    key = D.dropout_key(0, 1, 1, 1)

    def masks(parts: list[GraphPartition]) -> dict[int, tuple[bool, ...]]:
        out = {}
        for part in parts:
            ctx = GraphCache().context(part)
            ids = D.edge_ids(ctx)
            kept = D.row_dropout(torch.ones(ids.numel(), 3), ids, 0.6, True, key) != 0
            out.update(zip(ids.tolist(), map(tuple, kept.tolist())))
        return out

    whole, three = masks(_partitions(1)), masks(_partitions(3))
    assert whole == three and len(whole) > 240  # every edge (and self loop) once, the same mask


def test_masks_change_with_epoch_step_and_site_and_keep_the_rate() -> None:
    ids = torch.arange(20_000)
    x = torch.ones(20_000, 8, dtype=torch.float64, requires_grad=True)
    base = D.row_dropout(x, ids, 0.3, True, D.dropout_key(0, 0, 0, 0))
    for other in (D.dropout_key(0, 1, 1, 0), D.dropout_key(0, 0, 0, 1), D.dropout_key(1, 0, 0, 0)):
        assert not torch.equal(base != 0, D.row_dropout(x, ids, 0.3, True, other) != 0)
    kept = (base != 0).double().mean().item()
    assert abs(kept - 0.7) < 0.01
    assert set(base.unique().tolist()) == {0.0, 1 / 0.7}
    base.sum().backward()  # the gradient is the same mask, as F.dropout's
    torch.testing.assert_close(x.grad, base.detach())
    assert D.row_dropout(x, ids, 0.3, False, 0) is x
    assert torch.all(D.row_dropout(x, ids, 1.0, True, 0) == 0)
    with pytest.raises(ValueError, match=r"row_ids has shape \(3,\); expected \(20000,\)"):
        D.row_dropout(x, ids[:3], 0.3, True, 0)


@pytest.mark.parametrize("model_cls", [GCN, GAT])
def test_model_keys_fold_seed_epoch_and_site(model_cls: type) -> None:
    torch.manual_seed(3)
    kwargs = {"heads": 2} if model_cls is GAT else {}
    model = model_cls(NUM_FEATURES, 8, NUM_CLASSES, dropout=0.5, **kwargs).double()
    assert model.dropout_seed == 3  # from seed_everything / torch.manual_seed: equal on every graph server
    [part] = _partitions(1)
    graph = model.graph(part)
    first, second = model(graph), model(graph)  # outside a Trainer each training forward is a new step
    assert not torch.equal(first, second)
    assert model.dropout_key(0) != model.dropout_key(1)
    checkpoint: dict = {}
    model.on_save_checkpoint(checkpoint)
    other = model_cls(NUM_FEATURES, 8, NUM_CLASSES, dropout=0.5, **kwargs)
    other.on_load_checkpoint(checkpoint)
    assert other.dropout_seed == 3
    model.eval()
    torch.testing.assert_close(model(graph), model(graph), rtol=0, atol=0)  # no dropout in eval


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_row_source_remakes_its_rows_bit_for_bit(sparse: bool, dtype: torch.dtype,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A first layer keeps 1 bit per entry of its dropped-out rows (1 byte per nonzero of sparse features),
    not the rows: the backward's remade rows are the forward's bit for bit (-0, inf, nan included), without
    hashing again; into a reused buffer when given one."""
    monkeypatch.setattr(D, "CHUNK_ENTRIES", 64)  # several chunks per interval
    [part] = _partitions(1, sparse)
    part.x = part.x.to(dtype)
    if not sparse:
        part.x[0, :3] = torch.tensor([-1.0, float("inf"), float("nan")], dtype=dtype)
    source = D.RowSource(GraphCache().context(part), 0.5, True, D.dropout_key(3, 1, 1, 0))
    full = source.full()
    spans = [(0, 7), (7, 40), (40, part.n_local)]
    made = [source.rows(a, b) for a, b in spans]
    with pytest.raises(ValueError, match=r"out has shape \(2, 30\)"):
        source.rows(0, 3, torch.empty(2, 30, dtype=dtype))
    # no hash in the backward: the kept bits (dense) or the kept nonzeros (sparse) make the rows
    monkeypatch.setattr(D, "_grid_keep", lambda *args: pytest.fail("remake hashed again"))
    monkeypatch.setattr(D, "entry_hashes", lambda *args: pytest.fail("remake hashed again"))
    for (a, b), rows in zip(spans, made):
        buffer = torch.full((b - a, part.x.shape[1]), 7.0, dtype=dtype)
        for again in (source.remake(a, b), source.remake(a, b, buffer)):
            assert again.view(torch.int16 if dtype == torch.bfloat16 else dtype).numpy().tobytes() == \
                full[a:b].view(torch.int16 if dtype == torch.bfloat16 else dtype).numpy().tobytes()
            assert torch.equal(again.isnan(), rows.isnan())
        assert again.data_ptr() == buffer.data_ptr()  # a reused buffer, written over
    evaluation = D.RowSource(GraphCache().context(part), 0.5, False, 1)
    assert evaluation.remake(0, 5).data_ptr() == part.x.data_ptr()  # no dropout: a view of the features


def test_gat_masks_are_independent_draws_at_the_keep_rate() -> None:
    """GAT's four dropout sites on a Cora-sized graph (p = 0.6, 30 epochs) draw what ``F.dropout`` draws:
    every entry kept with probability 0.4, independently of the other heads of its edge, of the previous
    epoch, and of the other sites; an edge's kept heads are Binomial(8, 0.4). Issue 32 asked whether the
    hashed masks explain GAT's gap to PyG on CiteSeer: they do not (docs/dorylus-accuracy.md, "GAT against
    PyG"), and a change to the hash that correlates heads, epochs or layers fails here."""
    p, keep, n, epochs = 0.6, 0.4, 2708, 30
    gen = torch.Generator().manual_seed(0)
    src, dst = torch.randint(0, n, (2, 10_556), generator=gen)
    vertices = torch.arange(n)
    edges = torch.cat([src * n + dst, vertices * (n + 1)])  # global edge ids, self loops included

    def kept(ids: torch.Tensor, width: int, site: int) -> torch.Tensor:
        """(epochs, len(ids), width) 0/1: site ``site``'s masks in epochs 0.. (one step per epoch)."""
        keys = [D.dropout_key(0, epoch, epoch, site) for epoch in range(epochs)]
        return torch.stack([D.dropout_mask(ids, width, p, key, torch.float64) != 0 for key in keys]).double()

    features, attention1, hidden, attention2 = (
        kept(vertices, 64, 0), kept(edges, 8, 1), kept(vertices, 64, 2), kept(edges, 1, 3)
    )

    def assert_rate(both: torch.Tensor, rate: float, what: str) -> None:
        bound = 5 * (rate * (1 - rate) / both.numel()) ** 0.5  # 5 standard errors
        assert abs(both.mean().item() - rate) < bound, f"{what}: {both.mean().item():.4f}, expected {rate}"

    for name, masks in {"features": features, "attention 1": attention1, "hidden": hidden,
                        "attention 2": attention2}.items():
        assert_rate(masks, keep, f"{name} keep rate")
        assert_rate(masks[1:] * masks[:-1], keep**2, f"{name}: kept in two consecutive epochs")
    for i in range(8):
        for j in range(i + 1, 8):
            assert_rate(attention1[..., i] * attention1[..., j], keep**2, f"heads {i} and {j} both kept")
    assert_rate(attention1[..., 0] * attention2[..., 0], keep**2, "an edge kept in both layers")
    assert_rate(features * hidden, keep**2, "a vertex entry kept at both vertex sites")
    counts = torch.bincount(attention1.sum(-1).long().flatten(), minlength=9).double()
    expected = counts.sum() * torch.tensor([binom.pmf(k, 8, keep) for k in range(9)], dtype=torch.float64)
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 37.0, f"kept heads per edge vs Binomial(8, 0.4): chi2 {chi2:.1f} (8 dof; p < 1e-5 above 37)"
