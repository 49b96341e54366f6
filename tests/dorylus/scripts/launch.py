"""Runs a Dorylus worker script (``tests/dorylus/scripts``) with a free MASTER_PORT and a hard timeout."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.process import run_process, run_ranks

SCRIPTS = Path(__file__).resolve().parent


def run_script(name: str, args: list[str], timeout: float, cwd: Path, nprocs: int | None = None) -> str:
    """Runs ``scripts/<name>`` with ``args``; kills its whole process group on timeout; returns its output.

    ``nprocs``: start that many graph servers at once (:func:`tests.process.run_ranks`, an external
    launcher) instead of one process whose Trainer launches the others (Lightning's ``popen`` launcher).

    Raises:
        AssertionError: the script failed or timed out (with its output).
    """
    cmd = [sys.executable, str(SCRIPTS / name), *args]
    if nprocs is not None:
        return run_ranks(cmd, nprocs, timeout=timeout, cwd=cwd).stdout
    return run_process(cmd, timeout=timeout, cwd=cwd).stdout
