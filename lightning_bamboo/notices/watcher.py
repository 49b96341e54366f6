"""Runs the notice sources on a daemon thread; a training step only ever reads a flag."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import replace

from lightning_bamboo.notices.base import Notice, PreemptionNoticeSource

log = logging.getLogger(__name__)


class NoticeWatcher:
    """Polls each source at its own ``poll_interval_s`` on one daemon thread and keeps the first notice.

    Sources marked "auto" (``auto_detect``) are probed once on the thread (``detect()``, bounded by the
    source's own timeout) and dropped when they do not apply, so a machine off that cloud pays nothing and
    ``start`` never blocks. ``pending()`` is the only thing a step calls: a lock-free read of an attribute.

    Args:
        sources: the notice sources.
        auto_detect: names of sources to probe with ``detect()`` before use (others are trusted as given).
    """

    def __init__(self, sources: Sequence[PreemptionNoticeSource], auto_detect: Sequence[str] = ()) -> None:
        self.sources = list(sources)
        self.auto_detect = set(auto_detect)
        self.rank = -1
        self.active: list[PreemptionNoticeSource] = []
        self._notice: Notice | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.detected = threading.Event()  # set once the auto-detection pass is over

    def start(self, rank: int) -> None:
        """Start polling on behalf of global rank ``rank`` (idempotent)."""
        if self._thread is not None:
            return
        self.rank = rank
        for source in self.sources:
            start = getattr(source, "start", None)
            if callable(start):
                start(rank)
        self._thread = threading.Thread(target=self._run, name="bamboo-notice-watcher", daemon=True)
        self._thread.start()

    def pending(self) -> Notice | None:
        """The notice seen so far, if any (what a step boundary reads)."""
        return self._notice

    def on_step(self, step: int) -> Notice | None:
        """Tell the sources the global step (no I/O); a step-triggered notice is recorded at once."""
        for source in self.sources:
            notice = source.on_step(step)
            if notice is not None:
                self._record(notice)
        return self._notice

    def _record(self, notice: Notice) -> None:
        if self._notice is None:
            self._notice = replace(notice, rank=self.rank)
            log.warning(
                "Bamboo: preemption notice on rank %d from %s: %s", self.rank, notice.source, notice.detail
            )

    def _run(self) -> None:
        active = []
        for source in self.sources:
            if source.name in self.auto_detect and not source.detect():
                log.info("Bamboo: notice source %r does not apply on this machine; off", source.name)
                source.close()
                continue
            active.append(source)
        self.active = active
        self.detected.set()
        next_poll = {id(s): 0.0 for s in active}
        while not self._stop.is_set() and active:
            now = time.monotonic()
            for source in active:
                if now >= next_poll[id(source)]:
                    try:
                        notice = source.poll()
                    except Exception:  # a bug in one source must not end the others' polling silently
                        log.exception("Bamboo: notice source %r failed", source.name)
                        notice = None
                    next_poll[id(source)] = time.monotonic() + source.poll_interval_s
                    if notice is not None:
                        self._record(notice)
            wait = min(next_poll.values()) - time.monotonic()
            self._stop.wait(max(wait, 0.005))

    def stop(self) -> None:
        """Stop the thread and close every source."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        for source in self.sources:
            source.close()
