"""The Lambda executor through boto3 against the local Invoke endpoint running the real handler zip
(+ moto's S3 server).

Each test uses its own function name, so injected faults never leak into another test even when the
endpoint is shared (``scripts/services.sh``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import boto3
import numpy as np
import pytest
import torch

from lightning_dorylus.executors import (
    EXECUTORS,
    ExecutorError,
    InlineExecutor,
    LambdaExecutor,
    RemoteOpError,
    TensorOpRequest,
    build_executor,
)
from lightning_dorylus.ops import bundle
from tests.dorylus.aws_services import BUCKET, endpoint_stats, set_faults
from tests.dorylus.test_executors import _requests

pytestmark = [pytest.mark.timeout(180), pytest.mark.services]  # services.sh, or started by the fixtures


def _function() -> str:
    return f"dorylus-test-{uuid.uuid4().hex[:8]}"


def _executor(endpoint: str, function: str, **options) -> LambdaExecutor:
    options.setdefault("max_concurrency", 4)
    return LambdaExecutor(function_name=function, region="us-east-1", endpoint_url=endpoint, **options)


def _av(rows: int = 40, fi: int = 8, seed: int = 0, interval: int = 0) -> TensorOpRequest:
    g = torch.Generator().manual_seed(seed)
    return TensorOpRequest("apply_vertex.forward",
                           {"z": torch.randn(rows, fi, generator=g, dtype=torch.float64),
                            "weight": torch.randn(fi, 4, generator=g, dtype=torch.float64)},
                           {"activation": "relu"}, interval)


def test_dry_run_zip_answers_a_request_in_a_fresh_numpy_only_interpreter(handler_zip: Path,
                                                                          tmp_path: Path) -> None:
    site = bundle.link_numpy(tmp_path / "site")  # a directory with numpy and nothing else
    script = f"""
import sys, json, base64
sys.path[:0] = [{str(handler_zip)!r}, {str(site)!r}]
try:
    import torch
    sys.exit("torch must not be importable here")
except ImportError:
    pass
import numpy as np
from lightning_dorylus import wire
from lightning_dorylus.ops.lambda_entry import lambda_handler
assert wire.__file__.startswith({str(handler_zip)!r}), wire.__file__
z = np.arange(6.0).reshape(3, 2); w = np.ones((2, 4))
header = {{"op": "apply_vertex.forward", "attrs": {{"activation": "relu"}}}}
req = wire.encode(header, {{"z": z, "weight": w}})
out = lambda_handler(json.loads(json.dumps({{"payload": base64.b64encode(req).decode()}})), None)
header, arrays = wire.decode(base64.b64decode(out["payload"]))
print(json.dumps({{"ok": header["ok"], "h": arrays["h"].tolist()}}))
"""
    proc = subprocess.run([sys.executable, "-S", "-I", "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"ok": True, "h": [[1.0] * 4, [5.0] * 4, [9.0] * 4]}


def test_every_op_matches_inline_bit_for_bit(lambda_endpoint: str) -> None:
    assert "lambda" in EXECUTORS
    reqs = _requests(torch.float64)
    with build_executor("lambda", function_name=_function(), region="us-east-1",
                        endpoint_url=lambda_endpoint, max_concurrency=4) as ex:
        outs = ex.map(reqs)
    for req, out in zip(reqs, outs):
        expected = InlineExecutor().submit(req).result()
        assert out.keys() == expected.keys()
        for name in out:
            assert torch.equal(out[name], expected[name]), (req.op, name)


def test_throttled_invocations_are_retried_and_counted(lambda_endpoint: str) -> None:
    function = _function()
    set_faults(lambda_endpoint, function, throttle=3)
    with _executor(lambda_endpoint, function, max_attempts=1, backoff_base_s=0.01) as ex:
        out = ex.map([_av()])[0]
        assert ex.stats["throttled"] == 3 and ex.stats["retries"] == 3
    assert torch.equal(out["h"], InlineExecutor().map([_av()])[0]["h"])
    assert endpoint_stats(lambda_endpoint, function)["throttled"] == 3


def test_throttling_beyond_max_throttles_stops_with_a_clear_error(lambda_endpoint: str) -> None:
    function = _function()
    set_faults(lambda_endpoint, function, throttle=100)
    with _executor(lambda_endpoint, function, max_throttles=2, backoff_base_s=0.01) as ex, \
            pytest.raises(ExecutorError, match=r"op 'apply_vertex.forward' \(interval 3\) \[request \d+\] "
                          r"failed after 0 attempt\(s\) and 3 throttled call\(s\).*HTTP 429 "
                          r"TooManyRequestsException"):
        ex.map([_av(interval=3)])


def test_crashing_handler_message_reaches_the_caller(lambda_endpoint: str) -> None:
    function = _function()
    bad = TensorOpRequest("apply_vertex.forward", {"z": torch.ones(2, 3)}, {}, interval=9)
    with _executor(lambda_endpoint, function) as ex:
        with pytest.raises(RemoteOpError, match=rf"op 'apply_vertex.forward' \(interval 9\) \[request \d+\] "
                           rf"failed in Lambda function '{function}' \(attempt 0\): ValueError: op "
                           r"'apply_vertex.forward' is missing input\(s\) \['weight'\]") as info:
            ex.map([bad])
        assert info.value.error_type == "ValueError"
        assert ex.stats["retries"] == 0  # the same input would fail again


def test_runtime_that_dies_is_retried(lambda_endpoint: str) -> None:
    function = _function()
    set_faults(lambda_endpoint, function, exit=1)
    with _executor(lambda_endpoint, function, backoff_base_s=0.01) as ex:
        out = ex.map([_av()])[0]
        assert ex.stats["retries"] == 1
    assert torch.equal(out["h"], InlineExecutor().map([_av()])[0]["h"])
    assert endpoint_stats(lambda_endpoint, function)["errors"] == 1


def test_slow_invocation_is_relaunched_and_its_duplicate_dropped(lambda_endpoint: str) -> None:
    function = _function()
    with _executor(lambda_endpoint, function, straggler_ratio=3.0, straggler_min_s=0.5,
                   straggler_samples=3) as ex:
        ex.map([_av(seed=i) for i in range(4)])  # durations for the op's median
        set_faults(lambda_endpoint, function, delay_s=4.0, delay_count=1)
        t0 = time.monotonic()
        out = ex.map([_av(interval=5)])[0]
        took = time.monotonic() - t0
        assert ex.stats["relaunched"] == 1
        assert took < 4.0, f"the relaunched copy should win, took {took:.1f} s"
        deadline = time.monotonic() + 15
        while ex.stats["duplicates_dropped"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ex.stats["duplicates_dropped"] == 1
    assert torch.equal(out["h"], InlineExecutor().map([_av(interval=5)])[0]["h"])
    assert endpoint_stats(lambda_endpoint, function)["delayed"] == 1


def test_hung_invocation_fails_within_the_deadline(lambda_endpoint: str) -> None:
    function = _function()
    set_faults(lambda_endpoint, function, delay_s=60.0, delay_count=1)
    t0 = time.monotonic()
    with _executor(lambda_endpoint, function, deadline_s=1.0, max_attempts=1) as ex, \
            pytest.raises(ExecutorError, match=r"failed after 1 attempt\(s\).*no result within "
                          r"deadline_s=1.0"):
        ex.map([_av()])
    assert time.monotonic() - t0 < 10


def test_large_request_is_cut_into_pieces_under_the_limit(lambda_endpoint: str) -> None:
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3000, 300, generator=g, dtype=torch.float64)  # 7.2 MB of z: over 6 MB
    w = torch.randn(300, 16, generator=g, dtype=torch.float64)
    b = torch.randn(16, generator=g, dtype=torch.float64)
    h = torch.relu(z @ w + b)
    req = TensorOpRequest("apply_vertex.backward",
                          {"z": z, "weight": w, "h": h, "grad_h": torch.randn(3000, 16, generator=g,
                                                                               dtype=torch.float64)},
                          {"activation": "relu", "has_bias": True}, interval=1)
    function = _function()
    with _executor(lambda_endpoint, function) as ex:
        out = ex.map([req])[0]
        assert ex.stats["pieces"] >= 2 and ex.stats.get("s3_pieces", 0) == 0
    whole = InlineExecutor().submit(req).result()
    for name in whole:  # summed over pieces in another order: equal to rounding
        np.testing.assert_allclose(out[name].numpy(), whole[name].numpy(), rtol=1e-9, atol=1e-12)
    stats = endpoint_stats(lambda_endpoint, function)
    assert stats.get("too_large", 0) == 0 and stats["ok"] == ex.stats["pieces"]


def _big_edge_request(num_edges: int, interval: int = 2) -> TensorOpRequest:
    """apply_edge cannot be cut by rows; 200k edges x 4 heads of float64 is 6.4 MB: over the limit."""
    g = torch.Generator().manual_seed(1)
    n = num_edges // 4
    dst_ptr = torch.arange(0, num_edges + 1, 4, dtype=torch.int64)
    return TensorOpRequest("apply_edge.forward",
                           {"alpha_src_e": torch.randn(num_edges, 4, generator=g, dtype=torch.float64),
                            "alpha_dst": torch.randn(n, 4, generator=g, dtype=torch.float64),
                            "dst_ptr": dst_ptr}, {"negative_slope": 0.2}, interval)


def _objects(endpoint: str) -> list[str]:
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    return [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET).get("Contents", [])]


def test_request_over_6mb_goes_through_s3_and_its_objects_are_deleted(lambda_endpoint: str,
                                                                      s3_endpoint: str) -> None:
    req = _big_edge_request(200_000)
    function = _function()
    with _executor(lambda_endpoint, function, s3_bucket=BUCKET, s3_endpoint_url=s3_endpoint) as ex:
        out = ex.map([req])[0]
        assert ex.stats["s3_pieces"] == 1 and ex.stats["s3_objects_deleted"] == 2
    assert torch.equal(out["attention"], InlineExecutor().submit(req).result()["attention"])
    assert _objects(s3_endpoint) == []
    assert endpoint_stats(lambda_endpoint, function).get("too_large", 0) == 0


def test_s3_objects_are_deleted_when_the_handler_fails(lambda_endpoint: str, s3_endpoint: str) -> None:
    req = _big_edge_request(200_000)
    req.tensors["dst_ptr"] = req.tensors["dst_ptr"] + 1  # does not start at 0: the handler raises
    with _executor(lambda_endpoint, _function(), s3_bucket=BUCKET, s3_endpoint_url=s3_endpoint) as ex, \
            pytest.raises(RemoteOpError, match=r"ValueError: .*dst_ptr"):
        ex.map([req])
    assert _objects(s3_endpoint) == []


def test_oversize_without_a_bucket_is_a_clear_error(lambda_endpoint: str) -> None:
    with _executor(lambda_endpoint, _function()) as ex, \
            pytest.raises(ExecutorError, match=r"over the payload limit of 6291456 after base64 even alone, "
                          r"and LambdaExecutor has no s3_bucket.*set executor_options.s3_bucket"):
        ex.map([_big_edge_request(200_000)])


def test_endpoint_rejects_bodies_over_6mb_with_413(lambda_endpoint: str) -> None:
    body = json.dumps({"payload": "A" * (6 * 1024 * 1024 + 1)}).encode()
    req = urllib.request.Request(f"{lambda_endpoint}/2015-03-31/functions/f/invocations", data=body,
                                 method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 413
    assert info.value.headers["x-amzn-ErrorType"] == "RequestEntityTooLargeException"


def test_bad_options_are_named() -> None:
    with pytest.raises(ValueError, match=r"max_concurrency=0: expected an int >= 1"):
        LambdaExecutor(max_concurrency=0)
    with pytest.raises(ValueError, match=r"memory_mb=64: Lambda functions have 128..10240 MB"):
        LambdaExecutor(memory_mb=64)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['timeout'\]"):
        LambdaExecutor(timeout=3)
    assert "secret" not in repr(LambdaExecutor(function_name="f"))
