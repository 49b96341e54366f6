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

Both start ``python script.py`` / ``python -m module`` commands as forks of a preloaded test zygote
(:func:`zygote`: the product's preload server with torch, Lightning and PyG imported once per pytest
session) when a fork reproduces the fresh interpreter exactly; ``fresh=True`` or ``TEST_ZYGOTE=0`` start fresh
interpreters. What the launched processes start themselves (Lightning's popen ranks) is fresh; the Bamboo
supervisor forks its workers from its own preload server, as in production (``BAMBOO_PRELOAD=0``: fresh).
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks._harness import free_port, kill_groups, rank_env, watch
from lbd_common.preload import ENDED_CPU_SECONDS, PreloadedProcess, PreloadServer, stands_in_for

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data"  # the data the project carries (data/README.md)


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so a test polling for ``path`` never reads it half-written: the text goes to
    a hidden sibling first (no ``glob`` of the name matches it), then is renamed over ``path``."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)


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


def start(
    cmd: Sequence[str], cwd: Path, env: dict[str, str], stdout: Any, process_group: int | None,
    fresh: bool = False,
) -> subprocess.Popen[str] | PreloadedProcess:
    """Start ``cmd`` with stderr into ``stdout`` (``subprocess.PIPE`` or a file) in a new session
    (``process_group=None``), a new process group (``0``) or the group ``process_group``: forked from the
    test zygote (:func:`zygote`) when it can stand in for a fresh interpreter (and not ``fresh``), else
    a fresh one."""
    server = None if fresh else zygote()
    if server is not None and stands_in_for(list(cmd), env, server.env):
        return PreloadedProcess(server.path, cmd, cwd, env, stdout, subprocess.STDOUT, process_group)
    group = {"start_new_session": True} if process_group is None else {"process_group": process_group}
    return subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=stdout, stderr=subprocess.STDOUT, text=True,
                            **group)


# what the launched training processes import first (more than a Bamboo worker: the Dorylus tests' PyG too)
ZYGOTE_MODULES = ("torch", "numpy", "lightning.pytorch", "torch_geometric", "safetensors.torch")
_ZYGOTE: list[PreloadServer] = []
# CPU seconds of the forked processes that have ended (not this process's children: ``--cpu-times`` adds it)
FORKED_CPU_SECONDS = ENDED_CPU_SECONDS


def zygote() -> PreloadServer | None:
    """The test zygote of this pytest process, started on first use (``TEST_ZYGOTE=0``: none): the product's
    preload server (:mod:`lbd_common.preload`) with :data:`ZYGOTE_MODULES`."""
    if os.environ.get("TEST_ZYGOTE", "1") == "0":
        return None
    if _ZYGOTE and _ZYGOTE[0].alive():
        return _ZYGOTE[0]
    try:
        server = PreloadServer.start(launch_env(), REPO, ZYGOTE_MODULES)
    except RuntimeError as err:
        raise RuntimeError(f"the test zygote did not start ({err}); TEST_ZYGOTE=0 skips it") from None
    _ZYGOTE[:] = [server]
    return server


def run_process(
    cmd: Sequence[str], timeout: float, cwd: Path = REPO, env: Mapping[str, str] | None = None,
    fresh: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` (stdout and stderr together); kill its whole process group if it outlives ``timeout``.

    ``fresh``: a fresh interpreter even where the test zygote could stand in (a test that checks what
    importing prints, e.g. no Python warning: the zygote's imports print only once, in the zygote).

    Raises:
        AssertionError: with the tail of the output when the command fails or times out.
    """
    env = dict(env) if env is not None else launch_env()
    proc = start(cmd, cwd, env, subprocess.PIPE, process_group=None, fresh=fresh)
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
    cmd: Sequence[str], nprocs: int, timeout: float, cwd: Path = REPO, env: Mapping[str, str] | None = None,
    fresh: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Start ``nprocs`` copies of ``cmd`` at once as ranks 0..nprocs-1 of one node (an external launcher).

    Every rank gets ``LOCAL_RANK``, ``NODE_RANK=0`` and ``WORLD_SIZE`` on top of ``env`` (default
    :func:`launch_env`: one ``MASTER_PORT`` for all). The ranks share one process group, killed as a whole
    when the time is up or a few seconds after any rank fails (the others would wait for it in a collective).
    Their output, interleaved as under Lightning's launcher, is returned as ``stdout``. ``fresh``: as in
    :func:`run_process`.

    Raises:
        AssertionError: with the tail of the output when a rank fails or the run times out.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs={nprocs}: expected at least 1 process")
    base = dict(env) if env is not None else launch_env()
    procs: list[subprocess.Popen[str] | PreloadedProcess] = []
    failure = ""
    with tempfile.TemporaryFile("w+") as log:
        try:
            for rank in range(nprocs):  # rank 0 leads a new process group, the others join it
                group = procs[0].pid if procs else 0
                procs.append(start(cmd, cwd, rank_env(base, rank, nprocs), log, process_group=group,
                                   fresh=fresh))
            # a failed rank: the survivors get 5 s to print their side of it
            failure = watch(procs, timeout, failure_grace=5.0)
        finally:
            kill_groups(procs)
        log.seek(0)
        out = log.read()
    if failure:
        raise AssertionError(f"{nprocs} x {' '.join(cmd)} {failure}:\n{out[-6000:]}")
    return subprocess.CompletedProcess(procs[0].args, 0, out, None)
