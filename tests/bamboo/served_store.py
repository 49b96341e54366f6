"""A job's store served in the test process (a ``TCPStore``, as a one-machine agent serves it), for tests of
the coordinator's decisions that need no worker and no agent."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from lightning_bamboo.protocol import store as ms


@dataclass
class ServedStore:
    server: dist.TCPStore
    job: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.server.port}"

    def client(self, timeout: float = 60.0) -> dist.Store:
        """A new connection under the job's prefix (what a worker or an agent holds)."""
        return ms.connect(self.url, self.job, timeout=timeout)


def serve_store() -> ServedStore:
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    return ServedStore(server)
