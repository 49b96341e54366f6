"""Local AWS stand-ins for the Lambda tests: moto's S3 server and ``lightning_dorylus.lambda_local``.

``scripts/services.sh`` starts both once for a whole run and exports ``DORYLUS_TEST_S3_ENDPOINT`` and
``DORYLUS_TEST_LAMBDA_ENDPOINT``; the fixtures reuse those when set, else start their own server on a free
loopback port and stop it by PID (moto's ``ThreadedMotoServer`` shape, but as a separate process).
Everything listens on 127.0.0.1; credentials are dummies.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.process import REPO, free_port

DUMMY_AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}
BUCKET = "dorylus-test"


class Server:
    """A server process we started (killed by its process group), or an endpoint someone else runs."""

    def __init__(self, url: str, proc: subprocess.Popen | None = None) -> None:
        self.url = url
        self.proc = proc

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _wait_port(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before listening on {port}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def start_moto(timeout: float = 60.0) -> Server:
    """moto's real server (S3 and the rest of its API) on a free loopback port."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_port(port, proc, timeout)
    except BaseException:
        Server("", proc).stop()
        raise
    return Server(f"http://127.0.0.1:{port}", proc)


def build_handler_zip(path: Path) -> Path:
    """The deployment zip, built by ``deploy --dry-run`` (``main``, in-process)."""
    from lightning_dorylus import deploy

    assert deploy.main(["--dry-run", str(path)]) == 0
    return path


def start_lambda_local(zip_path: Path | None, concurrency: int = 4, timeout: float = 120.0,
                       port: int = 0) -> Server:
    """``python -m lightning_dorylus.lambda_local`` on ``port`` (0: a free one; it prints ``READY port=N``);
    ``zip_path`` None: it starts with no function (``deploy --endpoint-url`` creates it)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    code = ["--zip", str(zip_path)] if zip_path is not None else []
    proc = subprocess.Popen([sys.executable, "-m", "lightning_dorylus.lambda_local", *code,
                             "--port", str(port), "--concurrency", str(concurrency)],
                            stdout=subprocess.PIPE, text=True, env=env, cwd=REPO, start_new_session=True)
    assert proc.stdout is not None
    try:
        if not select.select([proc.stdout], [], [], timeout)[0]:
            raise RuntimeError(f"lambda_local printed nothing within {timeout} s")
        line = proc.stdout.readline()
        if not line.startswith("READY port="):
            raise RuntimeError(f"lambda_local did not start: {line!r} (exit {proc.poll()})")
    except BaseException:
        Server("", proc).stop()
        raise
    return Server(f"http://127.0.0.1:{int(line.split('=')[1])}", proc)


def set_faults(endpoint: str, function: str, **faults: float) -> None:
    """Inject faults into the local Lambda endpoint for ``function`` (see ``lambda_local``)."""
    body = json.dumps({"function": function, **faults}).encode()
    req = urllib.request.Request(f"{endpoint}/_control/faults", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        resp.read()


def endpoint_stats(endpoint: str, function: str) -> dict[str, int]:
    with urllib.request.urlopen(f"{endpoint}/_control/stats?function={function}", timeout=10) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="session")
def aws_env() -> Iterator[dict[str, str]]:
    """Dummy credentials in ``os.environ`` for boto3 (restored afterwards)."""
    saved = {k: os.environ.get(k) for k in DUMMY_AWS_ENV}
    os.environ.update(DUMMY_AWS_ENV)
    yield DUMMY_AWS_ENV
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def s3_endpoint(aws_env: dict[str, str]) -> Iterator[str]:
    """An S3 endpoint with the bucket ``BUCKET``: ``DORYLUS_TEST_S3_ENDPOINT`` or a moto server of our own."""
    import boto3

    server = Server(os.environ["DORYLUS_TEST_S3_ENDPOINT"]) if os.environ.get("DORYLUS_TEST_S3_ENDPOINT") \
        else start_moto()
    try:
        s3 = boto3.client("s3", endpoint_url=server.url, region_name="us-east-1")
        with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou):
            s3.create_bucket(Bucket=BUCKET)
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def handler_zip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_handler_zip(tmp_path_factory.mktemp("lambda") / "handler.zip")


@pytest.fixture(scope="session")
def lambda_endpoint(aws_env: dict[str, str], handler_zip: Path) -> Iterator[str]:
    """A Lambda Invoke endpoint: ``DORYLUS_TEST_LAMBDA_ENDPOINT`` or a ``lambda_local`` of our own."""
    env_url = os.environ.get("DORYLUS_TEST_LAMBDA_ENDPOINT")
    server = Server(env_url) if env_url else start_lambda_local(handler_zip)
    try:
        yield server.url
    finally:
        server.stop()
