"""Executors: inline vs local pool agree bit for bit; ordering, crashes, and shutdown behave."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from lightning_dorylus.executors import (
    EXECUTORS,
    ExecutorError,
    InlineExecutor,
    TensorOpRequest,
    build_executor,
)
from lightning_dorylus.executors.local import LocalPoolExecutor, RemoteOpError

pytestmark = pytest.mark.timeout(120)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _requests(dtype: torch.dtype, seed: int = 0) -> list[TensorOpRequest]:
    """One request per op (forward and backward), with shapes like a GCN/GAT interval."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=dtype)

    n, fi, fo, heads, ch = 50, 16, 12, 8, 8
    deg = torch.randint(0, 5, (n,), generator=g)
    deg[::4] = 1  # self loop only
    dst_ptr = torch.cat([torch.zeros(1, dtype=torch.int64), deg.cumsum(0)])
    num_edges = int(dst_ptr[-1])
    z, w, b = r(n, fi), r(fi, fo), r(fo)
    h = torch.relu(z @ w + b)
    x, wg, att_s, att_d = r(n, fi), r(fi, heads * ch), r(heads, ch), r(heads, ch)
    hg = x @ wg
    a_src_e, a_dst = r(num_edges, heads), r(n, heads)
    att = torch.rand(num_edges, heads, generator=g, dtype=dtype)
    return [
        TensorOpRequest("apply_vertex.forward", {"z": z, "weight": w, "bias": b}, {"activation": "relu"}, 0),
        TensorOpRequest("apply_vertex.forward", {"z": z, "weight": w}, {"activation": "elu"}, 1),
        TensorOpRequest(
            "apply_vertex.backward",
            {"z": z, "weight": w, "h": h, "grad_h": r(n, fo)},
            {"activation": "relu", "has_bias": True},
            2,
        ),
        TensorOpRequest(
            "gat.project.forward", {"x": x, "weight": wg, "att_src": att_s, "att_dst": att_d}, {}, 3
        ),
        TensorOpRequest(
            "gat.project.backward",
            {
                "x": x,
                "weight": wg,
                "att_src": att_s,
                "att_dst": att_d,
                "h": hg,
                "grad_h": r(n, heads * ch),
                "grad_alpha_src": r(n, heads),
                "grad_alpha_dst": r(n, heads),
            },
            {},
            4,
        ),
        TensorOpRequest(
            "apply_edge.forward",
            {"alpha_src_e": a_src_e, "alpha_dst": a_dst, "dst_ptr": dst_ptr},
            {"negative_slope": 0.2},
            5,
        ),
        TensorOpRequest(
            "apply_edge.backward",
            {
                "alpha_src_e": a_src_e,
                "alpha_dst": a_dst,
                "dst_ptr": dst_ptr,
                "attention": att,
                "grad_attention": r(num_edges, heads),
            },
            {"negative_slope": 0.2},
            6,
        ),
    ]


@pytest.fixture(scope="module")
def pool():
    with LocalPoolExecutor(num_workers=2) as ex:
        yield ex


def test_build_executor_by_name() -> None:
    assert isinstance(build_executor("inline"), InlineExecutor)
    local = build_executor("local", num_workers=1)
    assert isinstance(local, LocalPoolExecutor) and local.num_workers == 1
    local.close()  # never started: nothing to stop
    with pytest.raises(
        ValueError, match=r"unknown executor 'gpu'; valid executors are \['inline', 'lambda', 'local'\]"
    ):
        build_executor("gpu")
    assert sorted(EXECUTORS) == ["inline", "lambda", "local"]


@pytest.mark.parametrize("kwargs", [{"num_workers": 0}, {"threads_per_worker": -1}, {"num_workers": True}])
def test_local_rejects_bad_options(kwargs: dict) -> None:
    name, value = next(iter(kwargs.items()))
    with pytest.raises(ValueError, match=rf"{name}={value!r}: expected an int >= 1"):
        LocalPoolExecutor(**kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_inline_and_local_are_bit_identical_for_every_op(pool: LocalPoolExecutor, dtype: torch.dtype) -> None:
    requests = _requests(dtype)
    local = pool.map(requests, timeout=60)
    inline = InlineExecutor().map(requests)
    threaded = InlineExecutor(num_threads=2).map(requests)
    for req, lo, il, th in zip(requests, local, inline, threaded):
        assert lo.keys() == il.keys() == th.keys(), req.op
        for k in lo:
            assert lo[k].dtype == dtype, (req.op, k)
            assert torch.equal(lo[k], il[k]), f"{req.op} output {k!r} differs between local and inline"
            assert torch.equal(th[k], il[k]), req.op


def test_map_returns_many_concurrent_results_in_order(pool: LocalPoolExecutor) -> None:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 32, generator=g)
    requests = [
        TensorOpRequest(
            "apply_vertex.forward",
            {"z": torch.randn(300 + i, 64, generator=g), "weight": w},
            {"activation": "none"},
            interval=i,
        )
        for i in range(40)
    ]
    before = list(pool.requests_per_worker)
    outputs = pool.map(requests, timeout=60)
    for req, out in zip(requests, outputs):
        assert out["h"].shape == (300 + req.interval, 32)
        # Not bit-exact here: this process's BLAS may use more threads than the workers (see the next test).
        torch.testing.assert_close(out["h"], req.tensors["z"] @ w, rtol=1e-4, atol=1e-4)
    served = [a - b for a, b in zip(pool.requests_per_worker, before)]
    assert sum(served) == 40 and all(s > 0 for s in served), served


def test_large_payload_round_trip(pool: LocalPoolExecutor) -> None:
    g = torch.Generator().manual_seed(3)
    z, w = torch.randn(8192, 256, generator=g), torch.randn(256, 128, generator=g)  # 8 MiB of features
    out = pool.submit(TensorOpRequest("apply_vertex.forward", {"z": z, "weight": w}, {"activation": "relu"}))
    result = out.result(timeout=60)["h"]
    torch.testing.assert_close(result, torch.relu(z @ w), rtol=1e-4, atol=1e-4)
    result.add_(1)  # outputs are ordinary writable tensors


_SAME_THREADS_SCRIPT = """
import json, sys
import torch
from lightning_dorylus.executors import InlineExecutor, LocalPoolExecutor, TensorOpRequest
g = torch.Generator().manual_seed(0)
n, e, heads = 4096, 20000, 8
dst_ptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.linspace(0, e, n).round().long()])
requests = [
    TensorOpRequest("apply_vertex.forward", {"z": torch.randn(n, 256, generator=g),
                                             "weight": torch.randn(256, 128, generator=g)},
                    {"activation": "elu"}),
    TensorOpRequest("apply_vertex.backward", {"z": torch.randn(n, 256, generator=g),
                                              "weight": torch.randn(256, 128, generator=g),
                                              "h": torch.randn(n, 128, generator=g),
                                              "grad_h": torch.randn(n, 128, generator=g)},
                    {"activation": "relu", "has_bias": True}),
    TensorOpRequest("apply_edge.forward", {"alpha_src_e": torch.randn(e, heads, generator=g),
                                           "alpha_dst": torch.randn(n, heads, generator=g),
                                           "dst_ptr": dst_ptr}),
]
with LocalPoolExecutor(num_workers=2, threads_per_worker=1) as pool:
    local = pool.map(requests, timeout=120)
inline = InlineExecutor().map(requests)
print(json.dumps({f"{r.op}.{k}": bool(torch.equal(lo[k], il[k]))
                  for r, lo, il in zip(requests, local, inline) for k in lo}))
"""


def test_bit_identical_at_large_sizes_when_blas_threads_match() -> None:
    """numpy's BLAS splits big GEMMs by thread, which changes the summation order; with the graph
    server's BLAS pinned to the workers' thread count the results are bit-identical."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", _SAME_THREADS_SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    identical = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(identical) == 5 and all(identical.values()), identical


def test_op_errors_come_back_with_the_handler_message(pool: LocalPoolExecutor) -> None:
    bad = TensorOpRequest("apply_vertex.forward", {"z": torch.ones(2, 3)}, {}, interval=9)
    with pytest.raises(
        RemoteOpError,
        match=r"op 'apply_vertex.forward' \(interval 9\) \[request \d+\] failed in worker \d "
        r"\(pid \d+\): ValueError: .*missing input\(s\) \['weight'\]",
    ):
        pool.submit(bad).result(timeout=30)
    with pytest.raises(ValueError, match=r"missing input\(s\) \['weight'\]"):
        InlineExecutor().submit(bad).result()
    unknown = TensorOpRequest("apply_vertex.sideways", {}, {})
    with pytest.raises(RemoteOpError, match=r"unknown op 'apply_vertex.sideways': this handler has \["):
        pool.submit(unknown).result(timeout=30)
    # The worker survives op errors.
    assert pool.map(_requests(torch.float32)[:1], timeout=30)[0]["h"].shape == (50, 12)


def test_requests_must_hold_cpu_tensors() -> None:
    req = TensorOpRequest(
        "apply_vertex.forward", {"z": torch.ones(2, 3, device="meta"), "weight": torch.ones(3, 2)}
    )
    with pytest.raises(ValueError, match=r"tensor 'z' is on meta; executors take CPU tensors"):
        InlineExecutor().submit(req).result()


def test_killed_worker_fails_its_future_and_is_replaced() -> None:
    with LocalPoolExecutor(num_workers=1, max_attempts=1) as ex:
        victim = ex.worker_pids[0]
        g = torch.Generator().manual_seed(0)
        big = TensorOpRequest(
            "apply_vertex.forward",
            {
                "z": torch.randn(2000, 1500, generator=g, dtype=torch.float64),
                "weight": torch.randn(1500, 1500, generator=g, dtype=torch.float64),
            },
            {"activation": "relu"},
            interval=4,
        )
        future = ex.submit(big)
        deadline = time.monotonic() + 30
        while not future.running() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert future.running() and not future.done()
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(
            ExecutorError,
            match=r"failed after 1 attempt.*worker 0 \(pid \d+\) died with exit code -9 \(SIGKILL\) while "
            r"running op 'apply_vertex.forward' \(interval 4\)",
        ):
            future.result(timeout=30)
        assert not _pid_alive(victim)
        assert ex.respawns == 1 and ex.worker_pids[0] != victim
        assert ex.map(_requests(torch.float64)[:1], timeout=30)[0]["h"].dtype == torch.float64


def test_close_is_idempotent_and_leaves_no_processes() -> None:
    ex = LocalPoolExecutor(num_workers=2)
    with ex:
        pids = ex.worker_pids
        assert len(pids) == 2 and all(_pid_alive(p) for p in pids)
        ex.map(_requests(torch.float32)[:2], timeout=30)
    assert not any(_pid_alive(p) for p in pids)
    ex.close()
    with pytest.raises(ExecutorError, match="LocalPoolExecutor is closed"):
        ex.submit(_requests(torch.float32)[0])
    inline = InlineExecutor(num_threads=1)
    inline.close()
    inline.close()
    with pytest.raises(ExecutorError, match="InlineExecutor is closed"):
        inline.submit(_requests(torch.float32)[0])


def test_close_fails_queued_requests_instead_of_hanging() -> None:
    ex = LocalPoolExecutor(num_workers=1, close_timeout=0.0)
    g = torch.Generator().manual_seed(0)
    req = TensorOpRequest(
        "apply_vertex.forward",
        {
            "z": torch.randn(1000, 1000, generator=g, dtype=torch.float64),
            "weight": torch.randn(1000, 1000, generator=g, dtype=torch.float64),
        },
        {},
    )
    futures = [ex.submit(req) for _ in range(5)]
    pid = ex.worker_pids[0]
    ex.close()
    assert all(f.done() for f in futures)
    failed = [f for f in futures if f.exception() is not None]
    assert failed, "with close_timeout=0 the queued requests must fail, not wait"
    assert all(isinstance(f.exception(), ExecutorError) for f in failed), [
        repr(f.exception()) for f in failed
    ]
    assert any("closed before the op ran" in str(f.exception()) for f in failed)
    assert not _pid_alive(pid)


def test_worker_that_cannot_start_raises_with_its_exit_code(monkeypatch: pytest.MonkeyPatch, tmp_path):
    # Without numpy on its path the worker (python -S) dies at import, before saying hello.
    monkeypatch.setattr("lightning_dorylus.executors.local.bundle.link_numpy", lambda site: None)
    ex = LocalPoolExecutor(num_workers=1, startup_timeout=30)
    match = r"worker 0 \(pid \d+\) failed to start: exit code 1; see its stderr"
    with pytest.raises(ExecutorError, match=match):
        ex.start()
    assert ex.worker_pids == []
    ex.close()


def test_unsupported_tensor_dtype_is_named() -> None:
    req = TensorOpRequest("apply_vertex.forward", {"z": torch.ones(2, 3, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match=r"tensor 'z' has dtype torch.bfloat16; executors take"):
        InlineExecutor().submit(req).result()


def test_submits_from_many_threads(pool: LocalPoolExecutor) -> None:
    g = torch.Generator().manual_seed(11)
    w = torch.randn(8, 4, generator=g)
    zs = [torch.randn(20, 8, generator=g) for _ in range(64)]

    def run(k: int) -> list[bool]:
        futures = [
            (z, pool.submit(TensorOpRequest("apply_vertex.forward", {"z": z, "weight": w}, interval=i)))
            for i, z in enumerate(zs[k::4])
        ]
        return [torch.allclose(f.result(timeout=60)["h"], z @ w, atol=1e-5) for z, f in futures]

    with ThreadPoolExecutor(4) as threads:
        results = [ok for chunk in threads.map(run, range(4)) for ok in chunk]
    assert len(results) == 64 and all(results)


def test_request_repr_shows_shapes_not_values() -> None:
    req = TensorOpRequest("apply_vertex.forward", {"z": torch.ones(128, 64)}, {"activation": "relu"}, 3)
    assert repr(req) == (
        "TensorOpRequest(op='apply_vertex.forward', interval=3, attrs={'activation': 'relu'}, "
        "tensors={z: (128, 64) float32})"
    )
