"""A ``torch.distributed.Store`` kept in an etcd v3 server, for a job whose workers span several machines.

Spoken through etcd's v3 HTTP/JSON gateway with ``etcd3gw`` (no gRPC or protobuf pin). Every operation the
job and ``init_process_group`` need maps onto one etcd request or a short compare-and-swap loop:
``set`` = put; ``get``/``wait`` = a read, then, while the key is absent, sleeping until the process's one
watch stream on the job's keys reports its put (:class:`~lightning_bamboo.control.etcd_watch.PutWatch`;
polling made the step's commit hundreds of reads a second across machines);
``compare_set`` = one transaction; ``add`` = a transaction comparing the value read (so concurrent adders
never lose an increment), except ``add(key, 0)``, a read. :meth:`EtcdStore.vote` counts a key's voters in one
transaction, where concurrent ``add`` calls on one counter would retry against each other.
"""

from __future__ import annotations

import base64
import contextlib
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_bamboo.control.etcd_watch import PutWatch, prefix_end

_Op = dict[str, Any]
"""One compare or request of an etcd transaction, as the JSON gateway takes it."""


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _encode(value: str | bytes) -> str:
    """etcd's JSON gateway carries keys and values as base64."""
    return base64.b64encode(_bytes(value)).decode()


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
        self._puts = PutWatch.shared(self._client.get_url("/watch"), prefix.encode())

    @property
    def timeout(self) -> timedelta:  # type: ignore[override]
        return self._timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    def _key(self, key: str) -> str:
        return self._prefix + key

    def read(self, key: str) -> bytes | None:
        """``key``'s value, ``None`` when absent: one request (``check`` then ``get`` would be two)."""
        values = self._client.get(self._key(key))
        return _bytes(values[0]) if values else None

    def _txn(self, compare: list[_Op], success: list[_Op], failure: list[_Op]) -> dict[str, Any]:
        """One etcd transaction (the JSON gateway's ``/kv/txn``), its reply as etcd gives it."""
        return self._client.transaction({"compare": compare, "success": success, "failure": failure})

    def set(self, key: str, value: str | bytes) -> None:  # type: ignore[override]
        self._client.put(self._key(key), _bytes(value))

    def get(self, key: str) -> bytes:  # type: ignore[override]
        value = self.read(key)
        if value is None:
            self.wait([key])
            value = self.read(key)
        assert value is not None
        return value

    def add(self, key: str, amount: int) -> int:  # type: ignore[override]
        """Add ``amount`` to the counter at ``key`` (created at 0). ``add(key, 0)`` is how Store users read a
        counter: here it is one read, not a write (every etcd write is a consensus round and a disk sync, and
        agents read every machine's lease counter at every tick)."""
        while True:
            current = self.read(key)
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
        """One transaction: put ``desired`` if the key holds ``expected`` (is absent, for ``""``), else read
        it. As ``TCPStore``: an absent key and a non-empty ``expected``: nothing set, ``expected`` back."""
        expected_b, desired_b, etcd_key = _bytes(expected), _bytes(desired), _encode(self._key(key))
        if expected_b:
            holds = {"key": etcd_key, "result": "EQUAL", "target": "VALUE", "value": _encode(expected_b)}
        else:
            holds = {"key": etcd_key, "result": "EQUAL", "target": "CREATE", "create_revision": 0}
        reply = self._txn(
            [holds],
            [{"request_put": {"key": etcd_key, "value": _encode(desired_b)}}],
            [{"request_range": {"key": etcd_key}}],
        )
        if reply.get("succeeded"):
            return desired_b
        kvs = reply["responses"][0]["response_range"].get("kvs") or []
        if not kvs:
            return expected_b
        return base64.b64decode(kvs[0].get("value", ""))

    def vote(self, key: str, voter: str) -> int:
        """Record ``voter`` under ``key``; return how many voters it holds with this one. One transaction.

        What ``add(key, 1)`` returns to concurrent members, without their compare-and-swap retries against
        each other: transactions are serialised, so exactly one voter sees the full count. A vote repeated
        (a request retried) counts once."""
        prefix = _bytes(self._key(key) + "/")
        reply = self._txn(
            [],
            [
                {"request_put": {"key": _encode(prefix + voter.encode()), "value": _encode(b"1")}},
                {
                    "request_range": {
                        "key": _encode(prefix),
                        "range_end": _encode(prefix_end(prefix)),
                        "count_only": True,
                    }
                },
            ],
            [],
        )
        return int(reply["responses"][1]["response_range"].get("count", 0))

    def check(self, keys: list[str]) -> bool:  # type: ignore[override]
        return all(self.read(key) is not None for key in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:  # type: ignore[override]
        """Return once every key exists; ``TimeoutError`` after ``timeout``. Each key is read, and while
        absent the caller sleeps until the watch stream reports its put (or re-reads now and then)."""
        limit = (timeout or self._timeout).total_seconds()
        deadline = time.monotonic() + limit
        for key in keys:
            with self.watching([key]) as sleep:
                while self.read(key) is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"EtcdStore: keys {keys} not set within {limit:.1f}s")
                    sleep(left)

    @contextlib.contextmanager
    def watching(self, keys: list[str]) -> Iterator[Callable[[float], None]]:
        """Within the block, ``sleep(seconds)`` returns when one of ``keys`` was put since the block began
        or the last ``sleep`` (or after ``seconds``, at most the watch's re-read interval): a caller reads
        the keys it waits on, then sleeps, and reads again. What waits on two keys at once uses it (a step's
        outcome, or the next generation: :class:`~lightning_bamboo.control.commit.StepCommit`)."""
        with self._puts.registered([self._key(key).encode() for key in keys]) as sleep:
            yield sleep

    def delete_key(self, key: str) -> bool:  # type: ignore[override]
        return bool(self._client.delete(self._key(key)))

    def num_keys(self) -> int:  # type: ignore[override]
        return len(self._client.get_prefix(self._prefix))
