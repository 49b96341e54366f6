"""Generation 0 of a job, agreed in the store by every worker that starts it.

The first worker to arrive writes the layout it was started with (``num_stages`` x the pipelines of the
workers); a worker started with another ``num_stages`` is refused before anything forms. The settings every
later generation is checked against (stages, replicas, the global number of micro-batches) are agreed with
it, so a joiner or a replaced worker cannot bring different ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_bamboo.layout.ownership import OwnershipMap, initial
from lightning_bamboo.protocol import store as ms

if TYPE_CHECKING:
    import torch.distributed as dist

    from lightning_bamboo.runtime.formation import Formation


def agree(store: dist.Store, formation: Formation, nproc: int, member: int) -> OwnershipMap:
    """Generation 0's ownership map for ``nproc`` workers, agreed in ``store``; sets the formation's global
    micro-batch count.

    Raises:
        ValueError: the job's generation 0 has another number of stages than this worker's.
        RuntimeError: ``member`` has no stage in it (spare workers at start).
    """
    owners = initial(formation.num_stages, range(nproc))
    text = owners.to_json()
    stored = store.compare_set("gen0/map", "", text).decode()
    if stored != text:
        raise ValueError(
            f"this worker was started with num_stages={formation.num_stages}, but the job's "
            f"generation 0 is {OwnershipMap.from_json(stored).format()}"
        )
    store.compare_set("config/num_stages", "", str(formation.num_stages))
    store.compare_set(ms.REPLICAS, "", "1" if formation.redundancy else "0")
    total = str(formation.num_microbatches * len(owners.pipelines))
    formation.global_microbatches = int(store.compare_set(ms.GLOBAL_MICROBATCHES, "", total).decode())
    if member not in owners.members():
        raise RuntimeError(
            f"member {member} has no stage in generation 0 (spare workers are not "
            "supported at start: use a multiple of num_stages)"
        )
    formation.warn_if_unrecoverable(owners)
    return owners
