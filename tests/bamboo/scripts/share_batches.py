"""Worker script of the fallback tests: ``fallback.share_batches`` over a real 2-process gloo group.

Without ``--rank`` it starts ranks 0 and 1 (subprocesses) and exits non-zero when either fails. Rank 0 keeps
the batches of steps 2..4 (as members that trained since the start do); rank 1 keeps only step 5 (as a member
that joined at step 5). After ``share_batches(range(2, 5))`` rank 1 must hold exactly rank 0's batches; asking
for steps nobody keeps fails on both with a clear error.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_bamboo.checkpoint.periodic import BatchRing, share_batches
from tests.process import free_port


def batch(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return [torch.randn(4, 3, generator=generator, dtype=torch.float64), torch.arange(4) + step]


def worker(rank: int, port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=300))
    ring = BatchRing(capacity=5)
    for step in (2, 3, 4) if rank == 0 else (5,):
        ring.put(step, step - 1, batch(step))
    share_batches(ring, range(2, 5), torch.device("cpu"))
    for step in (2, 3, 4):
        batch_idx, got = ring.get(step)
        assert batch_idx == step - 1, (step, batch_idx)
        assert isinstance(got, list) and len(got) == 2
        for value, expected in zip(got, batch(step)):
            torch.testing.assert_close(value, expected, rtol=0, atol=0)
    try:
        share_batches(ring, range(0, 2), torch.device("cpu"))
    except RuntimeError as err:
        assert str(err) == "no member keeps the batches of steps 0..1 to re-run", err
    else:
        raise AssertionError("share_batches did not refuse steps nobody keeps")
    dist.destroy_process_group()
    print(f"rank {rank} ok", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, default=None)
    parser.add_argument("--port", type=int, default=None)
    args = parser.parse_args()
    if args.rank is not None:
        worker(args.rank, args.port)
        return
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--port", str(port)]) for r in (0, 1)
    ]
    codes = [proc.wait(timeout=400) for proc in procs]
    sys.exit(0 if codes == [0, 0] else 1)


if __name__ == "__main__":
    main()
