"""``BambooGroups``: the generation-0 :class:`~lightning_bamboo.layout.view.PipelineView` of a fixed
:class:`~lightning_bamboo.layout.plan.StageLayout`, for the engine used without the Trainer.

Kept as a public name (``from lightning_bamboo import BambooGroups``) for existing scripts. It is no second
layout model: ``BambooGroups.create`` builds the ownership map's data of generation 0 (pipeline ``p``'s
stage ``s`` run by rank ``p * num_stages + s``, no failover) and returns what
:func:`~lightning_bamboo.layout.view.view_of` and :func:`~lightning_bamboo.layout.view.create_groups`
give for it, the same functions the elastic strategy applies to every generation.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from lightning_bamboo.layout.plan import StageLayout
from lightning_bamboo.layout.view import PipelineView, create_groups, view_of


class BambooGroups:
    """Namespace of :meth:`create` (kept for existing scripts; see the module docstring)."""

    @staticmethod
    def create(layout: StageLayout, rank: int, timeout: timedelta | None = None) -> PipelineView:
        """This rank's view of ``layout``'s generation 0, with its process groups (collective: every rank
        must call it).

        Args:
            layout: the stage x pipeline layout; ``layout.num_stages * layout.num_pipelines`` must be the
                world size.
            rank: this process's global rank.
            timeout: timeout of the new groups' collectives (``None``: the default group's).
        """
        world = dist.get_world_size()
        if world != layout.world_size:
            raise ValueError(
                f"layout has num_stages ({layout.num_stages}) x num_pipelines ({layout.num_pipelines}) = "
                f"{layout.world_size} ranks but the world size is {world}"
            )
        pipelines = layout.generation_zero()
        pipeline_groups, stage_groups = create_groups(pipelines, _itself, timeout)
        return view_of(pipelines, rank, _itself, pipeline_groups, stage_groups)


def _itself(member: int) -> int:
    return member
