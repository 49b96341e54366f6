"""Suite-wide hooks: per-test CPU accounting (``--cpu-times``), for measuring the suite on a busy machine.

Wall times (``--durations``) inflate when other work shares the cores; CPU seconds do not. With
``--cpu-times`` every test's CPU (this process + the subprocesses it waited for, i.e. ``RUSAGE_CHILDREN``)
is summed and the largest are printed at the end, with the total: total / cores estimates a quiet run
(also under pytest-xdist, if used: the controller prints the workers' figures). Not counted: the
ranks that Lightning's popen launcher starts (nobody waits for them), so such a 2-process launch shows ~half;
the ranks that ``tests.process.run_ranks`` starts are all waited for, so counted.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import pytest

from tests.netns import Network

# Every process the tests start imports tests/site/sitecustomize.py: it skips the interpreter's final garbage
# collections at exit (1.2-3 CPU-s per process after ``import lightning``; see that module).
SITE = Path(__file__).resolve().parent / "site"
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), os.environ.get("PYTHONPATH")]))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-times", action="store_true", default=False,
        help="print each test's CPU seconds (own + waited-for subprocesses) and the total",
    )
    parser.addoption(
        "--launch-shard", choices=LAUNCH_SHARDS, default=None,
        help="run one of the two halves of the multi-process tests (scripts/test.sh runs both side by side)",
    )


LAUNCH_SHARDS = ("bamboo", "rest")
"""The multi-process tests in two halves of about equal wall time (``scripts/test.sh`` runs them side by
side): ``bamboo``, the Bamboo files but :data:`REST_BAMBOO_FILES`, and ``rest``, everything else. The launch
tests spend about 40% of their wall time waiting (for a failover to be noticed, a process to start, a lease
to run out), so two launches at once fill 2 cores where one left them idle: ``make test`` from a fresh clone
took 19.0 min with the setup, against 24.3 with one launch at a time (measured here, quiet)."""
REST_BAMBOO_FILES = frozenset({"test_elastic_user_model.py", "test_script_launcher.py", "test_data_order.py"})
"""Bamboo files run in the ``rest`` half, to even the halves (the Bamboo files took 1118 s, the others 578 s
side by side; these three about 265 s)."""


def _launch_shard(item: pytest.Item) -> str:
    path = item.path
    in_bamboo = path.parent.name == "bamboo" and path.parent.parent.name == "tests"
    return "bamboo" if in_bamboo and path.name not in REST_BAMBOO_FILES else "rest"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    shard = config.getoption("--launch-shard")
    if shard is None:
        return
    keep = [item for item in items if _launch_shard(item) == shard]
    dropped = [item for item in items if _launch_shard(item) != shard]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep


def _cpu_seconds() -> float:
    from tests.process import FORKED_CPU_SECONDS  # processes forked by the test zygote, not our children

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + FORKED_CPU_SECONDS[0]


_START_KEY = pytest.StashKey[float]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.config.getoption("--cpu-times"):
        item.stash[_START_KEY] = _cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, None, None]:
    outcome = yield
    if call.when == "teardown" and _START_KEY in item.stash:  # the report travels to the xdist controller
        outcome.get_result().user_properties.append(("cpu_s", _cpu_seconds() - item.stash[_START_KEY]))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for key, value in report.user_properties:
        if key == "cpu_s" and report.when == "teardown":
            _TIMES[report.nodeid] = _TIMES.get(report.nodeid, 0.0) + float(value)


_TIMES: dict[str, float] = {}


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    times = _TIMES
    if not times or hasattr(config, "workerinput"):  # printed by the xdist controller, not each worker
        return
    terminalreporter.section("CPU seconds per test (own + subprocesses)")
    for nodeid, seconds in sorted(times.items(), key=lambda kv: -kv[1])[:40]:
        terminalreporter.write_line(f"{seconds:8.1f}  {nodeid}")
    terminalreporter.write_line(f"{sum(times.values()):8.1f}  total over {len(times)} tests")


@pytest.fixture
def make_network() -> Iterator[Callable[[int], Network]]:
    """``make_network(3)``: 3 hosts as network namespaces on a bridge (:mod:`tests.netns`). Every network made
    is removed at teardown, processes included, also when the test failed; where namespaces cannot be made
    (not root, no iproute2) the test fails with that reason."""
    made: list[Network] = []

    def make(size: int = 2) -> Network:
        made.append(Network(size))
        return made[-1].create()

    yield make
    errors = []
    for net in reversed(made):
        try:
            net.close()
        except RuntimeError as exc:
            errors.append(str(exc))
    if errors:
        raise RuntimeError("; ".join(errors))


@pytest.fixture(autouse=True)
def process_environment_restored() -> Iterator[None]:
    """Every test leaves ``os.environ`` as it found it. Code a test runs in this process may set variables for
    its own children: Lightning's launchers set ``OMP_NUM_THREADS`` (``_set_num_threads_if_needed``) when a
    ``fit`` runs here. Left set, the next launch's environment differs from the test zygote's in what a fork
    cannot change, and every later launch starts a fresh interpreter (slower, and the zygote test fails)."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest) -> Iterator[object]:
    """A fixture shared by several tests (module, class, package or session scope) leaves the variables a
    fork cannot change (:func:`~lbd_common.preload.fixed_at_start`: thread counts, ``PYTHON*``)
    as it found them. Such a fixture sets up before :func:`process_environment_restored` saves a test's
    environment, so what it sets stays for the rest of the session: a module fixture that runs a ``fit`` here
    (Lightning's launcher sets ``OMP_NUM_THREADS``) made every later launch a fresh interpreter and failed the
    zygote test in CI. Function-scoped fixtures may set them on purpose (``monkeypatch``); the test's own
    restore undoes those."""
    if fixturedef.scope == "function":
        return (yield)
    from lbd_common.preload import fixed_at_start

    before = fixed_at_start(os.environ)
    try:
        return (yield)
    finally:
        for name in set(fixed_at_start(os.environ)) - set(before):
            del os.environ[name]
        os.environ.update(before)

