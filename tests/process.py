"""Run a command in its own process group with a timeout; the tests' one way to launch training processes.

Lightning's ``popen`` launcher re-runs ``sys.argv``, so multi-process runs are never started inside pytest:
they run as subprocess scripts, and whatever outlives the timeout is killed by process group.

Two ways to start an N-process Lightning run: :func:`run_process` on one command (Lightning's ``popen``
launcher starts ranks 1..N-1 itself, once rank 0 has imported everything and built its Trainer), or
:func:`run_ranks`, which starts all N ranks at once with ``LOCAL_RANK``/``NODE_RANK``/``WORLD_SIZE`` set, as
torchrun or SLURM do (Lightning then sees ``creates_processes_externally`` and launches nothing). Each
process spends ~7 CPU-seconds importing torch + Lightning; under ``popen`` rank 1 only starts importing when
rank 0 is done, under :func:`run_ranks` the imports overlap. The recipe and README tests keep the ``popen``
path covered for both strategies.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
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


def run_ranks(
    cmd: Sequence[str], nprocs: int, timeout: float, cwd: Path = REPO, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Start ``nprocs`` copies of ``cmd`` at once as ranks 0..nprocs-1 of one node (an external launcher).

    Every rank gets ``LOCAL_RANK``, ``NODE_RANK=0`` and ``WORLD_SIZE`` on top of ``env`` (default
    :func:`launch_env`: one ``MASTER_PORT`` for all). The ranks share one process group, killed as a whole
    when the time is up or a few seconds after any rank fails (the others would wait for it in a collective).
    Their output, interleaved as under Lightning's launcher, is returned as ``stdout``.

    Raises:
        AssertionError: with the tail of the output when a rank fails or the run times out.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs={nprocs}: expected at least 1 process")
    base = dict(env) if env is not None else launch_env()
    base.update({"NODE_RANK": "0", "WORLD_SIZE": str(nprocs)})
    procs: list[subprocess.Popen[str]] = []
    failure = ""
    with tempfile.TemporaryFile("w+") as log:
        try:
            for rank in range(nprocs):  # rank 0 leads a new process group, the others join it
                procs.append(subprocess.Popen(
                    list(cmd), cwd=cwd, env={**base, "LOCAL_RANK": str(rank)}, stdout=log,
                    stderr=subprocess.STDOUT, text=True, process_group=procs[0].pid if procs else 0,
                ))
            deadline = time.monotonic() + timeout
            failed_at: float | None = None
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                    failed_at = now
                if failed_at is not None and now - failed_at > 5:
                    break  # a rank failed: the survivors had 5 s to print their side of it
                if now > deadline:
                    failure = f"timed out after {timeout}s"
                    break
                time.sleep(0.05)
        finally:
            if procs and any(p.poll() is None for p in procs):
                os.killpg(procs[0].pid, signal.SIGKILL)
            for p in procs:
                p.wait()
        log.seek(0)
        out = log.read()
    codes = [p.returncode for p in procs]
    if not failure and any(codes):
        failure = f"exited with {codes} (by rank)"
    if failure:
        raise AssertionError(f"{nprocs} x {' '.join(cmd)} {failure}:\n{out[-6000:]}")
    return subprocess.CompletedProcess(procs[0].args, 0, out, None)
