"""Preemption notices: cloud warnings (AWS IMDSv2, GCE metadata), SIGTERM and injected faults.

Each source implements :class:`PreemptionNoticeSource`; a :class:`NoticeWatcher` polls them on a daemon
thread, and ``lightning_bamboo.callbacks.BambooNotices`` acts on a notice at the next step boundary.
"""

from lightning_bamboo.notices.aws import AwsSpotNoticeSource
from lightning_bamboo.notices.base import Notice, PreemptionNoticeSource
from lightning_bamboo.notices.config import build_watcher
from lightning_bamboo.notices.faults import FaultInjector
from lightning_bamboo.notices.gce import GcePreemptedSource
from lightning_bamboo.notices.signals import SigtermNoticeSource
from lightning_bamboo.notices.watcher import NoticeWatcher

__all__ = [
    "AwsSpotNoticeSource",
    "FaultInjector",
    "GcePreemptedSource",
    "Notice",
    "NoticeWatcher",
    "PreemptionNoticeSource",
    "SigtermNoticeSource",
    "build_watcher",
]
