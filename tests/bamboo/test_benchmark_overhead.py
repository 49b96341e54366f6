"""``benchmarks/bamboo_overhead.py`` in CI size: it runs all four parts and prints its summary line.

No timing is asserted (the machine is shared); what is asserted is the output contract and that the four
parts trained the same thing: same weights, same batch, same optimizer, hence the same losses.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from lightning_bamboo.schedule import add_forward_redundancy, build_1f1b, rank_program
from recipes.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "bamboo_overhead.py"
CI_SIZE = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16", "--batch-size", "8",
           "--microbatches", "4", "--stages", "2", "--steps", "2", "--warmup", "1", "--timeout", "150"]
TRACE = re.compile(r"^rank(?P<rank>\d) (?P<mode>bamboo|bamboo_rc)\s+(?P<events>.*)$")
EVENT = re.compile(r"(?P<name>[A-Za-z+ ]+?|[A-Z]+\d,\d) (?P<start>\d+)-(?P<end>\d+)")
REPLAY = re.compile(
    r"CPU-time replay \(1 steps, a free core per rank, free transfers\): \(c\) \d+\.\d ms, \(d\) \d+\.\d ms, "
    r"rc_overhead \d+\.\d{3} \(\d+\.\d{3} without the replica update\)"
)
SPEEDUP = re.compile(r"pipeline speed-up \(a\)/\(c\) \d+\.\d\d, ideal S\*M/\(M\+S-1\) 1\.60")
ROW = re.compile(r"^\((?P<part>[abcde])\) .*?\s(?P<sec>\d+\.\d+)\s+(?P<first>\d+\.\d+)\s+(?P<last>\d+\.\d+)$")


def run_script(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run the benchmark in its own process group; kill the whole group (workers too) on timeout."""
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *args], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"benchmark did not finish in {timeout} s\n{stdout[-2000:]}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_benchmark_runs_all_parts_and_prints_the_summary_line() -> None:
    result = run_script([*CI_SIZE, "--trace", "--cpu-profile", "1"], timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    speedups = [line for line in lines if SPEEDUP.fullmatch(line)]
    assert len(speedups) == 1, lines  # S = 2, M = 4: ideal 2 * 4 / (4 + 2 - 1) = 1.60
    # --cpu-profile: per-action CPU costs of every rank and part, replayed through the schedules
    assert sum(line.startswith("CPU ms per action, ") for line in lines) == 4, lines
    assert len([line for line in lines if REPLAY.fullmatch(line)]) == 1, lines
    assert re.fullmatch(r"rc_overhead=\d+\.\d\d vs_torch_1f1b=\d+\.\d\d", lines[-1]), lines[-1]
    assert re.fullmatch(r"replica_only_overhead=\d+\.\d\d", lines[-2]), lines[-2]
    rows = {m["part"]: m for m in map(ROW.match, lines) if m}
    assert sorted(rows) == ["a", "b", "c", "d", "e"], result.stdout
    # Same initial weights and batch: the first step's loss is the same in all five parts ...
    firsts = [float(rows[p]["first"]) for p in "abcde"]
    assert max(firsts) - min(firsts) < 1e-3, firsts
    # ... and the same gradients through the same AdamW keep them together after 3 steps.
    lasts = [float(rows[p]["last"]) for p in "abcde"]
    assert max(lasts) - min(lasts) < 1e-3, lasts
    assert lasts[0] < firsts[0]
    check_timelines(lines)


def check_timelines(lines: list[str]) -> None:
    """``--trace``: every rank prints one timeline per Bamboo part, with its program's actions in order."""
    plain = build_1f1b(2, 4)
    schedules = {"bamboo": plain, "bamboo_rc": add_forward_redundancy(plain, 2, 4)}
    traces = {(int(m["rank"]), m["mode"]): m["events"] for m in map(TRACE.match, lines) if m}
    assert sorted(traces) == [(r, mode) for r in (0, 1) for mode in ("bamboo", "bamboo_rc")], lines
    for (rank, mode), text in traces.items():
        events = [(e["name"].strip(), int(e["start"]), int(e["end"])) for e in EVENT.finditer(text)]
        assert all(start <= end for _, start, end in events), text
        actions = [name for name, _, _ in events if re.fullmatch(r"(F|B|FR)\d,\d", name)]
        expected = [f"{a.kind.value}{a.stage},{a.microbatch}" for a in rank_program(schedules[mode], rank)]
        assert actions == expected, (rank, mode, text)
        names = [name for name, _, _ in events]
        tail = ["optimizer", "replica post", "barrier"] if mode == "bamboo_rc" else ["optimizer", "barrier"]
        assert names[-len(tail) :] == tail, text
        if mode == "bamboo_rc":  # the replica's update is applied by the first FR, just before it runs
            first_fr = next(i for i, name in enumerate(names) if name.startswith("FR"))
            assert names[first_fr - 1] == "replica apply", text


def test_bad_sizes_are_rejected_with_the_arithmetic() -> None:
    """The command line's check, in this process (a fresh interpreter would spend ~7 s importing torch):
    ``SystemExit(message)`` is what prints the message to stderr and exits with status 1."""
    from benchmarks.bamboo_overhead import main

    with pytest.raises(SystemExit) as exited:
        main([*CI_SIZE, "--microbatches", "3"])
    assert str(exited.value.code) == "--microbatches (3) does not divide --batch-size (8): 8 % 3 = 2"
