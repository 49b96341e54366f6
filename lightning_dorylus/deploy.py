"""Deploy the tensor-op handler as an AWS Lambda function (boto3), or just build its zip.

    python -m lightning_dorylus.deploy --dry-run handler.zip
    python -m lightning_dorylus.deploy --function-name dorylus-tensor-ops \\
        --role-arn arn:aws:iam::123456789012:role/dorylus-lambda \\
        --layer-arn arn:aws:lambda:us-east-1:336392948345:layer:AWSSDKPandas-Python312:<version> \\
        [--region us-east-1] [--memory 1769] [--timeout 60] [--reserved-concurrency 100] [--op-module my_ops]

The zip is the handler bundle (``ops/bundle.py``: ``wire.py``, ``ops/*.py`` incl. ``lambda_entry.py``),
about 20 KB, plus each ``--op-module`` (a module of the user's own ops, see
``lightning_dorylus.ops.registry``; imported at the function's cold start). numpy is NOT vendored: it comes
from the AWS-managed "AWS SDK for pandas" layer (numpy is one of its packages; its ARN per region and
Python version is listed at https://aws-sdk-pandas.readthedocs.io/en/stable/layers.html and in SSM under
``/aws/service/aws-sdk-pandas/<version>/<region>/py3.12/x86_64/layer-arn``), which keeps function plus
layers far under Lambda's 250 MB unzipped limit (the layer is about 150 MB unzipped). The function is
created if missing, else its code and configuration are updated; each step waits until Lambda reports the
function active / updated. Credentials come from boto3's chain (environment, ``~/.aws``, instance role) and
are never printed. ``--print-iam`` prints the role and policies.

Without AWS, the same command deploys to the package's local endpoint (``python -m
lightning_dorylus.lambda_local``, started without ``--zip``; it prints ``READY port=N``), which serves the
calls made here and then runs the zip for the Lambda executor (any dummy credentials, any role and layer
ARN: the local runtime has numpy)::

    python -m lightning_dorylus.deploy --endpoint-url http://127.0.0.1:N --region us-east-1 \
        --role-arn arn:aws:iam::000000000000:role/local \
        --layer-arn arn:aws:lambda:us-east-1:000000000000:layer:numpy:1

A call that fails ends with one line naming it and Lambda's error (exit status 1), not a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_dorylus.ops import bundle, registry

#: Lambda's limits on a deployment package.
ZIP_UPLOAD_LIMIT = 50 * 1024 * 1024  # direct upload (ZipFile=...)
UNZIPPED_LIMIT = 250 * 1024 * 1024  # function + layers, unzipped
RUNTIME = "python3.12"

TRUST_POLICY = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Principal": {"Service": "lambda.amazonaws.com"},
                   "Action": "sts:AssumeRole"}],
}


def graph_server_policy(function_arn: str, bucket: str | None) -> dict[str, Any]:
    """What the graph servers' credentials need: invoke the function, and (for payloads over 6 MB)
    put/get/delete objects in the staging bucket (the handler reads and writes via presigned URLs, so
    the function's own role needs no S3 access)."""
    statements: list[dict[str, Any]] = [
        {"Effect": "Allow", "Action": "lambda:InvokeFunction", "Resource": function_arn}]
    if bucket:
        statements.append({"Effect": "Allow", "Action": ["s3:PutObject", "s3:GetObject", "s3:DeleteObject"],
                           "Resource": f"arn:aws:s3:::{bucket}/dorylus/*"})
    return {"Version": "2012-10-17", "Statement": statements}


def build_zip(path: str | Path, op_modules: Sequence[str] = ()) -> tuple[Path, int, int]:
    """Write the deployment zip, with the user op modules ``op_modules`` (module names, see
    ``lightning_dorylus.ops.registry``); returns ``(path, zipped bytes, unzipped bytes)``.

    Each op module is imported here first, so one that fails to import or registers no op fails the build,
    not the Lambda's cold start.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    bundle.check_imports()
    for name in op_modules:
        before = set(registry.op_modules())
        registry.import_op_modules([name])
        if name not in registry.op_modules() and name not in before:
            raise ValueError(f"--op-module {name}: importing it registered no op (call "
                             "lightning_dorylus.ops.register_ops at the top of that module)")
    bundle.write_zip(path, op_modules)
    with zipfile.ZipFile(path) as zf:
        unzipped = sum(info.file_size for info in zf.infolist())
    return path, path.stat().st_size, unzipped


def deploy(zip_bytes: bytes, function_name: str, role_arn: str, layer_arns: list[str], region: str | None,
           memory: int, timeout: int, endpoint_url: str | None = None,
           reserved_concurrency: int | None = None) -> dict[str, Any]:
    """Create or update the function; returns its configuration (``FunctionArn``, ``CodeSha256``, ...)."""
    import boto3

    client = boto3.client("lambda", region_name=region, endpoint_url=endpoint_url)
    config = {"Role": role_arn, "Handler": bundle.LAMBDA_HANDLER, "Runtime": RUNTIME, "MemorySize": memory,
              "Timeout": timeout, "Layers": layer_arns,
              "Environment": {"Variables": {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}}}
    try:
        client.get_function(FunctionName=function_name)
        exists = True
    except client.exceptions.ResourceNotFoundException:
        exists = False
    if exists:
        client.update_function_code(FunctionName=function_name, ZipFile=zip_bytes)
        client.get_waiter("function_updated").wait(FunctionName=function_name)
        result = client.update_function_configuration(FunctionName=function_name, **config)
        client.get_waiter("function_updated").wait(FunctionName=function_name)
    else:
        result = client.create_function(FunctionName=function_name, Code={"ZipFile": zip_bytes},
                                        Architectures=["x86_64"], **config)
        client.get_waiter("function_active_v2").wait(FunctionName=function_name)  # State Pending -> Active
    if reserved_concurrency is not None:
        client.put_function_concurrency(FunctionName=function_name,
                                        ReservedConcurrentExecutions=reserved_concurrency)
    return result


def _check_memory(value: str) -> int:
    mb = int(value)
    if not 128 <= mb <= 10240:
        raise argparse.ArgumentTypeError(f"--memory {mb}: Lambda allows 128..10240 MB")
    return mb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_dorylus.deploy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", metavar="ZIP", help="only write the deployment zip to ZIP")
    parser.add_argument("--function-name", default="dorylus-tensor-ops")
    parser.add_argument("--role-arn", help="execution role (see --print-iam)")
    parser.add_argument("--layer-arn", action="append", default=[],
                        help="numpy layer, e.g. AWS SDK for pandas, python3.12, your region (repeatable)")
    parser.add_argument("--region", default=None, help="AWS region (default: boto3's configuration)")
    parser.add_argument("--memory", type=_check_memory, default=1769, help="MB; 1769 MB = one full vCPU")
    parser.add_argument("--timeout", type=int, default=60, help="function timeout in seconds (max 900)")
    parser.add_argument("--reserved-concurrency", type=int, default=None)
    parser.add_argument("--endpoint-url", default=None, help="Lambda API endpoint (tests: a local one)")
    parser.add_argument("--bucket", default=None, help="S3 staging bucket, for the printed policy")
    parser.add_argument("--print-iam", action="store_true", help="print the IAM trust policy and policies")
    parser.add_argument("--op-module", action="append", default=[], metavar="MODULE",
                        help="a module of your own ops (lightning_dorylus.ops.register_ops), importable from "
                             "here, e.g. my_ops; shipped in the zip and imported at cold start (repeatable)")
    args = parser.parse_args(argv)
    if "" not in sys.path:  # `python -m` puts the working directory first; a console script may not
        sys.path.insert(0, "")

    tmp = None if args.dry_run else tempfile.TemporaryDirectory(prefix="dorylus-deploy-")
    out = Path(args.dry_run) if args.dry_run else Path(tmp.name) / "dorylus-handler.zip"  # type: ignore[union-attr]
    path, zipped, unzipped = build_zip(out, args.op_module)
    print(f"built {path}: {zipped} bytes zipped, {unzipped} bytes unzipped "
          f"(Lambda: {ZIP_UPLOAD_LIMIT >> 20} MB upload, {UNZIPPED_LIMIT >> 20} MB unzipped incl. layers; "
          f"numpy comes from the layer)")
    if args.print_iam or not args.dry_run:
        print("execution role trust policy (attach AWSLambdaBasicExecutionRole for logs):")
        print(json.dumps(TRUST_POLICY, indent=2))
        arn = f"arn:aws:lambda:{args.region or '<region>'}:<account>:function:{args.function_name}"
        print("policy for the graph servers' credentials:")
        print(json.dumps(graph_server_policy(arn, args.bucket), indent=2))
    if args.dry_run:
        return 0
    if not args.role_arn or not args.layer_arn:
        parser.error("deploying needs --role-arn and --layer-arn (a layer with numpy; see --help)")
    if not 1 <= args.timeout <= 900:
        parser.error(f"--timeout {args.timeout}: Lambda allows 1..900 seconds")
    zip_bytes = path.read_bytes()
    tmp.cleanup()  # type: ignore[union-attr]
    from botocore.exceptions import BotoCoreError, ClientError, WaiterError

    from lightning_dorylus.executors.aws_lambda import _where

    try:
        result = deploy(zip_bytes, args.function_name, args.role_arn, args.layer_arn, args.region,
                        args.memory, args.timeout, args.endpoint_url, args.reserved_concurrency)
    except ClientError as err:  # the operation and Lambda's error code and message; no request, no keys
        where = f" at {_where(args.endpoint_url)}" if args.endpoint_url else ""
        error = err.response.get("Error", {})
        print(f"deploy: {err.operation_name} on function {args.function_name!r}{where} failed: "
              f"{error.get('Code')}: {error.get('Message')}", file=sys.stderr)
        return 1
    except (BotoCoreError, WaiterError) as err:
        print(f"deploy: function {args.function_name!r}: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    print(f"deployed {result.get('FunctionArn')} (CodeSha256 {result.get('CodeSha256')}, "
          f"{result.get('MemorySize')} MB, timeout {result.get('Timeout')} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
