"""What the pipeline engine needs of the job's layout: one member's place in it, as a function of the
ownership map.

The layout has one model, the ownership map (``lightning_bamboo.layout.ownership.OwnershipMap``:
``{pipeline: {stage: member}}`` per generation). The engine runs *positions*: one member's run of consecutive
original stages (one stage each in generation 0, several fused after a failover). :func:`view_of` reads
this member's :class:`PipelineView` off the map's data, :func:`create_groups` makes the generation's
process groups from the same data (collective), and :func:`fused_positions` is the one place a pipeline's
positions are derived (the map's own ``positions`` calls it).

Names keep one meaning: a *stage* is an original stage of the body (``stages``, ``stage_groups``,
``OwnershipMap.num_stages``); a *position* is where the engine runs (``position``, ``num_positions``).
The pipeline floor does not import the elastic one: the map is read as plain data (a mapping and a
``rank_of`` function), which ``OwnershipMap`` gives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

Pipelines = Mapping[int, Mapping[int, int]]
"""The ownership map's ``pipelines``: ``pipeline id -> (original stage -> member)``."""


def fused_positions(owners: Mapping[int, int]) -> list[tuple[int, list[int]]]:
    """One pipeline's positions in data-flow order, ``(member, its consecutive stages)``, from
    ``stage -> member`` (a member owning consecutive stages runs them fused, as one position)."""
    positions: list[tuple[int, list[int]]] = []
    for stage in range(len(owners)):
        if positions and positions[-1][0] == owners[stage]:
            positions[-1][1].append(stage)
        else:
            positions.append((owners[stage], [stage]))
    return positions


@dataclass(frozen=True)
class PipelineView:
    """This member's place in its pipeline: all the pipeline engine and the replica exchange read.

    Attributes:
        position: this member's position in its pipeline (0 = first).
        ranks: the process-group rank of each position of the pipeline, in data-flow order.
        stages: the original stages each position runs (one each without a failover).
        pipeline: this pipeline's index among the job's pipelines (0-based, in pipeline-id order).
        num_pipelines: the job's pipelines now.
        pipeline_group: the ranks of this pipeline (loss and output broadcast).
        stage_groups: original stage -> the ranks holding it in every pipeline (gradient average); empty
            with one pipeline.
    """

    position: int
    ranks: tuple[int, ...]
    stages: tuple[tuple[int, ...], ...]
    pipeline: int = 0
    num_pipelines: int = 1
    pipeline_group: Any = None
    stage_groups: Mapping[int, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.ranks) != len(self.stages) or not 0 <= self.position < len(self.ranks):
            raise ValueError(
                f"position {self.position} of a pipeline with ranks {self.ranks} and stages {self.stages}: "
                "expected one rank and one run of stages per position, and a position among them"
            )

    @property
    def num_positions(self) -> int:
        """Positions of this pipeline now (its original stage count until a failover fuses some)."""
        return len(self.ranks)

    @property
    def own_stages(self) -> tuple[int, ...]:
        """The original stages this member runs."""
        return self.stages[self.position]

    @property
    def is_first(self) -> bool:
        return self.position == 0

    @property
    def is_last(self) -> bool:
        return self.position == len(self.ranks) - 1

    def rank_of_position(self, position: int) -> int:
        return self.ranks[position]

    @property
    def last_rank(self) -> int:
        return self.ranks[-1]

    @property
    def predecessor_rank(self) -> int:
        """The previous position's rank in the ring (the last position's for the first): it holds this
        member's replica."""
        return self.ranks[(self.position - 1) % len(self.ranks)]

    @property
    def successor_rank(self) -> int:
        """The next position's rank in the ring (the first position's for the last): this member holds
        its replica."""
        return self.ranks[(self.position + 1) % len(self.ranks)]


def view_of(
    pipelines: Pipelines,
    member: int,
    rank_of: Callable[[int], int],
    pipeline_groups: Mapping[int, Any] | None = None,
    stage_groups: Mapping[int, Any] | None = None,
) -> PipelineView:
    """``member``'s :class:`PipelineView` in the ownership map ``pipelines`` (``rank_of``: a member's
    process-group rank; the groups as :func:`create_groups` made them, by pipeline id and by stage)."""
    ids = sorted(pipelines)
    pipeline = next((p for p in ids if member in pipelines[p].values()), None)
    if pipeline is None:
        raise KeyError(f"member {member} owns no stage in this ownership map")
    positions = fused_positions(pipelines[pipeline])
    return PipelineView(
        position=next(i for i, (m, _) in enumerate(positions) if m == member),
        ranks=tuple(rank_of(m) for m, _ in positions),
        stages=tuple(tuple(stages) for _, stages in positions),
        pipeline=ids.index(pipeline),
        num_pipelines=len(ids),
        pipeline_group=(pipeline_groups or {}).get(pipeline),
        stage_groups=dict(stage_groups or {}),
    )


def create_groups(
    pipelines: Pipelines, rank_of: Callable[[int], int], timeout: timedelta | None = None
) -> tuple[dict[int, Any], dict[int, Any]]:
    """Every process group of the ownership map ``pipelines``: one per pipeline (its positions' ranks) and,
    with several pipelines, one per original stage (its holders' ranks, in pipeline order); by pipeline id
    and by stage.

    Collective over the whole world: ``new_group`` must be called in the same order on every rank, so
    all groups are made here, on every rank, in one order.
    """
    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    ids = sorted(pipelines)
    pipeline_groups = {
        p: dist.new_group([rank_of(m) for m, _ in fused_positions(pipelines[p])], **kwargs) for p in ids
    }
    stage_groups: dict[int, Any] = {}
    if len(ids) > 1:
        for stage in range(len(pipelines[ids[0]])):
            ranks = sorted(rank_of(pipelines[p][stage]) for p in ids)
            stage_groups[stage] = dist.new_group(ranks, **kwargs)
    return pipeline_groups, stage_groups
