"""Unblock a member waiting on a live peer that has gone into recovery: cut the old generation's sockets.

When a member dies, the peers talking to it get a gloo error at once, but a member blocked on a *live*
peer (stage 0 waiting for a gradient from stage 1, whose all-reduce with the dead member failed) waits
for the process group's timeout: the recovering peer's ``abort()``/``destroy_process_group`` does not close
its connections, gloo's p2p works complete only inside ``wait()`` (``is_completed()`` stays ``False``), and
aborting the group from another thread does not wake a pending receive.

:class:`GenerationCutter` is a daemon thread with its own store connection: when the launcher publishes a
failover, fallback or ``stop`` (the job is stopping) generation after the one this member runs, it
``shutdown()``s the sockets that the old generation's process groups opened (the socket fds that appeared
since the generation began forming, groups made later in it included; connections only, never a listening
socket, never one to the job's store). Gloo sees its connections close,
as if the peer had died, and the blocked ``wait()`` raises within milliseconds; the strategy's failure
handling takes it from there. A ``rejoin`` generation is left to the step boundary. Linux only
(``/proc/self/fd``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading

from lightning_bamboo.protocol import store as ms

log = logging.getLogger(__name__)

FAILED_KINDS = ("failover", "fallback", "stop")  # generations that end the one before by a failure
_CUT_KINDS = FAILED_KINDS


def socket_fds() -> set[int]:
    """The file descriptors of this process that are sockets."""
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                fds.add(int(name))
    return fds


class GenerationCutter:
    """Watches the job's generation; cuts the armed generation's sockets when a failover supersedes it.

    ``before_init()`` snapshots the sockets before a generation's process group is created, ``arm(g)``
    records the ones it opened once its groups exist, ``disarm()`` (under the same lock) forgets them before
    the group is destroyed, so a descriptor number reused later is never touched.
    """

    def __init__(self, env: ms.WorkerEnv, interval: float = 0.05) -> None:
        self._store = ms.connect(env.store_url, env.job)
        self._store_port = int(env.store_url.rsplit(":", 1)[1].split("/")[0])
        self._member = env.member
        self._interval = interval
        self._lock = threading.Lock()
        self._before: set[int] = set()
        self._fds: set[int] = set()
        self._generation = -1
        self.cuts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bamboo-cutter", daemon=True)
        self._thread.start()

    def before_init(self) -> None:
        self._before = socket_fds()

    def arm(self, generation: int) -> None:
        with self._lock:
            self._fds = socket_fds() - self._before
            self._generation = generation

    def disarm(self) -> None:
        with self._lock:
            self._fds = set()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        """Check the generation every ``interval``; on a store across machines (etcd), when it is written or
        at the watch's re-read interval (:data:`~lightning_bamboo.protocol.etcd_watch.REREAD_S`; each check
        is a round trip there, and six members checking every 50 ms were a third of the job's reads)."""
        watched = isinstance(self._store, ms.RoundTripStore)
        with self._store.watching(["gen"]) if watched else contextlib.nullcontext() as sleep:
            while not self._stop.is_set():
                if sleep is not None:
                    sleep(60.0)  # woken by a put of ``gen``, else after the re-read interval
                elif self._stop.wait(self._interval):
                    return
                try:
                    self._check()
                except Exception:  # the launcher is gone: the job is over
                    return

    def armed(self) -> bool:
        """Whether a formed generation is watched (lock held)."""
        return bool(self._fds)

    def _check(self) -> None:
        with self._lock:
            if not self.armed():
                return
            current = ms.current_generation(self._store)
            if current <= self._generation:
                return
            kind = ms.get_str(self._store, f"gen{current}/kind")
            if kind not in _CUT_KINDS:
                return
            self.superseded(kind)

    def superseded(self, kind: str) -> None:
        """A ``kind`` generation ended the armed one (lock held): cut its connections."""
        log.warning(
            "Bamboo member %d: generation %d superseded by a %s generation: closing its %d connections",
            self._member, self._generation, kind, len(self._fds),
        )
        self._shutdown()

    def cut_now(self) -> None:
        """Shut this member's connections of the armed generation down now, and disarm.

        For the member whose own operation failed (a lost peer): gloo does not fail a peer's pending receive
        when this member merely abandons the collective (a broadcast root whose send to a dead member failed
        never sends to the members after it), but it does when this side's sockets close: those peers then
        fail at once instead of at the process group's timeout.
        """
        with self._lock:
            if self._fds:
                self._shutdown()

    def _shutdown(self) -> None:
        """Shut down the armed generation's sockets and those opened since it began forming (lock held)."""
        # the generation's groups, and the sockets opened since it formed (a group made at a step
        # boundary, e.g. BambooNotices' flags): a peer cut off by a partition never resets them, so a
        # collective pending on one (and gloo with it) would otherwise wait on
        for fd in self._fds | (socket_fds() - self._before):
            with contextlib.suppress(OSError):
                sock = socket.socket(fileno=os.dup(fd))  # a duplicate: closing it leaves ``fd`` open
                try:
                    # connections only (gloo's listener aborts the process when its accept() fails),
                    # and never one to the job's store (an etcd client may open some while forming)
                    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) and (
                        sock.getpeername()[1] != self._store_port
                    ):
                        sock.shutdown(socket.SHUT_RDWR)  # acts on the socket itself, seen by gloo
                finally:
                    sock.close()
        self._fds = set()
        self.cuts += 1
