"""The generation cutter (``lightning_bamboo/runtime/cutter.py``) in one process, over a real ``TCPStore``: on
a failover generation it shuts down the connections the superseded generation opened, those opened after it
formed included, and nothing else."""

from __future__ import annotations

import json
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_bamboo.protocol import store as ms
from lightning_bamboo.runtime.cutter import GenerationCutter
from tests.process import REPO, launch_env, run_ranks

SCRIPT = REPO / "tests" / "bamboo" / "scripts" / "abandoned_broadcast.py"


def connected_pair(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(listener.getsockname(), timeout=5)
    server, _ = listener.accept()
    return client, server


def is_shut(sock: socket.socket) -> bool:
    """Whether ``sock`` was shut down here (a read returns at once with nothing)."""
    sock.settimeout(0.2)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False


def test_a_failover_cuts_the_generations_connections_and_those_made_after_it_formed() -> None:
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    env = ms.WorkerEnv(f"tcp://127.0.0.1:{server.port}", "cutjob", member=0, nproc=2)
    store = ms.connect(env.store_url, env.job)
    listener = socket.create_server(("127.0.0.1", 0))
    older, older_peer = connected_pair(listener)  # before the generation: not its business
    cutter = GenerationCutter(env, interval=0.01)
    formed_peer = later_peer = older_peer
    try:
        cutter.before_init()
        generation_listener = socket.create_server(("127.0.0.1", 0))
        formed, formed_peer = connected_pair(generation_listener)  # opened while generation 0 formed
        cutter.arm(0)
        # a group made at a step boundary of generation 0, after it formed
        later, later_peer = connected_pair(generation_listener)
        store.set("gen", "0")
        time.sleep(0.1)
        assert cutter.cuts == 0 and not is_shut(formed) and not is_shut(later)
        store.set("gen1/kind", "failover")
        store.set("gen", "1")
        deadline = time.monotonic() + 10
        while cutter.cuts == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cutter.cuts == 1
        assert is_shut(formed) and is_shut(later)
        assert not is_shut(older)
        generation_listener.settimeout(5)  # the listener still accepts (gloo aborts when accept() fails)
        socket.create_connection(generation_listener.getsockname(), timeout=5).close()
        generation_listener.accept()[0].close()
    finally:
        cutter.stop()
        for sock in (older, older_peer, listener, formed_peer, later_peer):
            sock.close()


@pytest.mark.multiprocess
@pytest.mark.parametrize("cut", [True, False], ids=["cut_now", "abandoned"])
def test_a_member_whose_broadcast_failed_cuts_its_connections_so_the_next_receiver_fails_at_once(
    tmp_path: Path, cut: bool
) -> None:
    """Rank 1 dies; the broadcast's root (rank 0) fails on its send to it and never sends to rank 2. With
    ``cut_now`` (what a failing member does before aborting its groups) rank 2's receive fails as soon as the
    root gave up; without it, only at the group's timeout (10 s here; the failover that took the job's 20 s
    in the node benchmark)."""
    env = launch_env()
    # the job's store lives outside the ranks, as in Bamboo (the launcher's, or etcd)
    server = dist.TCPStore("127.0.0.1", int(env["MASTER_PORT"]), is_master=True, wait_for_workers=False)
    cmd = [sys.executable, str(SCRIPT), str(tmp_path), *(["--cut"] if cut else [])]
    run_ranks(cmd, nprocs=3, timeout=120, env=env)
    del server
    waited = json.loads((tmp_path / "rank2.json").read_text())["waited_s"]
    if cut:
        assert waited < 5.0, waited  # the root's 1 s wait for rank 1 to die, then the cut
    else:
        assert waited >= 9.0, waited
