"""The ``nccl-like`` stand-in backend (``lightning_bamboo/runtime/nccl_like.py``) keeps NCCL's failure rules
on CPU: correct results while every peer lives; after a peer is lost an operation neither raises nor times
out until ``abort()`` is called from another thread; a destroy after any member's abort is refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_bamboo.runtime import nccl_like
from tests.process import REPO, launch_env, run_ranks

SCRIPT = REPO / "tests" / "bamboo" / "scripts" / "nccl_like_rules.py"


def test_the_backend_is_registered_on_import() -> None:
    assert nccl_like.NAME in dist.Backend.backend_list


@pytest.mark.multiprocess
def test_a_lost_peer_blocks_the_survivors_until_abort_and_a_destroy_after_abort_is_refused(
    tmp_path: Path,
) -> None:
    env = launch_env()
    server = dist.TCPStore("127.0.0.1", int(env["MASTER_PORT"]), is_master=True, wait_for_workers=False)
    run_ranks([sys.executable, str(SCRIPT), str(tmp_path)], nprocs=3, timeout=120, env=env)
    del server
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["sum"] == 6.0 and result["pair_sum"] == 3.0
        # blocked past the group's 2 s timeout, released by the abort at 4 s
        assert result["waited_s"] >= 3.9, result
        assert "aborted" in result["raised"], result
        assert result["later"], result  # no operation on a released group
        assert result["again"] == 3.0  # the next generation, under a new prefix
    assert "destroy_process_group" in json.loads((tmp_path / "rank1.json").read_text())["refused"]
