"""Dorylus layers in one process: equal to PyG, one executor request per interval, mirrored backward."""

from __future__ import annotations

import copy
import dataclasses
from concurrent.futures import Future

import pytest
import torch
import torch_geometric.nn as pyg_nn
from torch_geometric.data import Data
from torch_geometric.utils import to_undirected

from lightning_dorylus.data import partition_graph
from lightning_dorylus.executors import InlineExecutor, TensorOpExecutor, TensorOpRequest
from lightning_dorylus.graph import GhostExchange, GraphCache, structure
from lightning_dorylus.graph.structure import TRANSPOSE_GROUPS, TransposedSum
from lightning_dorylus.nn import DorylusRuntime, GATConv, GCNConv, SAGEConv
from lightning_dorylus.nn.dropout import RowSource, dropout_key, feature_dropout
from lightning_dorylus.nn.edge_pipeline import EdgeDropout, apply_edge_gather
from lightning_dorylus.nn.functions import OpCall, RowInput, gather_apply, rows_op

N, F_IN = 60, 7


@pytest.fixture
def graph() -> Data:
    gen = torch.Generator().manual_seed(0)
    edge_index = to_undirected(torch.randint(0, N, (2, 240), generator=gen), num_nodes=N)
    edge_index = edge_index[:, edge_index[0] != edge_index[1]]
    x = torch.randn(N, F_IN, generator=gen, dtype=torch.float64)
    return Data(x=x, edge_index=edge_index, y=torch.zeros(N, dtype=torch.long))


class RecordingExecutor(TensorOpExecutor):
    """The inline executor, recording which op ran on which interval."""

    def __init__(self) -> None:
        self.inner = InlineExecutor()
        self.calls: list[tuple[str, int]] = []

    def submit(self, request: TensorOpRequest) -> Future[dict[str, torch.Tensor]]:
        self.calls.append((request.op, request.interval))
        return self.inner.submit(request)


@pytest.mark.parametrize("order", ["gather_first", "weight_first"])
def test_gcn_conv_matches_pyg(graph: Data, order: str) -> None:
    [part] = partition_graph(graph, 1, interval_size=16)
    assert part.num_intervals == 4
    ctx = GraphCache().context(part)
    conv = GCNConv(F_IN, 5, activation="none", order=order).double()
    assert conv.order == order
    ref = pyg_nn.GCNConv(F_IN, 5).double()
    with torch.no_grad():
        ref.lin.weight.copy_(conv.weight.T)
        conv.bias.copy_(torch.randn(5, dtype=torch.float64))
        ref.bias.copy_(conv.bias)
    x = graph.x[part.local_nodes].clone().requires_grad_()
    x_ref = graph.x.clone().requires_grad_()
    out, out_ref = conv(x, ctx), ref(x_ref, graph.edge_index)[part.local_nodes]
    torch.testing.assert_close(out, out_ref)
    out.square().sum().backward()
    out_ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad[part.local_nodes])
    torch.testing.assert_close(conv.weight.grad, ref.lin.weight.grad.T)
    torch.testing.assert_close(conv.bias.grad, ref.bias.grad)


@pytest.mark.parametrize("activation", ["relu", "none"])
def test_sage_conv_matches_pyg(graph: Data, activation: str) -> None:
    """GraphSAGE (mean) forward and every gradient equal PyG's ``SAGEConv``, on 4 intervals."""
    keep = graph.edge_index[1] != 3  # vertex 3 has no in-edges: its mean is 0 in both
    graph = Data(x=graph.x, edge_index=graph.edge_index[:, keep], y=graph.y)
    [part] = partition_graph(graph, 1, interval_size=16)
    ctx = GraphCache().context(part)
    conv = SAGEConv(F_IN, 5, activation=activation).double()
    ref = pyg_nn.SAGEConv(F_IN, 5, aggr="mean").double()
    with torch.no_grad():
        ref.lin_l.weight.copy_(conv.weight_l.T)
        ref.lin_l.bias.copy_(conv.bias)
        ref.lin_r.weight.copy_(conv.weight_r.T)
    x = graph.x[part.local_nodes].clone().requires_grad_()
    x_ref = graph.x.clone().requires_grad_()
    out_ref = ref(x_ref, graph.edge_index)
    out_ref = (out_ref.relu() if activation == "relu" else out_ref)[part.local_nodes]
    out = conv(x, ctx)
    torch.testing.assert_close(out, out_ref)
    out.square().sum().backward()
    out_ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad[part.local_nodes])
    torch.testing.assert_close(conv.weight_l.grad, ref.lin_l.weight.grad.T)
    torch.testing.assert_close(conv.weight_r.grad, ref.lin_r.weight.grad.T)
    torch.testing.assert_close(conv.bias.grad, ref.lin_l.bias.grad)


@pytest.mark.parametrize("concat", [True, False])
def test_gat_conv_matches_pyg(graph: Data, concat: bool) -> None:
    [part] = partition_graph(graph, 1, interval_size=16)
    ctx = GraphCache().context(part)
    conv = GATConv(F_IN, 4, heads=3, concat=concat).double()
    ref = pyg_nn.GATConv(F_IN, 4, heads=3, concat=concat).double()
    with torch.no_grad():
        ref.lin.weight.copy_(conv.weight.T)
        ref.att_src.copy_(conv.att_src[None])
        ref.att_dst.copy_(conv.att_dst[None])
        conv.bias.copy_(torch.randn_like(conv.bias))
        ref.bias.copy_(conv.bias)
    x = graph.x[part.local_nodes].clone().requires_grad_()
    x_ref = graph.x.clone().requires_grad_()
    out, out_ref = conv(x, ctx), ref(x_ref, graph.edge_index)[part.local_nodes]
    torch.testing.assert_close(out, out_ref)
    out.square().sum().backward()
    out_ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad[part.local_nodes])
    torch.testing.assert_close(conv.weight.grad, ref.lin.weight.grad.T)
    torch.testing.assert_close(conv.att_src.grad, ref.att_src.grad[0])
    torch.testing.assert_close(conv.att_dst.grad, ref.att_dst.grad[0])
    torch.testing.assert_close(conv.bias.grad, ref.bias.grad)


@pytest.mark.parametrize("per_interval", [False, True])
def test_gather_apply_backward_is_the_transposed_adjacency(graph: Data, per_interval: bool) -> None:
    """GA -> AV (``GatherApply``) is differentiable at both GA granularities: one whole-partition block
    (synchronous; it is the adjacency itself, no copy) and per-interval blocks (staleness set)."""
    [part] = partition_graph(graph, 1, interval_size=16)
    ctx = GraphCache().context(part)
    adjacency = ctx.gcn(torch.float64)
    for matrix in (adjacency.adj, adjacency.adj_t):  # int32 indices: half the resident index memory
        assert matrix.crow_indices().dtype == matrix.col_indices().dtype == torch.int32
    blocks = ctx.blocks("gcn", torch.float64, per_interval)
    assert len(blocks) == (4 if per_interval else 1)
    if not per_interval:
        assert blocks[0].adj is adjacency.adj and blocks[0].adj_t_rows is adjacency.adj_t
    call = OpCall("apply_vertex.forward", InlineExecutor(), ctx.intervals, {"activation": "none"})
    h = torch.randn(N, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t, v: gather_apply(call, blocks, "z", t, weight=v)[0], (h, w))
    dense = adjacency.adj.to_dense()
    torch.testing.assert_close(adjacency.adj_t.to_dense(), dense.T)
    torch.testing.assert_close(dense.sum(), dense.T.sum())


@pytest.mark.parametrize("kind", ["gcn", "mean"])
@pytest.mark.parametrize("block", [5, 1 << 18])
def test_adjacency_built_in_row_blocks_equals_the_whole_list_sort(graph: Data, kind: str, block: int,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Both CSR matrices, built in place a block of destination rows at a time (no copies of the edge list),
    are the whole-list sort's arrays bit for bit: self loops in the edge list (GCN drops them and adds
    one per vertex), ghosts, vertices without in-edges, blocks of a few entries; an edge list not sorted
    by destination takes the sort itself."""
    monkeypatch.setattr(structure, "BUILD_CHUNK", block)
    parts = partition_graph(graph, 2, partitioner="random", interval_size=16)
    src, dst = parts[0].edge_index[:, parts[0].edge_index[1] != 5]  # vertex 5: no in-edges
    loops = torch.tensor([0, 3, 3, 7])  # self loops (one twice), kept in destination order
    order = torch.sort(torch.cat([dst, loops]), stable=True).indices
    with_loops = dataclasses.replace(parts[0], edge_index=torch.stack([torch.cat([src, loops])[order],
                                                                       torch.cat([dst, loops])[order]]))
    shuffled = dataclasses.replace(parts[1], edge_index=parts[1].edge_index.flip(1))
    assert parts[1].n_ghost > 0
    for part in (*parts, with_loops, shuffled):
        for dtype in (torch.float32, torch.float64):
            if kind == "gcn":
                built = structure.gcn_adjacency(part, dtype)
                deg = (part.in_degree.to(torch.float64) + 1.0).rsqrt()
                sorted_ = structure._adjacency_by_sort(
                    part, lambda s, d, m, deg=deg, dtype=dtype: _times(deg[s] * deg[d], m).to(dtype), True)
            else:
                built = structure.mean_adjacency(part, dtype)
                inv = 1.0 / torch.bincount(part.edge_index[1], minlength=part.n_local).double().clamp_min(1)
                sorted_ = structure._adjacency_by_sort(
                    part, lambda s, d, m, inv=inv, dtype=dtype: _times(inv[d], m).to(dtype), False)
            for got, expected in ((built.adj, sorted_.adj), (built.adj_t, sorted_.adj_t)):
                assert got.shape == expected.shape
                for name in ("crow_indices", "col_indices", "values"):
                    assert torch.equal(getattr(got, name)(), getattr(expected, name)()), name
    diagonal = structure.gcn_adjacency(with_loops, torch.float64).adj.to_dense().diagonal()
    degree = with_loops.in_degree[: with_loops.n_local].double() + 1  # the stored global in-degree
    torch.testing.assert_close(diagonal, degree.reciprocal())  # one self loop of weight 1 each, normalised


def test_one_request_per_interval_forward_and_mirrored_backward(graph: Data) -> None:
    [part] = partition_graph(graph, 1, interval_size=16)
    executor = RecordingExecutor()
    conv = GCNConv(F_IN, 5).double()
    conv.attach(DorylusRuntime(executor=executor, exchange=GhostExchange()))
    out = conv(graph.x[part.local_nodes], GraphCache().context(part))
    assert executor.calls == [("apply_vertex.forward", i) for i in range(4)]
    out.sum().backward()
    assert executor.calls[4:] == [("apply_vertex.backward", i) for i in range(4)]

    executor.calls.clear()
    gat = GATConv(F_IN, 2, heads=2).double()
    gat.attach(DorylusRuntime(executor=executor, exchange=GhostExchange()))
    gat(graph.x[part.local_nodes], GraphCache().context(part)).sum().backward()
    ops = [op for op, _ in executor.calls]
    assert (
        ops
        == ["gat.project.forward"] * 4
        + ["apply_edge.forward"] * 4
        + ["apply_edge.backward"] * 4
        + ["gat.project.backward"] * 4
    )


def test_gcn_conv_auto_order_and_first_layer_skips_grad_z(graph: Data) -> None:
    assert GCNConv(8, 4).order == "weight_first"  # narrows: the weights go first, graph work is 4 wide
    assert GCNConv(4, 8).order == "gather_first"
    assert GCNConv(4, 4).order == "gather_first"
    [part] = partition_graph(graph, 1, interval_size=16)
    ctx = GraphCache().context(part)
    seen: list[dict] = []

    class Spy(InlineExecutor):
        def submit(self, request: TensorOpRequest) -> Future[dict[str, torch.Tensor]]:
            seen.append(request.attrs)
            return super().submit(request)

    x = graph.x[part.local_nodes].double()
    for order in ("gather_first", "weight_first"):
        conv = GCNConv(F_IN, 3, order=order).double()
        conv.attach(DorylusRuntime(executor=Spy(), exchange=GhostExchange()))
        seen.clear()
        out = conv(x, ctx)  # x needs no gradient: a first layer
        out.square().sum().backward()
        assert [a["needs_grad_z"] for a in seen if "has_bias" in a] == [False] * 4
        ref = GCNConv(F_IN, 3, order=order).double()
        ref.load_state_dict(conv.state_dict())
        x_req = x.clone().requires_grad_()
        ref(x_req, ctx).square().sum().backward()
        assert x_req.grad is not None
        torch.testing.assert_close(ref.weight.grad, conv.weight.grad)
    with pytest.raises(ValueError, match=r"order='sideways' is not supported; expected one of \('auto'"):
        GCNConv(3, 2, order="sideways")


def test_layer_without_runtime_creates_inline_executor_and_copies_drop_it(graph: Data) -> None:
    conv = GCNConv(F_IN, 2)
    assert isinstance(conv.runtime.executor, InlineExecutor)
    assert conv.runtime is conv.runtime  # created once
    clone = copy.deepcopy(conv)
    assert clone._runtime is None
    torch.testing.assert_close(clone.weight, conv.weight)


def test_ghost_rows_need_torch_distributed(graph: Data) -> None:
    part = partition_graph(graph, 2, interval_size=16)[0]
    conv = GCNConv(F_IN, 2).double()
    with pytest.raises(RuntimeError, match=r"partition 0 of 2 needs ghost rows .* torch.distributed is not"):
        conv(part.x, GraphCache().context(part))


def test_bad_layer_arguments() -> None:
    with pytest.raises(ValueError, match=r"activation='tanh' is not supported; expected one of \('relu'"):
        GCNConv(3, 2, activation="tanh")
    with pytest.raises(ValueError, match=r"heads=0 must be >= 1"):
        GATConv(3, 2, heads=0)
    with pytest.raises(ValueError, match=r"dropout=1.0 must be in \[0, 1\)"):
        GATConv(3, 2, dropout=1.0)


def test_input_rows_must_match_partition(graph: Data) -> None:
    [part] = partition_graph(graph, 1, interval_size=16)
    with pytest.raises(ValueError, match=r"h_local has 3 rows but partition 0 owns 60 vertices"):
        GCNConv(F_IN, 2).double()(torch.zeros(3, F_IN, dtype=torch.float64), GraphCache().context(part))


def test_graph_structures_are_built_once_per_partition(graph: Data) -> None:
    """Lightning's batch transfer makes a new GraphPartition each step; the cached structures survive it."""
    [part] = partition_graph(graph, 1, interval_size=16)
    cache = GraphCache()
    ctx = cache.context(part)
    adjacency = ctx.gcn(torch.float64)
    moved = part.to("cpu")
    again = cache.context(moved)
    assert again is ctx and again.gcn(torch.float64) is adjacency
    assert again.partition is moved  # features and masks come from the current batch
    assert ctx.intervals == [(0, 16), (16, 32), (32, 48), (48, 60)]
    [other] = partition_graph(graph, 1, interval_size=32)
    assert cache.context(other) is not ctx


def test_block_add_transposed_equals_the_compact_product_scattered(graph: Data) -> None:
    """The pipelined GA/∇GA accumulate each group of intervals with one sparse addmm over the full-height
    block; it is the compact product ``adj_t @ x`` added into rows ``cols``, bit for bit."""
    parts = partition_graph(graph, 2, interval_size=2)  # more intervals than groups
    ctx = GraphCache().context(parts[0])
    for blocks in (ctx.column_blocks(torch.float64)[:-1], ctx.blocks("gcn", torch.float64)):
        closing = [b for b in blocks if b.closes_group]
        assert 1 < len(closing) <= TRANSPOSE_GROUPS < len(blocks)  # groups of several intervals
        n = closing[0].adj_t_rows.size(0)
        assert all(b.adj_t_rows.shape == (n, b.adj_t.size(1)) for b in closing)
        assert all(b.adj_t.size(1) == b.group_rows[1] - b.group_rows[0] for b in closing)
        gen = torch.Generator().manual_seed(2)
        expected = torch.randn(n, 3, generator=gen, dtype=torch.float64)
        got, summed = expected.clone(), expected.clone()
        adder = TransposedSum(blocks, summed)
        for block in closing:
            x = torch.randn(block.adj_t.size(1), 3, generator=gen, dtype=torch.float64)
            expected.index_add_(0, block.cols, torch.sparse.mm(block.adj_t, x))
            assert block.add_transposed(got, x) is got
            a0 = block.group_rows[0]
            for b in blocks:  # the same rows, interval by interval
                if a0 <= b.rows[0] and b.rows[1] <= block.group_rows[1]:
                    adder.add(x[b.rows[0] - a0 : b.rows[1] - a0], b.rows[1])
        assert torch.equal(got, expected) and torch.equal(summed, expected)
        with pytest.raises(ValueError, match="does not close its group"):
            next(b for b in blocks if not b.closes_group).add_transposed(got, x)


@pytest.mark.parametrize("own_group", [False, True])
@pytest.mark.parametrize("groups", [1, 3, 100])
def test_interval_blocks_are_the_dense_adjacencys_rows_and_group_transposes(
    groups: int, own_group: bool,
) -> None:
    """Every row block is ``Â[a:b]`` and every group's compact transpose is ``Â[a0:b1][:, cols]ᵀ`` with
    ``cols`` the columns the group reaches, on intervals that leave gaps and start past 0, and with the last
    block in a group of its own (``own_group``: the ghost block of ``column_blocks``, built in the same pass):
    read off a dense matrix, whatever the build does, with CSR arrays in order."""
    gen = torch.Generator().manual_seed(5)
    n_rows, n_cols, nnz = 90, 130, 700
    dense = torch.zeros(n_rows, n_cols, dtype=torch.float64)
    rows = torch.randint(0, n_rows, (nnz,), generator=gen)
    cols = torch.randint(0, n_cols, (nnz,), generator=gen)
    dense[rows, cols] = torch.rand(nnz, generator=gen, dtype=torch.float64)
    transposed = dense.t().contiguous().to_sparse_csr()
    adjacency = structure.GCNAdjacency(adj=dense.to_sparse_csr(), adj_t=transposed)
    intervals = [(3, 10), (10, 31), (40, 41), (41, 77), (80, 90)]  # gaps at 0-3, 31-40 and 77-80
    if own_group:
        blocks = structure.interval_blocks(adjacency, intervals[:-1], groups, own_group=intervals[-1])
        assert blocks[-1].group_rows == intervals[-1] and blocks[-1].closes_group
    else:
        blocks = structure.interval_blocks(adjacency, intervals, groups)
    assert [b.rows for b in blocks] == intervals
    for block in blocks:
        a, b = block.rows
        assert torch.equal(block.adj.to_dense(), dense[a:b])
        if block.closes_group:
            a0, b1 = block.group_rows
            reached = dense[a0:b1].ne(0).any(0).nonzero().squeeze(1)
            assert torch.equal(block.cols, reached)
            assert torch.equal(block.adj_t.to_dense(), dense[a0:b1][:, reached].t())
            crow, col = block.adj_t.crow_indices(), block.adj_t.col_indices()
            assert all(bool((col[crow[i] : crow[i + 1]].diff() > 0).all()) for i in range(crow.numel() - 1))
            assert torch.equal(block.adj_t_rows.to_dense()[reached], block.adj_t.to_dense())
    runs = len(structure._group_ends(4, groups)) + 1 if own_group else min(groups, 5)  # 4 in 3 runs: 2 runs
    assert sum(b.closes_group for b in blocks) == runs


def test_feature_dropout_draws_only_nonzeros_with_dense_dropout_distribution(graph: Data) -> None:
    [part] = partition_graph(graph, 1, interval_size=16)
    n = part.n_local
    x = torch.zeros(n, 500)
    x[:, ::10] = torch.rand(n, 50) + 0.5  # 50 nonzeros per row: 10 %
    part.x = x
    ctx = GraphCache().context(part)
    index, values = ctx.feature_nonzeros()
    assert index.numel() == 50 * n and ctx.feature_nonzeros()[0] is index  # computed once
    torch.testing.assert_close(values, x.reshape(-1)[index])
    key = dropout_key(0, 0)
    out = feature_dropout(ctx, 0.5, training=True, key=key)
    assert out.shape == x.shape and torch.all(out[x == 0] == 0)
    kept = out[x != 0] != 0
    torch.testing.assert_close(out[x != 0][kept], x[x != 0][kept] * 2)
    assert 0.4 < kept.float().mean() < 0.6
    assert feature_dropout(ctx, 0.5, training=False, key=key) is x
    assert torch.all(feature_dropout(ctx, 1.0, training=True, key=key) == 0)
    with pytest.raises(ValueError, match=r"dropout probability p=1.5 must be in \[0, 1\]"):
        feature_dropout(ctx, 1.5, training=True, key=key)
    part.x = torch.rand(n, 50) + 0.1  # dense: every entry hashed, same statistics
    ctx = GraphCache().context(part)
    assert ctx.feature_nonzeros() is None
    dense = feature_dropout(ctx, 0.5, training=True, key=key)
    assert 0.4 < (dense != 0).float().mean() < 0.6


def test_row_source_makes_the_feature_dropout_per_interval(graph: Data) -> None:
    """The weight-first pipeline's per-interval input equals the rows of the whole-partition dropout
    (sparse and dense features, training and eval)."""
    [part] = partition_graph(graph, 1, interval_size=16)
    sparse = torch.zeros(part.n_local, 40)
    sparse[:, ::8] = torch.rand(part.n_local, 5) + 0.5
    for x in (sparse, torch.rand(part.n_local, 40) + 0.1):
        part.x = x
        ctx = GraphCache().context(part)
        for training in (True, False):
            source = RowSource(ctx, 0.5, training, dropout_key(3, 1))
            full = source.full()
            torch.testing.assert_close(full, feature_dropout(ctx, 0.5, training, dropout_key(3, 1)))
            cuts = [(0, 7), (7, 8), (8, 31), (31, part.n_local)]
            torch.testing.assert_close(torch.cat([source.rows(a, b) for a, b in cuts]), full, rtol=0, atol=0)


@pytest.mark.parametrize("layer", ["gcn", "gcn_weight_first", "sage"])
def test_pipelined_gather_apply_equals_layer_by_layer(graph: Data, layer: str) -> None:
    """The engine's per-interval GA -> AV (staleness 0; weight-first GCN: AV -> GA) gives the synchronous
    layer's values and gradients, with one forward and one backward request per interval."""
    [part] = partition_graph(graph, 1, interval_size=16)
    ctx = GraphCache().context(part)
    torch.manual_seed(0)
    conv = {"gcn": lambda: GCNConv(F_IN, 5, order="gather_first"), "sage": lambda: SAGEConv(F_IN, 5),
            "gcn_weight_first": lambda: GCNConv(F_IN, 5, order="weight_first")}[layer]().double()
    piped = copy.deepcopy(conv)
    executor = RecordingExecutor()  # epoch 1: epoch 0 gathers whole (test_a_pipelined_first_epoch_...)
    piped.attach(DorylusRuntime(executor=executor, exchange=GhostExchange(), staleness=0, epoch=1))
    results = []
    for module in (conv, piped):
        x = graph.x[part.local_nodes].clone().requires_grad_()
        out = module(x, ctx)
        out.square().sum().backward()
        results.append((out, x.grad, [p.grad for p in module.parameters()]))
    (out, gx, gp), (out_p, gx_p, gp_p) = results
    if layer == "gcn_weight_first":  # GA summed per column block as the intervals' rows come back
        torch.testing.assert_close(out_p, out)
    else:
        torch.testing.assert_close(out_p, out, rtol=0, atol=0)  # same rows, same sums
    torch.testing.assert_close(gx_p, gx)  # the per-interval ∇GA adds in another order
    for a, b in zip(gp_p, gp):
        torch.testing.assert_close(a, b)
    op = "sage.update" if layer == "sage" else "apply_vertex"
    expected = [(f"{op}.forward", i) for i in range(4)] + [(f"{op}.backward", i) for i in range(4)]
    assert executor.calls == expected


@pytest.mark.parametrize("order", ["gather_first", "weight_first"])
@pytest.mark.parametrize("build_ahead", [True, False])
def test_a_pipelined_first_epoch_gathers_whole_while_its_blocks_are_built_beside_it(
    graph: Data, order: str, build_ahead: bool
) -> None:
    """Epoch 0 of a pipelined mode runs GA in one product (no per-interval block used) and builds the
    per-interval blocks on a background thread (unless ``build_ahead=False``: ``intervals="auto"`` re-cuts
    them); epoch 1 takes those blocks, equal array for array to a foreground build, and gives the same
    values and gradients up to the order of the sums. Requests go out per interval in both epochs."""
    [part] = partition_graph(graph, 1, interval_size=16)
    ctx = GraphCache().context(part)
    torch.manual_seed(0)
    conv = GCNConv(F_IN, 5, order=order).double()
    executor = RecordingExecutor()
    runtime = DorylusRuntime(executor=executor, exchange=GhostExchange(), staleness=0,
                             build_ahead=build_ahead)
    conv.attach(runtime)
    kind = "rows" if order == "gather_first" else "columns"
    results = []
    for epoch in (0, 1):
        runtime.epoch = epoch
        x = graph.x[part.local_nodes].clone().requires_grad_()
        out = conv(x, ctx)
        out.square().sum().backward()
        results.append((out.detach(), x.grad, [p.grad.clone() for p in conv.parameters()]))
        conv.zero_grad()
        built = set(ctx._blocks) | set(ctx._column_blocks)
        if epoch == 0:
            assert built == ({("gcn", torch.float64, False)} if kind == "rows" else {(torch.float64, False)})
            assert set(ctx._building) == ({(kind, "gcn", torch.float64)} if build_ahead else set())
        else:
            assert ("gcn", torch.float64, True) in built or (torch.float64, True) in built
            assert not ctx._building  # taken (or, without build_ahead, built now)
    assert executor.calls[:4] == [("apply_vertex.forward", i) for i in range(4)]
    assert executor.calls[8:12] == executor.calls[:4]  # epoch 1: per interval as well
    (out0, gx0, gp0), (out1, gx1, gp1) = results
    torch.testing.assert_close(out1, out0)
    torch.testing.assert_close(gx1, gx0)
    for a, b in zip(gp1, gp0):
        torch.testing.assert_close(a, b)
    adjacency = ctx.gcn(torch.float64)
    foreground = (structure.interval_blocks(adjacency, ctx.intervals) if kind == "rows"
                  else structure.column_blocks(adjacency, ctx.intervals))
    taken = ctx.blocks("gcn", torch.float64) if kind == "rows" else ctx.column_blocks(torch.float64)
    for mine, theirs in zip(taken, foreground, strict=True):
        assert mine.rows == theirs.rows and mine.group_rows == theirs.group_rows
        for name in ("adj", "adj_t", "adj_t_rows"):
            a, b = getattr(mine, name), getattr(theirs, name)
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a.to_dense(), b.to_dense())


def test_build_ahead_names_bad_arguments_and_a_re_cut_drops_a_pending_build(graph: Data) -> None:
    [part] = partition_graph(graph, 1, interval_size=16)
    ctx = GraphCache().context(part)
    with pytest.raises(ValueError, match=r"blocks='diagonal': expected 'rows' or 'columns'"):
        ctx.build_ahead("diagonal", "gcn", torch.float64)
    with pytest.raises(ValueError, match=r"kind='sum': expected 'gcn' or 'mean'"):
        ctx.build_ahead("rows", "sum", torch.float64)
    ctx.build_ahead("rows", "mean", torch.float64)
    ctx.build_ahead("rows", "mean", torch.float64)  # already under way: not started twice
    assert list(ctx._building) == [("rows", "mean", torch.float64)]
    ctx.set_num_intervals(2)  # blocks of the old intervals: never taken
    assert not ctx._building
    assert [b.rows for b in ctx.blocks("mean", torch.float64)] == ctx.intervals == [(0, 30), (30, 60)]


@pytest.mark.parametrize("concat", [True, False])
def test_pipelined_gat_equals_layer_by_layer(graph: Data, concat: bool) -> None:
    """The one AE -> attention dropout -> GA node (``ApplyEdgeGather``) cut in 4 intervals (staleness 0)
    gives the values and gradients of the whole layer at once (one interval, synchronous) (2 heads,
    dropout 0.5: masks hashed from global edge ids, so per-interval masks are the whole layer's; the last
    interval shorter), with one request per interval and op."""
    [part] = partition_graph(graph, 1, interval_size=16)
    ctx = GraphCache().context(part)
    assert [b - a for a, b in ctx.intervals] == [16, 16, 16, 12]
    [whole_part] = partition_graph(graph, 1, interval_size=N)
    whole = GraphCache().context(whole_part)
    assert whole.intervals == [(0, N)] and torch.equal(whole_part.local_nodes, part.local_nodes)
    torch.manual_seed(0)
    conv = GATConv(F_IN, 3, heads=2, concat=concat, dropout=0.5).double()
    with torch.no_grad():
        conv.bias.copy_(torch.randn_like(conv.bias))
    piped = copy.deepcopy(conv)
    executor = RecordingExecutor()
    piped.attach(DorylusRuntime(executor=executor, exchange=GhostExchange(), staleness=0))
    key = dropout_key(7, 1)
    results = []
    for module, context in ((conv, whole), (piped, ctx)):
        x = graph.x[part.local_nodes].clone().requires_grad_()
        out = module(x, context, dropout_key=key)
        out.square().sum().backward()
        results.append((out, x.grad, {n: p.grad for n, p in module.named_parameters()}))
    (out, gx, gp), (out_p, gx_p, gp_p) = results
    assert out.shape == (N, 6 if concat else 3)
    assert "ApplyEdgeGatherBackward" in _autograd_nodes(out_p) & _autograd_nodes(out)  # one implementation
    without = GATConv(F_IN, 3, heads=2, concat=concat, dropout=0.0).double()
    without.load_state_dict(conv.state_dict())
    assert not torch.allclose(without(graph.x[part.local_nodes], ctx), out)  # the dropout really drops
    torch.testing.assert_close(out_p, out, rtol=0, atol=0)  # each destination's edges, in the same order
    torch.testing.assert_close(gx_p, gx, rtol=1e-9, atol=1e-12)  # ∇GA / ∇AE summed per interval
    assert set(gp_p) == {"weight", "att_src", "att_dst", "bias"}
    for name, grad in gp.items():
        torch.testing.assert_close(gp_p[name], grad, rtol=1e-9, atol=1e-12)
    ops = ["gat.project.forward", "apply_edge.forward", "apply_edge.backward", "gat.project.backward"]
    assert executor.calls == [(op, i) for op in ops for i in range(4)]

    # a first layer: the features' dropout made per interval as the AV requests go out (RowSource), in
    # every mode, by the same TensorOp node; the backward makes the rows again from their masks
    source = RowSource(ctx, 0.5, True, dropout_key(7, 0))
    assert piped.takes_row_source and conv.takes_row_source
    outs = []
    for module, x in ((conv, source.full()), (conv, source), (piped, source)):
        module.zero_grad()
        out = module(x, ctx, dropout_key=key)
        rows = _row_inputs(out)
        out.square().sum().backward()
        outs.append((out, rows, {n: p.grad for n, p in module.named_parameters()}))
    (out, rows, gp), *with_source = outs
    assert rows == []  # a tensor input
    for out_s, rows_s, gp_s in with_source:
        assert [(r.source, r.name) for r in rows_s] == [(source, "x")]  # the rows made per interval
        torch.testing.assert_close(out_s, out, rtol=0, atol=0)
        for name, grad in gp.items():
            torch.testing.assert_close(gp_s[name], grad, rtol=1e-9, atol=1e-12)


def test_gat_first_layer_runs_ahead_on_one_stashed_version(graph: Data) -> None:
    """staleness=1: a GAT first layer's backward sends the next step's ``gat.project`` requests with the
    parameters as they are then (``W_0``); after the optimizer's update (``W_1``) the next forward takes
    them (no new projection request) and its backward sends ``W_0`` again, not ``W_1``: output and every
    gradient equal the synchronous layer's with the projection's parameters at ``W_0`` (bias at ``W_1``)."""
    [part] = partition_graph(graph, 1, interval_size=16)
    ctx = GraphCache().context(part)
    torch.manual_seed(0)
    piped = GATConv(F_IN, 3, heads=2).double()
    ref = copy.deepcopy(piped)
    executor = RecordingExecutor()
    runtime = DorylusRuntime(executor=executor, exchange=GhostExchange(), staleness=1)
    piped.attach(runtime)
    keys = dropout_key(7, 0), dropout_key(7, 1)
    piped(RowSource(ctx, 0.5, True, keys[0], keys[1]), ctx).square().sum().backward()
    ops = ["gat.project.forward", "apply_edge.forward", "apply_edge.backward", "gat.project.backward"]
    assert executor.calls == [(op, i) for op in [*ops, "gat.project.forward"] for i in range(4)]
    with torch.no_grad():  # the optimizer's step, in place
        for param in piped.parameters():
            param.add_(torch.randn_like(param))
    ref.bias.data.copy_(piped.bias)  # added after GA, on the server: always the current version
    piped.zero_grad()
    executor.calls.clear()
    source = RowSource(ctx, 0.5, True, keys[1])  # the last step: nothing more sent ahead
    out = piped(source, ctx)
    out.square().sum().backward()
    assert executor.calls == [(op, i) for op in ops[1:] for i in range(4)]
    assert (runtime.runahead.used, runtime.runahead.dropped, runtime.runahead.pending) == (1, 0, {})
    out_ref = ref(source.full(), ctx)
    out_ref.square().sum().backward()
    torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-12)
    for name, param in ref.named_parameters():
        torch.testing.assert_close(dict(piped.named_parameters())[name].grad, param.grad, rtol=1e-9,
                                   atol=1e-12)
    current = copy.deepcopy(piped).requires_grad_(False)
    current.attach(None)
    assert not torch.allclose(current(source.full(), ctx), out)  # W_1 really differs from W_0


def test_pipelined_gat_functions_name_bad_arguments(graph: Data) -> None:
    [part] = partition_graph(graph, 1, interval_size=16)
    ctx = GraphCache().context(part)
    edges, n = ctx.self_loops, part.n_local
    call = OpCall("apply_edge.forward", InlineExecutor(), ctx.intervals)
    h, a_dst = torch.zeros(n, 2, 3), torch.zeros(n, 2)
    with pytest.raises(ValueError, match=r"h_full \(60, 6\) must be \(n, H, C\)"):
        apply_edge_gather(call, edges, h.view(n, 6), a_dst, a_dst)
    with pytest.raises(ValueError, match=r"alpha_src_full \(60, 3\) \(n, H\) with the same n and H"):
        apply_edge_gather(call, edges, h, torch.zeros(n, 3), a_dst)
    bad = EdgeDropout(0.5, 1, torch.zeros(3, dtype=torch.long))
    expected = rf"dropout.edge_ids has shape \(3,\); expected \({edges.src.numel()},\) \(one id per in-edge\)"
    with pytest.raises(ValueError, match=expected):
        apply_edge_gather(call, edges, h, a_dst, a_dst, bad)
    source = RowSource(ctx, 0.0, False, 0)
    with pytest.raises(ValueError, match="rows_op needs at least one interval"):
        rows_op(OpCall("gat.project.forward", InlineExecutor(), []), RowInput(source, "x"),
                weight=torch.zeros(7, 6))


def _times(value: torch.Tensor, multiplicity: torch.Tensor | None) -> torch.Tensor:
    """An adjacency entry's value times its multiplicity (copies of an edge; ``None``: one each)."""
    return value if multiplicity is None else value * multiplicity


def _nodes(t: torch.Tensor) -> set:
    """The autograd nodes ``t`` was computed through."""
    seen, todo = set(), [t.grad_fn]  # every node (two nodes of one type may lead to different ones)
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(fn for fn, _ in node.next_functions)
    return seen


def _autograd_nodes(t: torch.Tensor) -> set[str]:
    """Names of the autograd nodes ``t`` was computed through."""
    return {type(node).__name__ for node in _nodes(t)}


def _row_inputs(t: torch.Tensor) -> list[RowInput]:
    """The row inputs made per interval of the ``TensorOp`` nodes ``t`` was computed through."""
    return [n.rows for n in _nodes(t) if type(n).__name__ == "TensorOpBackward" and n.rows is not None]


def test_run_ahead_takes_one_epoch_of_the_bound_when_ghosts_are_stale() -> None:
    """One server (no ghosts): the first layer runs ahead from ``S = 1``. Several servers: a ghost read
    ``a`` epochs old was made from weights ``a`` updates older than the run-ahead's, so the run-ahead needs
    ``S >= 2`` and the ghosts get ``S - 1`` (``S = 1``: stale ghosts only, no run-ahead)."""
    from lightning_dorylus.nn.base import ghost_staleness, runs_ahead

    assert [runs_ahead(s, stale_ghosts=False) for s in (None, 0, 1, 2)] == [False, False, True, True]
    assert [runs_ahead(s, stale_ghosts=True) for s in (None, 0, 1, 2, 3)] == [False, False, False, True, True]
    assert [ghost_staleness(s) for s in (1, 2, 3)] == [1, 1, 2]
    one = DorylusRuntime(executor=RecordingExecutor(), exchange=GhostExchange(), staleness=1)
    several = DorylusRuntime(executor=RecordingExecutor(), exchange=GhostExchange(), staleness=1,
                             stale_exchange=object())  # type: ignore[arg-type]
    assert one.runahead_for(training=True) is one.runahead and one.runahead_for(training=False) is None
    assert several.runahead_for(training=True) is None
