"""One rank of two (gloo): Bamboo's broadcasts over real collectives, on :mod:`lbd_common.codec`. Used by
``tests/test_codec_boundaries.py``.

    python codec_ranks.py OUT    # 2 ranks: LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT as torchrun sets them

Rank 0 broadcasts :func:`nested_batch` (every allowed dtype, 0-dim and empty tensors, nested containers) and
a JSON value with a path; rank 1 holds a batch of the same structure with other values (its container types
are used) and checks what arrives bit for bit. Each rank writes ``OUT/rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_bamboo.step.broadcast import all_gather_json, broadcast_batch, broadcast_json
from tests.test_codec_boundaries import assert_same_batch, nested_batch


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    cpu = torch.device("cpu")
    expected = nested_batch()
    mine = expected if rank == 0 else torch.utils._pytree.tree_map(  # other values, same structure
        lambda v: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v, expected
    )
    assert_same_batch(broadcast_batch(mine, 0, cpu), expected)
    value = {"dir": Path("/tmp/ckpt"), "n": 3, "names": ["a", "b"], "none": None}
    got = broadcast_json(value if rank == 0 else None, 0, cpu)
    assert got == value, got
    gathered = all_gather_json({"rank": rank}, cpu)
    (out / f"rank{rank}.json").write_text(
        json.dumps({"batch": "same", "json": "same", "gathered": [g["rank"] for g in gathered]})
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
