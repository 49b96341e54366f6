"""``DorylusLayer``: the base of a GNN layer written as Dorylus's graph and tensor operations.

A layer is composed from four verbs, named as in the paper, with PyG's names alongside:

* **SC** ``scatter`` — boundary rows to the graph servers that hold them as ghosts (torch.distributed P2P);
* **GA** ``gather`` — PyG's ``message`` + ``aggregate``: sparse aggregation over local + ghost rows
  (on the server);
* **AV** ``apply_vertex`` — PyG's ``update``/``lin``: dense per-vertex work, per interval on the executor;
* **AE** ``apply_edge`` — per-edge tensor work (GAT attention), per interval on the executor.

To write a new layer, subclass :class:`DorylusLayer`, keep the weights as parameters, and write ``forward``
as a sequence of these calls; send dense work through :func:`lightning_dorylus.nn.functions.tensor_op`, which
runs any op declared as an ``OpSpec`` in ``lightning_dorylus/ops/`` (numpy forward and backward, declared
once) per interval on the executor and differentiates it (see ``SAGEConv``).

The runtime (executor + ghost exchange) is injected by :class:`~lightning_dorylus.DorylusStrategy`; without it
(``strategy="auto"``: one process, one partition, no ghosts) a layer creates an inline executor on first use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from lightning_dorylus.executors import TensorOpExecutor, build_executor
from lightning_dorylus.graph import GhostExchange, GraphContext
from lightning_dorylus.graph.stale import StaleGhostExchange
from lightning_dorylus.nn.runahead import RunAhead


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
    """Base class: holds the injected runtime and exposes SC/GA/AV/AE building blocks to subclasses."""

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
        (rows made per interval as their requests go out); a layer that needs its whole input at once: no."""
        return False

    def scatter(self, h_local: Tensor, graph: GraphContext) -> Tensor:
        """SC: ``(n_local, ...) -> (n_local + n_ghost, ...)``: own rows, then ghost rows from their owners."""
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
