"""How a member lets go of a generation's process groups: one small interface, one implementation per
kind of backend, because gloo and NCCL fail differently.

A *planned* change (a join or a drain at a step boundary, every member alive) destroys the groups
(``destroy_process_group``) on any backend. A *failed* generation (a lost peer) is released as its backend
needs:

- gloo (:class:`CutSockets`): a lost peer makes gloo raise, and a member blocked on a live peer is woken by
  cutting the generation's sockets (:class:`~lightning_bamboo.runtime.cutter.GenerationCutter`, a watcher
  thread); the groups are then aborted and destroyed.
- NCCL, and the ``nccl-like`` stand-in (:class:`AbortBackends`): nothing raises when a peer dies (a survivor's
  main thread sits in a device synchronisation while the kernel spins), cutting sockets wakes nothing and
  would cut NCCL's own bootstrap and proxy sockets, and once any rank aborted a communicator every rank must
  release it by abort: ``destroy_process_group`` can block forever. So a watcher thread aborts every backend
  of the generation in one group call (``_abort_process_group``: ``ncclGroupStart``/``End`` around the
  aborts, pytorch#119797) as soon as the launcher publishes a generation that ends it by a failure, or when
  an attempt (a step, an evaluation batch, the forming of a generation) makes no progress in one generation
  for longer than its deadline (a backstop: the strategy's ``timeout``; the process group itself gets twice
  that). The main thread's operation then
  raises; it waits for the watcher's release to end, synchronises the device (a sticky CUDA error ends the
  worker, :class:`StickyDeviceError`), and the next generation forms under a new store prefix.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_bamboo._lightning import private as _private
from lightning_bamboo.protocol import store as ms
from lightning_bamboo.runtime import nccl_like
from lightning_bamboo.runtime.cutter import GenerationCutter

log = logging.getLogger(__name__)

ABORT_BACKENDS = ("nccl", nccl_like.NAME)  # backends whose failed generation is released by abort


class StickyDeviceError(dist.DistError):
    """The device reports an error after a failed generation was aborted: a sticky CUDA error, after which
    this process cannot use the GPU again. The worker ends; its launcher counts it as a lost worker (a
    communication failure, not an error of the training code)."""


def releases_by_abort(backend: str | None) -> bool:
    """Whether ``backend`` (a name, or ``"cpu:gloo,cuda:nccl"``) releases a failed generation by abort."""
    return backend is not None and any(b.split(":")[-1] in ABORT_BACKENDS for b in backend.split(","))


class Release:
    """Releasing generations on gloo (the base: no watcher without a launcher, sockets cut with one)."""

    def __init__(self, env: ms.WorkerEnv | None, device: Callable[[], torch.device]) -> None:
        self._watcher = self._make_watcher(env) if env is not None else None
        self._device = device

    def _make_watcher(self, env: ms.WorkerEnv) -> GenerationCutter:
        return GenerationCutter(env)

    def pg_timeout(self, timeout: timedelta | None) -> timedelta | None:
        """The default group's timeout for a step ``timeout`` (gloo: the same: its timeout raises)."""
        return timeout

    def before_init(self) -> None:
        if self._watcher is not None:
            self._watcher.before_init()

    def began(self, generation: int) -> None:
        """``generation``'s default group exists; the rest of it is forming (gloo: watched once formed)."""

    def formed(self, generation: int) -> None:
        """``generation``'s groups exist: watch them."""
        if self._watcher is not None:
            self._watcher.arm(generation)

    @contextlib.contextmanager
    def attempt(self) -> Iterator[None]:
        """Around one attempt of the retry loop (a deadline on the backends that need one)."""
        yield

    def end(self, failed: bool) -> None:
        """Leave the generation in place before the next forms (a step boundary; ``failed``: a generation
        that ends it by a failure was published). gloo destroys either way: its watcher cut the sockets."""
        self.planned()

    def planned(self) -> None:
        """Leave a generation every member leaves alive (a join, a drain): destroy its groups."""
        if self._watcher is not None:
            self._watcher.disarm()
        if dist.is_initialized():
            dist.destroy_process_group()

    def failed(self) -> None:
        """Leave a generation that lost a peer (main thread): cut this member's connections, so peers blocked
        on it fail now, not at their timeout (measured: 20 s without it), then abort and destroy."""
        if not dist.is_initialized():
            return
        if self._watcher is not None:
            self._watcher.cut_now()
        try:
            _private.abort_process_group()
        except Exception as err:  # the groups are being thrown away either way
            log.warning("Bamboo: aborting the process group failed (%s); peers may wait for their timeout",
                        err)
        if dist.is_initialized():
            dist.destroy_process_group()

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.disarm()
            self._watcher.stop()
            self._watcher = None


class _Aborter(GenerationCutter):
    """The watcher of :class:`AbortBackends`: aborts every backend of the armed generation (in one group call)
    when a failure generation supersedes it, or when an attempt outlives ``deadline`` seconds."""

    def __init__(self, env: ms.WorkerEnv, deadline: float | None) -> None:
        self.deadline = deadline
        self.attempt_since: float | None = None  # when the attempt in progress began
        self.released = threading.Event()  # the armed generation's backends are aborted
        self._armed_generation = False
        super().__init__(env)

    def arm(self, generation: int) -> None:
        """Watch ``generation``; an attempt in progress counts its deadline from here: the deadline bounds
        the time without progress in one generation, not the failovers an attempt went through."""
        with self._lock:
            self._generation, self._armed_generation = generation, True
            self.released.clear()
            if self.attempt_since is not None:
                self.attempt_since = time.monotonic()

    def disarm(self) -> None:
        with self._lock:
            self._armed_generation = False

    def armed(self) -> bool:
        return self._armed_generation

    def _check(self) -> None:
        since, deadline = self.attempt_since, self.deadline
        if since is not None and deadline is not None and time.monotonic() - since > deadline:
            with self._lock:
                if self._armed_generation:
                    log.warning("Bamboo member %d: an attempt of generation %d ran %.0f s (deadline %.0f s): "
                                "aborting its backends", self._member, self._generation,
                                time.monotonic() - since, deadline)
                    self.abort_now()
            return
        super()._check()

    def superseded(self, kind: str) -> None:
        log.warning("Bamboo member %d: generation %d superseded by a %s generation: aborting its backends",
                    self._member, self._generation, kind)
        self.abort_now()

    def abort_now(self) -> None:
        """Abort every group of this process (lock held; any thread), once per armed generation."""
        self._armed_generation = False
        self.cuts += 1
        try:
            if dist.is_initialized():
                _private.abort_process_group()
        except Exception as err:  # the generation is thrown away either way
            log.warning("Bamboo: aborting the process group failed: %s", err)
        finally:
            self.released.set()


class AbortBackends(Release):
    """Releasing generations on NCCL and ``nccl-like`` (see the module docstring)."""

    def __init__(self, env: ms.WorkerEnv | None, device: Callable[[], torch.device],
                 deadline: float | None) -> None:
        self._deadline = deadline
        super().__init__(env, device)

    def _make_watcher(self, env: ms.WorkerEnv) -> GenerationCutter:
        return _Aborter(env, self._deadline)

    def pg_timeout(self, timeout: timedelta | None) -> timedelta | None:
        """Twice the step deadline: the deadline and the launcher's generation decide, never this timeout."""
        return timeout * 2 if timeout is not None else None

    def began(self, generation: int) -> None:
        """Watched from its default group on: a peer lost while the generation forms (its groups, the layers
        moved to it) blocks NCCL as any loss does, and only an abort ends that."""
        self.formed(generation)

    @contextlib.contextmanager
    def attempt(self) -> Iterator[None]:
        watcher = self._watcher
        if not isinstance(watcher, _Aborter) or watcher.attempt_since is not None:  # nested: the outer counts
            yield
            return
        watcher.attempt_since = time.monotonic()
        try:
            yield
        finally:
            watcher.attempt_since = None

    def end(self, failed: bool) -> None:
        """A failed generation is released by abort, never destroyed; a planned change is destroyed."""
        if failed:
            self.failed()
        self.planned()

    def failed(self) -> None:
        """Abort every backend of the generation (if the watcher has not yet: a step the commit aborted,
        with no error here), then check the device: the aborted step's outputs are dropped by the caller."""
        watcher = self._watcher
        if isinstance(watcher, _Aborter):
            with watcher._lock:
                if not watcher.released.is_set():
                    watcher.abort_now()
        elif dist.is_initialized():
            _private.abort_process_group()
        device = self._device()
        if device.type == "cuda":
            try:
                torch.cuda.synchronize(device)
            except RuntimeError as err:
                raise StickyDeviceError(
                    f"Bamboo: {device} reports an error after the failed generation was aborted ({err}); a "
                    "CUDA error is sticky, so this worker ends and its launcher replaces it"
                ) from err


def for_backend(backend: str | None, env: ms.WorkerEnv | None, device: Callable[[], torch.device],
                timeout: timedelta | None) -> Release:
    """The release of ``backend``'s generations (``env``: the launcher's worker environment; ``None``: no
    launcher publishes generations, nothing is watched)."""
    if releases_by_abort(backend):
        return AbortBackends(env, device, timeout.total_seconds() if timeout is not None else None)
    return Release(env, device)
