"""Run a command in its own process group with a timeout; the tests' one way to launch training processes.

Lightning's ``popen`` launcher re-runs ``sys.argv``, so multi-process runs are never started inside pytest:
they run as subprocess scripts, and whatever outlives the timeout is killed by process group.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data"  # the data the project carries (data/README.md)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now (for ``MASTER_PORT``)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a fresh single-node launch: loopback rendezvous on a free port, one thread.

    Several training processes share this machine's 2 cores: one BLAS/OpenMP thread each (unless the caller
    set a count), or numpy's OpenBLAS starts a thread per core in every process and they fight.
    """
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"}
    for threads in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(threads, "1")
    for inherited in ("LOCAL_RANK", "WORLD_SIZE", "RANK", "NODE_RANK"):
        env.pop(inherited, None)
    # worker scripts under tests/ import their helpers as ``tests.*``, whatever directory they run from
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


def run_process(
    cmd: Sequence[str], timeout: float, cwd: Path = REPO, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` (stdout and stderr together); kill its whole process group if it outlives ``timeout``.

    Raises:
        AssertionError: with the tail of the output when the command fails or times out.
    """
    proc = subprocess.Popen(
        list(cmd), cwd=cwd, env=dict(env) if env is not None else launch_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} timed out after {timeout}s:\n{out[-6000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{out[-6000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)
