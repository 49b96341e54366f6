"""``DorylusLayer``: the base of a GNN layer written as Dorylus's graph and tensor operations.

A layer is composed from four verbs, named as in the paper, with PyG's names alongside:

* **SC** ``scatter`` — boundary rows to the graph servers that hold them as ghosts (torch.distributed P2P);
* **GA** ``gather`` — PyG's ``message`` + ``aggregate``: sparse aggregation over local + ghost rows
  (on the server);
* **AV** ``apply_vertex`` — PyG's ``update``/``lin``: dense per-vertex work, per interval on the executor;
* **AE** ``apply_edge`` — per-edge tensor work (GAT attention), per interval on the executor.

To write a new layer, subclass :class:`DorylusLayer`, keep the weights as parameters, and write ``forward``
as a sequence of these calls; send dense work through an ``autograd.Function`` like those in
:mod:`lightning_dorylus.nn.functions` (forward and backward each a named executor op with explicit inputs).

The runtime (executor + ghost exchange) is injected by :class:`~lightning_dorylus.DorylusStrategy`; without it
(``strategy="auto"``: one process, one partition, no ghosts) a layer creates an inline executor on first use.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from lightning_dorylus.executors import TensorOpExecutor, build_executor
from lightning_dorylus.graph import GhostExchange, GraphContext


@dataclass
class DorylusRuntime:
    """What a graph server lends its layers: where tensor ops run and how ghost rows move.

    Attributes:
        executor: Runs the AV/AE requests (and their backward ops).
        exchange: Moves boundary rows to ghosts (SC) and ghost gradients back (∇SC).
    """

    executor: TensorOpExecutor
    exchange: GhostExchange


class DorylusLayer(nn.Module):
    """Base class: holds the injected runtime and exposes SC/GA/AV/AE building blocks to subclasses."""

    def __init__(self) -> None:
        super().__init__()
        self._runtime: DorylusRuntime | None = None

    def attach(self, runtime: DorylusRuntime | None) -> None:
        """Uses ``runtime`` for all later forwards (``None`` detaches: back to the lazy inline runtime)."""
        self._runtime = runtime

    @property
    def runtime(self) -> DorylusRuntime:
        """The injected runtime, or (single process) an inline executor created on first use."""
        if self._runtime is None:
            executor = build_executor("inline")
            executor.start()
            self._runtime = DorylusRuntime(executor=executor, exchange=GhostExchange())
        return self._runtime

    def scatter(self, h_local: Tensor, graph: GraphContext) -> Tensor:
        """SC: ``(n_local, ...) -> (n_local + n_ghost, ...)``: own rows, then ghost rows from their owners."""
        return self.runtime.exchange.fill_ghosts(h_local, graph.partition)

    def __getstate__(self) -> dict:
        # an executor (worker processes, sockets) must never be copied or pickled with the module
        state = self.__dict__.copy()
        state["_runtime"] = None
        return state
