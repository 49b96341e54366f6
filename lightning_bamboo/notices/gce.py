"""The GCE preemption notice: ``computeMetadata/v1/instance/preempted`` turns ``TRUE`` ~30 s before."""

from __future__ import annotations

import logging

from lightning_bamboo.notices.base import Notice
from lightning_bamboo.notices.metadata_http import EndpointDown, MetadataSource, request

log = logging.getLogger(__name__)

PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
FLAVOR = {"Metadata-Flavor": "Google"}


class GcePreemptedSource(MetadataSource):
    """Polls GCE's ``instance/preempted`` (``"TRUE"``/``"FALSE"``), header ``Metadata-Flavor: Google``.

    Args:
        endpoint: base URL of the metadata server (default ``http://metadata.google.internal``).
        poll_interval_s: seconds between polls (GCE warns ~30 s ahead: poll every second or two).
        timeout_s: per-request timeout; also how long ``detect`` waits off GCE.
    """

    name = "gce"

    def __init__(
        self,
        endpoint: str = "http://metadata.google.internal",
        poll_interval_s: float = 2.0,
        timeout_s: float = 1.0,
    ) -> None:
        super().__init__(endpoint, poll_interval_s, timeout_s)

    def detect(self) -> bool:
        """On GCE iff the metadata server answers with the ``Metadata-Flavor: Google`` response header."""
        try:
            resp = request(self.endpoint + "/computeMetadata/v1/", headers=FLAVOR, timeout=self.timeout_s)
        except EndpointDown:
            return False
        return {k.lower(): v for k, v in resp.headers.items()}.get("metadata-flavor") == "Google"

    def poll(self) -> Notice | None:
        try:
            resp = request(self.endpoint + PREEMPTED_PATH, headers=FLAVOR, timeout=self.timeout_s)
        except EndpointDown as err:
            self.errors += 1
            log.warning("Bamboo GCE preemption notice: metadata server did not answer (%s)", err)
            return None
        value = resp.body.strip()
        if resp.status != 200 or value not in ("TRUE", "FALSE"):
            self.errors += 1
            log.warning("Bamboo GCE preemption notice: HTTP %d, body %r", resp.status, value[:100])
            return None
        return Notice(source=self.name, detail=value) if value == "TRUE" else None
