"""The "lambda" executor: tensor ops run in an AWS Lambda function, invoked through boto3.

Each planned piece of a request (see ``planning``: cut by rows so request and response fit Lambda's 6 MB
synchronous limit after base64) is one ``lambda.invoke`` (``InvocationType="RequestResponse"``) with the
event ``{"payload": base64(wire request)}``; the function (``ops/lambda_entry.py``, deployed by
``python -m lightning_dorylus.deploy``) answers ``{"payload": base64(wire response)}``. A piece that cannot
fit (an op that is not cut by rows, or one row too large) goes through S3: the request is put into
``s3_bucket``, the event carries a presigned GET URL for it and a presigned PUT URL for the response, and
both objects are deleted afterwards, also when the invocation fails.

Faults (``ResilientExecutor``, shared with the local pool): HTTP 429 ``TooManyRequestsException`` is retried
with jittered backoff and counted in ``stats["throttled"]``; a handler exception (``FunctionError``) raises
``RemoteOpError`` with the function's ``errorType: errorMessage``; a runtime crash or sandbox timeout, a
read timeout or an attempt past ``deadline_s`` is retried up to ``max_attempts``; a connection that cannot
be made or is dropped (the endpoint down, restarted, unreachable) is retried with backoff for
``max(outage_s, deadline_s)`` seconds (default 120) without using up ``max_attempts``, logged (op, interval
and endpoint host; never credentials); stragglers are
relaunched and late duplicates dropped. Credentials come from boto3's default chain and are never logged.

Op versions: a function whose op is other code than this graph server's (``OpVersionError`` from the
handler, or a response without this server's fingerprint) is refused, naming both fingerprints; with
``redeploy_on_mismatch=True`` the executor instead uploads this server's own handler zip (the bundle and the
op modules it imported, as ``python -m lightning_dorylus.deploy`` builds it) with ``UpdateFunctionCode``,
waits until the function is updated, and retries the request once; a second mismatch is refused as above.
One redeploy per executor; concurrent requests that meet the old code wait for it.

Where an option is not given, the environment fills it in (:data:`ENV_DEFAULTS`), the same for a user
script (``DorylusStrategy(executor="lambda")``) and for the recipes: e.g. ``DORYLUS_LAMBDA_ENDPOINT`` points
every graph server at the local endpoint (``python -m lightning_dorylus.lambda_local``). An explicit option
wins over the variable.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from typing_extensions import override

from .. import wire
from .base import ExecutorError, RemoteOpError, RetryableError, to_tensors
from .resilient import POLICY_FIELDS, Attempt, FaultPolicy, ResilientExecutor

log = logging.getLogger(__name__)

#: The options read from the environment when they are not given (``None``), and the default without either.
ENV_DEFAULTS: dict[str, tuple[str, str | None]] = {
    "function_name": ("DORYLUS_LAMBDA_FUNCTION", "dorylus-tensor-ops"),
    "endpoint_url": ("DORYLUS_LAMBDA_ENDPOINT", None),  # None: AWS
    "s3_bucket": ("DORYLUS_S3_BUCKET", None),
    "s3_endpoint_url": ("DORYLUS_S3_ENDPOINT", None),
}

#: FunctionError types that say the sandbox failed, not the op: worth another attempt.
RETRYABLE_FUNCTION_ERRORS = ("Runtime.", "Sandbox.")
#: Lambda API errors worth another attempt besides throttling.
RETRYABLE_API_ERRORS = frozenset({"ServiceException", "ResourceNotReadyException", "EC2ThrottledException",
                                  "ENILimitReachedException"})


class LambdaExecutor(ResilientExecutor):
    """Run ops in an AWS Lambda function (``executor="lambda"``).

    Args:
        function_name: the function (name or ARN) deployed by ``python -m lightning_dorylus.deploy``
            (``None``: ``$DORYLUS_LAMBDA_FUNCTION``, else ``"dorylus-tensor-ops"``).
        region: AWS region (``None``: boto3's configuration).
        endpoint_url: Lambda API endpoint (``None``: ``$DORYLUS_LAMBDA_ENDPOINT``, else AWS). The local
            endpoint: ``python -m lightning_dorylus.lambda_local`` prints ``READY port=N``; pass
            ``"http://127.0.0.1:N"``.
        max_concurrency: invocations in flight from this graph server (threads and HTTP connections).
            Lambda's default account limit is 1000 concurrent executions per region, shared by all servers.
        memory_mb: the function's memory (set at deploy time); only used for ``billed_gb_seconds``.
        s3_bucket: bucket for pieces over the payload limit (``None``: ``$DORYLUS_S3_BUCKET``, else none:
            such a piece raises instead).
        s3_prefix: key prefix of the staged objects.
        s3_endpoint_url: S3 endpoint (``None``: ``$DORYLUS_S3_ENDPOINT``, else AWS; tests: moto's server).
        payload_limit: bytes per invoke payload, each way (Lambda: 6 MB).
        max_rows: also cut requests into pieces of at most this many rows (``None``: only the limit cuts).
        connect_timeout: seconds to open an HTTPS connection.
        redeploy_on_mismatch: when the function runs other code for an op than this graph server, upload
            this server's handler zip to it (``lambda:UpdateFunctionCode``, which the credentials then need)
            and retry once, instead of refusing (see the module docstring). Off by default: a redeploy
            changes what every other user of the function runs.
        deadline_s, max_attempts, straggler_ratio, ...: the ``FaultPolicy`` fields. ``deadline_s`` also bounds
            boto3's read timeout, so an abandoned invocation frees its thread.
    """

    name = "lambda"

    def __init__(self, function_name: str | None = None, region: str | None = None,
                 endpoint_url: str | None = None, max_concurrency: int = 64, memory_mb: int = 1769,
                 s3_bucket: str | None = None, s3_prefix: str = "dorylus/",
                 s3_endpoint_url: str | None = None,
                 payload_limit: int = wire.LAMBDA_SYNC_PAYLOAD_LIMIT, max_rows: int | None = None,
                 connect_timeout: float = 10.0, redeploy_on_mismatch: bool = False, **policy: Any) -> None:
        function_name, endpoint_url, s3_bucket, s3_endpoint_url = (
            _from_env(name, value) for name, value in (
                ("function_name", function_name), ("endpoint_url", endpoint_url), ("s3_bucket", s3_bucket),
                ("s3_endpoint_url", s3_endpoint_url)))
        for name, url in (("endpoint_url", endpoint_url), ("s3_endpoint_url", s3_endpoint_url)):
            if url is not None and urlsplit(url).scheme not in ("http", "https"):
                raise ValueError(f"{name}={url!r}: expected an http(s) URL such as 'http://127.0.0.1:9001' "
                                 f"(from ${ENV_DEFAULTS[name][0]} when the option is not given)")
        if not isinstance(function_name, str) or not function_name:
            raise ValueError(f"function_name={function_name!r}: expected a Lambda function name or ARN")
        if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency!r}: expected an int >= 1")
        if not 128 <= memory_mb <= 10240:
            raise ValueError(f"memory_mb={memory_mb!r}: Lambda functions have 128..10240 MB")
        if not isinstance(redeploy_on_mismatch, bool):
            raise ValueError(f"redeploy_on_mismatch={redeploy_on_mismatch!r}: expected True or False")
        if not isinstance(payload_limit, int) or payload_limit < 4096:
            raise ValueError(f"payload_limit={payload_limit!r}: expected bytes >= 4096")
        unknown = sorted(set(policy) - POLICY_FIELDS)
        if unknown:
            raise TypeError(f"LambdaExecutor got unknown option(s) {unknown}; valid fault options are "
                            f"{sorted(POLICY_FIELDS)}")
        super().__init__(FaultPolicy(**policy), payload_limit=payload_limit, max_rows=max_rows)
        self.function_name = function_name
        self.region = region
        self.endpoint_url = endpoint_url
        self.max_concurrency = max_concurrency
        self.memory_mb = memory_mb
        self.s3_bucket = s3_bucket
        self.s3_prefix = s3_prefix
        self.s3_endpoint_url = s3_endpoint_url
        self.connect_timeout = connect_timeout
        self.redeploy_on_mismatch = redeploy_on_mismatch
        self._redeploy_lock = threading.Lock()
        self._redeployed: str | None = None  # the CodeSha256 uploaded by this executor's one redeploy
        self.billed_gb_seconds = 0.0  # client-side durations x memory: an upper bound of Lambda's bill
        self._start_lock = threading.Lock()
        self._closed = False
        self._pool: ThreadPoolExecutor | None = None
        self._lambda: Any = None
        self._s3: Any = None
        self._run_id = uuid.uuid4().hex[:12]
        self.stats.update(s3_pieces=0, s3_objects_deleted=0, redeploys=0)

    @override
    def start(self) -> None:
        with self._start_lock:
            if self._closed:
                raise ExecutorError("LambdaExecutor is closed")
            if self._pool is not None:
                return
            import boto3
            from botocore.config import Config

            session = boto3.session.Session(region_name=self.region)
            read_timeout = (self.policy.deadline_s or 900.0) + 10.0
            config = Config(retries={"total_max_attempts": 1, "mode": "standard"},  # we retry, and count
                            max_pool_connections=self.max_concurrency, connect_timeout=self.connect_timeout,
                            read_timeout=read_timeout)
            self._lambda = session.client("lambda", endpoint_url=self.endpoint_url, config=config)
            log.info("LambdaExecutor: function %r at %s", self.function_name,
                     _where(self.endpoint_url) if self.endpoint_url else "AWS")
            if self.s3_bucket is not None:
                s3_config = Config(retries={"mode": "standard"}, max_pool_connections=self.max_concurrency,
                                   s3={"addressing_style": "path"} if self.s3_endpoint_url else None)
                self._s3 = session.client("s3", endpoint_url=self.s3_endpoint_url, config=s3_config)
            self._pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="dorylus-lambda")
            self._start_monitor()

    @override
    def _launch(self, attempt: Attempt) -> None:
        assert self._pool is not None
        self._pool.submit(self._run, attempt)

    @override
    def _cancel(self, attempt: Attempt) -> None:
        """An HTTP invoke cannot be recalled: its late answer is dropped (boto3's read timeout ends it)."""

    def _run(self, attempt: Attempt) -> None:
        if not self._attempt_started(attempt):
            return
        start = time.monotonic()
        try:
            try:
                outputs = self._invoke(attempt)
            except FunctionVersionError:
                if not self.redeploy_on_mismatch:
                    raise
                self._redeploy()
                outputs = self._invoke(attempt)  # once: a second mismatch is refused
        except ExecutorError as err:
            self._attempt_done(attempt, error=err)
        except Exception as err:
            self._attempt_done(attempt, error=self._classify(attempt, err))
        else:
            self._attempt_done(attempt, outputs=outputs)
        finally:
            with self._state_lock:
                self.billed_gb_seconds += (time.monotonic() - start) * self.memory_mb / 1024

    def _redeploy(self) -> None:
        """Uploads this graph server's handler zip to the function and waits until it runs it (once per
        executor: later callers find it done)."""
        with self._redeploy_lock:
            if self._redeployed is not None:
                return
            from lightning_dorylus import deploy
            from lightning_dorylus.ops import registry

            with tempfile.TemporaryDirectory(prefix="dorylus-redeploy-") as tmp:
                path, _, _ = deploy.build_zip(Path(tmp) / "handler.zip", registry.op_modules())
                code = path.read_bytes()
            log.warning("LambdaExecutor: Lambda function %r runs other op code than this graph server; "
                        "redeploying this server's handler (%d bytes, redeploy_on_mismatch=True)",
                        self.function_name, len(code))
            result = self._lambda.update_function_code(FunctionName=self.function_name, ZipFile=code)
            self._lambda.get_waiter("function_updated").wait(FunctionName=self.function_name)
            self._redeployed = str(result.get("CodeSha256"))
            with self._state_lock:
                self.stats["redeploys"] += 1

    def _classify(self, attempt: Attempt, err: Exception) -> ExecutorError:
        from botocore.exceptions import BotoCoreError, ClientError, ConnectionClosedError
        from botocore.exceptions import ConnectionError as BotoConnectionError

        what = f"{attempt.call.describe()} attempt {attempt.number} on Lambda function {self.function_name!r}"
        if isinstance(err, ClientError):
            code = err.response.get("Error", {}).get("Code", "")
            message = err.response.get("Error", {}).get("Message", "")
            if code == "TooManyRequestsException":
                return RetryableError(f"{what} throttled (HTTP 429 TooManyRequestsException: {message})",
                                      "throttled")
            if code in RETRYABLE_API_ERRORS:
                return RetryableError(f"{what}: {code}: {message}", "lost")
            return ExecutorError(f"{what} failed: {code}: {message}")
        if isinstance(err, (BotoConnectionError, ConnectionClosedError)):  # refused, unreachable, reset
            where = _where(self.endpoint_url) if self.endpoint_url else "AWS Lambda"
            return RetryableError(f"{what}: {type(err).__name__}: could not reach {where}", "connection")
        if isinstance(err, BotoCoreError):  # read timeout, ...
            return RetryableError(f"{what}: {type(err).__name__}: {err}", "lost")
        return ExecutorError(f"{what} failed: {type(err).__name__}: {err}")

    def _invoke(self, attempt: Attempt) -> dict[str, Any]:
        call = attempt.call
        request = wire.encode(call.header, call.piece.inputs)
        if not call.piece.oversize:
            body = self._invoke_raw(attempt, {"payload": base64.b64encode(request).decode("ascii")})
            try:
                response = bytearray(base64.b64decode(body["payload"], validate=True))
            except (KeyError, TypeError, ValueError) as err:
                raise ExecutorError(f"{call.describe()}: Lambda function {self.function_name!r} answered "
                                    f"without a base64 'payload': {err}") from err
        else:
            response = self._invoke_via_s3(attempt, request)
        header, arrays = wire.decode(response)
        if not header.get("ok"):
            raise RemoteOpError(f"{call.describe()} failed in Lambda function {self.function_name!r}: "
                                f"{header.get('error_type')}: {header.get('message')}",
                                str(header.get("error_type")))
        ours, theirs = call.header["fingerprint"], header.get("fingerprint") or "without a fingerprint"
        if theirs != ours:  # a handler that does not check (deployed before fingerprints)
            raise FunctionVersionError(
                f"{call.describe()}: Lambda function {self.function_name!r} ran op {call.request.op!r} "
                f"{theirs}, this graph server runs {ours}: the function's code is not the graph server's; "
                "redeploy it (`python -m lightning_dorylus.deploy`, or LambdaExecutor("
                "redeploy_on_mismatch=True))", "OpVersionError")
        return to_tensors(arrays)

    def _invoke_raw(self, attempt: Attempt, event: dict[str, Any]) -> dict[str, Any]:
        call = attempt.call
        result = self._lambda.invoke(FunctionName=self.function_name, InvocationType="RequestResponse",
                                     Payload=json.dumps(event).encode())
        raw = result["Payload"].read()
        try:
            body = json.loads(raw)
        except ValueError as err:
            raise ExecutorError(f"{call.describe()}: Lambda function {self.function_name!r} answered "
                                f"{len(raw)} bytes that are not JSON") from err
        if result.get("FunctionError"):
            kind = str(body.get("errorType", result["FunctionError"])) if isinstance(body, dict) else "?"
            message = body.get("errorMessage", body) if isinstance(body, dict) else body
            text = (f"{call.describe()} failed in Lambda function {self.function_name!r} "
                    f"(attempt {attempt.number}): {kind}: {message}")
            if kind.startswith(RETRYABLE_FUNCTION_ERRORS):
                raise RetryableError(text, "lost")
            if kind == "OpVersionError":  # the handler refused: other code for the op than ours
                raise FunctionVersionError(text, kind)
            raise RemoteOpError(text, kind)
        if not isinstance(body, dict):
            raise ExecutorError(f"{call.describe()}: Lambda function {self.function_name!r} answered "
                                f"{type(body).__name__}, expected a JSON object")
        return body

    def _invoke_via_s3(self, attempt: Attempt, request: bytes) -> bytearray:
        call = attempt.call
        if self._s3 is None:
            raise ExecutorError(
                f"{call.describe()} needs {call.piece.request_bytes} request / {call.piece.response_bytes} "
                f"response bytes, over the payload limit of {self.payload_limit} after base64 even alone, "
                f"and LambdaExecutor has no s3_bucket to send it through; set executor_options.s3_bucket")
        key = f"{self.s3_prefix}{self._run_id}/{call.request_id}-{attempt.number}"
        keys = {"request": f"{key}.request", "response": f"{key}.response"}
        expires = int(self.policy.deadline_s or 900) + 300
        with self._state_lock:
            self.stats["s3_pieces"] += 1
        try:
            self._s3.put_object(Bucket=self.s3_bucket, Key=keys["request"], Body=request)
            get_url = self._s3.generate_presigned_url(
                "get_object", Params={"Bucket": self.s3_bucket, "Key": keys["request"]}, ExpiresIn=expires)
            put_url = self._s3.generate_presigned_url(
                "put_object", Params={"Bucket": self.s3_bucket, "Key": keys["response"]}, ExpiresIn=expires)
            body = self._invoke_raw(attempt, {"request_url": get_url, "response_url": put_url})
            if body.get("response_s3") is not True:
                raise ExecutorError(f"{call.describe()}: Lambda function {self.function_name!r} did not "
                                    f"write its response to S3: {sorted(body)}")
            obj = self._s3.get_object(Bucket=self.s3_bucket, Key=keys["response"])
            return bytearray(obj["Body"].read())
        finally:
            for k in keys.values():  # deleting a missing key is not an error in S3
                try:
                    self._s3.delete_object(Bucket=self.s3_bucket, Key=k)
                    with self._state_lock:
                        self.stats["s3_objects_deleted"] += 1
                except Exception:
                    pass

    @override
    def close(self) -> None:
        with self._start_lock:
            if self._closed:
                return
            self._closed = True
        self._stop_monitor("LambdaExecutor closed before the op finished")
        if self._pool is not None:
            # no wait: an invocation past its deadline ends by itself (boto3's read timeout)
            self._pool.shutdown(wait=False, cancel_futures=True)

    def __repr__(self) -> str:  # no credentials, no endpoints' secrets: names only
        endpoint = f", endpoint_url={_where(self.endpoint_url)!r}" if self.endpoint_url else ""
        return (f"LambdaExecutor(function_name={self.function_name!r}, region={self.region!r}{endpoint}, "
                f"max_concurrency={self.max_concurrency}, s3_bucket={self.s3_bucket!r})")


class FunctionVersionError(RemoteOpError):
    """The function ran (or refused to run) other code for the op than this graph server's."""


def _from_env(option: str, value: Any) -> Any:
    """``value`` if given, else the option's environment variable (if set and not empty), else its default."""
    if value is not None:
        return value
    variable, default = ENV_DEFAULTS[option]
    return os.environ.get(variable) or default


def _where(url: str) -> str:
    """An endpoint for logs and reprs: scheme, host and port only (no user:password@, path or query)."""
    parts = urlsplit(url)
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname}{port}"
