"""Each notice source against a fake endpoint on 127.0.0.1: notice, no notice, endpoint down, token expiry."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from lightning_bamboo.notices import (
    AwsSpotNoticeSource,
    FaultInjector,
    GcePreemptedSource,
    Notice,
    NoticeWatcher,
    SigtermNoticeSource,
    build_watcher,
)
from tests.bamboo.fake_metadata import FakeMetadata, dead_url


def test_aws_no_notice_then_notice() -> None:
    with FakeMetadata(notice=True, notice_after=1) as fake:
        source = AwsSpotNoticeSource(endpoint=fake.url, timeout_s=2)
        assert source.poll() is None  # 404
        notice = source.poll()
        assert notice == Notice(
            source="aws", detail='{"action": "terminate", "time": "2026-11-22T19:40:00Z"}',
            deadline="2026-11-22T19:40:00Z", received_at=notice.received_at,
        )
        put, get = fake.requests[0], fake.requests[1]
        assert put[0] == "PUT" and put[1] == "/latest/api/token"
        assert put[2]["x-aws-ec2-metadata-token-ttl-seconds"] == "21600"
        assert get[2]["x-aws-ec2-metadata-token"] == "token-0"
        assert source.token_fetches == 1  # the token is reused between polls
        assert source.errors == 0


def test_aws_token_expiry_refreshes_once() -> None:
    with FakeMetadata(notice=True, notice_after=1) as fake:
        source = AwsSpotNoticeSource(endpoint=fake.url, timeout_s=2)
        assert source.poll() is None
        fake.expire_tokens()
        notice = source.poll()  # 401 -> new token -> retry -> the notice
        assert notice is not None and notice.deadline == "2026-11-22T19:40:00Z"
        assert source.token_fetches == 2
        assert [r[0] for r in fake.requests] == ["PUT", "GET", "GET", "PUT", "GET"]
        assert fake.requests[-1][2]["x-aws-ec2-metadata-token"] == "token-0"  # the fresh token (set cleared)


def test_aws_token_refreshed_before_ttl_ends() -> None:
    with FakeMetadata() as fake:
        source = AwsSpotNoticeSource(endpoint=fake.url, timeout_s=2, token_ttl_s=1)
        assert source.poll() is None
        time.sleep(0.95)  # past 90% of the 1 s lifetime
        assert source.poll() is None
        assert source.token_fetches == 2
        assert fake.requests[-2][2]["x-aws-ec2-metadata-token-ttl-seconds"] == "1"


def test_aws_endpoint_down() -> None:
    source = AwsSpotNoticeSource(endpoint=dead_url(), timeout_s=0.5)
    assert source.detect() is False
    assert source.poll() is None
    assert source.errors == 1


def test_aws_bad_arguments() -> None:
    message = "token_ttl_s must be an integer in 1..21600 (IMDSv2 limit), got 0"
    with pytest.raises(ValueError, match=re.escape(message)):
        AwsSpotNoticeSource(token_ttl_s=0)
    message = "poll_interval_s and timeout_s must be > 0, got 0 and 1.0"
    with pytest.raises(ValueError, match=re.escape(message)):
        AwsSpotNoticeSource(poll_interval_s=0)


def test_gce_no_notice_notice_and_down() -> None:
    with FakeMetadata(notice=True, notice_after=1) as fake:
        source = GcePreemptedSource(endpoint=fake.url, timeout_s=2)
        assert source.detect() is True
        assert source.poll() is None  # FALSE
        notice = source.poll()
        assert notice is not None and notice.source == "gce" and notice.detail == "TRUE"
        assert all(r[2]["metadata-flavor"] == "Google" for r in fake.requests)
    down = GcePreemptedSource(endpoint=dead_url(), timeout_s=0.5)
    assert down.detect() is False
    assert down.poll() is None and down.errors == 1


def test_gce_detect_needs_the_google_flavor() -> None:
    """An AWS-only metadata service (no Metadata-Flavor response header) is not GCE."""
    with FakeMetadata() as fake:
        fake.server.RequestHandlerClass.do_GET = lambda self: self._send(200, "x")  # type: ignore[method-assign]
        assert GcePreemptedSource(endpoint=fake.url, timeout_s=2).detect() is False


def test_sigterm_becomes_a_notice_not_an_exit() -> None:
    source = SigtermNoticeSource()
    source.start(my_rank=0)
    try:
        assert source.poll() is None
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        notice = source.poll()
        assert notice is not None and notice.source == "sigterm" and notice.detail == "SIGTERM"
        assert source.poll() is None  # one notice per signal
    finally:
        source.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_fault_injector_step_and_time() -> None:
    drain = FaultInjector(rank=1, at_step=3)
    drain.start(my_rank=1)
    assert drain.on_step(2) is None
    notice = drain.on_step(3)
    assert notice is not None and notice.action == "drain"
    assert notice.detail == "injected drain of rank 1 at step 3"
    assert drain.on_step(4) is None  # once
    other = FaultInjector(rank=1, at_step=0)
    other.start(my_rank=0)
    assert other.on_step(5) is None  # not this rank
    timed = FaultInjector(rank=0, at_time_s=0.05)
    timed.start(my_rank=0)
    assert timed.poll() is None
    time.sleep(0.06)
    assert timed.poll() is not None
    with pytest.raises(ValueError, match="give exactly one of at_step and at_time_s, got None and None"):
        FaultInjector(rank=0)


def test_fault_injector_kill_kills_the_process() -> None:
    """A step-triggered kill SIGKILLs its own process (run in a child so the test survives)."""
    pid = os.fork()
    if pid == 0:
        injector = FaultInjector(rank=0, at_step=1, action="kill")
        injector.start(my_rank=0)
        injector.on_step(1)
        os._exit(0)  # not reached
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def test_watcher_polls_on_a_thread_and_drops_undetected_sources() -> None:
    with FakeMetadata(notice=True, notice_after=2) as fake:
        watcher = build_watcher(
            aws={"enabled": "auto", "endpoint": fake.url, "poll_interval_s": 0.02, "timeout_s": 2},
            gce={"enabled": "auto", "endpoint": dead_url(), "timeout_s": 0.3},
        )
        watcher.start(rank=3)
        try:
            assert watcher.detected.wait(5)
            assert [s.name for s in watcher.active] == ["aws"]
            deadline = time.monotonic() + 5
            while watcher.pending() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            notice = watcher.pending()
            assert notice is not None and notice.source == "aws" and notice.rank == 3
        finally:
            watcher.stop()


def test_watcher_step_trigger_is_synchronous() -> None:
    watcher = NoticeWatcher([FaultInjector(rank=0, at_step=2)])
    watcher.start(rank=0)
    try:
        assert watcher.on_step(1) is None
        notice = watcher.on_step(2)
        assert notice is not None and notice.rank == 0 and watcher.pending() is notice
    finally:
        watcher.stop()


def test_build_watcher_rejects_bad_enabled() -> None:
    message = "notices.aws.enabled must be 'auto', true or false, got 'yes'"
    with pytest.raises(ValueError, match=re.escape(message)):
        build_watcher(aws={"enabled": "yes"})
