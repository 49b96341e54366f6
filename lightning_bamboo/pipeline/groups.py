"""Every process group Bamboo uses, created in one place from a :class:`StageLayout`.

``torch.distributed.new_group`` is collective over the whole world and must be called in the same order on
every rank, so all groups are built here together, for every pipeline and every stage, and each rank keeps
the handles it belongs to. When the layout is re-planned (a preempted stage is taken over, new nodes join),
``BambooGroups.create`` is simply called again with the new layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_bamboo.pipeline.layout import StageLayout


@dataclass
class BambooGroups:
    """This rank's place in the layout and the process groups it communicates over.

    Attributes:
        layout: the layout the groups were built for.
        rank: this process's global rank.
        stage: this rank's stage index within its pipeline.
        pipeline: this rank's pipeline (data-parallel replica) index.
        pipeline_group: the ranks of this rank's pipeline, ordered by stage (loss broadcast); ``None`` when
            the pipeline is the whole world.
        stage_group: the ranks that hold the same stage in every pipeline (gradient all-reduce); ``None``
            when there is a single pipeline.
    """

    layout: StageLayout
    rank: int
    stage: int
    pipeline: int
    pipeline_group: Any
    stage_group: Any

    @classmethod
    def create(cls, layout: StageLayout, rank: int, timeout: timedelta | None = None) -> BambooGroups:
        """Build the pipeline and stage groups of ``layout`` (collective: every rank must call it).

        Args:
            layout: the stage x pipeline layout; ``layout.num_stages * layout.num_pipelines`` must be the
                world size.
            rank: this process's global rank.
            timeout: timeout of the new groups' collectives (``None``: the default group's).
        """
        world = dist.get_world_size()
        expected = layout.num_stages * layout.num_pipelines
        if world != expected:
            raise ValueError(
                f"layout has num_stages ({layout.num_stages}) x num_pipelines ({layout.num_pipelines}) = "
                f"{expected} ranks but the world size is {world}"
            )
        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        pipeline_group = stage_group = None
        if layout.num_pipelines > 1:
            for pipeline in range(layout.num_pipelines):
                group = dist.new_group(list(layout.pipeline_ranks(pipeline)), **kwargs)
                if pipeline == layout.pipeline_of(rank):
                    pipeline_group = group
            for stage in range(layout.num_stages):
                group = dist.new_group(list(layout.stage_group_ranks(stage)), **kwargs)
                if stage == layout.stage_of(rank):
                    stage_group = group
        return cls(
            layout=layout,
            rank=rank,
            stage=layout.stage_of(rank),
            pipeline=layout.pipeline_of(rank),
            pipeline_group=pipeline_group,
            stage_group=stage_group,
        )

    @property
    def num_stages(self) -> int:
        return self.layout.num_stages

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.layout.num_stages - 1

    def rank_of_stage(self, stage: int) -> int:
        """Global rank of ``stage`` in this rank's pipeline."""
        return self.layout.rank_of(self.pipeline, stage)

    @property
    def predecessor_rank(self) -> int:
        """Global rank of the previous stage in the ring (the last stage for stage 0)."""
        return self.rank_of_stage(self.layout.predecessor(self.stage))

    @property
    def successor_rank(self) -> int:
        """Global rank of the next stage in the ring (stage 0 for the last stage)."""
        return self.rank_of_stage(self.layout.successor(self.stage))

    @property
    def last_stage_rank(self) -> int:
        return self.rank_of_stage(self.layout.num_stages - 1)
