"""The function configurations behind ``lambda_local``'s control plane (what ``deploy`` calls).

``python -m lightning_dorylus.deploy --endpoint-url http://127.0.0.1:N`` makes the calls it makes against AWS:
``GetFunction`` (does it exist?), then ``CreateFunction`` or ``UpdateFunctionCode`` + the ``function_updated``
waiter (``GetFunctionConfiguration``) + ``UpdateFunctionConfiguration``, and ``PutFunctionConcurrency``. This
module keeps, per function name, the configuration those calls set and answer in the shapes of the Lambda
REST API (botocore's ``lambda/2015-03-31/service-2.json``: ``FunctionConfiguration``, errors as
``x-amzn-ErrorType`` + ``{"Type", "message"}``), and refuses what the local endpoint cannot run with a message
naming the local flow. It holds no code: ``lambda_local`` runs one zip for every function (the last one
created or updated), so creating or updating any function changes what all of them run, and every
configuration reports that zip's ``CodeSha256``.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from typing import Any

from lightning_dorylus.ops import bundle

Reply = tuple[int, dict[str, str], dict[str, Any]]
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # Lambda's function name rule
ACCOUNT = "000000000000"  # moto's and LocalStack's stand-in account
DEFAULT_REGION = "us-east-1"
LOCAL_FLOW = ("build and upload the handler zip with python -m lightning_dorylus.deploy --endpoint-url "
              "http://127.0.0.1:<port> (docs/dorylus-lambda.md, 'Without AWS')")
#: The fields UpdateFunctionConfiguration may change here (the rest of its request is refused).
CONFIGURABLE = ("Role", "Handler", "Runtime", "Timeout", "MemorySize", "Layers", "Environment", "Description")


def error(status: int, code: str, message: str) -> Reply:
    """A Lambda API error as botocore parses it (``Error.Code`` from the header, ``Error.Message``)."""
    return status, {"x-amzn-ErrorType": code}, {"Type": "User", "message": message}


def function_name(path_name: str) -> str:
    """The name in a function URL path, which may be an ARN (``arn:aws:lambda:r:a:function:name[:qual]``)."""
    if path_name.startswith("arn:") and ":function:" in path_name:
        return path_name.split(":function:", 1)[1].split(":", 1)[0]
    return path_name


class FunctionRegistry:
    """Function configurations by name. ``implicit``: every name exists (an endpoint started with ``--zip``,
    as before deploy could create functions); otherwise only those created by ``CreateFunction``."""

    def __init__(self, implicit: bool) -> None:
        self.implicit = implicit
        self._lock = threading.Lock()
        self._functions: dict[str, dict[str, Any]] = {}
        self._code: tuple[str, int] | None = None  # (CodeSha256, CodeSize) of the zip every function runs

    def set_code(self, sha256: str, size: int) -> None:
        """Every function runs this zip from now on."""
        with self._lock:
            self._code = (sha256, size)
            for conf in self._functions.values():
                conf.update(CodeSha256=sha256, CodeSize=size, LastModified=_now(), RevisionId=_revision())

    def get(self, name: str) -> dict[str, Any] | None:
        """The configuration of ``name`` (a copy), or None if there is no such function."""
        with self._lock:
            if name not in self._functions and self.implicit:
                self._functions[name] = self._configuration(name, DEFAULT_REGION, {})
            conf = self._functions.get(name)
            return None if conf is None else {**conf}

    def not_found(self, name: str, region: str) -> Reply:
        return error(404, "ResourceNotFoundException",
                     f"Function not found: {_arn(region, name)} (lambda_local started without --zip has only "
                     f"the functions created on it: {LOCAL_FLOW})")

    def create(self, request: dict[str, Any], region: str) -> Reply:
        """``CreateFunction`` once its code is installed (``set_code``): 201 and the configuration."""
        name = request.get("FunctionName")
        if not isinstance(name, str) or not name:
            return error(400, "InvalidParameterValueException", "CreateFunction needs FunctionName")
        name = function_name(name)
        if not _NAME.fullmatch(name):
            return error(400, "InvalidParameterValueException",
                         f"FunctionName {name!r}: expected 1-64 letters, digits, '-' or '_' (or an ARN)")
        if not isinstance(request.get("Role"), str):
            return error(400, "InvalidParameterValueException", "CreateFunction needs Role (an IAM role ARN; "
                         "lambda_local records it and assumes nothing)")
        refused = check_settings(request)
        if refused is not None:
            return refused
        with self._lock:
            if name in self._functions:
                return error(409, "ResourceConflictException",
                             f"Function already exist: {name} (deploy updates an existing function)")
            conf = self._configuration(name, region, request)
            self._functions[name] = conf
            return 201, {}, public(conf)

    def update(self, name: str, request: dict[str, Any]) -> Reply:
        """``UpdateFunctionConfiguration``."""
        unknown = sorted(set(request) - set(CONFIGURABLE) - {"FunctionName", "RevisionId"})
        if unknown:
            return error(400, "InvalidParameterValueException",
                         f"lambda_local cannot apply {unknown} (it serves {list(CONFIGURABLE)}: the settings "
                         f"python -m lightning_dorylus.deploy makes)")
        refused = check_settings(request)
        if refused is not None:
            return refused
        with self._lock:
            conf = self._functions.get(name)
            if conf is None:
                return self.not_found(name, DEFAULT_REGION)
            conf.update(_settings(request), LastModified=_now(), RevisionId=_revision())
            return 200, {}, public(conf)

    def set_concurrency(self, name: str, request: dict[str, Any], limit: int) -> Reply:
        """``PutFunctionConcurrency``: at most ``ReservedConcurrentExecutions`` invocations in flight (and
        never more than the endpoint's ``--concurrency`` runtimes, ``limit``)."""
        value = request.get("ReservedConcurrentExecutions")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return error(400, "InvalidParameterValueException",
                         f"ReservedConcurrentExecutions={value!r}: expected an int >= 0")
        with self._lock:
            conf = self._functions.get(name)
            if conf is None:
                return self.not_found(name, DEFAULT_REGION)
            conf["_reserved"] = value
        note = {} if value <= limit else {"x-dorylus-note": f"lambda_local runs at most {limit} at once"}
        return 200, note, {"ReservedConcurrentExecutions": value}

    def _configuration(self, name: str, region: str, request: dict[str, Any]) -> dict[str, Any]:
        sha, size = self._code or ("", 0)
        conf: dict[str, Any] = {
            "FunctionName": name, "FunctionArn": _arn(region, name), "Runtime": "python3.12",
            "Role": f"arn:aws:iam::{ACCOUNT}:role/lambda-local", "Handler": bundle.LAMBDA_HANDLER,
            "CodeSize": size, "CodeSha256": sha, "Description": "", "Timeout": 3, "MemorySize": 128,
            "LastModified": _now(), "Version": "$LATEST", "RevisionId": _revision(), "Layers": [],
            "State": "Active", "LastUpdateStatus": "Successful", "PackageType": "Zip",
            "Architectures": list(request.get("Architectures") or ["x86_64"]),
        }
        if self.implicit and not request:
            conf["Timeout"] = 900
        conf.update(_settings(request))
        return conf


def public(conf: dict[str, Any]) -> dict[str, Any]:
    """The configuration as the API returns it (without this module's own bookkeeping)."""
    return {k: v for k, v in conf.items() if not k.startswith("_")}


def check_settings(request: dict[str, Any]) -> Reply | None:
    """An error reply for what the local endpoint cannot run, else None."""
    code = request.get("Code")
    if code is not None and (not isinstance(code, dict) or set(code) != {"ZipFile"}):
        keys = sorted(code) if isinstance(code, dict) else code
        return error(400, "InvalidParameterValueException",
                     f"lambda_local takes the code as Code.ZipFile only, got {keys} (S3 locations and "
                     f"container images are not served locally): {LOCAL_FLOW}")
    if request.get("PackageType", "Zip") != "Zip":
        return error(400, "InvalidParameterValueException",
                     f"PackageType {request['PackageType']!r}: lambda_local runs zip packages only: "
                     f"{LOCAL_FLOW}")
    handler = request.get("Handler")
    if handler is not None and handler != bundle.LAMBDA_HANDLER:
        return error(400, "InvalidParameterValueException",
                     f"Handler {handler!r}: lambda_local runs the Dorylus handler {bundle.LAMBDA_HANDLER} "
                     f"only (the zip python -m lightning_dorylus.deploy builds)")
    runtime = request.get("Runtime")
    if runtime is not None and not str(runtime).startswith("python3."):
        return error(400, "InvalidParameterValueException",
                     f"Runtime {runtime!r}: lambda_local runs python3.x functions (in this machine's Python)")
    timeout = request.get("Timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int)
                                or not 1 <= timeout <= 900):
        return error(400, "InvalidParameterValueException", f"Timeout={timeout!r}: Lambda allows 1..900 s")
    memory = request.get("MemorySize")
    if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int)
                               or not 128 <= memory <= 10240):
        return error(400, "InvalidParameterValueException",
                     f"MemorySize={memory!r}: Lambda allows 128..10240 MB")
    return None


def _settings(request: dict[str, Any]) -> dict[str, Any]:
    """The configuration fields a Create/UpdateFunctionConfiguration request sets, in the response's shape."""
    out: dict[str, Any] = {k: request[k] for k in ("Role", "Handler", "Runtime", "Timeout", "MemorySize",
                                                   "Description") if k in request}
    if "Layers" in request:  # request: ARNs; response: [{"Arn", "CodeSize"}]
        out["Layers"] = [{"Arn": arn, "CodeSize": 0} for arn in request["Layers"]]
    if "Environment" in request:
        out["Environment"] = {"Variables": dict((request["Environment"] or {}).get("Variables") or {})}
    return out


def _arn(region: str, name: str) -> str:
    return f"arn:aws:lambda:{region}:{ACCOUNT}:function:{name}"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000+0000", time.gmtime())


def _revision() -> str:
    return str(uuid.uuid4())
