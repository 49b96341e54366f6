"""``nccl-like``: a process-group backend on CPU that carries gloo's traffic but fails the way NCCL does.

Bamboo's failure path on NCCL cannot be tested without GPUs, and gloo fails too kindly: a lost peer makes a
gloo operation raise, and cutting a member's sockets wakes its peers. NCCL does neither. A survivor's NCCL
operation never raises when a peer dies (its kernel spins; the main thread sits in a device synchronisation),
only ``ncclCommAbort`` (the backend's ``abort()``, callable from another thread) wakes it, and once any rank
aborted a communicator, destroying it instead of aborting it can block forever (NCCL's user guide, "Fault
Tolerance"). This backend reproduces exactly those three rules on top of a real ``ProcessGroupGloo``:

- an operation whose gloo work fails (a lost peer, a cut connection, gloo's timeout) does not raise: its
  ``wait()`` blocks until :meth:`NcclLikeGroup.abort` is called (from any thread), then raises
  :class:`torch.distributed.DistBackendError`, as an aborted NCCL communicator does;
- every operation after ``abort()`` raises at once;
- ``shutdown()`` (what ``destroy_process_group`` calls) of a group that this member aborted, that any member
  of the group aborted (a key in the group's store), or whose operation saw a lost peer, raises
  :class:`NcclLikeDestroyRefused` instead of hanging, so a test sees the mistake.

It is test support that ships: ``Trainer(strategy=BambooStrategy(process_group_backend="nccl-like"))`` and
``benchmarks/gpu_failover.py --backend nccl-like`` run a CPU job with NCCL's failure rules. Importing this
module registers the backend (:func:`register`). It is slower than gloo (one waiting thread per operation)
and never a replacement for it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_bamboo.runtime.cutter import socket_fds

NAME = "nccl-like"
ABORTED_KEY = "nccl_like/aborted"  # in each group's own store: some member aborted this group
_OPS = ("allreduce", "allreduce_coalesced", "broadcast", "allgather", "_allgather_base", "barrier",
        "reduce", "gather", "scatter", "reduce_scatter", "alltoall_base", "send", "recv", "recv_anysource")


class NcclLikeDestroyRefused(RuntimeError):
    """``destroy_process_group`` on a group that a member aborted or that lost a peer (NCCL may hang)."""


class NcclLikeWork(dist.Work):
    """One operation: done when gloo's work is; a gloo failure waits for the group's ``abort()``."""

    def __init__(self, inner: Any, group: NcclLikeGroup) -> None:
        super().__init__()
        self._inner, self._group = inner, group
        self.wake = threading.Event()  # set when gloo's work succeeded, or when the group is aborted
        self._ok = False
        group.pending(self)
        threading.Thread(target=self._run, name="nccl-like-work", daemon=True).start()

    def _run(self) -> None:
        try:
            self._inner.wait()
        except Exception:  # what a lost peer does to gloo; NCCL would spin instead: wait for abort()
            self._group.peer_lost()
            return
        self._ok = True
        self._group.finished(self)
        self.wake.set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.wake.wait()  # no timeout: a failed NCCL operation neither raises nor times out
        if self._group.aborted.is_set() and not self._ok:
            raise dist.DistBackendError(f"{NAME}: the communicator was aborted (rank {self._group.rank()})")
        return True

    def is_completed(self) -> bool:
        return self._ok

    def is_success(self) -> bool:
        return self._ok


class NcclLikeGroup(dist.ProcessGroup):
    """A ``ProcessGroupGloo`` behind NCCL's failure rules (see the module docstring)."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._store = store
        before = socket_fds()
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._sockets = socket_fds() - before  # gloo's full mesh, connected while it was built
        self.aborted = threading.Event()
        self.lost = False
        self._lock = threading.Lock()
        self._pending: set[NcclLikeWork] = set()  # operations abort() wakes

    def getBackendName(self) -> str:  # torch's name
        return NAME

    def pending(self, work: NcclLikeWork) -> None:
        with self._lock:
            self._pending.add(work)
            if self.aborted.is_set():
                work.wake.set()

    def finished(self, work: NcclLikeWork) -> None:
        with self._lock:
            self._pending.discard(work)

    def peer_lost(self) -> None:
        self.lost = True

    def abort(self) -> None:
        """``ncclCommAbort``: every pending and later operation of this group raises (any thread)."""
        with self._lock:
            self.aborted.set()
            for work in self._pending:
                work.wake.set()
            self._pending.clear()
        # and its connections go, as ncclCommAbort frees the communicator's: gloo's pending operations end
        # (a peer that has not aborted yet sees a failure, which blocks it until its own abort), so no thread
        # is left inside gloo when the process exits (gloo's own abort does not wake a pending receive)
        for fd in self._sockets:
            with contextlib.suppress(OSError):
                sock = socket.socket(fileno=os.dup(fd))  # a duplicate: closing it leaves ``fd`` open
                try:
                    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):  # never a listener
                        sock.shutdown(socket.SHUT_RDWR)
                finally:
                    sock.close()
        self._sockets = set()
        # and the group's peers learn that it was aborted (what their destroy refuses). From a thread of its
        # own: ncclCommAbort touches no store, and this one's connection may be held by the main thread's
        # blocking wait (a peer's key that will never come), which an abort must not wait behind.
        threading.Thread(target=self._say_aborted, name="nccl-like-aborted", daemon=True).start()

    def _say_aborted(self) -> None:
        with contextlib.suppress(Exception):  # the store may be what failed; the local rule still holds
            self._store.set(ABORTED_KEY, "1")

    def shutdown(self) -> None:
        """``destroy_process_group``: refused where NCCL could block forever (see the module docstring)."""
        peer_aborted = False
        if not self.aborted.is_set():
            with contextlib.suppress(Exception):  # a store that is gone is no abort seen
                peer_aborted = self._store.check([ABORTED_KEY])
        if self.aborted.is_set() or peer_aborted or self.lost:
            why = ("this member aborted it" if self.aborted.is_set()
                   else "a member aborted it" if peer_aborted else "it lost a peer")
            raise NcclLikeDestroyRefused(
                f"{NAME}: destroy_process_group on a group {why}; NCCL can block forever here: release a "
                "failed generation by abort (torch.distributed.distributed_c10d._abort_process_group)"
            )
        self._gloo.shutdown()  # a healthy group's gloo threads end before the process does


def _wrap(name: str) -> Any:
    def op(self: NcclLikeGroup, *args: Any, **kwargs: Any) -> NcclLikeWork:
        if self.aborted.is_set():
            raise dist.DistBackendError(f"{NAME}: {name} on an aborted communicator (rank {self.rank()})")
        return NcclLikeWork(getattr(self._gloo, name)(*args, **kwargs), self)

    op.__name__ = name
    op.__doc__ = f"gloo's ``{name}``, with NCCL's failure rules."
    return op


for _name in _OPS:
    setattr(NcclLikeGroup, _name, _wrap(_name))


def _create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> NcclLikeGroup:
    return NcclLikeGroup(store, rank, size, timeout)


def register() -> None:
    """Register ``nccl-like`` with ``torch.distributed`` (CPU tensors; once per process)."""
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, _create, devices=["cpu"])


register()
