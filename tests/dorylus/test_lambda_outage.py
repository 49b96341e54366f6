"""An endpoint that cannot be reached is retried over the outage window, not given up after
``max_attempts`` quick tries: a request fails only once the endpoint has been unreachable for
``max(outage_s, deadline_s)``, and one started again within it answers the same request."""

from __future__ import annotations

import logging
import time
import uuid

import pytest
import torch

from lightning_dorylus.executors import ExecutorError, FaultPolicy, InlineExecutor, LambdaExecutor
from tests.dorylus.aws_services import DUMMY_AWS_ENV
from tests.dorylus.test_lambda import _av
from tests.process import free_port

pytestmark = pytest.mark.timeout(120)


def _unreachable(**options) -> LambdaExecutor:
    """A Lambda executor pointed at a loopback port nothing listens on (connection refused)."""
    return LambdaExecutor(function_name=f"dorylus-outage-{uuid.uuid4().hex[:8]}", region="us-east-1",
                          endpoint_url=f"http://127.0.0.1:{free_port()}", max_concurrency=2, **options)


def test_connection_failures_are_retried_for_the_outage_window_then_fail(
        aws_env: dict[str, str], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="lightning_dorylus.executors")
    t0 = time.monotonic()
    with _unreachable(outage_s=2.0, deadline_s=1.0, max_attempts=1, outage_backoff_max_s=0.3) as ex, \
            pytest.raises(ExecutorError, match=r"op 'apply_vertex.forward' \(interval 4\) \[request \d+\] "
                          r"failed after 0 attempt\(s\) and 0 throttled call\(s\), (\d+) failed "
                          r"connection\(s\) over 2\.\d s \(outage_s=2.0\).*EndpointConnectionError: "
                          r"could not reach http://127.0.0.1:\d+"):
        ex.map([_av(interval=4)])
    took = time.monotonic() - t0
    assert 2.0 <= took < 10.0, took  # max_attempts=1 did not end it at the first refused connection
    assert ex.stats["connection_retries"] >= 3 and ex.stats["failed"] == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "connection lost" in warnings[0] and "up to 2 s" in warnings[0]
    retries = [r.getMessage() for r in caplog.records
               if r.levelno == logging.INFO and "retrying op" in r.getMessage()]
    assert retries and all("'apply_vertex.forward' (interval 4)" in m for m in retries)
    assert not any(secret in r.getMessage() for r in caplog.records for secret in DUMMY_AWS_ENV.values()
                   if secret != "us-east-1")


def test_outage_window_is_never_shorter_than_the_deadline(aws_env: dict[str, str]) -> None:
    t0 = time.monotonic()
    with _unreachable(outage_s=0.0, deadline_s=1.5, outage_backoff_max_s=0.2) as ex, \
            pytest.raises(ExecutorError, match=r"failed connection\(s\) over 1\.\d s \(outage_s=0.0\)"):
        ex.map([_av()])
    assert time.monotonic() - t0 >= 1.5


def test_the_default_window_is_at_least_a_minute() -> None:
    assert FaultPolicy().outage_s >= 60
    with pytest.raises(ValueError, match=r"outage_s=-1: expected seconds >= 0"):
        FaultPolicy(outage_s=-1)


@pytest.mark.services
def test_an_endpoint_started_within_the_window_answers_the_request(
        aws_env: dict[str, str], handler_zip, tmp_path) -> None:
    from tests.dorylus.aws_services import start_lambda_local

    port = free_port()
    ex = LambdaExecutor(function_name="dorylus-outage-late", region="us-east-1",
                        endpoint_url=f"http://127.0.0.1:{port}", outage_backoff_max_s=0.5, max_attempts=1)
    with ex:
        future = ex.submit(_av(interval=2))
        time.sleep(2.0)  # refused meanwhile
        assert not future.done() and ex.stats["connection_retries"] >= 1
        server = start_lambda_local(handler_zip, concurrency=1, port=port)
        try:
            out = future.result(timeout=60)
        finally:
            server.stop()
    assert torch.equal(out["h"], InlineExecutor().map([_av(interval=2)])[0]["h"])
