"""Gradient clipping by the norm over the whole pipeline, through the precision plugin (as FSDP's
``FSDPPrecision`` does for sharded parameters).

Lightning clips with ``precision_plugin.clip_grad_by_norm(optimizer, clip_val)``, over the parameters of the
optimizer it is given: on a Bamboo rank those are one stage's, so the norm would be the stage's. The strategy
therefore holds its precision plugin as a :class:`PipelineNormClipping` subclass of the plugin Lightning (or
the user) chose — same class, same settings, with only ``clip_grad_by_norm`` replaced by the strategy's
pipeline-wide clipping. The plugin the user passed is not modified.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer
from typing_extensions import override

ClipByNorm = Callable[[Optimizer, float], None]

_SUBCLASSES: dict[type, type] = {}


class PipelineNormClipping(Precision):
    """A precision plugin whose norm clipping is the pipeline's (see the module docstring)."""

    pipeline_clip_by_norm: ClipByNorm

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self.pipeline_clip_by_norm(optimizer, float(clip_val))


def with_pipeline_clipping(precision: Precision, clip_by_norm: ClipByNorm) -> Precision:
    """A copy of ``precision`` (same class and settings) that clips by norm through ``clip_by_norm``.

    Raises:
        TypeError: ``precision`` is not a Lightning ``Precision`` plugin.
    """
    if not isinstance(precision, Precision):
        raise TypeError(
            f"precision_plugin must be a lightning Precision plugin, got {type(precision).__name__}"
        )
    base = type(precision)
    if isinstance(precision, PipelineNormClipping):
        base = next(c for c in base.__mro__[1:] if not issubclass(c, PipelineNormClipping))
    cls = _SUBCLASSES.get(base)
    if cls is None:
        cls = type(f"Bamboo{base.__name__}", (PipelineNormClipping, base), {"__doc__": base.__doc__})
        _SUBCLASSES[base] = cls
    plugin: Any = cls.__new__(cls)
    plugin.__dict__.update(vars(precision))
    plugin.pipeline_clip_by_norm = clip_by_norm
    return plugin
