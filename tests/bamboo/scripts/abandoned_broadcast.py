"""One rank of a 3-rank gloo group in which rank 1 dies and the broadcast root (rank 0) fails on its send to
it, so rank 2 never receives: how long rank 2 waits, with the root cutting its connections
(``GenerationCutter.cut_now``, ``--cut``) or not. Used by ``tests/bamboo/test_cutter.py``.

    python abandoned_broadcast.py OUT [--cut]    # 3 ranks: LOCAL_RANK; a TCPStore served at MASTER_ADDR:PORT

Rank 2 writes ``OUT/rank2.json``: ``{"waited_s": seconds its broadcast took to fail}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_bamboo.protocol import store as ms
from lightning_bamboo.runtime.cutter import GenerationCutter

WORLD = 3
TIMEOUT_S = 10.0
SIZE = 1 << 22  # 32 MiB of float64: more than a socket's buffers, so the send to the dead rank fails


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--cut", action="store_true")
    args = parser.parse_args()
    args.rank = int(os.environ["LOCAL_RANK"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store_url = f"tcp://{host}:{port}"
    env = ms.WorkerEnv(store_url, "abandoned", member=args.rank, nproc=WORLD)
    store = ms.connect(store_url, env.job)
    cutter = GenerationCutter(env)
    cutter.before_init()
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("pg", store), rank=args.rank, world_size=WORLD,
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    cutter.arm(0)
    dist.barrier()
    if args.rank == 1:
        os._exit(0)  # dies: its connections close
    buffer = torch.ones(SIZE, dtype=torch.float64)
    if args.rank == 0:
        time.sleep(1.0)  # rank 1 is gone
        try:
            dist.broadcast(buffer, src=0)
        except RuntimeError:
            if args.cut:
                cutter.cut_now()
        store.wait(["done"], timedelta(seconds=2 * TIMEOUT_S))  # alive: its sockets stay open
        os._exit(0)  # not through the failed group's destructor
    started = time.monotonic()
    with contextlib.suppress(RuntimeError):
        dist.broadcast(buffer, src=0)
    (args.out / "rank2.json").write_text(json.dumps({"waited_s": time.monotonic() - started}))
    store.set("done", "1")
    os._exit(0)


if __name__ == "__main__":
    main()
