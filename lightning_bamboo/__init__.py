"""Bamboo: pipeline-parallel training that survives preemption through redundant computation.

``import lightning_bamboo`` registers ``Trainer(strategy="bamboo")`` with Lightning.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_bamboo._warnings import filter_lightning_leafspec_warning
from lightning_bamboo.checkpoint import consolidate_checkpoint
from lightning_bamboo.engine import PipelineEngine
from lightning_bamboo.groups import BambooGroups
from lightning_bamboo.microbatch import split_microbatches
from lightning_bamboo.replica import ReplicaSync
from lightning_bamboo.strategy import BambooStrategy

filter_lightning_leafspec_warning()
if BambooStrategy.strategy_name not in StrategyRegistry:
    BambooStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "BambooGroups",
    "BambooStrategy",
    "PipelineEngine",
    "ReplicaSync",
    "consolidate_checkpoint",
    "split_microbatches",
]
