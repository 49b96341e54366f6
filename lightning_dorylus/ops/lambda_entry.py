"""The AWS Lambda entry point: ``lambda_handler(event, context)`` around ``handlers.handle``.

Ships in the handler bundle (standard library + numpy only; no boto3). Two event shapes:

* ``{"payload": "<base64 wire request>"}`` -> ``{"payload": "<base64 wire response>"}`` — the normal case:
  request and response fit Lambda's 6 MB synchronous limit (the executor plans them to);
* ``{"request_url": "<presigned S3 GET>", "response_url": "<presigned S3 PUT>"}`` ->
  ``{"response_s3": true, "bytes": n}`` — for what cannot fit: the graph server uploaded the request and
  deletes both objects afterwards. Presigned URLs let this handler use plain ``urllib``.

An op error raises (Lambda answers with ``X-Amz-Function-Error: Unhandled`` and the message), so the graph
server raises ``RemoteOpError`` with the handler's message.
"""

from __future__ import annotations

import base64
import binascii
import urllib.parse
import urllib.request
from typing import Any

from . import handlers, registry, shipped

URL_TIMEOUT_S = 60.0

# at cold start: the user op modules deployed with this zip (``deploy --op-module``) register their ops
registry.import_op_modules(shipped.OP_MODULES)


def lambda_handler(event: Any, context: Any) -> dict[str, Any]:
    """Run one tensor-op request (see the module docstring for the event shapes)."""
    if not isinstance(event, dict):
        raise ValueError(f"event must be a JSON object with 'payload' or 'request_url'/'response_url', "
                         f"got {type(event).__name__}")
    if "payload" in event:
        data = event["payload"]
        if not isinstance(data, str):
            raise ValueError(f"event 'payload' must be a base64 string, got {type(data).__name__}")
        try:
            request = bytearray(base64.b64decode(data, validate=True))
        except (binascii.Error, ValueError) as err:
            raise ValueError(f"event 'payload' is not valid base64: {err}") from err
        return {"payload": base64.b64encode(handlers.handle(request)).decode("ascii")}
    if "request_url" in event and "response_url" in event:
        get_url, put_url = _url(event, "request_url"), _url(event, "response_url")
        with urllib.request.urlopen(get_url, timeout=URL_TIMEOUT_S) as resp:
            request = bytearray(resp.read())
        response = handlers.handle(request)
        # an explicit Content-Type: urllib's default (form-urlencoded) makes servers parse the body as a form
        put = urllib.request.Request(put_url, data=response, method="PUT",
                                     headers={"Content-Length": str(len(response)),
                                              "Content-Type": "application/octet-stream"})
        with urllib.request.urlopen(put, timeout=URL_TIMEOUT_S) as resp:
            resp.read()
        return {"response_s3": True, "bytes": len(response)}
    raise ValueError(f"event must hold 'payload' or both 'request_url' and 'response_url'; "
                     f"got keys {sorted(event)}")


def _url(event: dict[str, Any], key: str) -> str:
    url = event[key]
    if not isinstance(url, str) or urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        raise ValueError(f"event {key!r} must be an http(s) URL")
    return url
