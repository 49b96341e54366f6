"""Gradient clipping by the norm over the whole pipeline, through named precision plugins (as FSDP accepts
only ``FSDPPrecision``).

Lightning clips with ``precision_plugin.clip_grad_by_norm(optimizer, clip_val)``, over the parameters of the
optimizer it is given: on a Bamboo rank those are one stage's, so the norm would be the stage's. The strategy
therefore holds one of four named plugins, each Lightning's plugin of that precision with only
``clip_grad_by_norm`` replaced by the strategy's pipeline-wide clipping:

==============================  ==========================  ==============================
Bamboo plugin                   Lightning plugin it extends  ``Trainer(precision=...)``
==============================  ==========================  ==============================
:class:`BambooPrecision`        ``Precision``                ``"32-true"``
:class:`BambooDoublePrecision`  ``DoublePrecision``          ``"64-true"``
:class:`BambooHalfPrecision`    ``HalfPrecision``            ``"bf16-true"``, ``"16-true"``
:class:`BambooMixedPrecision`   ``MixedPrecision``           ``"bf16-mixed"``
==============================  ==========================  ==============================

Lightning's connector builds the plain Lightning plugin for ``Trainer(precision=...)`` and hands it to the
strategy's setter; :func:`with_pipeline_clipping` builds the Bamboo plugin of the same class from its settings
(the constructor's arguments: nothing copied through ``__dict__``), leaving the plugin it was given untouched.
A Bamboo plugin (or a user's subclass of one) is held as it is. Any other plugin (Transformer Engine,
bitsandbytes, a user's subclass of a Lightning plugin) is refused with a ``TypeError`` that names these.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch.optim import Optimizer
from typing_extensions import override

ClipByNorm = Callable[[Optimizer, float], None]


class PipelineNormClipping(Precision):
    """A precision plugin whose norm clipping is the pipeline's (see the module docstring); the base of the
    named Bamboo plugins. The strategy that holds it sets :attr:`pipeline_clip_by_norm`."""

    pipeline_clip_by_norm: ClipByNorm | None = None

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if self.pipeline_clip_by_norm is None:
            raise RuntimeError(
                f"{type(self).__name__} clips by the norm over a Bamboo pipeline: pass it to BambooStrategy "
                "(precision_plugin=...) or a Trainer with strategy='bamboo'"
            )
        self.pipeline_clip_by_norm(optimizer, float(clip_val))


class BambooPrecision(PipelineNormClipping):
    """``"32-true"``: Lightning's ``Precision`` with the pipeline's norm clipping."""


class BambooDoublePrecision(PipelineNormClipping, DoublePrecision):
    """``"64-true"``: Lightning's ``DoublePrecision`` with the pipeline's norm clipping."""


class BambooHalfPrecision(PipelineNormClipping, HalfPrecision):
    """``"bf16-true"`` / ``"16-true"``: Lightning's ``HalfPrecision`` with the pipeline's norm clipping."""


class BambooMixedPrecision(PipelineNormClipping, MixedPrecision):
    """``"bf16-mixed"``: Lightning's ``MixedPrecision`` with the pipeline's norm clipping (a gradient scaler,
    ``"16-mixed"``, is refused at setup: it would need the loss scale on every stage)."""


ACCEPTED = (BambooPrecision, BambooDoublePrecision, BambooHalfPrecision, BambooMixedPrecision)
"""The precision plugins ``BambooStrategy`` holds."""


def _named(precision: Precision) -> PipelineNormClipping | None:
    """The Bamboo plugin with ``precision``'s settings, for exactly Lightning's four classes (a subclass may
    have state its constructor does not show); ``None`` for any other class."""
    kind = type(precision)
    if kind is Precision:
        return BambooPrecision()
    if kind is DoublePrecision:
        return BambooDoublePrecision()
    if isinstance(precision, HalfPrecision) and kind is HalfPrecision:
        return BambooHalfPrecision(precision.precision)  # type: ignore[arg-type]
    if isinstance(precision, MixedPrecision) and kind is MixedPrecision:
        return BambooMixedPrecision(precision.precision, precision.device, precision.scaler)  # type: ignore[arg-type]
    return None


def with_pipeline_clipping(precision: Precision, clip_by_norm: ClipByNorm) -> PipelineNormClipping:
    """The Bamboo plugin for ``precision``, clipping by norm through ``clip_by_norm``.

    A Bamboo plugin is held itself (its clipping set to ``clip_by_norm``); Lightning's ``Precision``,
    ``DoublePrecision``, ``HalfPrecision`` and ``MixedPrecision`` are rebuilt as the Bamboo plugin of the same
    settings (the one given is not modified).

    Raises:
        TypeError: ``precision`` is not a Lightning ``Precision`` plugin, or one Bamboo has no plugin for.
    """
    if not isinstance(precision, Precision):
        raise TypeError(
            f"precision_plugin must be a lightning Precision plugin, got {type(precision).__name__}"
        )
    plugin = precision if isinstance(precision, PipelineNormClipping) else _named(precision)
    if plugin is None:
        names = ", ".join(cls.__name__ for cls in ACCEPTED)
        raise TypeError(
            "BambooStrategy clips gradients over the whole pipeline through its own precision plugins: "
            f"{names} (from lightning_bamboo), or Lightning's Precision, DoublePrecision, HalfPrecision "
            f"and MixedPrecision, which it rebuilds as them; got {type(precision).__qualname__}. Use "
            "Trainer(precision='32-true' | '64-true' | 'bf16-true' | 'bf16-mixed'), or subclass one of the "
            "Bamboo plugins"
        )
    plugin.pipeline_clip_by_norm = clip_by_norm
    return plugin
