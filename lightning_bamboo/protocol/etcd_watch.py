"""One watch stream on a store's keys in etcd, shared by a process's waiters: a key's put wakes its waiters.

Why not a watch per wait (``etcd3gw``'s ``watch_once``): each one opens an HTTP stream and a thread pool, and
with six members waiting for a step's outcome on two cores the outcome reached them 40 ms apart (median);
polling instead made the step's commit hundreds of reads a second. Here one daemon thread per process keeps
a single stream on the store's prefix (etcd's v3 JSON gateway, ``POST /v3/watch``) and notes the puts of the
keys someone waits for. A waiter registers its key *before* it reads it, so a put it did not read is one the
stream delivers after the registration. If the stream breaks (etcd restarted, the connection cut), the
waiters' own reads, at least every :data:`REREAD_S`, still see the key: the stream makes the common case fast.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import requests

REREAD_S = 2.0
"""The longest a waiter sleeps on the stream before it reads its key again (so a broken stream is noticed).

Only a broken stream waits this long; a put wakes the waiter at once. Each member holds two such waiters for
its whole life (its cutter's and its step boundary's watch on ``gen``): at 0.5 s, their re-reads alone were
about 4 requests per step of a failure-free six-member job (``docs/bamboo-elastic-reference.md``,
"The job's store on etcd")."""


def prefix_end(prefix: bytes) -> bytes:
    """The end of the key range holding every key that starts with ``prefix`` (etcd's ``range_end``)."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


class PutWatch:
    """The puts of registered keys under ``prefix``, as one watch stream at ``url`` (``.../v3/watch``) shows.

    Started on first use in the process that uses it (a forked child starts its own); :meth:`shared` gives
    every store of a process on the same server and prefix the same one (a worker holds several)."""

    _shared: dict[tuple[str, bytes], PutWatch] = {}
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls, url: str, prefix: bytes) -> PutWatch:
        with cls._shared_lock:
            return cls._shared.setdefault((url, prefix), cls(url, prefix))

    def __init__(self, url: str, prefix: bytes) -> None:
        self._url, self._prefix = url, prefix
        self._changed = threading.Condition()
        self._waiting: Counter[bytes] = Counter()  # key -> blocks registered on it
        self._puts: dict[bytes, int] = {}  # registered key -> its puts seen on the stream
        self._ready = threading.Event()
        self._owner: int | None = None

    @contextlib.contextmanager
    def registered(self, keys: list[bytes]) -> Iterator[Callable[[float], bool]]:
        """Note the keys' puts while the block runs; it gets ``sleep(seconds)``, which returns once one of
        them was put since the block began or since this block's last ``sleep`` (or after ``seconds``, at
        most :data:`REREAD_S`), and says whether one was (``sleep(0)``: a look, no wait). Each block counts
        for itself: two threads waiting on one key both wake."""
        self._start()
        with self._changed:
            for key in keys:
                self._waiting[key] += 1
                self._puts.setdefault(key, 0)
            seen = {key: self._puts[key] for key in keys}

        def sleep(seconds: float) -> bool:
            with self._changed:
                put = self._changed.wait_for(
                    lambda: any(self._puts[key] != seen[key] for key in keys), timeout=min(seconds, REREAD_S)
                )
                seen.update((key, self._puts[key]) for key in keys)
                return put

        try:
            yield sleep
        finally:
            with self._changed:
                for key in keys:
                    self._waiting[key] -= 1
                    if not self._waiting[key]:
                        del self._waiting[key], self._puts[key]

    def _start(self) -> None:
        with self._shared_lock:
            if self._owner != os.getpid():
                self._owner = os.getpid()
                self._ready.clear()
                threading.Thread(target=self._follow, name="etcd-put-watch", daemon=True).start()
        self._ready.wait(timeout=5.0)  # not ready in time: waiters fall back on their own reads

    def _follow(self) -> None:
        request = {
            "create_request": {
                "key": base64.b64encode(self._prefix).decode(),
                "range_end": base64.b64encode(prefix_end(self._prefix)).decode(),
                "filters": ["NODELETE"],
            }
        }
        while True:
            try:
                with requests.post(self._url, json=request, stream=True, timeout=(5.0, None)) as stream:
                    for line in stream.iter_lines():
                        if line:
                            self._note(json.loads(line).get("result", {}))
            except (requests.RequestException, ValueError):
                self._ready.set()  # no stream to wait for: the waiters read on their own meanwhile
            time.sleep(0.1)

    def _note(self, result: dict) -> None:
        if result.get("created"):
            self._ready.set()
        keys = {base64.b64decode(event["kv"]["key"]) for event in result.get("events", ())}
        with self._changed:
            woken = keys & self._waiting.keys()
            for key in woken:
                self._puts[key] += 1
            if woken:
                self._changed.notify_all()
