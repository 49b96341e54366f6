"""The small HTTP client the metadata sources share: urllib, short timeouts, status codes kept apart."""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass

from lightning_bamboo.notices.base import PreemptionNoticeSource


@dataclass(frozen=True)
class Response:
    status: int
    body: str
    headers: dict[str, str]


class EndpointDown(OSError):
    """The metadata endpoint did not answer (refused, unreachable, timed out)."""


def request(
    url: str, method: str = "GET", headers: dict[str, str] | None = None, timeout: float = 1.0
) -> Response:
    """One HTTP request; any HTTP status is a ``Response``, no answer at all raises ``EndpointDown``.

    Proxies are bypassed: link-local metadata addresses must never be sent through an HTTP proxy.
    """
    data = b"" if method == "PUT" else None
    req = urllib.request.Request(url, method=method, headers=headers or {}, data=data)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout) as resp:
            return Response(resp.status, resp.read().decode("utf-8", "replace"), dict(resp.headers))
    except urllib.error.HTTPError as err:
        body = err.read().decode("utf-8", "replace") if err.fp is not None else ""
        return Response(err.code, body, dict(err.headers or {}))
    except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
        raise EndpointDown(f"{method} {url}: {getattr(err, 'reason', err)}") from err


class MetadataSource(PreemptionNoticeSource):
    """A source polling a cloud metadata endpoint: keeps and checks its endpoint, poll interval and timeout.

    Args:
        endpoint: base URL of the metadata service (a trailing ``/`` is dropped).
        poll_interval_s: seconds between polls (> 0).
        timeout_s: per-request timeout (> 0); also how long ``detect`` waits off that cloud.
    """

    def __init__(self, endpoint: str, poll_interval_s: float, timeout_s: float) -> None:
        if poll_interval_s <= 0 or timeout_s <= 0:
            raise ValueError(
                f"poll_interval_s and timeout_s must be > 0, got {poll_interval_s!r} and {timeout_s!r}"
            )
        self.endpoint = endpoint.rstrip("/")
        self.poll_interval_s = poll_interval_s
        self.timeout_s = timeout_s
        self.errors = 0  # polls that found the endpoint down or answering an unexpected status
