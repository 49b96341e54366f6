"""``benchmarks/bamboo_modes.py``'s summary of its runs and its last line (the runs themselves need root and
network namespaces: ``bamboo_nodes.py``, exercised by ``test_nodes.py``)."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

from benchmarks._young_daly import DRAIN_FLAG, request_drain
from benchmarks.bamboo_modes import last_line, summary, surviving_steps

LINE = re.compile(
    r"peers_overhead=(nan|\d+\.\d{3}) replica_overhead=(nan|\d+\.\d{3}) peers_vs_replica=\d+\.\d{3} "
    r"best_vs_checkpoint_restart=(nan|\d+\.\d{3}) failover_s=\d+\.\d{3} exact=(true|false)"
)


def run(step: float, rate: float, failovers: list[float], exact: bool = True) -> dict[str, object]:
    return {"full_layout_step_s": step, "segment_samples_per_s": rate, "failover_s": failovers,
            "exact": exact, "events_not_applied": 0}


def test_medians_per_mode_and_the_worst_modes_failover() -> None:
    runs = {
        "peers": [run(0.30, 30.0, [1.0, 1.2]), run(0.32, 28.0, [1.4])],
        "replica": [run(0.33, 27.0, [1.1]), run(0.35, 25.0, [1.3, float("nan")])],
        "replica+forward": [run(0.40, 24.0, [2.0, 2.2]), run(0.42, 22.0, [1.8], exact=False)],
    }
    modes = summary(runs)
    assert math.isclose(modes["peers"]["full_layout_step_s"], 0.31)
    assert math.isclose(modes["peers"]["failover_median_s"], 1.2)
    # a failover the run could not time (nan) is left out
    assert math.isclose(modes["replica"]["failover_median_s"], 1.2)
    assert math.isclose(modes["replica+forward"]["step_vs_peers"], 0.41 / 0.31)
    line = last_line(modes)
    assert LINE.fullmatch(line), line
    assert "peers_vs_replica=1.115 " in line and "failover_s=2.000 " in line and line.endswith("exact=false")
    with_baseline = last_line(modes, no_fault_tolerance_step_s=0.25)
    assert with_baseline.startswith("peers_overhead=1.240 replica_overhead=1.360 "), with_baseline
    assert "best_vs_checkpoint_restart=nan " in with_baseline  # not measured
    # the best mode's committed samples/s (peers: 29.0) over checkpoint-restart's
    with_restarts = last_line(modes, 0.25, checkpoint_restart_samples_per_s=14.5)
    assert LINE.fullmatch(with_restarts) and "best_vs_checkpoint_restart=2.000 " in with_restarts


def test_checkpoint_restart_progress_counts_what_survived() -> None:
    # steps 1-4 trained, a kill, the reload from step 2's checkpoint trains 3-5 again
    completions = [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (3, 9.0), (4, 10.0), (5, 11.0)]
    assert surviving_steps(completions, 0.0, 20.0) == 5
    assert surviving_steps(completions, 0.0, 5.0) == 2  # 3 and 4 as first trained were lost
    assert surviving_steps(completions, 2.0, 10.0) == 3  # 2, 3 and 4 (again)


def test_a_drain_request_ends_the_job_and_is_taken_back(tmp_path: Path) -> None:
    """``request_drain`` (both benchmarks' checkpoint-restart grow): the flag a job's ranks read, waited on
    until they exit, and removed, so the relaunch does not drain at its first step."""
    waits_for_flag = (f"import os, time\nwhile not os.path.exists({str(tmp_path / DRAIN_FLAG)!r}): "
                      "time.sleep(0.01)")
    ranks = [subprocess.Popen([sys.executable, "-c", waits_for_flag]) for _ in range(2)]
    try:
        request_drain(tmp_path, ranks, timeout=60)
        assert [rank.poll() for rank in ranks] == [0, 0]
        assert not (tmp_path / DRAIN_FLAG).exists()
    finally:
        for rank in ranks:
            rank.kill()
