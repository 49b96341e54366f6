"""Bamboo: pipeline-parallel training that survives preemption through redundant computation.

``import lightning_bamboo`` registers ``Trainer(strategy="bamboo")`` with Lightning.

The package's own command-line tools (``python -m lightning_bamboo.launch``, ``...
lightning_bamboo.simulate``)
need no Lightning: when Python imports this package only to locate one of them, Lightning is not imported (the
supervisor starts its workers about 5 CPU-seconds sooner); the names below are then imported on first use.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_bamboo._lightning.precision import (
        BambooDoublePrecision,
        BambooHalfPrecision,
        BambooMixedPrecision,
        BambooPrecision,
    )
    from lightning_bamboo.checkpoint.sharded import consolidate_checkpoint
    from lightning_bamboo.layout.groups import BambooGroups
    from lightning_bamboo.pipeline.engine import PipelineEngine
    from lightning_bamboo.pipeline.microbatch import split_microbatches
    from lightning_bamboo.pipeline.replica import ReplicaSync
    from lightning_bamboo.protocol.drain import BambooDeparted
    from lightning_bamboo.strategy import BambooStrategy, ElasticBambooStrategy

_EXPORTS = {
    "BambooDoublePrecision": "lightning_bamboo._lightning.precision",
    "BambooHalfPrecision": "lightning_bamboo._lightning.precision",
    "BambooMixedPrecision": "lightning_bamboo._lightning.precision",
    "BambooPrecision": "lightning_bamboo._lightning.precision",
    "BambooDeparted": "lightning_bamboo.protocol.drain",
    "BambooGroups": "lightning_bamboo.layout.groups",
    "BambooStrategy": "lightning_bamboo.strategy",
    "ElasticBambooStrategy": "lightning_bamboo.strategy",
    "PipelineEngine": "lightning_bamboo.pipeline.engine",
    "ReplicaSync": "lightning_bamboo.pipeline.replica",
    "consolidate_checkpoint": "lightning_bamboo.checkpoint.sharded",
    "split_microbatches": "lightning_bamboo.pipeline.microbatch",
}
__all__ = [
    "BambooDeparted",
    "BambooDoublePrecision",
    "BambooGroups",
    "BambooHalfPrecision",
    "BambooMixedPrecision",
    "BambooPrecision",
    "BambooStrategy",
    "ElasticBambooStrategy",
    "PipelineEngine",
    "ReplicaSync",
    "consolidate_checkpoint",
    "split_microbatches",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lightning_bamboo' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def _locating_own_tool() -> bool:
    """Whether Python imports this package only to run one of its modules with ``-m`` (while it locates the
    module, ``sys.argv[0]`` is ``"-m"``; ``sys.orig_argv`` names the module)."""
    if sys.argv[:1] != ["-m"]:
        return False
    argv = getattr(sys, "orig_argv", [])
    module = next((argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "-m"), "")
    return module.startswith(f"{__name__}.")


def _register_strategy() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    from lbd_common._warnings import filter_lightning_leafspec_warning
    from lightning_bamboo.strategy import BambooStrategy

    filter_lightning_leafspec_warning()
    if BambooStrategy.strategy_name not in StrategyRegistry:
        BambooStrategy.register_strategies(StrategyRegistry)


if not _locating_own_tool():
    _register_strategy()
