"""End to end: 2 graph servers train the Cora GCN with ``executor="lambda"`` — every tensor op through boto3
to the local Lambda endpoint running the deploy zip, oversize pieces through moto's S3 — to the same
per-epoch losses as the local worker pool (float64, rtol 1e-9)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import boto3
import numpy as np
import pytest

from tests.dorylus.aws_services import BUCKET
from tests.dorylus.scripts.launch import SCRIPTS
from tests.process import REPO, launch_env, run_ranks

PLANETOID = REPO / "data" / "planetoid"


def _run(out: Path, extra_env: dict[str, str]) -> dict[str, dict]:
    """Both executors in one launch of the 2 graph servers (Lambda first, then the local pool)."""
    cmd = [sys.executable, str(SCRIPTS / "lambda_cora_run.py"), str(out), str(PLANETOID),
           "--executor", "lambda,local", "--epochs", "3"]
    run_ranks(cmd, 2, timeout=900, cwd=out, env=launch_env(extra_env))  # both servers started together
    return {name: json.loads((out / name / "result.json").read_text()) for name in ("lambda", "local")}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.services
@pytest.mark.timeout(1800)
@pytest.mark.skipif(not (PLANETOID / "Cora" / "raw").is_dir(), reason=f"no Cora raw files in {PLANETOID}")
def test_two_graph_servers_on_lambda_match_the_local_pool(tmp_path: Path, lambda_endpoint: str,
                                                          s3_endpoint: str) -> None:
    env = {"DORYLUS_TEST_LAMBDA_ENDPOINT": lambda_endpoint, "DORYLUS_TEST_S3_ENDPOINT": s3_endpoint,
           "DORYLUS_TEST_S3_BUCKET": BUCKET}
    results = _run(tmp_path, env)
    on_lambda, local = results["lambda"], results["local"]
    assert len(on_lambda["losses"]) == len(local["losses"]) == 3
    np.testing.assert_allclose(on_lambda["losses"], local["losses"], rtol=1e-9)
    np.testing.assert_allclose(on_lambda["val_acc"], local["val_acc"], rtol=1e-9)
    stats = on_lambda["stats"]
    # the 1433-wide float64 layer-1 requests are over 6 MB: they were cut into pieces
    assert stats["pieces"] > stats["requests"] > 0 and stats["failed"] == 0
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    assert s3.list_objects_v2(Bucket=BUCKET).get("KeyCount", 0) == 0
