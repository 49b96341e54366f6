"""A ``torch.distributed.Store`` kept in an etcd v3 server, for a job whose workers span several machines.

Spoken through etcd's v3 HTTP/JSON gateway with ``etcd3gw`` (no gRPC or protobuf pin). Every operation the
job and ``init_process_group`` need maps onto one etcd operation or a short compare-and-swap loop:
``set`` = put, ``get``/``wait`` = poll until the key exists, ``add`` and ``compare_set`` = transactions
comparing the value read (so concurrent adders never lose an increment), except ``add(key, 0)``, a read.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdStore(dist.Store):
    """Keys live under ``prefix`` in the etcd server at ``host:port`` (its client URL).

    Args:
        host, port: the etcd server's client endpoint (``--listen-client-urls``).
        timeout: seconds ``get`` and ``wait`` wait for a key before raising.
        prefix: namespace of this store's keys in etcd.
        request_timeout: seconds one HTTP request to etcd may take (a machine's lease renewals use a
            fraction of the lease, so a machine cut off from the store notices in time).
    """

    def __init__(
        self,
        host: str,
        port: int,
        timeout: float = 60.0,
        prefix: str = "/torch/",
        request_timeout: float = 30.0,
    ) -> None:
        super().__init__()
        import etcd3gw

        self._client = etcd3gw.client(host=host, port=port, timeout=request_timeout)
        try:
            self._client.status()  # a store that cannot be reached fails here, by its address
        except Exception as err:
            raise ConnectionError(
                f"cannot reach the job's etcd store at etcd://{host}:{port} (tried etcd's v3 HTTP gateway, "
                f"POST http://{host}:{port}/v3/maintenance/status: {type(err).__name__}: "
                f"{str(err) or 'no answer'}); start etcd there (scripts/services.sh starts one on "
                "127.0.0.1), or give another --store"
            ) from err
        self._prefix = prefix
        self._timeout = timedelta(seconds=timeout)
        self._poll = 0.002

    @property
    def timeout(self) -> timedelta:  # type: ignore[override]
        return self._timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    def _key(self, key: str) -> str:
        return self._prefix + key

    def _read(self, key: str) -> bytes | None:
        values = self._client.get(self._key(key))
        return _bytes(values[0]) if values else None

    def set(self, key: str, value: str | bytes) -> None:  # type: ignore[override]
        self._client.put(self._key(key), _bytes(value))

    def get(self, key: str) -> bytes:  # type: ignore[override]
        self.wait([key])
        value = self._read(key)
        assert value is not None
        return value

    def add(self, key: str, amount: int) -> int:  # type: ignore[override]
        """Add ``amount`` to the counter at ``key`` (created at 0). ``add(key, 0)`` is how Store users read a
        counter: here it is one read, not a write (every etcd write is a consensus round and a disk sync, and
        agents read every machine's lease counter at every tick)."""
        while True:
            current = self._read(key)
            count = int(current) if current is not None else 0
            if amount == 0:
                return count
            new = str(count + amount).encode()
            if current is None:
                done = self._client.create(self._key(key), new)
            else:
                done = self._client.replace(self._key(key), current, new)
            if done:
                return int(new)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:  # type: ignore[override]
        expected_b, desired_b = _bytes(expected), _bytes(desired)
        current = self._read(key)
        if current is None:
            if expected_b:
                return expected_b  # as TCPStore: nothing to compare with, nothing set
            if self._client.create(self._key(key), desired_b):
                return desired_b
        elif current == expected_b and self._client.replace(self._key(key), current, desired_b):
            return desired_b
        value = self._read(key)
        return value if value is not None else b""

    def check(self, keys: list[str]) -> bool:  # type: ignore[override]
        return all(self._read(key) is not None for key in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:  # type: ignore[override]
        limit = (timeout or self._timeout).total_seconds()
        deadline = time.monotonic() + limit
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise TimeoutError(f"EtcdStore: keys {keys} not set within {limit:.1f}s")
            time.sleep(self._poll)

    def delete_key(self, key: str) -> bool:  # type: ignore[override]
        return bool(self._client.delete(self._key(key)))

    def num_keys(self) -> int:  # type: ignore[override]
        return len(self._client.get_prefix(self._prefix))
