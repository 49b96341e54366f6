"""The "local" executor: a pool of worker processes running the Lambda handler code.

Each worker is ``python -S -m lightning_dorylus.executors.worker`` started inside a handler bundle (the
files a Lambda zip holds; see ``lightning_dorylus.ops.bundle``), talking wire payloads over its
stdin/stdout pipes. So this executor crosses a real process and serialization boundary with the same
bytes part 2 sends to AWS Lambda, and never pickles anything.

Flow: ``submit`` encodes the request (zero-copy frames over the tensors' memory) and puts it on one
queue; one dispatcher thread per worker takes the next request, streams it into its worker, reads the
reply into a fresh buffer and resolves the future with tensors viewing that buffer (no copy). A worker
that dies fails its in-flight future with its exit code and is respawned for later requests.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import queue
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import weakref
from concurrent.futures import Future
from typing import Any

from torch import Tensor
from typing_extensions import override

from .. import wire
from ..ops import bundle
from ..ops.handlers import request_header
from .base import ExecutorError, TensorOpExecutor, TensorOpRequest, to_tensors
from .worker import read_message, write_message

_THREAD_ENV_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS",
                    "VECLIB_MAXIMUM_THREADS")


class RemoteOpError(ExecutorError):
    """The op raised inside the executor; ``error_type`` is the remote exception's class name."""

    def __init__(self, message: str, error_type: str) -> None:
        super().__init__(message)
        self.error_type = error_type


def describe_exit(returncode: int | None) -> str:
    """``-9`` -> ``"exit code -9 (SIGKILL)"``."""
    if returncode is None:
        return "no exit code (still running)"
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"exit code {returncode} ({signal.Signals(-returncode).name})"
    return f"exit code {returncode}"


_POST_KILL_GRACE_S = 5.0  # how long close() waits for dispatchers once their workers are gone
PIPE_SIZE = 1 << 20  # intervals are MBs: fewer, larger pipe transfers (Linux F_SETPIPE_SZ; else the default)


def _grow_pipe(fd: int) -> None:
    if hasattr(fcntl, "F_SETPIPE_SZ"):
        with contextlib.suppress(OSError):  # above /proc/sys/fs/pipe-max-size: keep the default
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE)


class _Worker:
    """One worker process and its pipes; used by exactly one dispatcher thread."""

    def __init__(self, index: int, cmd: list[str], cwd: str, env: dict[str, str], startup_timeout: float):
        self.index = index
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     bufsize=0)
        for pipe in (self.proc.stdin, self.proc.stdout):
            _grow_pipe(pipe.fileno())  # type: ignore[union-attr]
        self._await_hello(startup_timeout)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _await_hello(self, timeout: float) -> None:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            ready = bool(sel.select(timeout))
        hello: dict[str, Any] = {}
        try:
            if ready and (message := read_message(self.proc.stdout)) is not None:  # type: ignore[arg-type]
                hello = wire.decode(message)[0]
        except (OSError, EOFError, ValueError):
            pass
        if hello.get("ready"):
            return
        if not ready:
            self.kill()
            raise ExecutorError(f"worker {self.index} (pid {self.pid}) did not report ready within "
                                f"{timeout} s (startup_timeout); it was killed")
        code = self.exit_code(timeout=5.0)
        self.kill()
        raise ExecutorError(f"worker {self.index} (pid {self.pid}) failed to start: {describe_exit(code)}; "
                            f"see its stderr above")

    def call(self, frames: list[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Send one request and wait for its reply. Raises OSError/EOFError if the worker died."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        write_message(self.proc.stdin, frames)  # type: ignore[arg-type]
        reply = read_message(self.proc.stdout)  # type: ignore[arg-type]
        if reply is None:
            raise EOFError("worker closed its output")
        return wire.decode(reply)

    def exit_code(self, timeout: float = 5.0) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float) -> None:
        """Close stdin (the worker exits on EOF), then kill if it does not exit within ``timeout``."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # type: ignore[union-attr]
        if self.exit_code(timeout) is None:
            self.kill()
        with contextlib.suppress(OSError):
            self.proc.stdout.close()  # type: ignore[union-attr]

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()


def _kill_all(workers: list[_Worker]) -> None:
    for w in workers:
        if w.proc.poll() is None:
            w.kill()


class LocalPoolExecutor(TensorOpExecutor):
    """Run ops in a pool of local worker processes, over the Lambda wire format.

    Args:
        num_workers: worker processes (>= 1); requests are spread over them as they free up.
        threads_per_worker: BLAS/OpenMP threads in each worker (sets ``OMP_NUM_THREADS`` etc.); 1 keeps
            ``num_workers`` workers from oversubscribing the graph server's cores.
        startup_timeout: seconds a worker may take to import numpy and report ready.
        close_timeout: seconds ``close`` waits for in-flight ops before killing workers.
        respawn: start a new worker when one dies (its in-flight op still fails).
    """

    def __init__(self, num_workers: int = 2, threads_per_worker: int = 1, startup_timeout: float = 60.0,
                 close_timeout: float = 10.0, respawn: bool = True) -> None:
        for name, value in (("num_workers", num_workers), ("threads_per_worker", threads_per_worker)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected an int >= 1")
        self.num_workers = num_workers
        self.threads_per_worker = threads_per_worker
        self.startup_timeout = startup_timeout
        self.close_timeout = close_timeout
        self.respawn = respawn
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        self._workers: list[_Worker] = []
        self._threads: list[threading.Thread] = []
        self._queue: queue.SimpleQueue[tuple[TensorOpRequest, list[Any], Future] | None] = queue.SimpleQueue()
        self._bundle_dir: str | None = None
        self._broken: BaseException | None = None
        self._finalizer: weakref.finalize | None = None
        self.respawns = 0
        self.requests_per_worker = [0] * num_workers  # answered requests (ok or op error), for tracing

    @property
    def worker_pids(self) -> list[int]:
        """PIDs of the current workers (changes when a worker is respawned)."""
        return [w.pid for w in self._workers]

    @override
    def start(self) -> None:
        with self._lock:
            if self._closed:
                raise ExecutorError("LocalPoolExecutor is closed")
            if self._started:
                return
            self._bundle_dir = tempfile.mkdtemp(prefix="dorylus-bundle-")
            self._finalizer = weakref.finalize(self, _cleanup, self._workers, self._bundle_dir)
            try:
                bundle.write_bundle(os.path.join(self._bundle_dir, "code"))
                bundle.link_numpy(os.path.join(self._bundle_dir, "site"))
                for i in range(self.num_workers):
                    self._workers.append(self._spawn(i))
            except BaseException:
                self._finalizer()
                self._workers.clear()
                raise
            for i in range(self.num_workers):
                t = threading.Thread(target=self._dispatch, args=(i,), name=f"dorylus-dispatch-{i}",
                                     daemon=True)
                t.start()
                self._threads.append(t)
            self._started = True

    def _spawn(self, index: int) -> _Worker:
        env = dict(os.environ)
        env.update({var: str(self.threads_per_worker) for var in _THREAD_ENV_VARS})
        assert self._bundle_dir is not None
        # -S: no site-packages; the import path is the bundle (cwd) and a directory holding only numpy.
        env["PYTHONPATH"] = os.path.join(self._bundle_dir, "site")
        cmd = [sys.executable, "-S", "-m", "lightning_dorylus.executors.worker"]
        return _Worker(index, cmd, os.path.join(self._bundle_dir, "code"), env, self.startup_timeout)

    @override
    def submit(self, request: TensorOpRequest) -> Future[dict[str, Tensor]]:
        self.start()
        future: Future[dict[str, Tensor]] = Future()
        try:
            _, frames = wire.encode_frames(request_header(request.op, request.attrs, request.interval),
                                           request.numpy_inputs())
        except Exception as err:
            future.set_exception(err)
            return future
        self._queue.put((request, frames, future))
        if self._closed:  # raced with close(): make sure nobody waits forever
            self._fail_queued("LocalPoolExecutor closed before the op ran")
        return future

    def _dispatch(self, index: int) -> None:
        while (item := self._queue.get()) is not None:
            request, frames, future = item
            if not future.set_running_or_notify_cancel():
                continue
            if self._broken is not None:
                future.set_exception(ExecutorError(f"op {request.op!r} not run: the pool is broken: "
                                                   f"{self._broken}"))
                continue
            worker = self._workers[index]
            try:
                header, arrays = worker.call(frames)
            except (OSError, EOFError, ValueError) as err:
                code = describe_exit(worker.exit_code())
                if self._closed:
                    future.set_exception(ExecutorError(
                        f"LocalPoolExecutor closed while op {request.op!r} (interval {request.interval}) was "
                        f"running in worker {index} (pid {worker.pid}, stopped with {code})"))
                    continue
                self._replace(index, worker)  # first, so later requests find a live worker
                future.set_exception(ExecutorError(
                    f"worker {index} (pid {worker.pid}) died with {code} while running op {request.op!r} "
                    f"(interval {request.interval}): {type(err).__name__}: {err}"))
                continue
            self.requests_per_worker[index] += 1
            if header.get("ok"):
                future.set_result(to_tensors(arrays))
            else:
                future.set_exception(RemoteOpError(
                    f"op {request.op!r} (interval {request.interval}) failed in worker {index} "
                    f"(pid {worker.pid}): {header.get('error_type')}: {header.get('message')}",
                    str(header.get("error_type"))))

    def _replace(self, index: int, dead: _Worker) -> None:
        dead.kill()
        if self._closed or not self.respawn:
            if not self._closed:
                self._broken = ExecutorError(f"worker {index} died and respawn=False")
            return
        try:
            self._workers[index] = self._spawn(index)
            self.respawns += 1
        except Exception as err:
            self._broken = err

    def _fail_queued(self, message: str) -> None:
        """Fail every request still waiting in the queue (stop sentinels are put back)."""
        sentinels = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                sentinels += 1
                continue
            request, _, future = item
            if future.set_running_or_notify_cancel():
                future.set_exception(ExecutorError(f"{message}: op {request.op!r} "
                                                   f"(interval {request.interval})"))
        for _ in range(sentinels):
            self._queue.put(None)

    @override
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._fail_queued("LocalPoolExecutor closed before the op ran")
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:  # let in-flight ops finish, up to close_timeout
            t.join(self.close_timeout)
        for w in list(self._workers):
            w.stop(self.close_timeout if not any(t.is_alive() for t in self._threads) else 0.0)
        for t in self._threads:  # a stopped worker unblocks its dispatcher, which fails its future
            t.join(max(self.close_timeout, _POST_KILL_GRACE_S))
        self._fail_queued("LocalPoolExecutor closed before the op ran")
        if self._finalizer is not None:
            self._finalizer()

    def __repr__(self) -> str:
        return (f"LocalPoolExecutor(num_workers={self.num_workers}, "
                f"threads_per_worker={self.threads_per_worker}, pids={self.worker_pids})")


def _cleanup(workers: list[_Worker], bundle_dir: str) -> None:
    """Kill leftover workers and remove the bundle (also runs at garbage collection / exit)."""
    _kill_all(workers)
    shutil.rmtree(bundle_dir, ignore_errors=True)
