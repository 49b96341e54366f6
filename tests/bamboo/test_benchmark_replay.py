"""``benchmarks/bamboo_replay.py``: refuses to run without measured costs; its output contract (fixture)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

from benchmarks import bamboo_replay
from tests.process import REPO

SCRIPT = REPO / "benchmarks" / "bamboo_replay.py"
FIXTURE = Path(__file__).parent / "data" / "bamboo_preemption_fixture.json"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    """``python benchmarks/bamboo_replay.py ARGS``, as its ``main()`` in this process: the same argument
    parsing, output and exit status, without a fresh interpreter importing torch + Lightning (~7 s each)."""
    out, err = io.StringIO(), io.StringIO()
    argv = sys.argv
    sys.argv = [str(SCRIPT), *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = bamboo_replay.main()
    finally:
        sys.argv = argv
    return subprocess.CompletedProcess([str(SCRIPT), *args], code, out.getvalue(), err.getvalue())


def test_missing_costs_names_the_file_and_the_command(tmp_path: Path) -> None:
    proc = run("--costs", str(tmp_path / "missing.json"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"error: {tmp_path / 'missing.json'} does not exist: the replay needs the costs measured by the live "
        "preemption benchmark; run: python benchmarks/bamboo_preemption.py --out "
        "benchmarks/results/bamboo_preemption.json"
    )


def test_a_cost_the_run_did_not_measure_is_named(tmp_path: Path) -> None:
    data = json.loads(FIXTURE.read_text())
    del data["costs"]["restart_stop_s"]["drain"]  # a run in which no grow found a launch training
    (tmp_path / "c.json").write_text(json.dumps(data))
    proc = run("--costs", str(tmp_path / "c.json"), "--allow-fixture")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: no measured restart stop of kind 'drain' (costs.restart_stop_s has ['kill']): the benchmark "
        "run saw no such restart"
    )


def test_fixture_is_refused_unless_allowed_and_the_last_line_is_exact() -> None:
    refused = run("--costs", str(FIXTURE))
    assert refused.returncode == 2 and "is a test fixture, not measured costs" in refused.stderr
    proc = run("--costs", str(FIXTURE), "--allow-fixture")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("WARNING: fixture costs, not measured")
    last = proc.stdout.strip().splitlines()[-1]
    pattern = r"vs_checkpoint_restart=\d+\.\d\d vs_on_demand_value=\d+\.\d\d sim_error=0\.033"
    assert re.fullmatch(pattern, last)


def test_pricing_another_mode_than_the_costs_measured_warns(tmp_path: Path) -> None:
    data = json.loads(FIXTURE.read_text())
    data["recovery"] = "replica+forward"
    data["costs"]["replica_step_s_by_layout"] = {"2x2": 0.45, "2x1": 0.9}
    (tmp_path / "c.json").write_text(json.dumps(data))
    same = run("--costs", str(tmp_path / "c.json"), "--allow-fixture")
    assert same.returncode == 0, same.stderr
    assert "WARNING: " not in same.stdout.replace("WARNING: fixture", "")
    assert "priced under recovery='replica+forward'" in same.stdout
    other = run("--costs", str(tmp_path / "c.json"), "--allow-fixture", "--recovery", "replica")
    assert other.returncode == 0, other.stderr
    assert (f"WARNING: {tmp_path / 'c.json'} was measured under recovery='replica+forward'; pricing "
            "recovery='replica'") in other.stdout
    assert other.stdout.splitlines()[-1] != same.stdout.splitlines()[-1]  # the replica's step priced
