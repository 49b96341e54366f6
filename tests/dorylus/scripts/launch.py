"""Runs a Dorylus worker script (``tests/dorylus/scripts``) with a free MASTER_PORT and a hard timeout."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.process import run_process

SCRIPTS = Path(__file__).resolve().parent


def run_script(name: str, args: list[str], timeout: float, cwd: Path) -> str:
    """Runs ``scripts/<name>`` with ``args``; kills its whole process group on timeout; returns its output.

    Raises:
        AssertionError: the script failed or timed out (with its output).
    """
    return run_process([sys.executable, str(SCRIPTS / name), *args], timeout=timeout, cwd=cwd).stdout
