"""Runs a worker script in its own process group with a free MASTER_PORT and a hard timeout."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_script(name: str, args: list[str], timeout: float, cwd: Path) -> str:
    """Runs ``scripts/<name>`` with ``args``; kills its whole process group on timeout; returns its output.

    Raises:
        AssertionError: the script failed or timed out (with its output).
    """
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1")
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        # graph servers computing in-process (inline executor): one BLAS thread each, or numpy's OpenBLAS
        # starts one thread per core in every process and they fight (20x slower on a busy 2-core box)
        env.setdefault(var, "1")
    env.pop("LOCAL_RANK", None)
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / name), *args],
        cwd=cwd,
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{name} {args} timed out after {timeout} s:\n{out[-4000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, f"{name} {args} exited with {proc.returncode}:\n{out[-4000:]}"
    return out
