"""Suite-wide hooks: one xdist group for the tests that launch processes or share the local services, and
per-test CPU accounting (``--cpu-times``), for measuring the suite on a busy machine.

``scripts/test.sh`` runs the suite on 2 pytest-xdist workers with ``--dist loadgroup``: every test marked
``multiprocess`` or ``services`` is put in the group ``serial``, which one worker runs one test after another
(at most one multi-process launch at a time on the 2 cores, one user of the moto/etcd servers at a time);
the single-process tests run beside it on the other worker, in the launches' idle time (waits for
heartbeats, timeouts, peers). Without ``-n`` the marker does nothing.

Wall times (``--durations``) inflate when other work shares the cores; CPU seconds do not. With
``--cpu-times`` every test's CPU (this process + the subprocesses it waited for, i.e. ``RUSAGE_CHILDREN``)
is summed and the largest are printed at the end, with the total: total / cores estimates a quiet run.
"""

from __future__ import annotations

import resource
from collections.abc import Generator

import pytest

_CPU_KEY = pytest.StashKey[dict[str, float]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-times", action="store_true", default=False,
        help="print each test's CPU seconds (own + waited-for subprocesses) and the total",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("multiprocess") or item.get_closest_marker("services"):
            item.add_marker(pytest.mark.xdist_group("serial"))


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    if not item.config.getoption("--cpu-times"):
        yield
        return
    start = _cpu_seconds()
    yield
    item.config.stash.setdefault(_CPU_KEY, {})[item.nodeid] = _cpu_seconds() - start


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    times = config.stash.get(_CPU_KEY, {})
    if not times:
        return
    terminalreporter.section("CPU seconds per test (own + subprocesses)")
    for nodeid, seconds in sorted(times.items(), key=lambda kv: -kv[1])[:40]:
        terminalreporter.write_line(f"{seconds:8.1f}  {nodeid}")
    terminalreporter.write_line(f"{sum(times.values()):8.1f}  total over {len(times)} tests")
