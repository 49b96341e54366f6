"""Autotuning: the request-cost fit, the interval/in-flight choice, and the strategy applying it."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_dorylus.autotune import RequestSample, TimedExecutor, choose, fit_request_cost
from lightning_dorylus.executors import InlineExecutor, TensorOpRequest


def test_fit_recovers_latency_and_per_row_cost() -> None:
    samples = [RequestSample(rows, 0.020 + 2e-6 * rows, 0.001) for rows in (100, 1000, 5000, 20000)]
    latency, per_row, overhead = fit_request_cost(samples)
    assert latency == pytest.approx(0.020)
    assert per_row == pytest.approx(2e-6)
    assert overhead == pytest.approx(0.001)


def test_fit_needs_two_requests() -> None:
    with pytest.raises(ValueError, match="need at least 2 timed requests to fit a cost model, got 1"):
        fit_request_cost([RequestSample(10, 0.1, 0.0)])


def test_choice_balances_pipeline_tail_against_per_request_overhead() -> None:
    # k* = sqrt(per_row * n / overhead) = sqrt(1e-6 * 1e6 / 1e-3) ~ 31.6
    result = choose(1_000_000, latency_s=0.020, per_row_s=1e-6, overhead_s=1e-3, workers=2)
    assert result.num_intervals in (31, 32)
    compute = 1e-6 * 1_000_000 / result.num_intervals
    assert result.max_in_flight == min(result.num_intervals, math.ceil(2 * (0.020 + compute) / compute))
    # no overhead: as many intervals as min_rows allows; all latency: one
    assert choose(10_000, 0.02, 1e-6, 0.0, workers=1, min_rows=100).num_intervals == 100
    assert choose(10_000, 0.02, 0.0, 1e-3, workers=1).num_intervals == 1


def test_timed_executor_records_rows_and_caps_in_flight() -> None:
    timed = TimedExecutor(InlineExecutor(), max_in_flight=1)
    timed.recording = True
    z = torch.ones(7, 3, dtype=torch.float64)
    out = timed.submit(
        TensorOpRequest("apply_vertex.forward", {"z": z, "weight": torch.ones(3, 2, dtype=torch.float64)})
    )
    assert out.result()["h"].shape == (7, 2)
    assert [s.rows for s in timed.samples] == [7]
    with pytest.raises(ValueError, match="max_in_flight=0 must be None or >= 1"):
        timed.set_max_in_flight(0)
