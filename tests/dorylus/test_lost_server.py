"""A graph server killed mid-fit: the survivor's error names the lost server (rank, host, pid), the
collective it was in and the exact resume command, instead of gloo's ``Connection closed by peer``; the
command it names (``trainer.fit(..., ckpt_path="last")`` on both servers) resumes to the weights of the
uninterrupted run, bit for bit (float64)."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from benchmarks._harness import kill_groups, rank_env, watch
from tests.dorylus.scripts.launch import SCRIPTS
from tests.process import launch_env, start

SCRIPT = SCRIPTS / "lost_server_run.py"
EPOCHS = 4


def launch(out: Path, *args: str, timeout: float = 300.0) -> list[int | None]:
    """Both graph servers of ``lost_server_run.py`` at once; returns their exit codes. A failed rank leaves
    the other 60 s to end (it probes the heartbeats and records its error), then both are killed."""
    out.mkdir(parents=True, exist_ok=True)
    base = launch_env()
    procs = []
    with (out / "ranks.log").open("w") as log:
        try:
            for rank in range(2):
                group = procs[0].pid if procs else 0
                procs.append(start([sys.executable, str(SCRIPT), str(out), "--epochs", str(EPOCHS), *args],
                                   out, rank_env(base, rank, 2), log, process_group=group))
            watch(procs, timeout, failure_grace=60.0)
        finally:
            kill_groups(procs)
    return [p.poll() for p in procs]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_killed_graph_server_is_named_and_the_named_resume_is_exact(tmp_path: Path) -> None:
    killed = tmp_path / "killed"
    codes = launch(killed, "--kill-rank", "1", "--kill-epoch", "2")
    log = (killed / "ranks.log").read_text()
    assert codes[1] == -9, log[-4000:]  # rank 1 SIGKILLed itself at epoch 2
    assert codes[0] not in (0, None), log[-4000:]
    error = json.loads((killed / "error_rank0.json").read_text())
    assert error["type"] == "GraphServerLostError" and error["lost"] == [1], error
    assert error["cause"] == "DistBackendError" or error["cause"] == "RuntimeError", error
    host = socket.gethostname()
    message = error["message"]
    assert message.startswith(f"graph server rank 1 of 2 (host {host}, pid "), message
    assert f"was lost during {error['collective']} (no heartbeat for " in message, message
    assert "ghost-row exchange" in error["collective"] or "all_reduce" in error["collective"], error
    assert "at epoch 2, global step 2 (fit); this is graph server rank 0 of 2" in message, message
    assert 'resume with trainer.fit(model, datamodule=..., ckpt_path="last")' in message, message
    assert "ModelCheckpoint(save_last=True) saved " in message and "last.ckpt" in message, message
    assert "The backend said: " in message, message

    # the resume the error names: the same command on both servers, trainer.fit(..., ckpt_path="last")
    assert launch(killed, "--resume") == [0, 0], (killed / "ranks.log").read_text()[-4000:]
    calm = tmp_path / "calm"
    assert launch(calm) == [0, 0], (calm / "ranks.log").read_text()[-4000:]
    for rank in range(2):
        resumed, reference = weights(killed / f"weights_rank{rank}.safetensors"), weights(
            calm / f"weights_rank{rank}.safetensors")
        assert resumed.keys() == reference.keys()
        for key, value in reference.items():
            assert torch.equal(resumed[key], value), (rank, key)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_killed_rank_zero_is_named_though_its_store_is_gone(tmp_path: Path) -> None:
    """Rank 0 hosts the process group's store (Lightning's launch): its heartbeat cannot be read once it is
    gone, and the store failing names it."""
    codes = launch(tmp_path, "--kill-rank", "0", "--kill-epoch", "2")
    assert codes[0] == -9 and codes[1] not in (0, None), (tmp_path / "ranks.log").read_text()[-4000:]
    error = json.loads((tmp_path / "error_rank1.json").read_text())
    assert error["type"] == "GraphServerLostError" and error["lost"] == [0], error
    assert error["message"].startswith(f"graph server rank 0 of 2 (host {socket.gethostname()}, pid "), error
    assert "(the store rank 0 hosts no longer answers" in error["message"], error
    assert 'ckpt_path="last"' in error["message"], error
