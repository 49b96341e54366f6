"""``benchmarks/bamboo_ft_cost.py``: its arguments, and one short run of its three jobs (torchrun, one
machine's supervisor, the several-machine design on etcd) whose figures come from counters that moved: CPU
per step of every worker, the store's bytes, etcd's requests. Its timing goal is the benchmark's, not
checked here."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from benchmarks.bamboo_ft_cost import main, summarize
from tests.process import REPO, launch_env, run_process

LINE = re.compile(
    r"^ft_cpu_ms_per_step=-?\d+\.\d{2} ft_requests_per_step=\d+\.\d{2} ft_bytes_per_step=\d+ "
    r"control_cpu_per_s=\d+\.\d{3} overhead_at_0\.5s=\d+\.\d{3} overhead_at_2s=\d+\.\d{3}$"
)


@pytest.mark.parametrize(("argv", "message"), [
    (["--configs", "tcp,gpu"], "--configs: a comma-separated subset of fixed,tcp,etcd"),
    (["--warmup", "1"], "--warmup >= 2"),
])
def test_bad_arguments_are_named(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def test_the_overheads_add_the_measured_step_increase_to_a_longer_step() -> None:
    def run(config: str, step_s: float, cpu: float) -> dict[str, object]:
        return {"config": config, "step_s": step_s, "worker_cpu_ms_per_step": cpu, "control_cpu_per_s": 0.1,
                "requests_per_step_per_worker": None if config != "etcd" else 0.5,
                "bytes_per_step_per_worker": 0.0 if config == "fixed" else 1000.0, "store_cpu_per_s": None}

    summary = summarize([run("fixed", 0.5, 10.0), run("tcp", 0.49, 10.5), run("etcd", 0.51, 13.0)], 2176)
    etcd, tcp = summary["figures"]["etcd"], summary["figures"]["tcp"]
    assert etcd["ft_cpu_ms_per_step"] == pytest.approx(3.0)
    assert etcd["overhead_at_0.5s"] == pytest.approx(1.02) and etcd["overhead_at_2s"] == pytest.approx(1.005)
    assert tcp["added_step_s"] == 0.0  # faster than the reference: nothing added, not a negative cost
    assert summary["overheads_are"] == {"0.5s": "measured", "2s": "projected"}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_short_run_reports_what_the_counters_measured(tmp_path: Path) -> None:
    out = tmp_path / "ft.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "bamboo_ft_cost.py"), "--rounds", "1", "--warmup", "3",
           "--window", "6", "--out", str(out)]
    stdout = run_process(cmd, timeout=500, env=launch_env()).stdout
    assert LINE.match(stdout.strip().splitlines()[-1]), stdout[-3000:]
    result = json.loads(out.read_text())
    assert {"command", "commit", "machine"} <= set(result)
    runs = {r["config"]: r for r in result["runs"]}
    assert set(runs) == {"fixed", "tcp", "etcd"} and all(r["exit"] == 0 for r in runs.values())
    assert all(r["steps"] >= 6 and len(r["worker_cpu_ms_per_step_each"]) == 4 for r in runs.values())
    assert all(cpu > 0 for r in runs.values() for cpu in r["worker_cpu_ms_per_step_each"])
    bytes_, requests = "bytes_per_step_per_worker", "requests_per_step_per_worker"
    assert runs["fixed"][bytes_] == 0 and runs["fixed"][requests] is None  # no store after the start
    assert runs["tcp"][bytes_] > 0 and runs["tcp"][requests] is None  # a TCPStore counts no requests
    assert runs["etcd"][requests] > 0 and runs["etcd"][bytes_] > 0
