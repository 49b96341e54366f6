"""The shared fault layer on the local pool: a hung worker, a dispatcher error, an idle worker's death,
stragglers and request planning (cut by rows, merged back)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

from lightning_dorylus import wire
from lightning_dorylus.executors import ExecutorError, FaultPolicy, InlineExecutor, TensorOpRequest
from lightning_dorylus.executors.local import LocalPoolExecutor, _Worker
from lightning_dorylus.executors.planning import merge_outputs, payload_fits, plan_request

pytestmark = pytest.mark.timeout(120)


def _av(rows: int = 40, fi: int = 8, fo: int = 4, interval: int = 0, seed: int = 0) -> TensorOpRequest:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, fi, generator=g, dtype=torch.float64)
    w = torch.randn(fi, fo, generator=g, dtype=torch.float64)
    return TensorOpRequest("apply_vertex.forward", {"z": z, "weight": w}, {"activation": "relu"}, interval)


def _av_backward(rows: int, fi: int, fo: int, seed: int = 0) -> TensorOpRequest:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, fi, generator=g, dtype=torch.float64)
    w = torch.randn(fi, fo, generator=g, dtype=torch.float64)
    b = torch.randn(fo, generator=g, dtype=torch.float64)
    h = torch.relu(z @ w + b)
    return TensorOpRequest("apply_vertex.backward",
                           {"z": z, "weight": w, "h": h, "grad_h": torch.randn(rows, fo, generator=g,
                                                                                dtype=torch.float64)},
                           {"activation": "relu", "has_bias": True}, interval=3)


def test_hung_worker_fails_the_request_within_the_deadline() -> None:
    """A worker stopped forever (SIGSTOP) used to hang ``map`` forever; now the deadline fails it."""
    with LocalPoolExecutor(num_workers=1, deadline_s=1.5, max_attempts=1) as ex:
        victim = ex.worker_pids[0]
        os.kill(victim, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(ExecutorError, match=r"op 'apply_vertex.forward' \(interval 7\) \[request \d+\] "
                           r"failed after 1 attempt\(s\).*no result within deadline_s=1.5"):
            ex.map([_av(interval=7)])  # no timeout: the executor's deadline is what ends the wait
        assert time.monotonic() - t0 < 10
        assert ex.stats["timeouts"] == 1
        # the stuck worker was killed and replaced; the pool keeps serving
        assert ex.map([_av()], timeout=30)[0]["h"].shape == (40, 4)
        assert ex.worker_pids[0] != victim and ex.respawns == 1


def test_hung_worker_is_replaced_and_the_request_retried() -> None:
    with LocalPoolExecutor(num_workers=1, deadline_s=1.5, max_attempts=2) as ex:
        os.kill(ex.worker_pids[0], signal.SIGSTOP)
        out = ex.map([_av()], timeout=60)[0]
        expected = InlineExecutor().map([_av()])[0]
        assert torch.equal(out["h"], expected["h"])
        assert ex.stats["timeouts"] == 1 and ex.stats["retries"] == 1 and ex.respawns == 1


def test_dispatcher_error_fails_the_request_and_the_dispatcher_keeps_serving(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A MemoryError/RecursionError in the dispatcher used to kill its thread silently (future never
    resolved); now the request fails with it and the next request is served."""
    with LocalPoolExecutor(num_workers=1, deadline_s=60) as ex:
        real_call = _Worker.call
        raised = []

        def call(self, frames):
            if not raised:
                raised.append(1)
                raise MemoryError("cannot allocate the reply buffer")
            return real_call(self, frames)

        monkeypatch.setattr(_Worker, "call", call)
        with pytest.raises(ExecutorError, match=r"dispatcher of worker 0 \(pid \d+\) failed running op "
                           r"'apply_vertex.forward' \(interval 0\).*MemoryError: cannot allocate"):
            ex.submit(_av()).result(timeout=10)
        assert ex.map([_av()], timeout=30)[0]["h"].shape == (40, 4)


def test_idle_worker_death_is_retried_not_failed() -> None:
    """A worker killed while idle used to fail the next request; now it is replaced and the request runs."""
    with LocalPoolExecutor(num_workers=1) as ex:
        victim = ex.worker_pids[0]
        os.kill(victim, signal.SIGKILL)
        time.sleep(0.2)
        out = ex.map([_av()], timeout=30)[0]
        assert torch.equal(out["h"], InlineExecutor().map([_av()])[0]["h"])
        assert ex.respawns == 1 and ex.worker_pids[0] != victim


def test_straggler_is_relaunched_and_its_late_duplicate_dropped() -> None:
    policy = {"straggler_ratio": 2.0, "straggler_min_s": 0.3, "straggler_samples": 3, "deadline_s": 60}
    with LocalPoolExecutor(num_workers=2, **policy) as ex:
        ex.map([_av(seed=i) for i in range(4)], timeout=30)  # durations for the median
        stalled = ex._workers[0]
        os.kill(stalled.pid, signal.SIGSTOP)  # whatever worker 0 takes next stalls until SIGCONT
        try:
            futures = []
            deadline = time.monotonic() + 20
            while stalled.current is None and time.monotonic() < deadline:
                futures.append(ex.submit(_av(interval=5)))
                time.sleep(0.02)
            assert stalled.current is not None, "worker 0 never took a request"
            outs = [f.result(timeout=30) for f in futures]  # the stalled one comes back through worker 1
        finally:
            os.kill(stalled.pid, signal.SIGCONT)
        out = outs[-1]
        assert torch.equal(out["h"], InlineExecutor().map([_av(interval=5)])[0]["h"])
        assert ex.stats["relaunched"] == 1
        deadline = time.monotonic() + 10
        while ex.stats["duplicates_dropped"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ex.stats["duplicates_dropped"] == 1


def test_fault_policy_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match=r"straggler_ratio=0.5: expected a ratio > 1 or None"):
        FaultPolicy(straggler_ratio=0.5)
    with pytest.raises(ValueError, match=r"max_attempts=0: expected an int >= 1"):
        FaultPolicy(max_attempts=0)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['deadline'\]"):
        LocalPoolExecutor(deadline=3)


def test_plan_cuts_by_rows_under_the_limit_and_merges_back() -> None:
    req = _av_backward(rows=3000, fi=300, fo=16)
    inputs = req.numpy_inputs()
    limit = 2 * 1024 * 1024
    pieces = plan_request(req.op, inputs, req.attrs, req.interval, limit)
    assert len(pieces) > 1 and pieces[0].start == 0 and pieces[-1].stop == 3000
    assert all(p.stop - p.start <= pieces[0].stop - pieces[0].start for p in pieces)
    for p in pieces:
        assert not p.oversize
        assert payload_fits(p.request_bytes, limit) and payload_fits(p.response_bytes, limit)
        encoded = wire.encode({"op": req.op, "attrs": req.attrs, "interval": req.interval}, p.inputs)
        assert len(encoded) == p.request_bytes
    inline = InlineExecutor()
    parts = [inline.submit(TensorOpRequest(req.op, {k: torch.from_numpy(v) for k, v in p.inputs.items()},
                                           req.attrs)).result() for p in pieces]
    merged = merge_outputs(req.op, parts)
    whole = inline.submit(req).result()
    # BLAS blocks a GEMM by its row count and sums run in another order: equal to rounding, measured against
    # the largest magnitude (an entry that cancels to near zero carries the rounding of its large terms;
    # an element-wise rtol of 1e-12 failed on this machine's OpenBLAS kernel at 1.3e-12)
    for name in ("grad_z", "grad_weight", "grad_bias"):
        _assert_equal_to_rounding(merged[name].numpy(), whole[name].numpy())


def _assert_equal_to_rounding(actual: np.ndarray, expected: np.ndarray) -> None:
    np.testing.assert_allclose(actual, expected, rtol=1e-12, atol=1e-12 * float(np.abs(expected).max()))


def test_plan_marks_what_cannot_be_cut_as_oversize() -> None:
    big_row = _av(rows=2, fi=300_000, fo=2)  # one row is 2.4 MB: over a 1 MB limit alone
    pieces = plan_request(big_row.op, big_row.numpy_inputs(), big_row.attrs, 0, 1 << 20)
    assert all(p.oversize for p in pieces)
    assert plan_request(big_row.op, big_row.numpy_inputs(), big_row.attrs, 0, None)[0].oversize is False


def test_local_pool_with_max_rows_matches_inline() -> None:
    req = _av_backward(rows=100, fi=8, fo=4)
    with LocalPoolExecutor(num_workers=2, max_rows=30) as ex:
        out = ex.submit(req).result(timeout=30)
        assert ex.stats["pieces"] == 4
    whole = InlineExecutor().submit(req).result()
    _assert_equal_to_rounding(out["grad_z"].numpy(), whole["grad_z"].numpy())
    _assert_equal_to_rounding(out["grad_weight"].numpy(), whole["grad_weight"].numpy())
