"""SIGTERM (what Kubernetes, Slurm and the cloud agents send before a kill) recorded as a notice."""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

from lightning_bamboo.notices.base import Notice, PreemptionNoticeSource


class SigtermNoticeSource(PreemptionNoticeSource):
    """Replaces the handler of ``signals`` (default SIGTERM) by one that records a notice instead of dying.

    The handler only sets an event (async-signal safe); ``poll`` turns it into one ``Notice``. Handlers are
    installed by ``start`` (on the main thread: only there can Python install them); the previous ones come
    back on ``close``. ``BambooNotices`` starts it in ``on_train_start``, after Lightning installed its
    own SIGTERM handler (which would end training), so the notice replaces Lightning's handling while
    training runs.
    """

    name = "sigterm"

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,), poll_interval_s: float = 0.1) -> None:
        self.signals = tuple(signals)
        self.poll_interval_s = poll_interval_s
        self._got = threading.Event()
        self._signum = 0
        self._reported = False
        self._previous: dict[int, Any] = {}

    def start(self, my_rank: int) -> None:
        """Install the handlers (idempotent)."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("SigtermNoticeSource must be started on the main thread (signal handlers)")
        for signum in self.signals:
            if signum not in self._previous:
                self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._signum = signum
        self._got.set()

    def poll(self) -> Notice | None:
        if self._got.is_set() and not self._reported:
            self._reported = True
            return Notice(source=self.name, detail=signal.Signals(self._signum).name)
        return None

    def close(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # handlers can only be restored from the main thread; the process is ending anyway
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
