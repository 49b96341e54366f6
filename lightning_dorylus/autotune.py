"""Autotuning of the pipeline: how many intervals a partition is cut into, and how many requests fly at once.

Instead of a hand-set interval size, the strategy (``DorylusStrategy(intervals="auto")``) measures the first
training epoch: :class:`TimedExecutor` records every request's rows, round-trip seconds and the seconds the
graph server spent submitting it. :func:`fit_request_cost` fits ``seconds = latency + rows * per_row``
(least squares) and :func:`choose` picks the interval count ``k`` minimising the modelled time of one op
over ``n`` rows on ``W`` executor workers:

    ``T(k) = latency + per_row * n / W + per_row * n / k + k * overhead``

The first two terms do not depend on ``k`` (the latency of the last request, the workers' total compute);
``per_row * n / k`` is the pipeline's fill/drain tail (one interval's compute that nothing overlaps) and
``overhead`` the graph server's cost to slice, encode and submit one request (measured in ``submit``).
So ``k* ≈ sqrt(per_row * n / overhead)``, clamped so an interval keeps at least ``min_rows`` rows. The
requests in flight ``c`` follow Little's law: enough to keep ``W`` workers busy despite the latency,
``W * (latency + t) / t`` with ``t`` one interval's compute, at most ``k``. The choice is logged and can be
overridden (``intervals=<int>``, ``max_in_flight=<int>``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from torch import Tensor

from lightning_dorylus.executors import TensorOpExecutor, TensorOpRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestSample:
    """One request: its rows, round-trip seconds (submit to result) and seconds spent in ``submit``."""

    rows: int
    seconds: float
    submit_seconds: float


@dataclass(frozen=True)
class TuneResult:
    """The chosen configuration and the fitted cost model behind it (all logged)."""

    num_intervals: int
    max_in_flight: int
    latency_s: float
    per_row_s: float
    overhead_s: float
    predicted_op_s: float


class TimedExecutor(TensorOpExecutor):
    """Wraps an executor: records every request's rows and round trip; optionally caps requests in flight.

    Args:
        inner: The executor doing the work (not owned: its owner closes it).
        max_in_flight: At most this many requests submitted to ``inner`` and not yet finished (``None``: no
            cap); ``submit`` blocks for a free slot.
    """

    def __init__(self, inner: TensorOpExecutor, max_in_flight: int | None = None) -> None:
        self.inner = inner
        self.samples: list[RequestSample] = []
        self.recording = False
        self._lock = threading.Lock()
        self._slots: threading.Semaphore | None = None
        self.set_max_in_flight(max_in_flight)

    def set_max_in_flight(self, max_in_flight: int | None) -> None:
        """Cap (or uncap, ``None``) the requests in flight from now on."""
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight={max_in_flight} must be None or >= 1")
        self.max_in_flight = max_in_flight
        self._slots = threading.Semaphore(max_in_flight) if max_in_flight else None

    def start(self) -> None:
        self.inner.start()

    def submit(self, request: TensorOpRequest) -> Future[dict[str, Tensor]]:
        slots = self._slots
        if slots is not None:
            slots.acquire()
        start = time.perf_counter()
        future = self.inner.submit(request)
        submitted = time.perf_counter()
        rows = max((t.size(0) for t in request.tensors.values() if t.dim() > 0), default=0)

        def done(_: Future) -> None:
            if slots is not None:
                slots.release()
            if self.recording:
                with self._lock:
                    self.samples.append(RequestSample(rows, time.perf_counter() - start, submitted - start))

        future.add_done_callback(done)
        return future

    def close(self) -> None:  # the inner executor belongs to whoever built it
        pass


def fit_request_cost(samples: list[RequestSample]) -> tuple[float, float, float]:
    """Least-squares ``seconds = latency + per_row * rows`` over ``samples``, plus the mean submit cost.

    Returns ``(latency_s, per_row_s, overhead_s)``, each clamped at 0.
    """
    if len(samples) < 2:
        raise ValueError(f"need at least 2 timed requests to fit a cost model, got {len(samples)}")
    n = len(samples)
    mean_x = sum(s.rows for s in samples) / n
    mean_y = sum(s.seconds for s in samples) / n
    var = sum((s.rows - mean_x) ** 2 for s in samples)
    slope = sum((s.rows - mean_x) * (s.seconds - mean_y) for s in samples) / var if var > 0 else 0.0
    slope = max(slope, 0.0)
    # one request size only: latency and compute cannot be told apart; charge it all to latency
    latency = mean_y if var == 0 else max(mean_y - slope * mean_x, 0.0)
    overhead = sum(s.submit_seconds for s in samples) / n
    return latency, slope, overhead


def choose(
    n_rows: int,
    latency_s: float,
    per_row_s: float,
    overhead_s: float,
    workers: int,
    max_intervals: int = 256,
    min_rows: int = 64,
) -> TuneResult:
    """The interval count (and requests in flight) minimising the modelled op time over ``n_rows``."""
    if n_rows < 1:
        raise ValueError(f"n_rows={n_rows} must be >= 1")
    best: TuneResult | None = None
    upper = max(1, min(max_intervals, n_rows // max(min_rows, 1)))
    for k in range(1, upper + 1):
        compute = per_row_s * n_rows / k  # one interval's compute
        predicted = latency_s + per_row_s * n_rows / max(workers, 1) + compute + k * overhead_s
        in_flight = k if compute <= 0 else min(k, math.ceil(workers * (latency_s + compute) / compute))
        if best is None or predicted < best.predicted_op_s - 1e-12:
            best = TuneResult(k, in_flight, latency_s, per_row_s, overhead_s, predicted)
    assert best is not None
    return best


def autotune(samples: list[RequestSample], n_rows: int, workers: int) -> TuneResult:
    """Fit the request cost from ``samples`` and choose; logs the measurements and the choice."""
    latency, per_row, overhead = fit_request_cost(samples)
    result = choose(n_rows, latency, per_row, overhead, workers)
    log.info(
        "Dorylus autotune: %d requests measured: latency %.2f ms, %.3f us/row, server overhead %.2f ms per "
        "request -> %d intervals of ~%d rows, %d requests in flight (modelled %.1f ms per op); override with "
        "DorylusStrategy(intervals=..., max_in_flight=...)",
        len(samples),
        latency * 1e3,
        per_row * 1e6,
        overhead * 1e3,
        result.num_intervals,
        math.ceil(n_rows / result.num_intervals),
        result.max_in_flight,
        result.predicted_op_s * 1e3,
    )
    return result
