"""What one member holds for one generation of the ownership map.

A :class:`Generation` is filled by :meth:`lightning_bamboo.runtime.formation.Formation.form` and read by the
step session (:mod:`lightning_bamboo.step.session`) and the membership runtime
(:mod:`lightning_bamboo.runtime.membership`); the strategy exposes its parts (``owners``, ``view``,
``engine``, ``replica``, ...) as read-only attributes. It holds no behaviour beyond reading itself:
building one is the formation's job, re-forming it the membership's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn
from torch.optim import Optimizer

from lightning_bamboo.layout.ownership import OwnershipMap

if TYPE_CHECKING:
    from lightning_bamboo.layout.view import PipelineView
    from lightning_bamboo.pipeline.engine import PipelineEngine
    from lightning_bamboo.pipeline.replica import ReplicaSync
    from lightning_bamboo.pipeline.ties import TiedGradient
    from lightning_bamboo.runtime.reshard import LayerState


@dataclass(eq=False)
class Generation:
    """This member's part of the current generation (empty before generation 0 forms).

    ``owners`` is set as soon as the generation's process group exists; the rest once it has formed
    (``view`` and ``engine`` are ``None`` again while the groups are aborted after a lost peer).
    """

    num_stages: int = 1  # the job's pipeline length (what the positions below default to before forming)
    member: int = 0  # this member's id (stable across generations)
    owners: OwnershipMap | None = None
    view: PipelineView | None = None
    engine: PipelineEngine | None = None
    stage: nn.Module | None = None  # this member's stages' layers, installed as the module's pipeline body
    replica: nn.Module | None = None  # the successor stage's layers it keeps current (redundancy)
    replica_sync: ReplicaSync | None = None
    replica_optimizer: Optimizer | None = None
    held: dict[int, LayerState] = field(default_factory=dict)  # layer -> its module and optimizer state
    tied: list[TiedGradient] = field(default_factory=list)  # this generation's reductions of tied gradients

    def stage_params(self) -> list[nn.Parameter]:
        assert self.stage is not None
        return list(self.stage.parameters())

    @property
    def pipeline_index(self) -> int:
        """The position of this member's pipeline among the generation's pipelines (0 before it forms)."""
        if self.owners is None:
            return 0
        return self.owners.pipeline_ids().index(self.owners.pipeline_of(self.member))

    @property
    def num_pipelines(self) -> int:
        return len(self.owners.pipelines) if self.owners is not None else 1

    @property
    def pipeline_length(self) -> int:
        """Positions of this member's pipeline now (shorter than ``num_stages`` after a failover)."""
        return self.view.num_positions if self.view is not None else self.num_stages

    @property
    def stage_index(self) -> int:
        """The first original stage this member holds."""
        if self.owners is None:
            return self.member % self.num_stages
        return self.owners.stages_of(self.member)[0]
