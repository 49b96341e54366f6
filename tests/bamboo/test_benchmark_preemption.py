"""``benchmarks/bamboo_preemption.py --ci``: a worker is really SIGKILLed by the trace and Bamboo trains on.

No timing is asserted (the machine is shared): the output contract (the last line's format) and that the
kill happened, Bamboo completed steps after it inside the same job, and checkpoint-restart restarted.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.paths import REPO_ROOT
from tests.bamboo.launch_record import NAME, Record

SCRIPT = REPO_ROOT / "benchmarks" / "bamboo_preemption.py"
LAST = re.compile(r"vs_checkpoint_restart=(\d+\.\d\d|inf) failover_s=(\d+\.\d\d) step_s=(\d+\.\d\d\d)")


def run_benchmark(args: list[str], timeout: float, record: Path | None = None) -> str:
    """Run it in its own process group; on timeout SIGTERM first (it then kills its workers, which run in
    their own sessions), then SIGKILL the group. ``record``: where its supervisor keeps its JSON record
    (``BAMBOO_EVENTS``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"BAMBOO_EVENTS": str(record)} if record else {})}
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *args], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True, env=env,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"benchmark did not finish in {timeout} s\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ci_run_kills_a_worker_and_bamboo_trains_on(tmp_path: Path) -> None:
    record = tmp_path / NAME
    out = run_benchmark(["--ci", "--out", str(tmp_path / "r.json"), "--keep", str(tmp_path / "run")], 400,
                        record)
    last = out.strip().splitlines()[-1]
    match = LAST.fullmatch(last)
    assert match, f"last line {last!r}"
    assert math.isfinite(float(match[2]))  # a step completed after the kill
    result = json.loads((tmp_path / "r.json").read_text())
    bamboo, cr = result["live"]["bamboo"], result["live"]["checkpoint_restart"]
    assert [e["kind"] for e in bamboo["events"]] == ["remove"]
    assert bamboo["failovers"] == 1 and len(bamboo["failover_s_each"]) == 1
    assert [c.kind for c in Record.read(record).changes][:1] == ["failover"]  # the kill, then maybe a rejoin
    # training went on in the same job: steps after the kill, on the shrunk layout
    kill = bamboo["events"][0]["t_s"]
    assert bamboo["samples"] > 0
    steps = [
        line.split() for path in (tmp_path / "run" / "bamboo").glob("steps-member*.txt")
        for line in path.read_text().splitlines()
    ]
    assert any(layout == "2+1" for _, _, layout in steps), "no step on the shrunk layout"
    assert kill > 0 and cr["restarts"] == 1
    # the restart's record (--ci does not wait for the relaunch's first step, so only its stop is measured;
    # the split of a relaunch is checked on hand-written files in test_preemption_timeline.py)
    (restart,) = cr["restart_each"]
    assert restart["why"] == "kill" and restart["stop_kind"] == "kill" and restart["layout"] == "2x1"
    assert result["schema"] == 2 and result["costs"]["restart_stop_s"] == {"kill": restart["stop_s"]}
