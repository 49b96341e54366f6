"""``benchmarks/gpu_failover.py`` in its CPU mode (the GPU run is the same scenario on NCCL): a real 2 x 2 job
under Bamboo's supervisor loses a worker mid-step and ends equal to the uninterrupted job, with no survivor
lost; and its arguments and accounting on their own. Its timing goal is the benchmark's, not checked here."""

from __future__ import annotations

import re
import sys

import pytest

from benchmarks.gpu_failover import KILLED, main, survivors_lost
from tests.process import REPO, launch_env, run_process

LINE = re.compile(
    r"^backend=(nccl|gloo|nccl-like) nccl_version=(\S+) exact=(true|false) failover_s=(\d+\.\d{3}|nan) "
    r"step_s=\d+\.\d{3} survivors_lost=(\d+) default_env_survivors_lost=(\d+|skipped)$"
)


def test_a_survivor_that_failed_or_wrote_nothing_is_lost() -> None:
    record = {"exit_codes": {0: 0, 1: -6, 2: 0, KILLED: -9}, "finals": ["final-member0.pt"]}
    assert survivors_lost(record) == 2  # member 1 aborted, member 2 wrote no parameters; the victim is not


@pytest.mark.parametrize(("argv", "message"), [
    (["--device", "cpu", "--backend", "nccl"], "--backend nccl needs --device cuda"),
    (["--device", "cpu", "--steps", "4", "--kill-step", "3"], "--kill-step must be between 1 and"),
])
def test_bad_arguments_are_named(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["gloo", "nccl-like"])
def test_the_cpu_mode_fails_over_exactly_and_loses_no_survivor(backend: str) -> None:
    cmd = [sys.executable, str(REPO / "benchmarks" / "gpu_failover.py"), "--device", "cpu", "--backend",
           backend, "--steps", "6", "--kill-step", "3"]
    out = run_process(cmd, timeout=450, env=launch_env()).stdout
    last = out.strip().splitlines()[-1]
    match = LINE.match(last)
    assert match, last
    assert match.group(1) == backend and match.group(2) == "none"
    assert match.group(3) == "true" and match.group(5) == "0", out[-4000:]
    assert match.group(6) == "skipped"
