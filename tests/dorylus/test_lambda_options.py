"""``executor="lambda"`` takes its endpoint from ``endpoint_url`` or ``$DORYLUS_LAMBDA_ENDPOINT``, in a user
script as in the recipe; checked on the boto3 client the executor builds (no request is sent).

Was: only the recipe read ``DORYLUS_LAMBDA_ENDPOINT``; a user script with ``executor="lambda"`` went to AWS.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_dorylus import DorylusStrategy
from lightning_dorylus.executors import LambdaExecutor, TensorOpExecutor, build_executor
from recipes.compose import compose_recipe
from recipes.train import build_strategy

LOCAL = "http://127.0.0.1:9001"


@pytest.fixture
def no_aws_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No DORYLUS_* variable from the caller's shell; dummy credentials (boto3 builds clients offline)."""
    for name in ("DORYLUS_LAMBDA_ENDPOINT", "DORYLUS_LAMBDA_FUNCTION", "DORYLUS_S3_BUCKET",
                 "DORYLUS_S3_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    return monkeypatch


def _started(strategy: DorylusStrategy) -> TensorOpExecutor:
    """The executor as ``DorylusStrategy`` builds it from ``executor`` + ``executor_options``, started
    (which creates the boto3 clients; nothing is invoked)."""
    executor = build_executor(strategy.options.executor, **strategy.options.executor_options)
    executor.start()
    return executor


def test_user_script_honours_the_endpoint_variable(no_aws_env: pytest.MonkeyPatch) -> None:
    no_aws_env.setenv("DORYLUS_LAMBDA_ENDPOINT", LOCAL)
    no_aws_env.setenv("DORYLUS_S3_ENDPOINT", "http://127.0.0.1:5000")
    executor = _started(DorylusStrategy(executor="lambda", executor_options={"region": "us-east-1"}))
    try:
        assert isinstance(executor, LambdaExecutor)
        assert executor._lambda.meta.endpoint_url == LOCAL
        assert executor.function_name == "dorylus-tensor-ops" and executor.s3_bucket is None
        assert "endpoint_url='http://127.0.0.1:9001'" in repr(executor)
    finally:
        executor.close()


def test_the_explicit_option_wins_over_the_variable(no_aws_env: pytest.MonkeyPatch) -> None:
    no_aws_env.setenv("DORYLUS_LAMBDA_ENDPOINT", LOCAL)
    no_aws_env.setenv("DORYLUS_LAMBDA_FUNCTION", "from-env")
    options = {"region": "us-east-1", "endpoint_url": "http://127.0.0.1:9002", "function_name": "mine"}
    executor = _started(DorylusStrategy(executor="lambda", executor_options=options))
    try:
        assert executor._lambda.meta.endpoint_url == "http://127.0.0.1:9002"
        assert executor.function_name == "mine"
    finally:
        executor.close()


def test_without_variable_or_option_boto3_goes_to_aws(no_aws_env: pytest.MonkeyPatch) -> None:
    executor = LambdaExecutor(region="eu-west-1")
    executor.start()
    try:
        assert executor._lambda.meta.endpoint_url == "https://lambda.eu-west-1.amazonaws.com"
    finally:
        executor.close()


def test_a_bad_endpoint_is_named_with_its_variable(no_aws_env: pytest.MonkeyPatch) -> None:
    no_aws_env.setenv("DORYLUS_LAMBDA_ENDPOINT", "127.0.0.1:9001")  # no scheme
    with pytest.raises(ValueError, match=r"endpoint_url='127.0.0.1:9001': expected an http\(s\) URL .* "
                                         r"\$DORYLUS_LAMBDA_ENDPOINT"):
        LambdaExecutor(region="us-east-1")


def test_the_recipe_gets_the_same_endpoint(no_aws_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    no_aws_env.setenv("DORYLUS_LAMBDA_ENDPOINT", LOCAL)
    no_aws_env.setenv("DORYLUS_S3_BUCKET", "b")
    cfg = compose_recipe("dorylus_gcn_cora_lambda", tmp_path, ["trainer.max_epochs=1"])
    strategy = build_strategy(cfg.strategy)
    executor = _started(strategy)
    try:
        assert executor._lambda.meta.endpoint_url == LOCAL and executor.s3_bucket == "b"
    finally:
        executor.close()
