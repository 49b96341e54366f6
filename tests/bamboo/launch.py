"""Run a Bamboo worker script (``tests/bamboo/scripts``) with a timeout, and read back its snapshots."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.process import run_process

SCRIPTS = Path(__file__).parent / "scripts"


def run_script(name: str, args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``scripts/<name>`` with ``args``; kill its whole process group if it outlives ``timeout``.

    Raises:
        AssertionError: with the script's output when it fails or times out.
    """
    return run_process([sys.executable, str(SCRIPTS / name), *args], timeout=timeout)


def snapshot(out: Path, step: int, rank: int) -> dict[str, torch.Tensor]:
    path = out / f"step{step}_rank{rank}.safetensors"
    assert path.exists(), f"missing snapshot {path}"
    return load_file(str(path))
