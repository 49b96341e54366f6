"""Fake cloud metadata services on 127.0.0.1 (AWS IMDSv2 and GCE), for the notice-source tests."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeMetadata:
    """One loopback server that answers like IMDSv2 and like the GCE metadata server.

    ``notice`` (AWS: the instance-action JSON; GCE: ``preempted`` is ``TRUE``) turns on after
    ``notice_after`` notice GETs and once ``notice_when()`` (if given) is true, so a test can serve it
    "mid-training". ``expire_tokens()`` makes every
    token issued so far answer 401. ``requests`` logs (method, path, lower-cased headers) of every request.
    """

    def __init__(
        self, notice: bool = False, notice_after: int = 0, notice_when: Callable[[], bool] | None = None
    ) -> None:
        self.notice = notice
        self.notice_after = notice_after
        self.notice_when = notice_when
        self.notice_gets = 0
        self.tokens: set[str] = set()
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.action = {"action": "terminate", "time": "2026-11-22T19:40:00Z"}
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _send(self, status: int, body: str = "", headers: dict[str, str] | None = None) -> None:
                data = body.encode()
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self) -> None:
                fake.requests.append(("PUT", self.path, {k.lower(): v for k, v in self.headers.items()}))
                if self.path != "/latest/api/token":
                    return self._send(404)
                ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
                if ttl is None or not ttl.isdigit():
                    return self._send(400, "missing or bad ttl")
                token = f"token-{len(fake.tokens)}"
                fake.tokens.add(token)
                self._send(200, token)

            def _noticed(self) -> bool:
                fake.notice_gets += 1
                when = fake.notice_when is None or fake.notice_when()
                return fake.notice and fake.notice_gets > fake.notice_after and when

            def do_GET(self) -> None:
                fake.requests.append(("GET", self.path, {k.lower(): v for k, v in self.headers.items()}))
                if self.path == "/latest/meta-data/spot/instance-action":
                    if self.headers.get("X-aws-ec2-metadata-token") not in fake.tokens:
                        return self._send(401)
                    if self._noticed():
                        return self._send(200, json.dumps(fake.action))
                    return self._send(404, "Not Found")
                if self.path.startswith("/computeMetadata/v1/"):
                    if self.headers.get("Metadata-Flavor") != "Google":
                        return self._send(403, "Missing Metadata-Flavor:Google header.")
                    flavor = {"Metadata-Flavor": "Google"}
                    if self.path == "/computeMetadata/v1/instance/preempted":
                        return self._send(200, "TRUE" if self._noticed() else "FALSE", flavor)
                    return self._send(200, "instance/\nproject/\n", flavor)
                self._send(404)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def expire_tokens(self) -> None:
        self.tokens.clear()

    def __enter__(self) -> FakeMetadata:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def dead_url() -> str:
    """A loopback URL nothing listens on (an endpoint that is down)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"
