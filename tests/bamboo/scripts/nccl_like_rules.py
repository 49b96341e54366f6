"""One rank of a 3-rank ``nccl-like`` group (``lightning_bamboo/runtime/nccl_like.py``): rank 2 dies after a
correct all-reduce; ranks 0 and 1 then all-reduce again. Their operation must neither raise nor time out
(the group's timeout is 2 s, they wait 4 s) until a side thread calls ``abort()``, which makes it raise a
``DistBackendError``; ``destroy_process_group`` after that is refused. Used by
``tests/bamboo/test_nccl_like.py``.

    python nccl_like_rules.py OUT    # 3 ranks: LOCAL_RANK; a TCPStore served at MASTER_ADDR:PORT

Ranks 0 and 1 write ``OUT/rank<r>.json`` (written, then renamed).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_bamboo.runtime import nccl_like

WORLD = 3
TIMEOUT_S = 2.0
ABORT_AFTER_S = 4.0


def main() -> None:
    out, rank = Path(sys.argv[1]), int(os.environ["LOCAL_RANK"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group(nccl_like.NAME, store=dist.PrefixStore("g0", store), rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=TIMEOUT_S))
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    pair = dist.new_group([0, 1])
    pair_sum = torch.tensor([float(rank + 1)])
    if rank < 2:
        dist.all_reduce(pair_sum, group=pair)
    dist.barrier()
    if rank == 2:
        os._exit(0)  # a lost peer: its connections close
    time.sleep(0.5)
    start = time.monotonic()
    watcher = threading.Timer(ABORT_AFTER_S, dist.distributed_c10d._abort_process_group)
    watcher.start()
    raised = ""
    try:
        dist.all_reduce(torch.ones(1))
    except dist.DistBackendError as err:
        raised = str(err)
    waited = time.monotonic() - start
    watcher.join()  # the main thread wakes at the first group's abort; the release ends with the last
    later = ""
    try:
        dist.all_reduce(torch.ones(1))
    except Exception as err:  # the group is gone from torch's world after the abort
        later = type(err).__name__
    # a fresh generation under a new prefix works between the survivors
    dist.init_process_group(nccl_like.NAME, store=dist.PrefixStore("g1", store), rank=rank, world_size=2,
                            timeout=timedelta(seconds=TIMEOUT_S))
    again = torch.tensor([float(rank + 1)])
    dist.all_reduce(again)
    dist.distributed_c10d._abort_process_group()  # every rank aborted it: destroy must now be refused
    dist.init_process_group(nccl_like.NAME, store=dist.PrefixStore("g2", store), rank=rank, world_size=2)
    dist.barrier()
    if rank == 0:
        dist.distributed_c10d._abort_process_group()
    time.sleep(0.5)
    refused = ""
    if rank == 1:  # rank 0 aborted g2: rank 1 destroying it would hang on NCCL
        try:
            dist.destroy_process_group()
        except nccl_like.NcclLikeDestroyRefused as err:
            refused = str(err)
    result = {"sum": value.item(), "pair_sum": pair_sum.item(), "waited_s": waited, "raised": raised,
              "later": later, "again": again.item(), "refused": refused}
    tmp = out / f".rank{rank}.json"
    tmp.write_text(json.dumps(result))
    tmp.rename(out / f"rank{rank}.json")
    os._exit(0)


if __name__ == "__main__":
    main()
