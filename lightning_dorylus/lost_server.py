"""A graph server lost mid-fit is named: which rank, on which host, in which collective, and how to resume.

When a graph server dies, the survivors' next collective with it fails with the backend's own text (gloo:
``Connection closed by peer [10.0.0.2]:41234``, or a timeout), which names neither the server nor what to do.
Every graph server therefore writes who it is (rank, host, pid) into the process group's store at setup and
keeps a heartbeat there (a counter, every :data:`BEAT_S` s, from a daemon thread); the collectives run inside
:func:`collective` (``with collective("all_reduce of the weight gradients"): ...``), which turns such a
failure into :class:`GraphServerLostError`: the servers whose heartbeat stopped (or rank 0, when the store it
hosts no longer answers), their hosts, the collective, where training was, and the resume command. The
backend's own error stays attached (``__cause__``) and quoted.

Only the store's keys and JSON values cross between processes (no pickle). The heartbeat costs one small
store write per server every :data:`BEAT_S` s.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)

BEAT_S = 0.5  # heartbeat period
PROBE_S = 2.5  # a heartbeat unchanged for this long: the server is gone (or frozen)
_PREFIX = "dorylus/servers"
#: Texts of the backends' errors when a peer went away or stopped answering.
PEER_FAILURES = ("connection closed by peer", "connection reset by peer", "broken pipe", "timed out",
                 "timeout", "connection refused", "socket closed", "nccl communicator was aborted",
                 "unhandled system error", "remote process exited")


class GraphServerLostError(RuntimeError):
    """A graph server stopped answering during a collective. ``lost``: the ranks found lost (may be empty
    when none could be told apart), ``collective``: what the survivors were doing."""

    def __init__(self, message: str, lost: list[int], collective: str) -> None:
        super().__init__(message)
        self.lost = lost
        self.collective = collective


class ServerDirectory:
    """Who every graph server is, and a heartbeat per server in the process group's store."""

    def __init__(self, store: Any, rank: int, world_size: int, trainer: Callable[[], Any],
                 timeout_s: float = 60.0) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.trainer = trainer  # the Trainer now (for where training was and its checkpoints), or None
        me = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid()}
        store.set(f"{_PREFIX}/{rank}", json.dumps(me))
        keys = [f"{_PREFIX}/{r}" for r in range(world_size)]
        store.wait(keys, _timedelta(timeout_s))
        self.servers = [json.loads(store.get(k)) for k in keys]  # kept: the store may be lost with rank 0
        self._stop = threading.Event()
        self._beats = 0
        self._beat()
        self._thread = threading.Thread(target=self._run, name="dorylus-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self._beats += 1
        self.store.set(f"{_PREFIX}/{self.rank}/beat", str(self._beats))

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self._beat()
            except Exception:  # the store is gone (its host was lost): the collective's error names it
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def describe(self, rank: int) -> str:
        server = self.servers[rank]
        return f"rank {rank} of {self.world_size} (host {server['host']}, pid {server['pid']})"

    def find_lost(self) -> tuple[list[int], str]:
        """The ranks whose heartbeat stopped, and how that was told (read twice, :data:`PROBE_S` apart)."""
        others = [r for r in range(self.world_size) if r != self.rank]
        try:
            first = {r: self._read(r) for r in others}
            time.sleep(PROBE_S)
            second = {r: self._read(r) for r in others}
        except Exception as err:  # the store itself went away: its host, rank 0, was lost
            if self.rank == 0:
                return [], f"this server's own store failed too ({type(err).__name__})"
            return [0], f"the store rank 0 hosts no longer answers ({type(err).__name__}: {err})"
        lost = [r for r in others if first[r] == second[r]]
        return lost, f"no heartbeat for {PROBE_S} s"

    def _read(self, rank: int) -> str | None:
        key = f"{_PREFIX}/{rank}/beat"
        return self.store.get(key).decode() if self.store.check([key]) else None


_directory: ServerDirectory | None = None


def process_group_store() -> Any | None:
    """The default process group's store (the rendezvous TCPStore: rank 0's under Lightning's launcher,
    torchrun's agent's under torchrun). torch has no public accessor: None where this torch lacks the
    private one, and lost servers are then reported by the backend's error alone."""
    import torch.distributed as dist

    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except Exception:  # no default group
        return None


def start(store: Any | None, rank: int, world_size: int, trainer: Callable[[], Any]) -> None:
    """Registers this graph server and starts its heartbeat (one directory per process; a new one replaces
    the last). ``trainer``: returns the Trainer running now (or None). ``store`` None: nothing to do."""
    global _directory
    stop()
    if store is None:
        log.debug("no process-group store: a lost graph server is reported by the backend's error alone")
        return
    _directory = ServerDirectory(store, rank, world_size, trainer)


def stop() -> None:
    global _directory
    if _directory is not None:
        _directory.close()
        _directory = None


def is_peer_failure(err: BaseException) -> bool:
    """Whether ``err`` is a collective failing because a peer went away or stopped answering: torch's
    ``DistError`` (backend, network, store), or a backend's RuntimeError saying so. An executor's or a
    user's own error is never taken for one."""
    import torch.distributed as dist

    if isinstance(err, dist.DistError):
        return True
    text = str(err).lower()
    from_backend = any(name in text for name in ("gloo", "nccl", "processgroup"))
    return from_backend and any(marker in text for marker in PEER_FAILURES)


@contextmanager
def collective(name: str) -> Iterator[None]:
    """Runs a collective; a peer failure in it raises :class:`GraphServerLostError` naming the lost server.
    Nested: the innermost (most precise) name wins."""
    try:
        yield
    except GraphServerLostError:
        raise
    except RuntimeError as err:
        directory = _directory
        if directory is None or directory.world_size < 2 or not is_peer_failure(err):
            raise
        raise lost_error(directory, name, err) from err


def lost_error(directory: ServerDirectory, name: str, err: BaseException) -> GraphServerLostError:
    """The error a survivor raises (after probing the heartbeats)."""
    lost, how = directory.find_lost()
    if lost:
        who = ", ".join(directory.describe(r) for r in lost)
        head = f"graph server {who} was lost during {name}"
    else:
        head = (f"a graph server stopped answering during {name}, but every heartbeat is still beating "
                f"(a server hung, or the network between servers failed)")
    backend = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
    trainer = directory.trainer()
    message = (f"{head} ({how}), {where(trainer)}; this is graph server "
               f"{directory.describe(directory.rank)}. {resume_hint(trainer)} The backend said: {backend}")
    log.error("%s", message)
    return GraphServerLostError(message, lost, name)


def _timedelta(seconds: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=seconds)


def where(trainer: Any) -> str:
    """Where training was, for the error."""
    if trainer is None:
        return "outside fit"
    stage = getattr(trainer.state.fn, "value", None) or "fit"
    return f"at epoch {trainer.current_epoch}, global step {trainer.global_step} ({stage})"


def resume_hint(trainer: Any) -> str:
    """How to resume exactly, from the checkpoints this run has (Lightning's ``ModelCheckpoint``)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    callbacks = [c for c in getattr(trainer, "checkpoint_callbacks", []) if isinstance(c, ModelCheckpoint)]
    with_last = [c for c in callbacks if c.save_last]
    latest = next((c.best_model_path for c in callbacks if c.best_model_path), "")
    if with_last:
        path = 'ckpt_path="last"'
        saved = f"ModelCheckpoint(save_last=True) saved {with_last[0].last_model_path or 'nothing yet'}"
    elif latest:
        path = f"ckpt_path={latest!r}"
        saved = "ModelCheckpoint(save_last=True) would keep the last epoch's for ckpt_path=\"last\""
    else:
        return ("No checkpoint was saved, so the run starts over: with ModelCheckpoint(save_last=True) "
                "such a run resumes exactly with trainer.fit(model, datamodule=..., ckpt_path=\"last\").")
    return (f"Start every graph server again (the same command, with the lost server's machine back or "
            f"replaced) and resume with trainer.fit(model, datamodule=..., {path}): it restores the last "
            f"checkpointed epoch exactly (weights, optimizer, epoch; {saved}).")
