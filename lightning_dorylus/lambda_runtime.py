"""The Lambda runtime loop of ``lambda_local``: one process that runs a deployment zip's handler.

Standard library only, run as ``python -S lambda_runtime.py MODULE.FUNCTION`` with ``PYTHONPATH`` = the
handler zip (imported from the zip, as the files of /var/task) and a directory holding only numpy (the
layer). So the handler sees what it sees on AWS: the standard library, numpy and its own zip.

Protocol over stdin/stdout, each message = 8-byte little-endian length + UTF-8 JSON:
in ``{"event": ..., "exit": bool}`` (``exit``: die mid-invocation, a test fault); out ``{"ready": true}``
once, then ``{"ok": true, "result": ...}`` or ``{"ok": false, "errorType", "errorMessage", "stackTrace"}``
(Lambda's shape of an unhandled error). EOF on stdin: exit 0.
"""

from __future__ import annotations

import importlib
import json
import os
import struct
import sys
import traceback
from typing import Any, BinaryIO

_LEN = struct.Struct("<Q")


def read_frame(stream: BinaryIO) -> bytes | None:
    """One length-prefixed frame, or None on EOF."""
    head = _read(stream, _LEN.size)
    if head is None:
        return None
    body = _read(stream, _LEN.unpack(head)[0])
    if body is None:
        raise EOFError("stream closed inside a frame")
    return body


def write_frame(stream: BinaryIO, obj: Any) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    stream.write(_LEN.pack(len(data)) + data)
    stream.flush()


def _read(stream: BinaryIO, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = stream.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


class _Context:
    """The few fields of Lambda's context object a handler may read."""

    function_name = os.environ.get("AWS_LAMBDA_FUNCTION_NAME", "local")
    memory_limit_in_mb = int(os.environ.get("AWS_LAMBDA_FUNCTION_MEMORY_SIZE", "128"))
    aws_request_id = ""


def main() -> None:
    module_name, _, func_name = sys.argv[1].rpartition(".")
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # handler prints go to stderr, not the protocol
    inp = os.fdopen(os.dup(sys.stdin.fileno()), "rb")
    handler = getattr(importlib.import_module(module_name), func_name)
    write_frame(out, {"ready": True, "pid": os.getpid()})
    while (frame := read_frame(inp)) is not None:
        message = json.loads(frame)
        if message.get("exit"):
            os._exit(1)
        try:
            reply = {"ok": True, "result": handler(message["event"], _Context())}
        except Exception as err:
            reply = {"ok": False, "errorType": type(err).__name__, "errorMessage": str(err),
                     "stackTrace": traceback.format_exception(err)[-8:]}
        write_frame(out, reply)


if __name__ == "__main__":
    main()
