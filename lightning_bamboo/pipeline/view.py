"""One member's place in the ownership map, shaped for the pipeline engine.

The engine runs *positions* (one member's run of consecutive stages, fused after a failover) as stages; a
:class:`PipelineView` answers its questions (who is before me, who is last, which group) from the
:class:`~lightning_bamboo.elastic.ownership.OwnershipMap`, and :class:`StageAveragingEngine` averages
gradients over the pipelines per ORIGINAL stage, so any layout gives the same averaged gradients.

The pipeline floor does not import the elastic one: what the view reads of the map is stated here as the
:class:`Owners` protocol, which ``OwnershipMap`` satisfies.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from torch import nn
from typing_extensions import override

from lightning_bamboo.pipeline.engine import PipelineEngine
from lightning_bamboo.ties import TiedGradient


class Owners(Protocol):
    """What :class:`PipelineView` reads of an ownership map (``lightning_bamboo.elastic.ownership``)."""

    @property
    def pipelines(self) -> Mapping[int, Mapping[int, int]]:
        """``pipeline id -> (stage -> member)``."""
        ...

    def pipeline_of(self, member: int) -> int: ...

    def positions(self, pipeline: int) -> list[tuple[int, list[int]]]:
        """The pipeline's positions in order: ``(member, its consecutive stages)``."""
        ...


class PipelineView:
    """This member's place in its pipeline, shaped like :class:`BambooGroups` for the engine.

    A *position* is one member's run of consecutive stages (fused); the engine runs positions as stages.
    """

    def __init__(
        self,
        owners: Owners,
        member: int,
        rank_of: Callable[[int], int],
        pipeline_groups: dict[int, Any],
        stage_groups: dict[int, Any],
    ) -> None:
        self.map = owners
        self.member = member
        self.pipeline = owners.pipeline_of(member)
        self.positions = owners.positions(self.pipeline)
        self.stage = next(i for i, (m, _) in enumerate(self.positions) if m == member)
        self._rank_of = rank_of
        self.pipeline_group = pipeline_groups.get(self.pipeline)
        self.stage_groups = stage_groups
        self.layout = self  # the engine reads layout.num_pipelines

    @property
    def num_stages(self) -> int:
        return len(self.positions)

    @property
    def num_pipelines(self) -> int:
        return len(self.map.pipelines)

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == len(self.positions) - 1

    def rank_of_stage(self, position: int) -> int:
        return self._rank_of(self.positions[position][0])

    @property
    def last_stage_rank(self) -> int:
        return self.rank_of_stage(len(self.positions) - 1)

    @property
    def predecessor_rank(self) -> int:
        return self.rank_of_stage((self.stage - 1) % len(self.positions))

    @property
    def successor_rank(self) -> int:
        return self.rank_of_stage((self.stage + 1) % len(self.positions))


class StageAveragingEngine(PipelineEngine):
    """The pipeline engine over a :class:`PipelineView`: gradients are averaged per original stage.

    ``stage_params[s]`` are this member's parameters of stage ``s``; each is all-reduced over the members
    holding ``s`` in every pipeline, stages in increasing order on every member (no cycle between groups);
    ``tied``: the tied parameters' sums over their uses, after the averages.
    """

    def __init__(
        self,
        *args: Any,
        stage_params: dict[int, list[nn.Parameter]],
        tied: Sequence[TiedGradient] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.stage_params = stage_params
        self.tied = list(tied)

    @override
    def _average_gradients(self) -> None:
        """The stages' averages (tied copies included), then each tied copy's gradient summed over the tie's
        uses (:mod:`lightning_bamboo.ties`), ties in the same order on every member."""
        super()._average_gradients()
        for gradient in self.tied:
            gradient.reduce()

    @override
    def _averaging_groups(self) -> list[tuple[list[nn.Parameter], Any]]:
        view: PipelineView = self.groups  # type: ignore[assignment]
        return [(self.stage_params[s], view.stage_groups[s]) for s in sorted(self.stage_params)]
