"""The AWS EC2 spot interruption notice, read from the instance metadata service (IMDSv2).

Two minutes before EC2 reclaims a spot instance, ``/latest/meta-data/spot/instance-action`` starts to answer
``{"action": "terminate"|"stop"|"hibernate", "time": "2026-11-22T19:40:00Z"}``; until then it answers 404.
IMDSv2 needs a session token: ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds``, then
each GET carries ``X-aws-ec2-metadata-token``. A 401 means the token expired: fetch a new one and retry.
"""

from __future__ import annotations

import json
import logging
import time

from lightning_bamboo.notices.base import Notice
from lightning_bamboo.notices.metadata_http import EndpointDown, MetadataSource, request

log = logging.getLogger(__name__)

TOKEN_PATH = "/latest/api/token"
NOTICE_PATH = "/latest/meta-data/spot/instance-action"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"


class AwsSpotNoticeSource(MetadataSource):
    """Polls the EC2 spot ``instance-action`` through IMDSv2.

    Args:
        endpoint: base URL of the metadata service (default ``http://169.254.169.254``).
        poll_interval_s: seconds between polls (AWS gives a two-minute warning; every few seconds is enough).
        timeout_s: per-request timeout; also how long ``detect`` waits on a machine that is not on EC2.
        token_ttl_s: lifetime asked for the session token (1..21600 s). It is refreshed a little before it
            ends, and at once when the service answers 401.
    """

    name = "aws"

    def __init__(
        self,
        endpoint: str = "http://169.254.169.254",
        poll_interval_s: float = 5.0,
        timeout_s: float = 1.0,
        token_ttl_s: int = 21600,
    ) -> None:
        if not isinstance(token_ttl_s, int) or not 1 <= token_ttl_s <= 21600:
            raise ValueError(
                f"token_ttl_s must be an integer in 1..21600 (IMDSv2 limit), got {token_ttl_s!r}"
            )
        super().__init__(endpoint, poll_interval_s, timeout_s)
        self.token_ttl_s = token_ttl_s
        self._token: str | None = None
        self._token_expires = 0.0
        self.token_fetches = 0

    def _fetch_token(self) -> str:
        resp = request(
            self.endpoint + TOKEN_PATH, "PUT", {TTL_HEADER: str(self.token_ttl_s)}, timeout=self.timeout_s
        )
        if resp.status != 200 or not resp.body:
            raise EndpointDown(f"PUT {self.endpoint}{TOKEN_PATH}: HTTP {resp.status}")
        self.token_fetches += 1
        self._token = resp.body.strip()
        # refresh 10% early so a long poll interval never sends an expired token
        self._token_expires = time.monotonic() + 0.9 * self.token_ttl_s
        return self._token

    def _token_now(self) -> str:
        if self._token is None or time.monotonic() >= self._token_expires:
            return self._fetch_token()
        return self._token

    def detect(self) -> bool:
        """On EC2 iff the token endpoint answers within ``timeout_s``."""
        try:
            self._fetch_token()
        except EndpointDown:
            return False
        return True

    def poll(self) -> Notice | None:
        """The pending spot action; ``None`` on 404, or when the service did not answer (``errors``)."""
        try:
            for attempt in range(2):
                token = self._token_now()
                url = self.endpoint + NOTICE_PATH
                resp = request(url, headers={TOKEN_HEADER: token}, timeout=self.timeout_s)
                if resp.status == 401 and attempt == 0:
                    self._token = None  # expired or revoked: one fresh token, one retry
                    continue
                break
        except EndpointDown as err:
            self.errors += 1
            log.warning("Bamboo AWS spot notice: metadata service did not answer (%s)", err)
            return None
        if resp.status == 404:
            return None
        if resp.status != 200:
            self.errors += 1
            log.warning("Bamboo AWS spot notice: %s answered HTTP %d", NOTICE_PATH, resp.status)
            return None
        deadline = None
        try:
            deadline = json.loads(resp.body).get("time")
        except (ValueError, AttributeError):
            log.warning("Bamboo AWS spot notice: body is not the documented JSON: %r", resp.body[:200])
        return Notice(source=self.name, detail=resp.body.strip(), deadline=deadline)
