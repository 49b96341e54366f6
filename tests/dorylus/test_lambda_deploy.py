"""``python -m lightning_dorylus.deploy``: the zip's size and contents, and create-then-update of the
function through boto3 against moto's Lambda API (moto stores functions without Docker; only invoking
would need it — invocations are tested against ``lambda_local``)."""

from __future__ import annotations

import base64
import hashlib
import json
import zipfile
from pathlib import Path

import boto3
import pytest

from lightning_dorylus import deploy
from lightning_dorylus.ops import bundle

TRUST = json.dumps(deploy.TRUST_POLICY)


def test_dry_run_writes_only_the_bundle_and_is_reproducible(tmp_path: Path, capsys) -> None:
    assert deploy.main(["--dry-run", str(tmp_path / "a.zip")]) == 0
    printed = capsys.readouterr().out
    assert "bytes zipped" in printed and "numpy comes from the layer" in printed
    assert deploy.main(["--dry-run", str(tmp_path / "b.zip")]) == 0
    a, b = (tmp_path / "a.zip").read_bytes(), (tmp_path / "b.zip").read_bytes()
    assert a == b  # same sources, same bytes: an unchanged bundle keeps its CodeSha256
    with zipfile.ZipFile(tmp_path / "a.zip") as zf:
        names = set(zf.namelist())
    assert "lightning_dorylus/ops/lambda_entry.py" in names and "lightning_dorylus/wire.py" in names
    assert not any(n.startswith(("torch", "numpy")) for n in names)
    assert len(a) < 1 << 20  # far under the 50 MB upload / 250 MB unzipped limits


@pytest.mark.services
def test_deploy_creates_then_updates_the_function(s3_endpoint: str, tmp_path: Path, capsys) -> None:
    moto = s3_endpoint  # moto's server answers every AWS API it mocks, IAM and Lambda included
    iam = boto3.client("iam", endpoint_url=moto, region_name="us-east-1")
    role = iam.create_role(RoleName=f"dorylus-{tmp_path.name[-8:]}", AssumeRolePolicyDocument=TRUST)["Role"]
    lam = boto3.client("lambda", endpoint_url=moto, region_name="us-east-1")
    # moto checks that layers exist: publish one in the account standing in for the managed numpy layer
    layer_zip = tmp_path / "layer.zip"
    with zipfile.ZipFile(layer_zip, "w") as zf:
        zf.writestr("python/README", "stand-in for the AWS SDK for pandas layer (numpy)")
    layer = lam.publish_layer_version(LayerName="numpy-stand-in", Content={"ZipFile": layer_zip.read_bytes()},
                                      CompatibleRuntimes=[deploy.RUNTIME])
    args = ["--function-name", f"dorylus-deploy-{tmp_path.name[-8:]}", "--role-arn", role["Arn"],
            "--layer-arn", layer["LayerVersionArn"], "--region", "us-east-1", "--endpoint-url", moto,
            "--memory", "2048"]
    assert deploy.main([*args]) == 0
    first = capsys.readouterr().out
    assert "deployed arn:aws:lambda:us-east-1:" in first and '"lambda.amazonaws.com"' in first
    conf = lam.get_function(FunctionName=args[1])["Configuration"]
    assert conf["Handler"] == bundle.LAMBDA_HANDLER and conf["Runtime"] == deploy.RUNTIME
    assert conf["MemorySize"] == 2048
    assert deploy.main([*args[:-2], "--memory", "3008"]) == 0  # exists now: update code and configuration
    conf = lam.get_function(FunctionName=args[1])["Configuration"]
    assert conf["MemorySize"] == 3008
    zip_bytes = deploy.build_zip(tmp_path / "same.zip")[0].read_bytes()  # reproducible: the deployed bytes
    assert conf["CodeSha256"] == base64.b64encode(hashlib.sha256(zip_bytes).digest()).decode()


def test_deploy_without_role_or_layer_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        deploy.main(["--function-name", "f", "--region", "us-east-1"])
