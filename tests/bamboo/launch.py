"""Run a Bamboo worker script (``tests/bamboo/scripts``) with a timeout, and read back its snapshots."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.process import run_process, run_ranks

SCRIPTS = Path(__file__).parent / "scripts"


def run_script(
    name: str, args: list[str], timeout: float = 120, nprocs: int | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``scripts/<name>`` with ``args``; kill its whole process group if it outlives ``timeout``.

    ``nprocs``: start that many ranks at once (:func:`tests.process.run_ranks`, an external launcher)
    instead of one process whose Trainer launches the others (Lightning's ``popen`` launcher).

    Raises:
        AssertionError: with the script's output when it fails or times out.
    """
    cmd = [sys.executable, str(SCRIPTS / name), *args]
    if nprocs is not None:
        return run_ranks(cmd, nprocs, timeout=timeout)
    return run_process(cmd, timeout=timeout)


def snapshot(out: Path, step: int, rank: int) -> dict[str, torch.Tensor]:
    path = out / f"step{step}_rank{rank}.safetensors"
    assert path.exists(), f"missing snapshot {path}"
    return load_file(str(path))
