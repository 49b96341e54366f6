"""Graph-server memory: an answered request's tensors are freed at once; a server's peak stays in budget."""

from __future__ import annotations

import gc
import json
import time
import weakref
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from lightning_dorylus.data import partition_graph
from lightning_dorylus.data.synthetic import powerlaw_graph
from lightning_dorylus.executors import InlineExecutor, TensorOpRequest
from lightning_dorylus.executors.local import LocalPoolExecutor
from lightning_dorylus.graph import GhostExchange, GraphCache
from lightning_dorylus.nn import DorylusRuntime, GCNConv
from lightning_dorylus.nn.dropout import RowSource, dropout_key
from tests.dorylus.scripts.launch import run_script
from tests.process import REPO


def test_an_answered_request_is_freed_without_the_garbage_collector() -> None:
    """The fault layer kept each request in a call <-> attempt reference cycle, so its tensors (a first
    layer's input rows) lived until Python's next full collection: +90 MiB per epoch on a 200k-vertex graph
    server. With the collector off, the rows must be freed as soon as the caller lets go of them."""
    z = torch.randn(512, 64, dtype=torch.float64)
    weight = torch.randn(64, 8, dtype=torch.float64)
    rows = weakref.ref(z)
    with LocalPoolExecutor(num_workers=1) as executor:
        gc.collect()
        gc.disable()
        try:
            future = executor.submit(TensorOpRequest("apply_vertex.forward", {"z": z, "weight": weight},
                                                     {"activation": "relu"}))
            assert future.result(timeout=60)["h"].shape == (512, 8)
            del z, future
            deadline = time.monotonic() + 10  # the worker's reader thread lets go of the attempt just after
            while rows() is not None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert rows() is None, "the request's rows outlived it (held by a reference cycle)"
        finally:
            gc.enable()


class _RowsWatcher(InlineExecutor):
    """The inline executor, holding a weak reference to every ``apply_vertex.forward`` request's rows."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[weakref.ref] = []

    def submit(self, request: TensorOpRequest) -> Future[dict[str, torch.Tensor]]:
        if request.op == "apply_vertex.forward":
            self.rows.append(weakref.ref(request.tensors["z"]))
        return super().submit(request)


def test_a_first_layers_dropped_out_rows_are_not_kept_for_its_backward() -> None:
    """A weight-first first layer kept its input after dropout, ``(n_local, F_in)``, the widest tensor of
    the epoch, from the forward to the backward (256 MiB per server on the benchmark's graph, at the peak).
    Now each interval's rows live while their request is out; the backward makes them again from 1 bit per
    entry. Same output and gradients as the layer given the whole dropped-out input (float64)."""
    [part] = partition_graph(powerlaw_graph(300, 6, 12, 3, seed=0), 1, interval_size=64)
    part.x = part.x.double()
    graph = GraphCache().context(part)
    source = RowSource(graph, 0.5, True, dropout_key(0, 1, 1, 0))
    results = []
    for x in (source, source.full()):
        executor = _RowsWatcher()
        conv = GCNConv(12, 4).double()
        torch.manual_seed(0)
        conv.reset_parameters()
        conv.attach(DorylusRuntime(executor=executor, exchange=GhostExchange()))
        assert conv.order == "weight_first" and conv.takes_row_source
        gc.collect()
        gc.disable()
        try:
            out = conv(x, graph)
            if isinstance(x, RowSource):
                assert len(executor.rows) == 5  # one request per interval ...
                assert all(rows() is None for rows in executor.rows)  # ... none of their rows kept
            out.square().sum().backward()
        finally:
            gc.enable()
        results.append((out, conv.weight.grad))
    (out, grad), (out_full, grad_full) = results
    torch.testing.assert_close(out, out_full, rtol=0, atol=0)
    torch.testing.assert_close(grad, grad_full, rtol=0, atol=0)


# The budget of a graph server's peak resident memory above its size once torch, Lightning and the model are
# loaded (measured by scripts/memory_run.py), for the 2-layer GCN (hidden 16, dropout 0.5) over 6 epochs:
#     BASE_BYTES + BYTES_PER_FEATURE * n_local * features + BYTES_PER_EDGE * edges
# (n_local: the server's own vertices, features: the input width, edges: its partition's in-edges).
# Measured on the guard's graph (80,000 vertices, ~790k edges, 256 features, 2 servers; 40,000 vertices and
# ~395k edges each), per server: 121-141 MiB with the adjacency built in place and the first layer's rows not
# kept for the backward (issue 19); 150-153 MiB before that; 301-333 MiB with the request reference cycle
# that kept every request to the next garbage collection. From the same graph at 128 and 32 features the
# rise grows by ~4.6 B per local feature entry (the features themselves, 1 bit per entry of kept mask). The
# spread (20 MiB) is the first layer's interval rows in flight to the executor: at most all of them at once
# (one more copy of the features, 39 MiB here), hence 8 B per feature entry. The budget (160 MiB on this
# graph) leaves ~14 % above the highest measurement; it fails the reference cycle (and anything that keeps
# requests), but not every regression of a few tens of MiB, which the spread would hide.
BASE_BYTES = 64 << 20  # Lightning's fit, the gloo group, the executor's threads and pipes, allocator slack
BYTES_PER_FEATURE = 8  # the partition's input rows, and at most one more copy of them in flight per interval
BYTES_PER_EDGE = 48  # edge_index (16), the two CSR adjacencies (16), hidden-width rows per vertex (~10 edges)
NODES, AVG_DEGREE, FEATURES, EPOCHS = 80_000, 10, 256, 6


def memory_budget(n_local: int, features: int, edges: int) -> int:
    """Bytes a graph server's peak may rise above its resident size at the start of training."""
    return BASE_BYTES + BYTES_PER_FEATURE * n_local * features + BYTES_PER_EDGE * edges


@pytest.mark.multiprocess
@pytest.mark.slow
def test_graph_server_peak_memory_stays_within_budget(tmp_path: Path) -> None:
    """2 graph servers train 6 epochs; each one's peak rise must stay within :func:`memory_budget`."""
    run_script("memory_run.py", ["prepare", str(tmp_path), str(NODES), str(AVG_DEGREE), str(FEATURES)],
               timeout=600, cwd=REPO)
    partition_dir = json.loads((tmp_path / "prepared.json").read_text())["partition_dir"]
    out = run_script("memory_run.py", ["train", partition_dir, str(FEATURES), str(EPOCHS), str(tmp_path)],
                     timeout=600, cwd=REPO, nprocs=2)
    servers = [json.loads((tmp_path / f"memory_rank{r}.json").read_text()) for r in range(2)]
    assert sorted(s["rank"] for s in servers) == [0, 1], out[-3000:]
    for s in servers:
        budget = memory_budget(s["n_local"], s["features"], s["edges"])
        assert s["peak_rise"] <= budget, (
            f"graph server {s['rank']}: peak {s['peak_rise'] / 2**20:.0f} MiB above its start, budget "
            f"{budget / 2**20:.0f} MiB ({BASE_BYTES >> 20} MiB + {BYTES_PER_FEATURE} B x {s['n_local']} "
            f"vertices x {s['features']} features + {BYTES_PER_EDGE} B x {s['edges']} edges)")
