"""``DorylusLayer``: the base of a GNN layer written as Dorylus's graph and tensor operations.

A layer is composed from four verbs, named as in the paper, with PyG's names alongside:

* **SC** ``scatter`` — boundary rows to the graph servers that hold them as ghosts (torch.distributed P2P);
* **GA** ``gather`` — PyG's ``message`` + ``aggregate``: sparse aggregation over local + ghost rows
  (on the graph server);
* **AV** ``apply_vertex`` — PyG's ``update``/``lin``: dense per-vertex work, per interval on the executor;
* **AE** ``apply_edge`` — per-edge tensor work (GAT attention), per interval on the executor.

As PyG's ``MessagePassing.propagate`` alone picks the fused path, this class alone picks how the stages run:
a layer declares each stage once, by op name (a numpy op declared as an ``OpSpec`` in
``lightning_dorylus/ops/`` or registered by the user), and the stage methods below decide, from the
runtime, between the synchronous engine (layer by layer: the whole GA, then every interval's AV) and the
pipeline engine (``staleness`` 0 or S: GA and AV/AE interleaved per interval, a first layer's input rows
made per interval, the next epoch's requests sent ahead). A layer has no mode branches:

* :meth:`run_op` — AV/AE: ``op`` per interval on the executor, differentiable (any op);
* :meth:`gather_apply` — GA over the ``"gcn"``/``"mean"`` adjacency, then AV ``op`` on its result;
* :meth:`apply_gather` — AV ``x W`` per interval, then SC and GA over the GCN adjacency (PyG's order);
* :meth:`edge_gather` — AE ``op`` (attention per in-edge), dropout, then the attention-weighted GA.

The runtime (executor + ghost exchange) is injected by :class:`~lightning_dorylus.DorylusStrategy`; without it
(``strategy="auto"``: one process, one partition, no ghosts) a layer creates an inline executor on first use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_dorylus.executors import TensorOpExecutor, build_executor
from lightning_dorylus.graph import GhostExchange, GraphContext, attention_gather, gcn_gather
from lightning_dorylus.graph.stale import StaleGhostExchange
from lightning_dorylus.nn.dropout import RowSource, edge_ids, row_dropout
from lightning_dorylus.nn.edge_pipeline import EdgeDropout, apply_edge_gather
from lightning_dorylus.nn.functions import OpCall, apply_gather, gather_apply, ghost_gather, tensor_op
from lightning_dorylus.nn.row_apply import apply_rows
from lightning_dorylus.nn.runahead import RunAhead

ADJACENCIES = ("gcn", "mean")


@dataclass
class DorylusRuntime:
    """What a graph server lends its layers: where tensor ops run and how ghost rows move.

    Attributes:
        executor: Runs the AV/AE requests (and their backward ops).
        exchange: Moves boundary rows to ghosts (SC) and ghost gradients back (∇SC), synchronously.
        staleness: ``None``: synchronous layer-by-layer ops; ``S >= 0``: per-interval GA -> AV pipeline, and
            for ``S >= 1`` training SC/∇SC through ``stale_exchange`` (ghosts at most ``S`` epochs old).
        stale_exchange: The bounded-stale exchange (``S >= 1`` only).
        epoch: The training epoch the next forward belongs to (set by the strategy each step).
        runahead: The next epoch's first-layer requests sent early (``S >= 1``; :mod:`~.runahead`).
    """

    executor: TensorOpExecutor
    exchange: GhostExchange
    staleness: int | None = None
    stale_exchange: StaleGhostExchange | None = None
    epoch: int = 0
    runahead: RunAhead = field(default_factory=RunAhead)

    @property
    def pipelined(self) -> bool:
        """Whether layers run the per-interval GA -> AV pipeline (any ``staleness`` but ``None``)."""
        return self.staleness is not None

    @property
    def runs_ahead(self) -> bool:
        """Whether a training step may send the next epoch's first-layer requests early (``S >= 1``)."""
        return self.staleness is not None and self.staleness >= 1


class DorylusLayer(nn.Module):
    """Base class: holds the injected runtime and runs a layer's declared SC/GA/AV/AE stages, choosing the
    engine (synchronous or pipelined) in one place.

    Attributes:
        applies_first: Whether the layer's first stage is AV on its input rows (set by a subclass: GAT,
            weight-first GCN); in the pipeline engine such a layer takes a :class:`RowSource` input.
    """

    applies_first: bool = False

    def __init__(self) -> None:
        super().__init__()
        self._runtime: DorylusRuntime | None = None
        self.layer_index = 0

    def attach(self, runtime: DorylusRuntime | None, layer_index: int = 0) -> None:
        """Uses ``runtime`` for all later forwards (``None`` detaches: back to the lazy inline runtime).

        ``layer_index`` (the same on every graph server) tags this layer's stale SC messages.
        """
        self._runtime = runtime
        self.layer_index = layer_index

    @property
    def runtime(self) -> DorylusRuntime:
        """The injected runtime, or (single process) an inline executor created on first use."""
        if self._runtime is None:
            executor = build_executor("inline")
            executor.start()
            self._runtime = DorylusRuntime(executor=executor, exchange=GhostExchange())
        return self._runtime

    @property
    def takes_row_source(self) -> bool:
        """Whether ``forward`` accepts a :class:`~lightning_dorylus.nn.dropout.RowSource` for its input
        (rows made per interval as their requests go out, and not kept: the backward makes them again from
        their dropout masks): a layer whose first stage is AV on its input (:attr:`applies_first`), in
        either engine; a layer that needs its whole input at once: no."""
        return self.applies_first

    def _pipelines(self, graph: GraphContext) -> bool:
        """The one engine decision: interleave graph and tensor work per interval (pipeline engine, and
        the partition has intervals) or run stage after stage."""
        return self.runtime.pipelined and bool(graph.intervals)

    def _runahead(self) -> RunAhead | None:
        """Where a first layer's next-epoch requests go early (``staleness >= 1``, training); else None."""
        return self.runtime.runahead if self.runtime.runs_ahead and self.training else None

    def _call(self, op: str, graph: GraphContext, attrs: dict[str, Any] | None) -> OpCall:
        return OpCall(op, self.runtime.executor, graph.intervals, dict(attrs or {}))

    def run_op(
        self, op: str, graph: GraphContext, attrs: dict[str, Any] | None = None,
        **tensors: Tensor | RowSource | None,
    ) -> tuple[Tensor, ...]:
        """AV/AE: differentiable ``op`` per interval on the executor; outputs in the op's declared order.

        Args:
            op: A forward op's name (its numpy forward and backward declared once as an ``OpSpec``).
            graph: The partition (its intervals cut the rows).
            attrs: The op's JSON attributes (e.g. ``{"activation": "relu"}``).
            tensors: The op's inputs by name; ``None`` is an absent optional input. At most one may be a
                :class:`RowSource` (a first layer's dropped-out features, needing no gradient): its rows are
                made per interval just before each request goes out and not kept (the backward makes them
                again from their dropout masks, 1 bit per entry), and with ``staleness >= 1`` the next
                epoch's requests are sent during this one's backward.
        """
        sources = [name for name, t in tensors.items() if isinstance(t, RowSource)]
        if len(sources) > 1:
            raise ValueError(f"run_op({op!r}) takes at most one RowSource input; got {sources}")
        call = self._call(op, graph, attrs)
        if sources and graph.intervals:  # either engine: rows made per interval, remade in the backward
            (name,) = sources
            shared = {n: t for n, t in tensors.items() if n != name and t is not None}
            return apply_rows(call, tensors[name], name, self._runahead(), self.layer_index, **shared)  # type: ignore[arg-type]
        full = {n: t.full() if isinstance(t, RowSource) else t for n, t in tensors.items()}
        return tensor_op(call, **full)

    def gather_apply(
        self, adjacency: str, h_full: Tensor, op: str, gather_input: str, graph: GraphContext,
        attrs: dict[str, Any] | None = None, **tensors: Tensor | None,
    ) -> tuple[Tensor, ...]:
        """GA ``Z = A h_full`` (``adjacency``: ``"gcn"``, PyG's ``gcn_norm``, or ``"mean"``, GraphSAGE's mean;
        ``h_full``: local then ghost rows, after SC), then AV ``op`` with ``Z`` as its input ``gather_input``
        and ``tensors`` as the others. Pipeline engine: interval ``i``'s GA, then its request at once, while
        ``i + 1``'s GA runs; its backward adds each interval's ∇GA as the ∇AV results come back."""
        if adjacency not in ADJACENCIES:
            raise ValueError(f"adjacency={adjacency!r} is not supported; expected one of {ADJACENCIES}")
        call = self._call(op, graph, attrs)
        if self._pipelines(graph):
            return gather_apply(call, graph.blocks(adjacency, h_full.dtype), gather_input, h_full, **tensors)
        matrix = graph.gcn(h_full.dtype) if adjacency == "gcn" else graph.mean(h_full.dtype)
        return tensor_op(call, **{gather_input: gcn_gather(h_full, matrix)}, **tensors)

    def apply_gather(self, x: Tensor | RowSource, weight: Tensor, graph: GraphContext) -> Tensor:
        """AV ``P = x W`` per interval (``apply_vertex.forward``, no activation), SC ``P``, then GA ``Â P``
        over the GCN adjacency: ``(n_local, F_out)``. Pipeline engine: as each interval's ``P_i`` comes back
        the server adds its column block's share while later requests are out; then SC and the ghost
        columns' share; a :class:`RowSource` ``x`` is made per interval (and runs ahead, staleness >= 1)."""
        call = self._call("apply_vertex.forward", graph, {"activation": "none"})
        if not self._pipelines(graph):
            (p,) = self.run_op(call.op, graph, call.attrs, z=x, weight=weight)  # AV: (n_local, F_out)
            p_full = self.scatter(p, graph)  # SC: (n_local + n_ghost, F_out)
            return gcn_gather(p_full, graph.gcn(p_full.dtype))  # GA
        blocks = graph.column_blocks(weight.dtype)
        if isinstance(x, RowSource):
            p, z = apply_gather(call, blocks[:-1], weight, source=x, runahead=self._runahead(),
                                layer=self.layer_index)
        else:
            p, z = apply_gather(call, blocks[:-1], weight, x=x)
        if graph.partition.num_parts == 1:
            return z
        p_full = self.scatter(p, graph)  # SC: (n_local + n_ghost, F_out)
        n_local = graph.partition.n_local
        return z + ghost_gather(p_full[n_local:], blocks[-1], n_local)

    def edge_gather(
        self, op: str, h_full: Tensor, alpha_src_full: Tensor, alpha_dst: Tensor, graph: GraphContext,
        attrs: dict[str, Any] | None = None, dropout: float = 0.0, dropout_key: int | None = None,
    ) -> Tensor:
        """AE ``op`` (attention of each self-loop-augmented in-edge from its source score in
        ``alpha_src_full (n_full, H)`` and destination score ``alpha_dst (n_local, H)``), attention dropout
        (training, probability ``dropout``), then GA ``out_i = Σ_j attention_ij h_j`` per head over
        ``h_full (n_full, H, C)``: ``(n_local, H, C)``.

        The dropout mask of an edge hashes ``dropout_key`` and the edge's global ``(src, dst)``, the same
        whichever server owns ``dst``; ``None`` draws a key from torch's global generator. Pipeline engine:
        interval ``i``'s AE request in flight while the server drops out and gathers the ones before it."""
        call = self._call(op, graph, attrs)
        key = None  # the attention dropout's key, when it drops (training)
        if self.training and dropout > 0.0:
            key = dropout_key if dropout_key is not None else int(torch.randint(-(2**63), 2**63 - 1, ()))
        edges = graph.self_loops
        if self._pipelines(graph):
            drop = EdgeDropout(dropout, key, edge_ids(graph)) if key is not None else None
            return apply_edge_gather(call, edges, h_full, alpha_src_full, alpha_dst, drop)
        alpha_src_e = alpha_src_full.index_select(0, edges.src)  # (E', H): the server gathers source scores
        (attention,) = tensor_op(call, alpha_src_e=alpha_src_e, alpha_dst=alpha_dst, dst_ptr=edges.dst_ptr)
        if key is not None:
            attention = row_dropout(attention, edge_ids(graph), dropout, True, key)
        return attention_gather(h_full, attention, edges, graph.partition.n_local)

    def scatter(self, h_local: Tensor | RowSource, graph: GraphContext) -> Tensor:
        """SC: ``(n_local, ...) -> (n_local + n_ghost, ...)``: own rows, then ghost rows from their owners."""
        if isinstance(h_local, RowSource):
            h_local = h_local.full()
        runtime = self.runtime
        partition = graph.partition
        if (
            runtime.stale_exchange is not None
            and partition.num_parts > 1
            and self.training
            and torch.is_grad_enabled()
        ):
            return runtime.stale_exchange.fill_ghosts(h_local, partition, self.layer_index, runtime.epoch)
        return runtime.exchange.fill_ghosts(h_local, partition)

    def __getstate__(self) -> dict:
        # an executor (worker processes, sockets) must never be copied or pickled with the module
        state = self.__dict__.copy()
        state["_runtime"] = None
        return state
