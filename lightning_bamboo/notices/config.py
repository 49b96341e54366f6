"""Build a ``NoticeWatcher`` from plain config (what ``recipes/conf/notices/*.yaml`` holds)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning_bamboo.notices.aws import AwsSpotNoticeSource
from lightning_bamboo.notices.base import PreemptionNoticeSource
from lightning_bamboo.notices.faults import FaultInjector
from lightning_bamboo.notices.gce import GcePreemptedSource
from lightning_bamboo.notices.signals import SigtermNoticeSource
from lightning_bamboo.notices.watcher import NoticeWatcher

_CLOUD = {"aws": AwsSpotNoticeSource, "gce": GcePreemptedSource}
_KEYS = {"aws", "gce", "sigterm", "faults"}


def build_watcher(
    aws: Mapping[str, Any] | None = None,
    gce: Mapping[str, Any] | None = None,
    sigterm: bool | Mapping[str, Any] = False,
    faults: Sequence[Mapping[str, Any]] = (),
) -> NoticeWatcher:
    """A watcher over the configured sources.

    Args:
        aws, gce: ``{"enabled": "auto"|true|false, **source kwargs}`` (endpoint, poll_interval_s, timeout_s,
            token_ttl_s for AWS). ``"auto"`` probes the metadata service once with the source's ``timeout_s``
            (on the watcher thread) and turns the source off when it does not answer; ``true`` always polls.
        sigterm: ``True`` or ``{"enabled": ...}``: SIGTERM becomes a notice instead of ending the worker.
        faults: ``FaultInjector`` kwargs, one mapping per injected fault.
    """
    sources: list[PreemptionNoticeSource] = []
    auto: list[str] = []
    for name, cfg in (("aws", aws), ("gce", gce)):
        if cfg is None:
            continue
        kwargs = dict(cfg)
        enabled = kwargs.pop("enabled", "auto")
        if enabled not in ("auto", True, False):
            raise ValueError(f"notices.{name}.enabled must be 'auto', true or false, got {enabled!r}")
        if enabled is False:
            continue
        sources.append(_CLOUD[name](**kwargs))
        if enabled == "auto":
            auto.append(name)
    sig = dict(sigterm) if isinstance(sigterm, Mapping) else {"enabled": bool(sigterm)}
    if sig.pop("enabled", True):
        sources.append(SigtermNoticeSource(**sig))
    for fault in faults:
        sources.append(FaultInjector(**dict(fault)))
    return NoticeWatcher(sources, auto_detect=auto)
