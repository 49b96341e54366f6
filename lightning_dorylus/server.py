"""``GraphServer``: what one graph server's Dorylus layers run on, from ``setup`` to ``teardown``.

The tensor-op executor (built from its name, or the user's instance), timed and capped where ``intervals`` /
``max_in_flight`` ask for it (:mod:`lightning_dorylus.autotune`), the ghost exchanges (exact, and bounded
stale on its own gloo group with ``staleness >= 1``) and the :class:`~lightning_dorylus.nn.DorylusRuntime`
that every Dorylus layer of the model is attached to. ``DorylusStrategy`` owns one and calls it at the points
of a fit where the runtime changes; the strategy itself only says when.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist
from torch import nn

from lightning_dorylus.autotune import TimedExecutor, TuneResult, autotune
from lightning_dorylus.executors import TensorOpExecutor, build_executor
from lightning_dorylus.graph import GhostExchange, GraphCache
from lightning_dorylus.graph.stale import StaleGhostExchange
from lightning_dorylus.nn import DorylusLayer, DorylusRuntime
from lightning_dorylus.nn.base import ghost_staleness
from lightning_dorylus.options import DorylusOptions
from lightning_dorylus.threads import (
    colocated_worker_threads,
    limit_server_threads,
    pipelined_server_threads,
    server_threads,
)

log = logging.getLogger(__name__)


class GraphServer:
    """One graph server's executor, ghost exchanges and layer runtime (``None`` outside start .. stop)."""

    def __init__(self, options: DorylusOptions) -> None:
        self.options = options
        self.executor: TensorOpExecutor | None = None
        self.runtime: DorylusRuntime | None = None
        self.tuned: TuneResult | None = None
        self._timed: TimedExecutor | None = None
        self._exchange: GhostExchange | None = None
        self._stale_group: Any | None = None  # made once, kept for the next fit (new_group is collective)

    def start(self, module: nn.Module, layers: list[DorylusLayer], world_size: int, num_processes: int,
              rank: int) -> None:
        """Starts the executor and lends it, with the ghost exchange, to every Dorylus layer in ``layers``."""
        opts = self.options
        if self.executor is None:
            spec = opts.executor
            self.executor = build_executor(spec, **opts.executor_options) if isinstance(spec, str) else spec
        self.executor.start()
        if opts.staleness is not None and opts.num_threads is None:  # no count given: leave the workers
            colocated = colocated_worker_threads(self.executor)  # that share this server's cores theirs
            if colocated:
                threads = pipelined_server_threads(server_threads(None, num_processes), colocated)
                limit_server_threads(threads, num_processes)
                log.debug("graph server %d: %d threads (pipelined, %d executor worker threads share its "
                          "cores)", rank, threads, colocated)
        self._exchange = GhostExchange()
        stale = None
        if opts.staleness and world_size > 1:
            if self._stale_group is None:  # its own group: stale P2P never interleaves with collectives
                self._stale_group = dist.new_group(backend="gloo")
            stale = StaleGhostExchange(ghost_staleness(opts.staleness), self._stale_group, opts.stale_reads)
        executor: TensorOpExecutor = self.executor
        if opts.timed:
            self._timed = TimedExecutor(self.executor, opts.max_in_flight)
            executor = self._timed
            set_num_intervals(module, None if opts.intervals == "auto" else opts.intervals)  # type: ignore[arg-type]
        self.runtime = DorylusRuntime(
            executor=executor, exchange=self._exchange, staleness=opts.staleness, stale_exchange=stale,
            build_ahead=opts.intervals != "auto",
        )
        for index, layer in enumerate(layers):
            layer.attach(self.runtime, layer_index=index)

    def before_step(self, module: Any, batch: Any) -> None:
        """Stamps this step's stale messages with the epoch; with ``intervals="auto"``, times the first
        epoch(s) on the partition's intervals, then tunes once (:meth:`_autotune`)."""
        if self.runtime is None:
            return
        epoch = module.current_epoch
        self.runtime.epoch = epoch
        if self.options.intervals == "auto" and self._timed is not None and self.tuned is None:
            if epoch == 0 or len(self._timed.samples) < 2:
                self._timed.recording = True
            else:
                self._autotune(module, batch)

    def _autotune(self, module: Any, batch: Any) -> None:
        """Choose intervals and requests in flight from the timed requests (this graph server's own)."""
        assert self._timed is not None
        self._timed.recording = False
        inner = self.executor
        workers = getattr(inner, "num_workers", None)  # local pool; a wrapper's inner pool; else 1
        workers = workers or getattr(getattr(inner, "inner", None), "num_workers", 1)
        self.tuned = autotune(self._timed.samples, max(1, int(batch.n_local)), int(workers))
        set_num_intervals(module, self.tuned.num_intervals)
        self._timed.set_max_in_flight(self.options.max_in_flight or self.tuned.max_in_flight)

    def drain(self, discard: bool = False) -> None:
        """Waits for every stale SC/∇SC message and every request sent ahead; ``discard`` also drops the
        requests sent ahead for the next epoch and the held ghost buffers."""
        if self.runtime is None:
            return
        self.runtime.runahead.drain(discard)
        if self.runtime.stale_exchange is not None:
            self.runtime.stale_exchange.drain(discard)

    def stop(self, layers: list[DorylusLayer]) -> None:
        """Drops what is in flight, detaches the layers and closes an executor this server built."""
        self.drain(discard=True)
        for layer in layers:
            layer.attach(None)
        if self.executor is not None and self.options.owns_executor:
            self.executor.close()
        self.drain()
        self.executor = self._exchange = self.runtime = None


def set_num_intervals(module: Any, num_intervals: int | None) -> None:
    """Re-cuts the intervals of every ``GraphCache`` the module holds (``NodeClassifier``'s, or a user
    module's own, under any attribute name)."""
    for value in vars(module).values():
        if isinstance(value, GraphCache):
            value.set_num_intervals(num_intervals)
