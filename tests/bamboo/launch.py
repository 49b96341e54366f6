"""Run a worker script in its own process group with a timeout, and read back its snapshots."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_script(name: str, args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``scripts/<name>`` with ``args``; kill its whole process group if it outlives ``timeout``.

    Raises:
        AssertionError: with the script's output when it fails or times out.
    """
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    env.pop("WORLD_SIZE", None)
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / name), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{name} {' '.join(args)} timed out after {timeout}s:\n{out[-6000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode != 0:
        raise AssertionError(f"{name} {' '.join(args)} exited with {proc.returncode}:\n{out[-6000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


def snapshot(out: Path, step: int, rank: int) -> dict[str, torch.Tensor]:
    path = out / f"step{step}_rank{rank}.safetensors"
    assert path.exists(), f"missing snapshot {path}"
    return load_file(str(path))
