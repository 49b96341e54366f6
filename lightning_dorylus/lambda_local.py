"""A local AWS Lambda endpoint that runs the real handler zip (development and tests).

moto and LocalStack run handlers only inside Docker; this serves, on 127.0.0.1 only, the API the Lambda
executor and ``python -m lightning_dorylus.deploy`` use. Start it empty and deploy to it as to AWS::

    python -m lightning_dorylus.lambda_local [--port 0] [--concurrency 4]      # prints READY port=N
    python -m lightning_dorylus.deploy --endpoint-url http://127.0.0.1:N --region us-east-1 \
        --role-arn arn:aws:iam::000000000000:role/any \
        --layer-arn arn:aws:lambda:us-east-1:000000000000:layer:numpy:1

or with a zip every function name runs at once (no deploy step)::

    python -m lightning_dorylus.lambda_local --zip handler.zip [--port 0] [--concurrency 4]

It prints ``READY port=<port>`` once it listens. Point boto3 at it with ``endpoint_url`` (any dummy
credentials). What it does, like Lambda:

* ``POST /2015-03-31/functions/{name}/invocations`` (``RequestResponse``): runs ``lambda_handler`` in one
  of ``--concurrency`` runtime processes (``python -S`` with only the zip and numpy importable, see
  ``lambda_runtime.py``; numpy stands in for the layer); one zip for every function (the last created or
  updated); a function that does not exist: 404 ``ResourceNotFoundException``; each function's
  ``Timeout`` and reserved concurrency apply;
* a handler exception: HTTP 200 with ``X-Amz-Function-Error: Unhandled`` and
  ``{"errorMessage", "errorType", "stackTrace"}``; a runtime that dies: ``Runtime.ExitError``; a response
  over 6 MB: ``Function.ResponseSizeTooLarge``; past ``--timeout``: ``Sandbox.Timedout``;
* a request body over 6 MB: HTTP 413 ``RequestEntityTooLargeException``;
* more concurrent invocations than ``--concurrency``: HTTP 429 ``TooManyRequestsException``.

* what deploy calls (``lambda_functions``): ``GetFunction``, ``CreateFunction`` (``Code.ZipFile``),
  ``PUT .../code`` (``UpdateFunctionCode`` with ``ZipFile``: later invocations, of every function name, run
  the new zip; idle runtimes are replaced at once, busy ones when they finish), ``GetFunctionConfiguration``
  (boto3's ``function_updated`` waiter; ``CodeSha256``, ``State: Active``, ``LastUpdateStatus:
  Successful``: changes apply before the call returns), ``UpdateFunctionConfiguration`` and
  ``PutFunctionConcurrency``; S3 code locations, container images and other handlers are refused with a
  message naming this flow.

Test faults, per function name: ``POST /_control/faults`` with ``{"function": name, "throttle": n,
"delay_s": s, "delay_count": n, "exit": n}`` makes the next ``n`` invocations answer 429 / start ``s``
seconds late / kill their runtime; ``GET /_control/stats?function=name`` returns the counters.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
import queue
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from lightning_dorylus import lambda_functions, lambda_runtime
from lightning_dorylus.ops import bundle

PAYLOAD_LIMIT = 6 * 1024 * 1024  # Lambda's synchronous invoke limit, request and response
_INVOKE = re.compile(r"^/2015-03-31/functions/([^/]+)/invocations$")
_CODE = re.compile(r"^/2015-03-31/functions/([^/]+)/code$")
_CONFIGURATION = re.compile(r"^/2015-03-31/functions/([^/]+)/configuration$")
_FUNCTION = re.compile(r"^/2015-03-31/functions/([^/]+)$")
_CONCURRENCY = re.compile(r"^/2017-10-31/functions/([^/]+)/concurrency$")
_FUNCTIONS = "/2015-03-31/functions"
_REGION = re.compile(r"Credential=[^/,]+/\d{8}/([a-z0-9-]+)/lambda/")  # SigV4 scope: region only
SERVED = ("Invoke", "GetFunction", "CreateFunction", "UpdateFunctionCode", "GetFunctionConfiguration",
          "UpdateFunctionConfiguration", "PutFunctionConcurrency")


class _Runtime:
    """One runtime process (a warm Lambda sandbox)."""

    def __init__(self, cmd: list[str], env: dict[str, str], startup_timeout: float) -> None:
        self.generation = 0  # of the code it imported (LocalLambda._generation)
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        if not self._wait_readable(startup_timeout):
            self.kill()
            raise RuntimeError(f"lambda runtime (pid {self.proc.pid}) did not start within "
                               f"{startup_timeout} s")
        hello = lambda_runtime.read_frame(self.proc.stdout)  # type: ignore[arg-type]
        if hello is None or not json.loads(hello).get("ready"):
            code = self.proc.wait()
            raise RuntimeError(f"lambda runtime (pid {self.proc.pid}) failed to start: exit code {code}")

    def _wait_readable(self, timeout: float) -> bool:
        return bool(select.select([self.proc.stdout], [], [], timeout)[0])

    def invoke(self, event: Any, exit_now: bool, timeout: float) -> dict[str, Any] | None:
        """The runtime's reply; ``None`` if it died; raises TimeoutError past ``timeout``."""
        try:
            lambda_runtime.write_frame(self.proc.stdin, {"event": event, "exit": exit_now})  # type: ignore[arg-type]
            if not self._wait_readable(timeout):
                raise TimeoutError
            frame = lambda_runtime.read_frame(self.proc.stdout)  # type: ignore[arg-type]
        except (OSError, EOFError):
            return None
        return None if frame is None else json.loads(frame)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class LocalLambda:
    """The runtime pool, concurrency limit, faults and counters behind the HTTP server."""

    def __init__(self, zip_path: str | None, concurrency: int, timeout: float,
                 startup_timeout: float = 60.0) -> None:
        if zip_path is not None and not Path(zip_path).is_file():
            raise FileNotFoundError(f"--zip {zip_path}: no such file (build it with python -m "
                                    f"lightning_dorylus.deploy --dry-run {zip_path})")
        if concurrency < 1:
            raise ValueError(f"--concurrency {concurrency}: expected >= 1")
        self.timeout = timeout
        self.startup_timeout = startup_timeout
        self._dir = tempfile.mkdtemp(prefix="dorylus-lambda-local-")
        shutil.copyfile(lambda_runtime.__file__, os.path.join(self._dir, "lambda_runtime.py"))
        self._site = str(bundle.link_numpy(os.path.join(self._dir, "site")))
        self._env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PYTHON"))}
        self._env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self._cmd = [sys.executable, "-S", os.path.join(self._dir, "lambda_runtime.py"),
                     bundle.LAMBDA_HANDLER]
        self._lock = threading.Lock()
        self._code_lock = threading.Lock()  # one code update at a time
        self._generation = 0  # of the code: a runtime of an older one is replaced when it comes back
        self.concurrency = concurrency
        self.functions = lambda_functions.FunctionRegistry(implicit=zip_path is not None)
        self._slots = threading.BoundedSemaphore(concurrency)
        self._idle: queue.SimpleQueue[_Runtime] = queue.SimpleQueue()
        self._in_flight: dict[str, int] = {}  # per function, for its reserved concurrency
        self._faults: dict[str, dict[str, float]] = {}
        self._stats: dict[str, dict[str, int]] = {}
        if zip_path is not None:
            self._install(Path(zip_path).read_bytes())

    def _use_code(self, zip_path: Path) -> None:
        """Runtimes started from now on import ``zip_path``."""
        data = zip_path.read_bytes()
        with self._lock:
            self._env = {**self._env, "PYTHONPATH": os.pathsep.join([str(zip_path), self._site])}
            self._code_sha = base64.b64encode(hashlib.sha256(data).digest()).decode()
            self._generation += 1
        self.functions.set_code(self._code_sha, len(data))

    def _install(self, code: bytes) -> None:
        """Every function runs ``code`` (a zip) from the next invocation on: the first one starts the
        runtimes, later ones replace the idle runtimes now and busy ones when they finish."""
        with self._code_lock:
            first = self._generation == 0
            path = Path(self._dir) / f"code-{self._generation + 1}.zip"
            path.write_bytes(code)
            self._use_code(path)
            stale = []
            while True:  # idle runtimes of the old code
                try:
                    stale.append(self._idle.get_nowait())
                except queue.Empty:
                    break
            for runtime in stale:
                runtime.kill()
            for _ in range(self.concurrency if first else len(stale)):
                self._idle.put(self._spawn())

    def _spawn(self) -> _Runtime:
        """A runtime of the current code."""
        with self._lock:
            env, generation = self._env, self._generation
        runtime = _Runtime(self._cmd, env, self.startup_timeout)
        runtime.generation = generation
        return runtime

    def update_code(self, function: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        """``UpdateFunctionCode``: every function name runs the new zip from the next invocation on."""
        function = lambda_functions.function_name(function)
        if self.functions.get(function) is None:
            return _reply(self.functions.not_found(function, lambda_functions.DEFAULT_REGION))
        request = _json(body)
        if request is None or set(request) - {"FunctionName", "ZipFile", "Publish", "RevisionId"}:
            keys = sorted(request) if isinstance(request, dict) else "a body that is not JSON"
            return _error(400, "InvalidParameterValueException",
                          f"lambda_local takes UpdateFunctionCode with ZipFile only, got {keys}: "
                          f"{lambda_functions.LOCAL_FLOW}")
        code = _zip(request.get("ZipFile"))
        if isinstance(code, tuple):
            return code
        self._install(code)
        self._count(function, "code_updates")
        return self.configuration(function)

    def create_function(self, body: bytes, region: str) -> tuple[int, dict[str, str], bytes]:
        """``CreateFunction`` (``Code.ZipFile``): the function exists, and every function runs its zip."""
        request = _json(body)
        if request is None:
            return _error(400, "InvalidRequestContentException", "Could not parse request body into json")
        refused = lambda_functions.check_settings(request)
        if refused is not None:
            return _reply(refused)
        name = lambda_functions.function_name(str(request.get("FunctionName") or ""))
        if name and self.functions.get(name) is not None:
            return _error(409, "ResourceConflictException", f"Function already exist: {name}")
        code = _zip((request.get("Code") or {}).get("ZipFile"))
        if isinstance(code, tuple):
            return code
        created = self.functions.create(request, region)  # checks the rest before the code is installed
        if created[0] == 201:
            self._install(code)
            created = (201, {}, lambda_functions.public(self.functions.get(name) or {}))
        return _reply(created)

    def get_function(self, function: str) -> tuple[int, dict[str, str], bytes]:
        """``GetFunction``: its configuration, code location and reserved concurrency."""
        conf = self.functions.get(lambda_functions.function_name(function))
        if conf is None:
            return _reply(self.functions.not_found(function, lambda_functions.DEFAULT_REGION))
        body: dict[str, Any] = {"Configuration": lambda_functions.public(conf),
                                "Code": {"RepositoryType": "S3"}}
        if "_reserved" in conf:
            body["Concurrency"] = {"ReservedConcurrentExecutions": conf["_reserved"]}
        return 200, {}, json.dumps(body).encode()

    def configuration(self, function: str) -> tuple[int, dict[str, str], bytes]:
        """``GetFunctionConfiguration``: what boto3's ``function_updated`` waiter reads."""
        function = lambda_functions.function_name(function)
        conf = self.functions.get(function)
        if conf is None:
            return _reply(self.functions.not_found(function, lambda_functions.DEFAULT_REGION))
        return 200, {}, json.dumps(lambda_functions.public(conf)).encode()

    def update_configuration(self, function: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        """``UpdateFunctionConfiguration``."""
        request = _json(body)
        if request is None:
            return _error(400, "InvalidRequestContentException", "Could not parse request body into json")
        function = lambda_functions.function_name(function)
        if self.functions.get(function) is None:  # implicit functions exist on first use
            return _reply(self.functions.not_found(function, lambda_functions.DEFAULT_REGION))
        return _reply(self.functions.update(function, request))

    def put_concurrency(self, function: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        """``PutFunctionConcurrency``."""
        request = _json(body)
        if request is None:
            return _error(400, "InvalidRequestContentException", "Could not parse request body into json")
        function = lambda_functions.function_name(function)
        if self.functions.get(function) is None:
            return _reply(self.functions.not_found(function, lambda_functions.DEFAULT_REGION))
        return _reply(self.functions.set_concurrency(function, request, self.concurrency))

    def _count(self, function: str, key: str) -> None:
        with self._lock:
            stats = self._stats.setdefault(function, {})
            stats[key] = stats.get(key, 0) + 1

    def set_faults(self, function: str, faults: dict[str, float]) -> None:
        with self._lock:
            self._faults.setdefault(function, {}).update(faults)

    def stats(self, function: str) -> dict[str, int]:
        with self._lock:
            return dict(self._stats.get(function, {}))

    def _take_fault(self, function: str, key: str) -> bool:
        with self._lock:
            faults = self._faults.get(function, {})
            if faults.get(key, 0) > 0:
                faults[key] -= 1
                return True
            return False

    def invoke(self, function: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        """(status, headers, body) of one Invoke call."""
        function = lambda_functions.function_name(function)
        conf = self.functions.get(function)
        if conf is None:
            return _reply(self.functions.not_found(function, lambda_functions.DEFAULT_REGION))
        self._count(function, "requests")
        if len(body) > PAYLOAD_LIMIT:
            self._count(function, "too_large")
            return _error(413, "RequestEntityTooLargeException",
                          f"Request must be smaller than {PAYLOAD_LIMIT} bytes for the InvokeFunction "
                          f"operation")
        try:
            event = json.loads(body or b"{}")
        except ValueError:
            return _error(400, "InvalidRequestContentException", "Could not parse request body into json")
        if self._take_fault(function, "throttle") or not self._reserve(function, conf.get("_reserved")):
            self._count(function, "throttled")
            return _error(429, "TooManyRequestsException", "Rate Exceeded.",
                          Reason="ReservedFunctionConcurrentInvocationLimitExceeded")
        try:
            if self._take_fault(function, "delay_count"):
                self._count(function, "delayed")
                time.sleep(self._faults[function].get("delay_s", 0.0))
            return self._run(function, event, min(self.timeout, float(conf.get("Timeout") or self.timeout)))
        finally:
            self._release(function)

    def _reserve(self, function: str, reserved: int | None) -> bool:
        """A slot for one invocation of ``function``: within its reserved concurrency and the runtimes."""
        with self._lock:
            if reserved is not None and self._in_flight.get(function, 0) >= reserved:
                return False
            if not self._slots.acquire(blocking=False):
                return False
            self._in_flight[function] = self._in_flight.get(function, 0) + 1
            return True

    def _release(self, function: str) -> None:
        with self._lock:
            self._in_flight[function] -= 1
        self._slots.release()

    def _run(self, function: str, event: Any, timeout: float) -> tuple[int, dict[str, str], bytes]:
        request_id = str(uuid.uuid4())
        runtime = self._idle.get()
        reply = None
        try:
            reply = runtime.invoke(event, self._take_fault(function, "exit"), timeout)
        except TimeoutError:
            reply = {"ok": False, "errorType": "Sandbox.Timedout",
                     "errorMessage": f"RequestId: {request_id} Error: Task timed out after "
                                     f"{timeout} seconds"}
        finally:
            if reply is None or reply.get("errorType") == "Sandbox.Timedout":
                code = runtime.proc.poll()
                runtime.kill()
                if reply is None:
                    reply = {"ok": False, "errorType": "Runtime.ExitError",
                             "errorMessage": f"RequestId: {request_id} Error: Runtime exited with error: "
                                             f"exit status {code}"}
                runtime = self._spawn()
            elif runtime.generation != self._generation:  # code updated meanwhile
                runtime.kill()
                runtime = self._spawn()
            self._idle.put(runtime)
        headers = {"X-Amz-Executed-Version": "$LATEST", "x-amzn-RequestId": request_id}
        if reply.get("ok"):
            out = json.dumps(reply["result"], separators=(",", ":")).encode()
            if len(out) <= PAYLOAD_LIMIT:
                self._count(function, "ok")
                return 200, headers, out
            reply = {"errorType": "Function.ResponseSizeTooLarge",
                     "errorMessage": f"Response payload size ({len(out)} bytes) exceeded maximum allowed "
                                     f"payload size ({PAYLOAD_LIMIT} bytes)."}
        self._count(function, "errors")
        err = {k: reply[k] for k in ("errorMessage", "errorType", "stackTrace") if k in reply}
        return 200, {**headers, "X-Amz-Function-Error": "Unhandled"}, json.dumps(err).encode()

    def close(self) -> None:
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                break
        shutil.rmtree(self._dir, ignore_errors=True)


def _error(status: int, code: str, message: str, **extra: str) -> tuple[int, dict[str, str], bytes]:
    body = json.dumps({"Type": "User", "message": message, **extra}).encode()
    return status, {"x-amzn-ErrorType": code}, body


def _reply(reply: lambda_functions.Reply) -> tuple[int, dict[str, str], bytes]:
    status, headers, body = reply
    return status, headers, json.dumps(body).encode()


def _json(body: bytes) -> dict[str, Any] | None:
    """A request body that is a JSON object, else None."""
    try:
        value = json.loads(body or b"{}")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _zip(value: Any) -> bytes | tuple[int, dict[str, str], bytes]:
    """The zip archive a base64 ``ZipFile`` field holds, or an error reply."""
    try:
        code = base64.b64decode(value, validate=True)
        bad = zipfile.ZipFile(io.BytesIO(code)).testzip()
    except (ValueError, TypeError, zipfile.BadZipFile) as err:
        return _error(400, "InvalidParameterValueException",
                      f"ZipFile must be a zip archive (base64): {type(err).__name__}: {err}; "
                      f"{lambda_functions.LOCAL_FLOW}")
    if bad is not None:
        return _error(400, "InvalidParameterValueException", f"ZipFile: {bad} is corrupt in the zip")
    return code


def _unknown(method: str, path: str) -> tuple[int, dict[str, str], bytes]:
    return _error(404, "UnknownOperationException",
                  f"lambda_local serves {', '.join(SERVED)} (what python -m lightning_dorylus.deploy and the "
                  f"Lambda executor call); no such operation: {method} {path}")


def _region(authorization: str | None) -> str:
    """The region a SigV4-signed request was signed for (the credential scope), else the default."""
    match = _REGION.search(authorization or "")
    return match.group(1) if match else lambda_functions.DEFAULT_REGION


def make_server(backend: LocalLambda, port: int = 0) -> ThreadingHTTPServer:
    """An HTTP server on 127.0.0.1:``port`` (0: a free port) in front of ``backend``."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as botocore's connection pool expects

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _send(self, status: int, headers: dict[str, str], body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def do_POST(self) -> None:
            path = urlsplit(self.path).path
            body = self._body()
            if path == "/_control/faults":
                faults = json.loads(body)
                backend.set_faults(str(faults.pop("function")), {k: float(v) for k, v in faults.items()})
                self._send(200, {}, b"{}")
                return
            if path == _FUNCTIONS:
                self._send(*backend.create_function(body, _region(self.headers.get("Authorization"))))
                return
            match = _INVOKE.match(path)
            if match is None:
                self._send(*_unknown("POST", path))
                return
            kind = self.headers.get("X-Amz-Invocation-Type", "RequestResponse")
            if kind != "RequestResponse":
                self._send(*_error(400, "InvalidParameterValueException",
                                   f"lambda_local serves InvocationType RequestResponse only, got {kind}"))
                return
            self._send(*backend.invoke(unquote(match.group(1)), body))

        def do_PUT(self) -> None:
            path = urlsplit(self.path).path
            body = self._body()
            routes = ((_CODE, backend.update_code), (_CONFIGURATION, backend.update_configuration),
                      (_CONCURRENCY, backend.put_concurrency))
            for pattern, serve in routes:
                match = pattern.match(path)
                if match is not None:
                    self._send(*serve(unquote(match.group(1)), body))
                    return
            self._send(*_unknown("PUT", path))

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            if url.path == "/_control/stats":
                function = parse_qs(url.query).get("function", [""])[0]
                self._send(200, {}, json.dumps(backend.stats(function)).encode())
                return
            for pattern, serve in ((_CONFIGURATION, backend.configuration),  # type: ignore[assignment]
                                   (_FUNCTION, backend.get_function)):
                match = pattern.match(url.path)
                if match is not None:
                    self._send(*serve(unquote(match.group(1))))
                    return
            self._send(*_unknown("GET", url.path))

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_dorylus.lambda_local", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--zip", default=None,
                        help="deployment zip (deploy --dry-run ZIP) that every function name runs at once; "
                             "without it the endpoint starts with no function (deploy --endpoint-url)")
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: a free one)")
    parser.add_argument("--concurrency", type=int, default=4,
                        help="runtime processes = concurrent invocations")
    parser.add_argument("--timeout", type=float, default=900.0, help="function timeout in seconds")
    args = parser.parse_args(argv)
    backend = LocalLambda(args.zip, args.concurrency, args.timeout)
    server = make_server(backend, args.port)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # kill PID: clean up runtimes and the temp dir
    print(f"READY port={server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        backend.close()


if __name__ == "__main__":
    main()
