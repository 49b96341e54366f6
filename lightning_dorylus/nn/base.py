"""``DorylusLayer``: the base of a GNN layer written as Dorylus's graph and tensor operations.

A layer is composed from four verbs, named as in the paper, with PyG's names alongside:

* **SC** ``scatter`` — boundary rows to the graph servers that hold them as ghosts (torch.distributed P2P);
* **GA** ``gather`` — PyG's ``message`` + ``aggregate``: sparse aggregation over local + ghost rows
  (on the graph server);
* **AV** ``apply_vertex`` — PyG's ``update``/``lin``: dense per-vertex work, per interval on the executor;
* **AE** ``apply_edge`` — per-edge tensor work (GAT attention), per interval on the executor.

As PyG's ``MessagePassing.propagate`` alone picks the fused path, this class alone picks how the stages run:
a layer declares each stage once, by op name (a numpy op declared as an ``OpSpec`` in
``lightning_dorylus/ops/`` or registered by the user). There is one engine: each stage has one
implementation (one autograd node: SC ``_Scatter``; AV/AE alone ``TensorOp``, its row input a tensor or made
per interval; GA+AV ``GatherApply``; AV+GA ``ApplyGather`` with ``column_gather``; AE+GA ``ApplyEdgeGather``),
every interval's request is submitted before any is waited for, and the mode is a parameter read in one
place, :class:`DorylusRuntime` (its ``staleness``):

* the GA granularity (:attr:`DorylusRuntime.pipelined`): synchronous (``staleness=None``) runs a layer's GA
  as one whole-partition product (no per-interval copies of the adjacency) before its requests go out;
  ``staleness`` 0 or S per interval, so the GA of interval ``i + 1`` overlaps the request of ``i`` -- from
  epoch 1 on: epoch 0 runs whole while the per-interval blocks are built beside it
  (:meth:`DorylusLayer._per_interval`);
* the ghost exchange (:meth:`DorylusRuntime.ghost_exchange`): this epoch's ghosts, or (``S >= 1``,
  training) ghosts up to ``S`` epochs old;
* the run-ahead (:meth:`DorylusRuntime.runahead_for`): ``S >= 1``, training: a first layer's next-epoch
  requests sent during this epoch's backward.

The stage methods, with no mode branches:

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
from lightning_dorylus.graph import GhostExchange, GraphContext
from lightning_dorylus.graph.stale import StaleGhostExchange
from lightning_dorylus.nn.dropout import RowSource, edge_ids
from lightning_dorylus.nn.edge_pipeline import EdgeDropout, apply_edge_gather
from lightning_dorylus.nn.functions import (
    OpCall,
    RowInput,
    apply_gather,
    column_gather,
    gather_apply,
    rows_op,
    tensor_op,
)
from lightning_dorylus.nn.runahead import RunAhead

ADJACENCIES = ("gcn", "mean")


def runs_ahead(staleness: int | None, stale_ghosts: bool) -> bool:
    """Whether a first layer sends the next epoch's requests early under the bound ``staleness``.

    The run-ahead's forward uses the weights one update behind, and a ghost row read ``a`` epochs old was
    computed by its owner from weights ``a`` updates older still: with both, a gradient can rest on weights
    ``1 + a`` updates behind. So the run-ahead takes one epoch of the bound and the ghosts get the rest
    (:func:`ghost_staleness`): with stale ghosts (more than one graph server) it needs ``S >= 2``; on one
    server (no ghosts) ``S >= 1``. On 2 servers at ``S = 1`` both together cost an epoch more to the
    target (100k-vertex benchmark graph: 10 epochs against 9) and the run-ahead hides one round trip.
    """
    if staleness is None or staleness < 1:
        return False
    return staleness >= 2 or not stale_ghosts


def ghost_staleness(staleness: int) -> int:
    """How many epochs old a ghost read may be under the bound ``staleness >= 1`` (several graph servers):
    ``S`` at ``S = 1`` (no run-ahead), ``S - 1`` from ``S = 2`` on (the run-ahead takes one epoch)."""
    return staleness if staleness == 1 else staleness - 1


@dataclass
class DorylusRuntime:
    """What a graph server lends its layers: where tensor ops run and how ghost rows move.

    Attributes:
        executor: Runs the AV/AE requests (and their backward ops).
        exchange: Moves boundary rows to ghosts (SC) and ghost gradients back (∇SC), synchronously.
        staleness: The mode. ``None`` (synchronous): each layer's GA in one whole-partition product;
            ``S >= 0``: GA per interval, overlapping the requests; ``S >= 1``: also, while training, SC/∇SC
            through ``stale_exchange`` (ghosts at most :func:`ghost_staleness` epochs old) and, where
            :func:`runs_ahead`, the first layer's run-ahead (weights one update behind).
        stale_exchange: The bounded-stale exchange (``S >= 1`` only).
        epoch: The training epoch the next forward belongs to (set by the strategy each step).
        runahead: The next epoch's first-layer requests sent early (:func:`runs_ahead`; :mod:`~.runahead`).
        build_ahead: Whether a pipelined mode's epoch 0 builds the per-interval blocks in the background
            (``False`` when the intervals are re-cut after epoch 0, ``intervals="auto"``: those blocks
            would never be used).
    """

    executor: TensorOpExecutor
    exchange: GhostExchange
    staleness: int | None = None
    stale_exchange: StaleGhostExchange | None = None
    epoch: int = 0
    runahead: RunAhead = field(default_factory=RunAhead)
    build_ahead: bool = True

    @property
    def pipelined(self) -> bool:
        """Whether GA runs per interval, overlapping the requests (any ``staleness`` but ``None``), or as one
        whole-partition product before them (synchronous: no per-interval copies of the adjacency)."""
        return self.staleness is not None

    def ghost_exchange(self, training: bool) -> GhostExchange:
        """Where SC reads ghost rows and ∇SC ghost gradients: up to ``S`` epochs old while training with
        ``S >= 1``; else (evaluation, synchronous, staleness 0) this epoch's."""
        if self.stale_exchange is not None and training and torch.is_grad_enabled():
            return self.stale_exchange
        return self.exchange

    def runahead_for(self, training: bool) -> RunAhead | None:
        """Where a first layer's next-epoch requests go early (training, :func:`runs_ahead`), or ``None``."""
        ahead = training and runs_ahead(self.staleness, self.stale_exchange is not None)
        return self.runahead if ahead else None


class DorylusLayer(nn.Module):
    """Base class: holds the injected runtime and runs a layer's declared SC/GA/AV/AE stages, one
    implementation each, with the mode read from the runtime.

    Attributes:
        applies_first: Whether the layer's first stage is AV on its input rows (set by a subclass: GAT,
            weight-first GCN); such a layer takes a :class:`RowSource` input.
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
        every mode; a layer that needs its whole input at once: no."""
        return self.applies_first

    def _per_interval(self, graph: GraphContext, blocks: str, kind: str, dtype: torch.dtype) -> bool:
        """GA per interval (a pipelined mode, the partition has intervals, epoch >= 1) or in one product.

        Epoch 0 of a pipelined mode runs its GA in one product, as the synchronous mode does, and starts
        building the per-interval ``blocks`` of ``kind`` and ``dtype`` on a background thread
        (:meth:`GraphContext.build_ahead`) for epoch 1 on. Built in the foreground, the blocks made epoch 0
        a third longer than the synchronous one (2 servers, 100k vertices: 0.73 s against 0.55 s; beside
        it: 0.66 s; ``benchmarks/results/dorylus_first_epoch.json``). Values are the same either way up to
        the order of floating-point sums; the rule depends on the epoch only, so a run and its resume
        agree."""
        runtime = self.runtime
        if not (runtime.pipelined and graph.intervals):
            return False
        if runtime.epoch > 0:
            return True
        if runtime.build_ahead:
            graph.build_ahead(blocks, kind, dtype)
        return False

    def _runahead(self) -> RunAhead | None:
        return self.runtime.runahead_for(self.training)

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
        if sources and graph.intervals:  # rows made per interval, remade in the backward
            (name,) = sources
            shared = {n: t for n, t in tensors.items() if n != name and t is not None}
            return rows_op(call, RowInput(tensors[name], name, self._runahead(), self.layer_index), **shared)  # type: ignore[arg-type]
        full = {n: t.full() if isinstance(t, RowSource) else t for n, t in tensors.items()}
        return tensor_op(call, **full)

    def gather_apply(
        self, adjacency: str, h_full: Tensor, op: str, gather_input: str, graph: GraphContext,
        attrs: dict[str, Any] | None = None, **tensors: Tensor | None,
    ) -> tuple[Tensor, ...]:
        """GA ``Z = A h_full`` (``adjacency``: ``"gcn"``, PyG's ``gcn_norm``, or ``"mean"``, GraphSAGE's mean;
        ``h_full``: local then ghost rows, after SC), then AV ``op`` per interval with ``Z``'s rows as its
        input ``gather_input`` and ``tensors`` as the others (:class:`~.functions.GatherApply`). Per interval
        (``staleness`` set): interval ``i``'s GA, then its request at once, while ``i + 1``'s GA runs; its
        backward adds each group's ∇GA as the ∇AV results come back."""
        if adjacency not in ADJACENCIES:
            raise ValueError(f"adjacency={adjacency!r} is not supported; expected one of {ADJACENCIES}")
        call = self._call(op, graph, attrs)
        per_interval = self._per_interval(graph, "rows", adjacency, h_full.dtype)
        blocks = graph.blocks(adjacency, h_full.dtype, per_interval)
        return gather_apply(call, blocks, gather_input, h_full, **tensors)

    def apply_gather(self, x: Tensor | RowSource, weight: Tensor, graph: GraphContext) -> Tensor:
        """AV ``P = x W`` per interval (``apply_vertex.forward``, no activation), SC ``P``, then GA ``Â P``
        over the GCN adjacency: ``(n_local, F_out)`` (:class:`~.functions.ApplyGather`). Per interval
        (``staleness`` set): as each interval's ``P_i`` comes back the server adds its column block's share
        while later requests are out; then SC and the ghost columns' share. Synchronous: SC, then ``Â P``
        in one product. A :class:`RowSource` ``x`` is made per interval (and runs ahead, staleness >= 1)."""
        call = self._call("apply_vertex.forward", graph, {"activation": "none"})
        per_interval = self._per_interval(graph, "columns", "gcn", weight.dtype)
        blocks = graph.column_blocks(weight.dtype, per_interval)
        local = blocks[:-1] if per_interval else []
        if isinstance(x, RowSource) and graph.intervals:
            p, z = apply_gather(call, local, weight, source=x, runahead=self._runahead(),
                                layer=self.layer_index)
        else:
            p, z = apply_gather(call, local, weight, x=x.full() if isinstance(x, RowSource) else x)
        if per_interval and graph.partition.num_parts == 1:
            return z
        p_full = self.scatter(p, graph)  # SC: (n_local + n_ghost, F_out)
        n_local = graph.partition.n_local
        if not per_interval:
            return column_gather(p_full, blocks[0], n_local)  # GA: Â P_full
        return z + column_gather(p_full[n_local:], blocks[-1], n_local)  # the ghost columns' share

    def edge_gather(
        self, op: str, h_full: Tensor, alpha_src_full: Tensor, alpha_dst: Tensor, graph: GraphContext,
        attrs: dict[str, Any] | None = None, dropout: float = 0.0, dropout_key: int | None = None,
    ) -> Tensor:
        """AE ``op`` (attention of each self-loop-augmented in-edge from its source score in
        ``alpha_src_full (n_full, H)`` and destination score ``alpha_dst (n_local, H)``), attention dropout
        (training, probability ``dropout``), then GA ``out_i = Σ_j attention_ij h_j`` per head over
        ``h_full (n_full, H, C)``: ``(n_local, H, C)`` (:class:`~.edge_pipeline.ApplyEdgeGather`).

        The dropout mask of an edge hashes ``dropout_key`` and the edge's global ``(src, dst)``, the same
        whichever server owns ``dst``; ``None`` draws a key from torch's global generator. Interval ``i``'s
        AE request is in flight while the server drops out and gathers the ones before it, in every mode
        (GAT's GA needs no adjacency copy)."""
        call = self._call(op, graph, attrs)
        drop = None  # the attention dropout, when it drops (training)
        if self.training and dropout > 0.0:
            key = dropout_key if dropout_key is not None else int(torch.randint(-(2**63), 2**63 - 1, ()))
            drop = EdgeDropout(dropout, key, edge_ids(graph))
        return apply_edge_gather(call, graph.self_loops, h_full, alpha_src_full, alpha_dst, drop)

    def scatter(self, h_local: Tensor | RowSource, graph: GraphContext) -> Tensor:
        """SC: ``(n_local, ...) -> (n_local + n_ghost, ...)``: own rows, then ghost rows from their owners
        (this epoch's, or up to ``S`` epochs old: :meth:`DorylusRuntime.ghost_exchange`)."""
        if isinstance(h_local, RowSource):
            h_local = h_local.full()
        runtime = self.runtime
        exchange = runtime.ghost_exchange(self.training)
        return exchange.fill_ghosts(h_local, graph.partition, self.layer_index, runtime.epoch)

    def __getstate__(self) -> dict:
        # an executor (worker processes, sockets) must never be copied or pickled with the module
        state = self.__dict__.copy()
        state["_runtime"] = None
        return state
