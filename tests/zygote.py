"""A preloaded Python that forks the training processes the tests launch (test harness only).

Each Python process a test starts spends ~5 CPU-seconds importing torch, Lightning and PyG before it does
anything, and the multi-process tests start over a hundred of them on a 2-core machine. The zygote imports
those once; :func:`tests.process.start` then asks it to fork a process for ``python script.py ...`` or
``python -m module ...`` instead of starting a fresh interpreter. The forked process takes the caller's
argv, environment, working directory, output files and process group, runs the script as ``__main__``
(``runpy``, as the interpreter does) and exits as a fresh interpreter would. Commands it cannot stand in for
exactly (other interpreter flags, another ``PYTHONPATH`` or thread-count variables, which are read when the
libraries load) start a fresh interpreter as before. Processes that the launched ones start themselves
(the Bamboo supervisor's workers, Lightning's ``popen`` ranks) are fresh interpreters: the product's own
launch paths are untouched. ``TEST_ZYGOTE=0`` turns it off.

Protocol (one Unix-socket connection per process): the client sends one JSON line (argv, cwd, env, process
group) with its stdout/stderr file descriptors attached; the zygote forks a waiter, which forks the process,
answers ``pid <pid>`` and later ``status <raw wait status> <CPU seconds>``. Nothing but JSON and these lines
crosses the socket.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import runpy
import select
import signal
import socket
import sys
from dataclasses import dataclass
from typing import Any

import numpy

# what every launched training process imports first; nothing here starts a thread or touches a device
PRELOAD = ("torch", "numpy", "lightning.pytorch", "torch_geometric", "safetensors.torch")
# read by the interpreter or by libgomp/OpenBLAS/MKL when they load: a request must match the zygote's
FIXED_AT_START = (
    "PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONWARNINGS",
    "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
)


@dataclass
class Request:
    """One process to fork: ``argv`` (``[python, script, ...]`` or ``[python, -m, module, ...]``)."""

    argv: list[str]
    cwd: str
    env: dict[str, str]
    process_group: int | None  # None: a new session (start_new_session); 0: a new group; else join that one


def stands_in_for(argv: list[str], env: dict[str, str], zygote_env: dict[str, str]) -> bool:
    """Whether a process forked from a zygote started with ``zygote_env`` is exactly ``argv`` run with ``env``
    by a fresh interpreter."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return False
    if argv[1] == "-m":
        if len(argv) < 3:
            return False
    elif argv[1].startswith("-") or not argv[1].endswith(".py"):
        return False
    return all(env.get(name) == zygote_env.get(name) for name in FIXED_AT_START)


def serve(path: str) -> Request | None:
    """Preload, listen on ``path`` and fork per request; returns only in a forked process (its request)."""
    for module in PRELOAD:
        __import__(module)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".binding")
    listener.listen(64)
    os.rename(path + ".binding", path)  # the client connects once the path exists
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the waiters are reaped by the kernel
    parent = os.getppid()
    while True:
        if not select.select([listener], [], [], 1.0)[0]:
            if os.getppid() != parent:  # the pytest process is gone (killed): leave nothing behind
                os._exit(0)
            continue
        conn, _ = listener.accept()
        try:
            request, fds = _receive(conn)
        except (OSError, ValueError):
            conn.close()
            continue
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
            # reported (the next rank of run_ranks joins it at once)
            if request.process_group is not None:
                with contextlib.suppress(OSError):
                    os.setpgid(pid, request.process_group)
            try:
                conn.sendall(f"pid {pid}\n".encode())
                _, status, usage = os.wait4(pid, 0)  # its CPU, with what it waited for, for --cpu-times
                conn.sendall(f"status {status} {usage.ru_utime + usage.ru_stime:.3f}\n".encode())
            finally:
                os._exit(0)
        conn.close()
        for fd in fds:
            os.close(fd)


def _receive(conn: socket.socket) -> tuple[Request, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 2)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 16)
        if not more:
            raise ValueError("request cut short")
        data += more
    if len(fds) != 2:
        raise ValueError(f"expected stdout and stderr descriptors, got {len(fds)}")
    fields: dict[str, Any] = json.loads(data)
    return Request(**fields), list(fds)


def _become(request: Request, fds: list[int]) -> None:
    """In the forked process: take the request's process group, files, directory and environment."""
    if request.process_group is None:
        os.setsid()
    else:
        os.setpgid(0, request.process_group)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    stdin = os.open(os.devnull, os.O_RDONLY)
    for target, fd in ((0, stdin), (1, fds[0]), (2, fds[1])):
        os.dup2(fd, target)
    for fd in (stdin, *fds):
        os.close(fd)
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    # a fresh interpreter seeds these from the OS; forked copies would all share the zygote's state
    random.seed()
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


def main() -> None:
    request = serve(sys.argv[1])
    if request is not None:  # only the forked processes get here; the zygote serves until killed
        code = run(request)
        sys.exit(code)  # exit handlers, flushing and the exit status as for a fresh interpreter


if __name__ == "__main__":
    main()
