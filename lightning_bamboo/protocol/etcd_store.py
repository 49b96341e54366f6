"""A ``torch.distributed.Store`` kept in an etcd v3 server, for a job whose workers span several machines.

Spoken through etcd's v3 HTTP/JSON gateway with ``etcd3gw`` (no gRPC or protobuf pin). Every operation the
job and ``init_process_group`` need maps onto one etcd request or a short compare-and-swap loop:
``set`` = put; ``get``/``wait`` = a read, then, while the key is absent, sleeping until the process's one
watch stream on the job's keys reports its put (:class:`~lightning_bamboo.protocol.etcd_watch.PutWatch`;
polling made the step's commit hundreds of reads a second across machines);
``compare_set`` = one transaction; ``add`` = a transaction comparing the value read (so concurrent adders
never lose an increment), except ``add(key, 0)``, a read. :meth:`EtcdStore.vote` counts a key's voters in one
transaction, where concurrent ``add`` calls on one counter would retry against each other.
:meth:`EtcdStore.tick` batches the reads of a polling loop's pass (an agent's tick) into one transaction.
"""

from __future__ import annotations

import base64
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_bamboo.protocol.etcd_watch import PutWatch, prefix_end

_Op = dict[str, Any]
"""One compare or request of an etcd transaction, as the JSON gateway takes it."""

_TXN_OPS = 100
"""Reads per prefetch transaction: etcd refuses a transaction of more than ``--max-txn-ops`` (128 by
default) operations."""


def _range_value(response: dict[str, Any]) -> bytes | None:
    """The value a transaction's range request of one key read, ``None`` where the key is absent."""
    kvs = response["response_range"].get("kvs") or []
    return base64.b64decode(kvs[0].get("value", "")) if kvs else None


class _TickReads(threading.local):
    """The reads of one :meth:`EtcdStore.tick` block, for the thread that opened it: the values prefetched
    at its start (each served once), and every key read in it (the next block's prefetch)."""

    def __init__(self) -> None:
        self.values: dict[str, bytes | None] | None = None
        self.seen: set[str] = set()


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _encode(value: str | bytes) -> str:
    """etcd's JSON gateway carries keys and values as base64."""
    return base64.b64encode(_bytes(value)).decode()


def _once_more(read: Callable[[], Any]) -> Any:
    """A read (nothing it does changes the store, so it is safe to send twice) sent again once when its
    connection was dropped: the HTTP client reuses a kept-alive connection, and one etcd closed while it was
    idle fails the next request without an answer (``RemoteDisconnected``; seen after a test's client idled
    through a machine's fencing). A second failure is the store's: it is raised."""
    import etcd3gw.exceptions

    try:
        return read()
    except etcd3gw.exceptions.ConnectionFailedError:
        return read()


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
        self._tick = _TickReads()

    @property
    def timeout(self) -> timedelta:  # type: ignore[override]
        return self._timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    def _key(self, key: str) -> str:
        return self._prefix + key

    def read(self, key: str) -> bytes | None:
        """``key``'s value, ``None`` when absent: one request (``check`` then ``get`` would be two), or none
        for the first read of a key a :meth:`tick` block prefetched."""
        tick = self._tick
        if tick.values is not None:
            tick.seen.add(key)
            if key in tick.values:
                return tick.values.pop(key)  # served once: a loop re-reading the key reads it live
        values = _once_more(lambda: self._client.get(self._key(key)))
        return _bytes(values[0]) if values else None

    def read_many(self, keys: list[str]) -> dict[str, bytes | None]:
        """The values of ``keys`` (``None`` where absent) from one revision of the store: one read-only
        transaction per :data:`_TXN_OPS` keys."""
        values: dict[str, bytes | None] = {}
        for start in range(0, len(keys), _TXN_OPS):
            chunk = keys[start:start + _TXN_OPS]
            ops = [self._range_op(key) for key in chunk]
            reply = _once_more(lambda ops=ops: self._txn([], ops, []))
            for key, response in zip(chunk, reply.get("responses", []), strict=True):
                values[key] = _range_value(response)
        return values

    @contextlib.contextmanager
    def tick(self) -> Iterator[None]:
        """One pass of a polling loop (an agent's tick) that reads many keys: at the block's start, the keys
        the previous block read are fetched in one transaction, and the block's first read of each is served
        from there. About 18 reads a tick were 18 round trips (an agent reads every machine's lease, its
        workers' heartbeats, the coordinator, the job's end), 10 ticks a second on every machine. A key this
        block writes, and every later read of a key, is read live, so a loop waiting in the block for a
        change still sees it. Only the thread that opened the block is served; blocks do not nest."""
        tick = self._tick
        if tick.values is not None:
            yield
            return
        keys, tick.seen = sorted(tick.seen), set()
        tick.values = self.read_many(keys) if keys else {}
        try:
            yield
        finally:
            tick.values = None

    def _written(self, key: str) -> None:
        """A write of ``key`` in a :meth:`tick` block: its prefetched value is stale."""
        if self._tick.values is not None:
            self._tick.values.pop(key, None)

    def _range_op(self, key: str) -> _Op:
        """A transaction's read of ``key`` (:func:`_range_value` takes its answer)."""
        return {"request_range": {"key": _encode(self._key(key))}}

    def _txn(self, compare: list[_Op], success: list[_Op], failure: list[_Op]) -> dict[str, Any]:
        """One etcd transaction (the JSON gateway's ``/kv/txn``), its reply as etcd gives it."""
        return self._client.transaction({"compare": compare, "success": success, "failure": failure})

    def set(self, key: str, value: str | bytes) -> None:  # type: ignore[override]
        self._written(key)
        self._client.put(self._key(key), _bytes(value))

    def get(self, key: str) -> bytes:  # type: ignore[override]
        """``key``'s value, waiting for it while absent (``TimeoutError`` after the store's timeout)."""
        value = self.read(key)
        if value is not None:
            return value
        return self._await(key, [key], self._timeout.total_seconds(), time.monotonic())

    def add(self, key: str, amount: int) -> int:  # type: ignore[override]
        """Add ``amount`` to the counter at ``key`` (created at 0). ``add(key, 0)`` is how Store users read a
        counter: here it is one read, not a write (every etcd write is a consensus round and a disk sync, and
        agents read every machine's lease counter at every tick)."""
        if amount:
            self._written(key)
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
        self._written(key)
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
        value = _range_value(reply["responses"][0])
        return expected_b if value is None else value

    def vote(self, key: str, voter: str) -> int:
        """Record ``voter`` under ``key``; return how many voters it holds with this one. One transaction.

        What ``add(key, 1)`` returns to concurrent members, without their compare-and-swap retries against
        each other: transactions are serialised, so exactly one voter sees the full count. A vote repeated
        (a request retried) counts once."""
        return self.vote_and_read(key, voter, [])[0]

    def vote_and_read(self, key: str, voter: str, reads: list[str]) -> tuple[int, dict[str, bytes | None]]:
        """:meth:`vote`, and the values of ``reads`` as they are right after it, in the same transaction: a
        member that prepares a step reads the step's outcome and the generation with its vote (three round
        trips were one)."""
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
                *(self._range_op(read) for read in reads),
            ],
            [],
        )
        responses = reply["responses"]
        values = {read: _range_value(response) for read, response in zip(reads, responses[2:], strict=True)}
        return int(responses[1]["response_range"].get("count", 0)), values

    def check(self, keys: list[str]) -> bool:  # type: ignore[override]
        return all(self.read(key) is not None for key in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:  # type: ignore[override]
        """Return once every key exists; ``TimeoutError`` after ``timeout``. Each key is read, and while
        absent the caller sleeps until the watch stream reports its put (or re-reads now and then)."""
        limit = (timeout or self._timeout).total_seconds()
        began = time.monotonic()
        for key in keys:
            self._await(key, keys, limit, began)

    def _await(self, key: str, keys: list[str], limit: float, began: float) -> bytes:
        """``key``'s value once it is set: read, then sleep on the watch until its put (or a re-read), at
        most until ``limit`` seconds after ``began`` (``TimeoutError`` naming ``keys``, the wait's keys)."""
        with self.watching([key]) as sleep:
            while (value := self.read(key)) is None:
                left = began + limit - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"EtcdStore: keys {keys} not set within {limit:.1f}s")
                sleep(left)
        return value

    @contextlib.contextmanager
    def watching(self, keys: list[str]) -> Iterator[Callable[[float], bool]]:
        """Within the block, ``sleep(seconds)`` returns when one of ``keys`` was put since the block began
        or the last ``sleep`` (or after ``seconds``, at most the watch's re-read interval), ``True`` when one
        was: a caller reads the keys it waits on, then sleeps, and reads again. What waits on two keys at
        once uses it (a step's outcome, or the next generation: :class:`~lightning_bamboo.protocol.commit.
        StepCommit`)."""
        with self._puts.registered([self._key(key).encode() for key in keys]) as sleep:
            yield sleep

    def delete_key(self, key: str) -> bool:  # type: ignore[override]
        self._written(key)
        return bool(self._client.delete(self._key(key)))

    def num_keys(self) -> int:  # type: ignore[override]
        return len(self._client.get_prefix(self._prefix))
