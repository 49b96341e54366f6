"""An endpoint that cannot be reached is retried over the outage window, not given up after
``max_attempts`` quick tries: a request fails only once the endpoint has been unreachable for
``max(outage_s, deadline_s)``, and one started again within it answers the same request."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
import uuid
from urllib.parse import urlsplit

import numpy as np
import pytest
import torch

from lightning_dorylus.executors import ExecutorError, FaultPolicy, InlineExecutor, LambdaExecutor
from tests.dorylus.aws_services import DUMMY_AWS_ENV
from tests.dorylus.scripts.launch import SCRIPTS
from tests.dorylus.test_lambda import _av
from tests.process import REPO, free_port, launch_env, run_ranks

PLANETOID = REPO / "data" / "planetoid"

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


class Outage:
    """Stops a local endpoint once it has answered ``after_ok`` invocations of ``function`` and starts it
    again on the same port ``down_s`` seconds later (a thread; the test joins it)."""

    def __init__(self, server, zip_path, function: str, after_ok: int, down_s: float) -> None:
        self.server, self.zip_path, self.function = server, zip_path, function
        self.after_ok, self.down_s = after_ok, down_s
        self.stopped_at: float | None = None
        self.back_at: float | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from tests.dorylus.aws_services import endpoint_stats, start_lambda_local

        try:
            deadline = time.monotonic() + 600
            while endpoint_stats(self.server.url, self.function).get("ok", 0) < self.after_ok:
                if time.monotonic() > deadline:
                    raise TimeoutError("the run never reached the endpoint")
                time.sleep(0.2)
            port = urlsplit(self.server.url).port
            self.server.stop()
            self.stopped_at = time.monotonic()
            time.sleep(self.down_s)
            self.server = start_lambda_local(self.zip_path, concurrency=4, port=port)
            self.back_at = time.monotonic()
        except BaseException as err:  # reported by the test
            self.error = err


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.services
@pytest.mark.timeout(1800)
@pytest.mark.skipif(not (PLANETOID / "Cora" / "raw").is_dir(), reason=f"no Cora raw files in {PLANETOID}")
def test_two_graph_servers_survive_the_endpoint_stopped_for_10_s(
        aws_env: dict[str, str], handler_zip, s3_endpoint: str, tmp_path) -> None:
    """Both servers of the Cora e2e run lose the endpoint mid-fit for 10 s; both wait it out, and the
    per-epoch losses equal the local pool's (float64, rtol 1e-9), as in the uninterrupted e2e test."""
    from tests.dorylus.aws_services import BUCKET, start_lambda_local

    server = start_lambda_local(handler_zip, concurrency=4)
    outage = Outage(server, handler_zip, "dorylus-cora-e2e", after_ok=6, down_s=10.0)
    env = {"DORYLUS_TEST_LAMBDA_ENDPOINT": server.url, "DORYLUS_TEST_S3_ENDPOINT": s3_endpoint,
           "DORYLUS_TEST_S3_BUCKET": BUCKET}
    cmd = [sys.executable, str(SCRIPTS / "lambda_cora_run.py"), str(tmp_path), str(PLANETOID),
           "--executor", "lambda,local", "--epochs", "3"]
    outage.thread.start()
    try:
        run_ranks(cmd, 2, timeout=900, cwd=tmp_path, env=launch_env(env))
    finally:
        outage.thread.join(120)
        outage.server.stop()
        server.stop()
    assert outage.error is None, outage.error
    assert outage.stopped_at is not None and outage.back_at is not None
    assert outage.back_at - outage.stopped_at >= 10.0
    on_lambda, local = (json.loads((tmp_path / name / "result.json").read_text())
                        for name in ("lambda", "local"))
    assert len(on_lambda["losses"]) == len(local["losses"]) == 3
    np.testing.assert_allclose(on_lambda["losses"], local["losses"], rtol=1e-9)
    np.testing.assert_allclose(on_lambda["val_acc"], local["val_acc"], rtol=1e-9)
    stats = on_lambda["stats"]  # rank 0's executor
    assert stats["connection_retries"] >= 1 and stats["failed"] == 0, stats
