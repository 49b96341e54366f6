"""``benchmarks/bamboo_modes.py``'s summary of its runs and its last line (the runs themselves need root and
network namespaces: ``bamboo_nodes.py``, exercised by ``test_nodes.py``)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


REFERENCE = {"costs": {"checkpoint_s": 0.2, "restart_s": 9.0}}
MACHINES = {"m0": (0, 3), "m1": (1, 4), "m2": (2, 5)}  # the coordinator's round-robin placement


def commit_times(start: float, end: float, step: float) -> list[float]:
    count = round((end - start) / step)
    return [start + i * step for i in range(count + 1)]


def test_a_runs_timeline_replays_to_its_own_samples_per_second(tmp_path: Path) -> None:
    """A synthetic multi-machine run: 2 x 3 at 0.1 s a step, machine m0 (members 0 and 3) lost at 5.05 s,
    the first step of the next generation 1.0 s later, then 0.2 s a step on the fused map (2+1+1: the
    replicas of members 1 and 2 cover 0 and 3). The costs file carries those figures, names the workers so
    that the replay's member ids are the runtime's, and the replay predicts what the run committed."""
    from benchmarks._nodes_replay import Applied, generations, replay_costs
    from lightning_bamboo.simulate.costs import load_costs
    from lightning_bamboo.simulate.run import validate

    full, fused = commit_times(0.1, 5.0, 0.1), commit_times(6.05, 9.85, 0.2)
    commits = [(i, t, 0) for i, t in enumerate(full)] + [(len(full) + i, t, 1) for i, t in enumerate(fused)]
    gens = generations(commits, {0: "2x3", 1: "2+1+1"}, {0: 6, 1: 4})
    live = len(commits) * 12 / 10.0
    data = replay_costs(gens, [Applied(5.05, "remove", "m0", (0, 3))], MACHINES, [1.0], 0.0, 10.0, live,
                        12, 2, "replica", REFERENCE)
    costs = data["costs"]
    assert costs["step_s_by_layout"] == {"2x3": pytest.approx(0.1)}
    assert costs["step_s_by_shape"] == {"2+1+1": pytest.approx(0.2)}
    assert costs["failover_s"] == 1.0 and costs["failover_warmup_s"] == pytest.approx(0.0, abs=1e-9)
    assert costs["rejoin_s"] is None  # no replacement joined
    assert data["initial_nodes"] == ["m0/0", "m1/1", "m2/2", "m0/3", "m1/4", "m2/5"]  # member order
    assert data["events"] == [{"t_s": 5.05, "kind": "remove", "node": "m0/0"},
                              {"t_s": 5.05, "kind": "remove", "node": "m0/3"}]
    path = tmp_path / "replay_costs.json"
    path.write_text(json.dumps(data))
    check = validate(load_costs(path))
    # 5.05 s at 120 samples/s, the 1.0 s failover, then 3.95 s at 60 samples/s, over 10 s
    assert check.predicted["bamboo"] == pytest.approx((5.05 * 120 + 3.95 * 60) / 10.0)
    assert check.sim_error < 0.02  # the run's own commits: 70 steps of 12 samples


def test_a_layouts_step_is_its_mean_interval_stalls_included() -> None:
    """A generation of 0.1 s steps with one 1.0 s stall after its warm-up: its step for the replay is the
    mean interval (what it trained per second), not the median, which would drop the stall."""
    from benchmarks._nodes_replay import WARMUP_SPANS, generations, steady_steps

    times = commit_times(0.0, 3.0, 0.1)
    stalled = times[: WARMUP_SPANS + 5] + [t + 0.9 for t in times[WARMUP_SPANS + 5:]]
    gens = generations([(i, t, 0) for i, t in enumerate(stalled)], {0: "2x3"}, {0: 6})
    steady = gens[0].spans[WARMUP_SPANS:]
    assert sorted(steady)[len(steady) // 2] == pytest.approx(0.1)  # the median would say 0.1 s
    assert steady_steps(gens) == {"2x3": pytest.approx((0.1 * (len(steady) - 1) + 1.0) / len(steady))}


def test_a_replacement_joining_is_priced_by_its_delay_and_its_pause() -> None:
    """m3 (members 6 and 7) starts at 7.0 s while the fused map trains; the job's last step without it is at
    9.0 s, its first with it at 9.5 s: a rejoin delay of 2.0 s and a pause of 0.5 s less a 0.1 s step."""
    from benchmarks._nodes_replay import Applied, generations, replay_costs

    full, fused, grown = (commit_times(0.1, 5.0, 0.1), commit_times(6.0, 9.0, 0.2),
                          commit_times(9.5, 12.0, 0.1))
    times = [(t, 0) for t in full] + [(t, 1) for t in fused] + [(t, 2) for t in grown]
    commits = [(i, t, g) for i, (t, g) in enumerate(times)]
    gens = generations(commits, {0: "2x3", 1: "2+1+1", 2: "2x3"}, {0: 6, 1: 4, 2: 6})
    applied = [Applied(5.05, "remove", "m0", (0, 3)), Applied(7.0, "add", "m3", (6, 7))]
    data = replay_costs(gens, applied, MACHINES, [0.95], 0.0, 12.0, 100.0, 12, 2, "peers", REFERENCE)
    costs = data["costs"]
    assert costs["rejoin_delay_s"] == pytest.approx(2.0)
    assert costs["rejoin_s"] == pytest.approx(0.4)
    assert costs["peers_failover_s"] == costs["failover_s"] == 0.95
    assert [e["node"] for e in data["events"]] == ["m0/0", "m0/3", "m3/6", "m3/7"]
    assert data["live"]["bamboo"]["recovery"] == "peers"


@pytest.mark.parametrize("clock_kept", [True, False], ids=["segment-start-kept", "from-the-kill"])
def test_a_kept_run_is_built_again_into_the_costs_it_wrote(tmp_path: Path, clock_kept: bool) -> None:
    """``--replay-kept``: a run's costs file rebuilt from what ``bamboo_nodes.py --out`` kept (its commits,
    kills and the file it wrote) equals the one it wrote; runs kept before the segment's start was recorded
    take it from a kill's time less its event's offset."""
    from benchmarks._nodes_replay import Applied, failover_times, generations, replay_costs, replay_kept_run

    start = 100.0
    full, fused = commit_times(0.1, 5.0, 0.1), commit_times(6.0, 9.0, 0.2)
    grown = commit_times(9.5, 12.0, 0.1)
    times = [(start + t, 0) for t in full] + [(start + t, 1) for t in fused] + [(start + t, 2) for t in grown]
    commits = [(i, t, g) for i, (t, g) in enumerate(times)]
    kills = [(0, start + 5.05, 0, True)]
    gens = generations(commits, {0: "2x3", 1: "2+1+1", 2: "2x3"}, {0: 6, 1: 4, 2: 6})
    applied = [Applied(5.05, "remove", "m0", (0, 3)), Applied(7.0, "add", "m3", (6, 7))]
    written = replay_costs(gens, applied, MACHINES, failover_times(commits, kills), start, 12.0, 100.0, 12, 2,
                           "peers", REFERENCE)
    kept = {"commits": commits, "kills": kills, **({"segment_start": start} if clock_kept else {})}
    (tmp_path / "commits.json").write_text(json.dumps(kept))
    (tmp_path / "replay_costs.json").write_text(json.dumps(written))
    again = replay_kept_run(tmp_path)
    assert again["costs"].keys() == written["costs"].keys()
    for key, value in written["costs"].items():  # flat values and flat dicts of seconds
        assert again["costs"][key] == (value if value is None else pytest.approx(value)), key
    assert again["costs"]["rejoin_delay_s"] == pytest.approx(2.0)  # the clock: m3 started at 107 s
    rest = {k: v for k, v in written.items() if k != "costs"}
    assert {k: v for k, v in again.items() if k != "costs"} == rest


def test_the_advice_is_the_mode_with_the_most_samples_predicted() -> None:
    from benchmarks.bamboo_modes import advice

    modes = {"peers": {"replay_predicted_samples_per_s": 90.0, "segment_samples_per_s": 93.0},
             "replica": {"replay_predicted_samples_per_s": 99.0, "segment_samples_per_s": 101.0}}
    advised = advice(modes)
    assert advised["recommended"] == advised["fastest_measured"] == "replica"
    assert advised["sim_error"] == pytest.approx(3.0 / 93.0)
