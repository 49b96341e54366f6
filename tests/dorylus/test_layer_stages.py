"""``DorylusLayer``'s stage methods: a layer declares its stages once, each stage has one implementation, and
the base class alone reads the mode (GA in one whole-partition product under ``staleness=None``, per
interval under ``staleness >= 0``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn
from torch_geometric.data import Data
from torch_geometric.utils import to_undirected

from lightning_dorylus.data import partition_graph
from lightning_dorylus.executors import InlineExecutor
from lightning_dorylus.graph import GhostExchange, GraphCache, GraphContext
from lightning_dorylus.nn import DorylusLayer, DorylusRuntime
from lightning_dorylus.nn.dropout import RowSource, dropout_key

N, F_IN, F_OUT = 50, 6, 4


class UserGCN(DorylusLayer):
    """A user's layer, one class with no mode branch: SC, then GA over Â fused with AV ``act(Z W + b)``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(F_IN, F_OUT, dtype=torch.float64))
        self.bias = nn.Parameter(torch.randn(F_OUT, dtype=torch.float64))

    def forward(self, x: Tensor, graph: GraphContext) -> Tensor:
        h_full = self.scatter(x, graph)
        return self.gather_apply("gcn", h_full, "apply_vertex.forward", "z", graph, {"activation": "elu"},
                                 weight=self.weight, bias=self.bias)[0]


@pytest.fixture
def context() -> GraphContext:
    gen = torch.Generator().manual_seed(1)
    edge_index = to_undirected(torch.randint(0, N, (2, 200), generator=gen), num_nodes=N)
    edge_index = edge_index[:, edge_index[0] != edge_index[1]]  # the layers add self loops themselves
    x = torch.randn(N, F_IN, generator=gen, dtype=torch.float64)
    [part] = partition_graph(Data(x=x, edge_index=edge_index, y=torch.zeros(N, dtype=torch.long)), 1,
                             interval_size=16)
    assert part.num_intervals == 4
    return GraphCache().context(part)


def test_user_layer_runs_both_modes_from_one_declaration(context: GraphContext) -> None:
    """The same class gives the same values and gradients synchronously and pipelined (float64), through
    the one GA -> AV node; the mode only sets its GA granularity: one block that is the adjacency itself
    under ``staleness=None``, one per interval under ``staleness=0``."""
    sync = UserGCN()
    piped = copy.deepcopy(sync)
    piped.attach(DorylusRuntime(executor=InlineExecutor(), exchange=GhostExchange(), staleness=0,
                                epoch=1))  # from epoch 1 on: epoch 0 gathers whole while the blocks are built
    results = []
    for layer in (sync, piped):
        x = context.partition.x.clone().requires_grad_()
        out = layer(x, context)
        out.square().sum().backward()
        results.append((out, x.grad, layer.weight.grad, layer.bias.grad, type(out.grad_fn).__name__))
        if layer is sync:  # synchronous: no per-interval copy of the adjacency was built (the memory)
            assert set(context._blocks) == {("gcn", torch.float64, False)}
    (out, *grads, node), (out_p, *grads_p, node_p) = results
    torch.testing.assert_close(out_p, out, rtol=0, atol=0)  # the same rows summed in the same order
    for a, b in zip(grads_p, grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)  # ∇GA adds per interval
    assert node == node_p == "GatherApplyBackward"  # one implementation
    whole, per_interval = (context.blocks("gcn", torch.float64, p) for p in (False, True))
    assert len(whole) == 1 and whole[0].adj is context.gcn(torch.float64).adj and len(per_interval) == 4
    assert not sync.takes_row_source and not piped.takes_row_source  # its first stage is not AV


def test_stage_methods_name_bad_arguments(context: GraphContext) -> None:
    layer = UserGCN()
    h = context.partition.x
    expected = r"adjacency='sum' is not supported; expected one of \('gcn', 'mean'\)"
    with pytest.raises(ValueError, match=expected):
        layer.gather_apply("sum", h, "apply_vertex.forward", "z", context, weight=layer.weight)
    source = RowSource(context, 0.5, True, dropout_key(0, 0))
    with pytest.raises(ValueError, match=r"takes at most one RowSource input; got \['z', 'weight'\]"):
        layer.run_op("apply_vertex.forward", context, z=source, weight=source)  # type: ignore[arg-type]
