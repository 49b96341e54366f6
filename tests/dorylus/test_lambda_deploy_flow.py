"""The Lambda path as a user deploys it, without AWS: ``python -m lightning_dorylus.deploy --endpoint-url``
into a running local endpoint that started with no function, then training through it with the Lambda
executor (the handler zip runs behind the real serialization boundary: JSON + base64 wire bytes, never a
pickle); the same endpoint stopped for 10 s mid-fit and started again on the same port, the fit carrying on
to the weights of an uninterrupted run."""

from __future__ import annotations

import base64
import datetime
import hashlib
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import boto3
import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_dorylus import DorylusStrategy, deploy
from lightning_dorylus.executors import ExecutorError, LambdaExecutor
from lightning_dorylus.ops import bundle
from tests.dorylus.aws_services import Server, endpoint_stats, start_lambda_local
from tests.dorylus.scripts.exact_run import make_model
from tests.dorylus.test_executor_failure_checkpoint import _fit
from tests.dorylus.test_lambda import _av

pytestmark = [pytest.mark.services, pytest.mark.timeout(600)]
TIMEOUT = datetime.timedelta(seconds=120)
ROLE = "arn:aws:iam::000000000000:role/dorylus-local"
LAYER = "arn:aws:lambda:us-east-1:000000000000:layer:numpy:1"


def _deploy_args(endpoint: str, function: str, *extra: str) -> list[str]:
    return ["--endpoint-url", endpoint, "--function-name", function, "--region", "us-east-1",
            "--role-arn", ROLE, "--layer-arn", LAYER, *extra]


def _executor(endpoint: str, function: str, **options) -> LambdaExecutor:
    return LambdaExecutor(function_name=function, region="us-east-1", endpoint_url=endpoint,
                          max_concurrency=4, **options)


def _weights(model: LightningModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """4 epochs of the float64 GCN with the inline executor (the ops on the graph server itself)."""
    model = make_model("gcn")
    _fit(DorylusStrategy(executor="inline", timeout=TIMEOUT), model, tmp_path_factory.mktemp("inline"))
    return _weights(model)


@pytest.fixture
def empty_endpoint(aws_env: dict[str, str]):
    """A local Lambda endpoint of this test's own, started with no function (no ``--zip``)."""
    server = start_lambda_local(None, concurrency=2)
    yield server
    server.stop()


def test_deploy_into_an_empty_local_endpoint_then_train_through_it(
        empty_endpoint: Server, reference: dict[str, torch.Tensor], tmp_path: Path, capsys) -> None:
    endpoint, function = empty_endpoint.url, f"dorylus-deployed-{uuid.uuid4().hex[:8]}"
    with _executor(endpoint, function) as ex, \
            pytest.raises(ExecutorError, match=r"ResourceNotFoundException: Function not found: "
                          rf"arn:aws:lambda:us-east-1:000000000000:function:{function} .*python -m "
                          r"lightning_dorylus.deploy --endpoint-url"):
        ex.map([_av()])  # nothing deployed yet

    assert deploy.main(_deploy_args(endpoint, function)) == 0  # GetFunction (404) -> CreateFunction -> active
    assert f"deployed arn:aws:lambda:us-east-1:000000000000:function:{function}" in capsys.readouterr().out
    lam = boto3.client("lambda", endpoint_url=endpoint, region_name="us-east-1")
    conf = lam.get_function(FunctionName=function)["Configuration"]
    zip_bytes = deploy.build_zip(tmp_path / "same.zip")[0].read_bytes()  # reproducible: the deployed bytes
    assert conf["CodeSha256"] == base64.b64encode(hashlib.sha256(zip_bytes).digest()).decode()
    assert (conf["Handler"], conf["Runtime"], conf["Role"]) == (bundle.LAMBDA_HANDLER, deploy.RUNTIME, ROLE)
    assert (conf["MemorySize"], conf["Timeout"], conf["State"]) == (1769, 60, "Active")
    assert [layer["Arn"] for layer in conf["Layers"]] == [LAYER]

    model = make_model("gcn")
    with _executor(endpoint, function) as ex:
        _fit(DorylusStrategy(executor=ex, timeout=TIMEOUT), model, tmp_path / "lambda")
        assert ex.stats["requests"] > 0 and ex.stats["failed"] == 0
    for name, value in reference.items():
        assert torch.equal(model.state_dict()[name], value), name  # float64, bit for bit
    assert endpoint_stats(endpoint, function)["ok"] >= ex.stats["requests"]

    # deployed again: the function exists, so its code and configuration are updated (and waited for)
    again = _deploy_args(endpoint, function, "--memory", "2048", "--reserved-concurrency", "2")
    assert deploy.main(again) == 0
    got = lam.get_function(FunctionName=function)
    assert got["Configuration"]["MemorySize"] == 2048
    assert got["Concurrency"] == {"ReservedConcurrentExecutions": 2}
    assert endpoint_stats(endpoint, function)["code_updates"] == 1


def test_what_the_local_endpoint_cannot_run_is_refused_naming_the_local_flow(
        empty_endpoint: Server, tmp_path: Path, capsys) -> None:
    lam = boto3.client("lambda", endpoint_url=empty_endpoint.url, region_name="us-east-1")
    with pytest.raises(lam.exceptions.InvalidParameterValueException,
                       match=r"Code.ZipFile only, got \['S3Bucket', 'S3Key'\].*python -m "
                             r"lightning_dorylus.deploy --endpoint-url"):
        lam.create_function(FunctionName="f", Role=ROLE, Code={"S3Bucket": "bucket", "S3Key": "k.zip"})
    zip_bytes = deploy.build_zip(tmp_path / "handler.zip")[0].read_bytes()
    with pytest.raises(lam.exceptions.InvalidParameterValueException,
                       match=rf"Handler 'app.handler': lambda_local runs the Dorylus handler "
                             rf"{bundle.LAMBDA_HANDLER} only"):
        lam.create_function(FunctionName="f", Role=ROLE, Handler="app.handler", Code={"ZipFile": zip_bytes})
    with pytest.raises(lam.exceptions.ClientError, match=r"lambda_local serves Invoke, GetFunction, "
                       r"CreateFunction.*no such operation: GET /2015-03-31/functions"):
        lam.list_functions()
    # a call that fails in deploy: one line naming it, Lambda's code and message, exit status 1
    assert deploy.main([*_deploy_args(empty_endpoint.url, "f"), "--timeout", "900"]) == 0
    lam.put_function_concurrency(FunctionName="f", ReservedConcurrentExecutions=0)
    assert lam.get_function(FunctionName="f")["Concurrency"]["ReservedConcurrentExecutions"] == 0
    capsys.readouterr()
    assert deploy.main(_deploy_args(empty_endpoint.url, "missing:name")) == 1
    err = capsys.readouterr().err
    assert err.startswith("deploy: CreateFunction on function 'missing:name' at http://127.0.0.1:") and \
        "InvalidParameterValueException: FunctionName 'missing:name'" in err and "Traceback" not in err, err


class StopEndpoint(Callback):
    """At the start of epoch ``epoch``, stops the endpoint and starts it again on the same port (from the
    same handler zip) ``down_s`` seconds later, on a thread, while training goes on."""

    def __init__(self, server: Server, zip_path: Path, epoch: int, down_s: float) -> None:
        self.server, self.zip_path, self.epoch, self.down_s = server, zip_path, epoch, down_s
        self.stopped_at: float | None = None
        self.back_at: float | None = None
        self.thread: threading.Thread | None = None

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.current_epoch != self.epoch:
            return
        self.server.stop()
        self.stopped_at = time.monotonic()
        self.thread = threading.Thread(target=self._restart, daemon=True)
        self.thread.start()

    def _restart(self) -> None:
        time.sleep(self.down_s)
        port = urlsplit(self.server.url).port
        self.server = start_lambda_local(self.zip_path, concurrency=2, port=port)
        self.back_at = time.monotonic()


@pytest.mark.slow  # about a minute: 10 s down, a restart, 4 epochs
def test_fit_survives_the_endpoint_stopped_for_10_s(
        aws_env: dict[str, str], handler_zip: Path, reference: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    server = start_lambda_local(handler_zip, concurrency=2)
    stopper = StopEndpoint(server, handler_zip, epoch=2, down_s=10.0)
    model = make_model("gcn")
    try:
        with _executor(server.url, "dorylus-outage", max_attempts=2) as ex:
            _fit(DorylusStrategy(executor=ex, timeout=TIMEOUT), model, tmp_path / "run", callbacks=[stopper])
            stats = dict(ex.stats)
    finally:
        if stopper.thread is not None:
            stopper.thread.join(120)
        stopper.server.stop()
        server.stop()
    assert stopper.stopped_at is not None and stopper.back_at is not None
    assert stopper.back_at - stopper.stopped_at >= 10.0
    assert stats["connection_retries"] >= 2 and stats["failed"] == 0  # it waited the outage out
    for name, value in reference.items():
        assert torch.equal(model.state_dict()[name], value), name  # the uninterrupted run's weights
