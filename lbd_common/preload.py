"""Preloaded worker starts: a fork server that imports torch, numpy and Lightning once and forks each worker.

Why: every worker is ``python train.py``, and a fresh interpreter spends ~7 CPU-seconds importing torch and
Lightning before it trains; a replacement or joining worker pays them again while the job waits for it. The
server (``python -m lbd_common.preload SOCKET [MODULE ...]``, a separate process: its starter, a Bamboo agent
or a test session, imports no torch for it) imports the modules once; :func:`start_process` then asks it to
fork a process for ``python script.py ...`` or ``python -m module ...``. The forked process takes the caller's
argv, environment, working directory, standard files and session (or process group), runs the script as
``__main__`` (``runpy``, as the interpreter does) and exits as a fresh interpreter would. Commands
it cannot stand in for exactly (:func:`stands_in_for`: other interpreter flags, other ``PYTHON*`` or
thread-count variables, which are read when the interpreter and the libraries load) start a fresh
interpreter, as does every command when the server cannot start or has died.

Rules of the server: it never initialises CUDA (a forked CUDA context is unusable; each worker initialises it
after the fork) and never starts a thread (a fork copies only the forking thread); both are checked before
each fork. It exits when the process that started it is gone.

Protocol (one Unix-socket connection per process, the socket in a fresh 0700 directory): the client sends one
JSON line (argv, cwd, env, process group) with its stdin/stdout/stderr descriptors attached; the server forks
a waiter, which forks the process, answers ``pid <pid>`` and later ``status <raw wait status> <CPU seconds>``.
Nothing but JSON and these lines crosses the socket; nothing is unpickled.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_MODULES = ("torch", "numpy", "lightning.pytorch")
"""What a Bamboo worker imports first; nothing here starts a thread or touches a device on import."""

_FIXED_PREFIXES = ("PYTHON", "OMP_", "KMP_", "GOMP_", "OPENBLAS_", "MKL_")
_FIXED_NAMES = ("LD_PRELOAD", "LD_LIBRARY_PATH")

ENDED_CPU_SECONDS = [0.0]
"""CPU seconds of the preloaded processes of this process that have ended: they are not its children, so
``getrusage(RUSAGE_CHILDREN)`` does not count them (the test suite's ``--cpu-times`` adds this)."""


@dataclass
class Request:
    """One process to fork: ``argv`` (``[python, script, ...]`` or ``[python, -m, module, ...]``)."""

    argv: list[str]
    cwd: str
    env: dict[str, str]
    process_group: int | None  # None: a new session (start_new_session); 0: a new group; else join that one


def fixed_at_start(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` read when the interpreter or libgomp/OpenBLAS/MKL load (``PYTHON*``, thread
    counts, the loader's): a forked process keeps the server's values of these, whatever it is given."""
    return {k: v for k, v in env.items() if k.startswith(_FIXED_PREFIXES) or k in _FIXED_NAMES}


def stands_in_for(argv: Sequence[str], env: Mapping[str, str], server_env: Mapping[str, str]) -> bool:
    """Whether a process forked from a server started with ``server_env`` is exactly ``argv`` run with ``env``
    by a fresh interpreter."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return False
    if argv[1] == "-m":
        if len(argv) < 3:
            return False
    elif argv[1].startswith("-") or not argv[1].endswith(".py"):
        return False
    return fixed_at_start(env) == fixed_at_start(server_env)


# ---------------------------------------------------------------------------------------------- the server
def serve(path: str, modules: Sequence[str]) -> Request | None:
    """Import ``modules``, listen on ``path`` and fork per request; returns only in a forked process (its
    request)."""
    # ``-m lbd_common.preload`` imported its package to locate the server; a fresh interpreter has not: forget
    # it (the running code keeps its globals), so that a worker imports exactly what ``python train.py`` would
    package = __spec__.name.split(".")[0] if __spec__ is not None else "lbd_common"
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        del sys.modules[name]
    for module in modules:
        __import__(module)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".binding")
    listener.listen(64)
    os.rename(path + ".binding", path)  # the client connects once the path exists
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the waiters are reaped by the kernel
    parent = os.getppid()
    while True:
        if not select.select([listener], [], [], 1.0)[0]:
            if os.getppid() != parent:  # its starter (supervisor, agent, test session) is gone: leave nothing
                os._exit(0)
            continue
        conn, _ = listener.accept()
        try:
            request, fds = _receive(conn)
        except (OSError, ValueError, TypeError):
            conn.close()
            continue
        _check_fork_safe()
        if os.fork() == 0:  # the waiter: forks the process, reports its pid and, later, its wait status
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            pid = os.fork()
            if pid == 0:
                conn.close()
                _become(request, fds)
                return request
            for fd in fds:
                os.close(fd)
            # the process joins its group itself too; whichever runs first, the group exists before the pid is
            # reported (a next process may join it at once)
            if request.process_group is not None:
                with contextlib.suppress(OSError):
                    os.setpgid(pid, request.process_group)
            try:
                conn.sendall(f"pid {pid}\n".encode())
                _, status, usage = os.wait4(pid, 0)  # its CPU, with what it waited for
                conn.sendall(f"status {status} {usage.ru_utime + usage.ru_stime:.3f}\n".encode())
            finally:
                os._exit(0)
        conn.close()
        for fd in fds:
            os.close(fd)


def _check_fork_safe() -> None:
    """A fork copies only the forking thread and leaves a CUDA context unusable: neither may exist here."""
    if threading.active_count() != 1:
        raise RuntimeError(f"the preload server has {threading.active_count()} threads; it forks with one")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("the preload server initialised CUDA; workers must initialise it after the fork")


def _receive(conn: socket.socket) -> tuple[Request, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 16)
        if not more:
            raise ValueError("request cut short")
        data += more
    if len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"expected stdin, stdout and stderr descriptors, got {len(fds)}")
    fields: dict[str, Any] = json.loads(data)
    return Request(**fields), list(fds)


def _become(request: Request, fds: list[int]) -> None:
    """In the forked process: take the request's session or group, files, directory and environment."""
    if request.process_group is None:
        os.setsid()
    else:
        os.setpgid(0, request.process_group)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    # a fresh interpreter seeds these from the OS; forked copies would all share the server's state
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def run(request: Request) -> int | str | None:
    """Run the request's script or module as ``__main__``; returns what ``sys.exit`` would get."""
    args = request.argv[1:]
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]  # runpy puts the module's file in argv[0]
            sys.path[0] = request.cwd
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as stop:
        return stop.code
    return 0


def main(argv: Sequence[str]) -> None:
    """``SOCKET [MODULE ...]``: serve on SOCKET with MODULE ... preloaded (:data:`DEFAULT_MODULES`)."""
    request = serve(argv[0], list(argv[1:]) or DEFAULT_MODULES)
    if request is not None:  # only the forked processes get here; the server serves until its parent is gone
        code = run(request)
        sys.exit(code)  # exit handlers, flushing and the exit status as for a fresh interpreter


# ---------------------------------------------------------------------------------------------- the client
class PreloadServer:
    """A running server: its process, socket and the environment it was started with (what it can stand in
    for). :meth:`start` waits until its imports are done."""

    def __init__(self, proc: subprocess.Popen[bytes], folder: str, env: dict[str, str]) -> None:
        self.proc, self.folder, self.env = proc, folder, env
        self.path = os.path.join(folder, "socket")

    @classmethod
    def start(cls, env: Mapping[str, str], cwd: str | os.PathLike[str] | None = None,
              modules: Sequence[str] = DEFAULT_MODULES, timeout: float = 180.0) -> PreloadServer:
        """Start a server with ``env`` in ``cwd`` preloading ``modules``; stopped at exit of this process.

        Raises:
            RuntimeError: when it exits or is not serving within ``timeout`` seconds.
        """
        folder = tempfile.mkdtemp(prefix="bamboo-preload-")  # 0700: only this user may connect
        env = dict(env)
        proc = subprocess.Popen([sys.executable, "-m", __name__, os.path.join(folder, "socket"), *modules],
                                cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                start_new_session=True)
        server = cls(proc, folder, env)
        atexit.register(server.stop)
        deadline = time.monotonic() + timeout
        while not os.path.exists(server.path):  # bound once the imports are done
            if proc.poll() is not None or time.monotonic() > deadline:
                code = proc.poll()
                server.stop()
                state = f"exited with {code}" if code is not None else f"not serving after {timeout:.0f}s"
                raise RuntimeError(f"the preload server {state}")
            time.sleep(0.05)
        return server

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """Kill the server (its forked processes live on: they are in their own sessions)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


class PreloadedProcess:
    """A process forked by a :class:`PreloadServer`, with the parts of :class:`subprocess.Popen` the
    supervisor and the tests use (``pid``, ``poll``, ``wait``, ``returncode``, ``communicate``, signals).

    ``stdout`` is ``None`` (this process's), ``subprocess.PIPE`` (text read by :meth:`communicate`) or a
    file; ``stderr`` is ``None`` (this process's) or ``subprocess.STDOUT``.

    Raises:
        OSError: when the server does not answer with the pid (the caller may start a fresh interpreter).
    """

    def __init__(self, server_path: str, cmd: Sequence[str], cwd: str | os.PathLike[str],
                 env: Mapping[str, str], stdout: Any = None, stderr: Any = None,
                 process_group: int | None = None) -> None:
        if stderr not in (None, subprocess.STDOUT):
            raise ValueError(f"stderr must be None or subprocess.STDOUT, got {stderr!r}")
        self.args, self.returncode = list(cmd), None
        self.cpu_seconds: float | None = None
        self._pipe: int | None = None
        self._chunks: list[bytes] = []
        close: list[int] = []
        if stdout is subprocess.PIPE:
            self._pipe, out = os.pipe()
            close.append(out)
        else:
            out = 1 if stdout is None else stdout.fileno()
        err = out if stderr is subprocess.STDOUT else 2
        stdin = _stdin()
        if stdin != 0:
            close.append(stdin)
        request = {"argv": self.args, "cwd": os.fspath(cwd), "env": dict(env), "process_group": process_group}
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._received = b""
        try:
            self._conn.connect(server_path)
            socket.send_fds(self._conn, [json.dumps(request).encode() + b"\n"], [stdin, out, err])
            line = self._line().split()  # "pid <pid>"
            if len(line) != 2 or line[0] != "pid":
                raise ConnectionError(f"the preload server answered {' '.join(line)!r} instead of a pid")
        except OSError:
            self._conn.close()
            if self._pipe is not None:
                os.close(self._pipe)
            raise
        finally:
            for fd in close:
                os.close(fd)
        self.pid = int(line[1])
        self._reader: threading.Thread | None = None
        if self._pipe is not None:
            self._reader = threading.Thread(target=self._read_pipe, daemon=True)
            self._reader.start()

    def _read_pipe(self) -> None:
        assert self._pipe is not None
        while chunk := os.read(self._pipe, 1 << 16):
            self._chunks.append(chunk)
        os.close(self._pipe)

    def _line(self) -> str:
        """The next line from the server's waiter ("" if it closed the connection)."""
        while b"\n" not in self._received:
            chunk = self._conn.recv(4096)
            if not chunk:
                return ""
            self._received += chunk
        line, self._received = self._received.split(b"\n", 1)
        return line.decode()

    def _ready(self, timeout: float | None) -> bool:
        return b"\n" in self._received or bool(select.select([self._conn], [], [], timeout)[0])

    def poll(self) -> int | None:
        if self.returncode is None and self._ready(0):
            self._finish()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if timeout is not None and not self._ready(timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._finish()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def _finish(self) -> None:
        line = self._line().split()  # "status <raw wait status> <CPU seconds>"; [] if the waiter was killed
        self.returncode = os.waitstatus_to_exitcode(int(line[1])) if line else -signal.SIGKILL
        self.cpu_seconds = float(line[2]) if line else 0.0
        ENDED_CPU_SECONDS[0] += self.cpu_seconds
        self._conn.close()

    def communicate(self, timeout: float | None = None) -> tuple[str | None, None]:
        """Output until every holder of the pipe has closed it, as :meth:`subprocess.Popen.communicate` in
        text mode (``None`` when stdout is not a pipe)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._reader is not None:
            self._reader.join(timeout)
            if self._reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if self._reader is None:
            return None, None
        text = b"".join(self._chunks).decode(errors="replace")  # newlines as Popen's text mode reads them
        return text.replace("\r\n", "\n").replace("\r", "\n"), None


def _stdin() -> int:
    """This process's stdin for the forked one, as a fresh child inherits it (``/dev/null`` if closed)."""
    try:
        os.fstat(0)
        return 0
    except OSError:
        return os.open(os.devnull, os.O_RDONLY)  # the caller closes it once sent


class Preloader:
    """Starts the worker command of a supervisor or agent: forked from a shared server when it can stand in
    for a fresh interpreter, else (also when the server cannot start or has died: said once through ``log``)
    with :class:`subprocess.Popen`. The server starts on first use with the environment it is given."""

    def __init__(self, server_env: Mapping[str, str], log: Callable[..., Any] = print,
                 modules: Sequence[str] = DEFAULT_MODULES) -> None:
        self.server_env = dict(server_env)
        self.modules = tuple(modules)
        self.log = log
        self.failed = False  # no server: every start from now on is fresh
        self._lock = threading.Lock()

    def server(self) -> PreloadServer | None:
        """The live server this preloader forks from (started or shared on first use), or ``None``."""
        with self._lock:
            if self.failed:
                return None
            key = (self.modules, os.getcwd(), tuple(sorted(fixed_at_start(self.server_env).items())))
            server = _SERVERS.get(key)
            if server is not None and server.alive():
                return server
            try:
                server = PreloadServer.start(self.server_env, os.getcwd(), self.modules)
            except (OSError, RuntimeError) as err:
                self._fail(f"{err}")
                return None
            _SERVERS[key] = server
            return server

    def _fail(self, why: str) -> None:
        self.failed = True
        self.log(f"[bamboo.launch] preloaded starts off ({why}): workers start as fresh interpreters",
                 flush=True)

    def start(self, cmd: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen[bytes] | PreloadedProcess:
        """Start ``cmd`` with exactly ``env`` in its own session, this process's stdio and directory."""
        server = self.server() if stands_in_for(cmd, env, self.server_env) else None
        if server is not None:
            try:
                return PreloadedProcess(server.path, cmd, os.getcwd(), env)
            except OSError as err:
                with self._lock:
                    self._fail(f"the server did not answer: {err}")
        return subprocess.Popen(list(cmd), env=dict(env), start_new_session=True)


_SERVERS: dict[tuple[Any, ...], PreloadServer] = {}
"""Servers of this process by what they can stand in for: supervisors in one process share one."""


if __name__ == "__main__":
    main(sys.argv[1:])
