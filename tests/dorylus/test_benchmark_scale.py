"""benchmarks/dorylus_scale.py at CI size: two machines (network namespaces) of a small memory cgroup, the
chunked generator, PyG in one machine against streamed preparation + torchrun graph servers in both; an
OOM kill is an answer; everything it made is removed."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.process import REPO, launch_env, run_process

SCRIPT = REPO / "benchmarks" / "dorylus_scale.py"
LAST = re.compile(
    r"^machines=2 limit_gib=0\.75 pyg_max_edges=(\d+) dorylus_max_edges=(\d+) scale_ratio=(\S+) "
    r"prep_peak_gib=(\d+\.\d\d) server_peak_gib=(\d+\.\d\d) epoch_s=(\d+\.\d\d)$"
)


def h48_leftovers() -> list[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    from benchmarks._cgroups import ROOT

    cgroups = [p.name for p in ROOT.glob("h48-*")]
    found = re.findall(r"\d+: (h48[bv]\d+\S*?)[@:]", links)
    return [n for n in names if n.startswith("h48-")] + found + cgroups


@pytest.mark.netns
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_scale_benchmark_at_ci_size(tmp_path) -> None:
    """0.75 GiB machines: PyG and Dorylus both fit at 10k vertices (equal initial losses, checked by the
    benchmark), the doubling goes on until PyG is OOM-killed, and the line is printed."""
    before = h48_leftovers()
    done = run_process(
        [sys.executable, str(SCRIPT), "--machines", "2", "--limit-gib", "0.75", "--start-nodes", "10000",
         "--max-nodes", "80000", "--workdir", str(tmp_path / "work"), "--timeout", "300"],
        timeout=850, cwd=REPO, env=launch_env(),
    )
    last = done.stdout.strip().splitlines()[-1]
    match = LAST.match(last)
    assert match, done.stdout[-3000:]
    assert int(match.group(2)) >= int(match.group(1)) > 0
    assert '"initial_loss_equal": true' in done.stdout
    assert h48_leftovers() == before
