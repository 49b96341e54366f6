"""``benchmarks/preemption_timeline.py``: a restart's measured parts, worked out by hand on hand-written step
and phase files (the live benchmark writes the same files; its ``--ci`` test checks a real one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.preemption_timeline import event_warmups, median_by, restart_records, warmup_excess


def test_warmup_excess_takes_out_checkpoints_and_stops_at_the_next_event() -> None:
    # first step at 10.0, then 3 steps of 0.5 s, 0.2 s, 0.1 s (steady 0.1 s); a 0.05 s checkpoint inside
    times = [10.0, 10.5, 10.7, 10.8, 20.0]
    assert warmup_excess(times, 0.1, [(10.6, 0.05)], end=11.0) == pytest.approx((0.8 - 0.05 - 0.3, 3))
    assert warmup_excess([10.0], 0.1, (), end=11.0) is None


def test_restart_record_splits_a_relaunch(tmp_path: Path) -> None:
    """A kill at t0+5 (all stopped at t0+5.1), relaunched at 2x1: processes created at +5.3, imported at
    +7.3, set up at +8.3, restored at +8.8; first step at +9.2 (steady 0.1 s: relaunch 9.2-5.1-0.1 = 4.0 s),
    then 2 steps of 0.3 s before the next restart at +10.0 (warm-up 0.6 - 0.2 = 0.4 s)."""
    t0 = 1000.0
    for rank, offset in ((0, 0.0), (1, 0.1)):
        phases = {"exec": t0 + 5.2 + offset, "imported": t0 + 7.2 + offset, "setup": t0 + 8.3,
                  "train_start": t0 + 8.7 + offset}
        (tmp_path / f"phases-launch1-rank{rank}.json").write_text(json.dumps(phases))
    steps = ((40, 9.2), (41, 9.5), (42, 9.8), (43, 10.5))
    rows = [(s, t0 + t, "2x1", "steps-launch1-rank0") for s, t in steps]
    restarts = [
        {"t_s": 5.0, "launch": 1, "why": "kill", "drained": False, "stopped_s": 5.1, "launched_s": 5.15,
         "layout": "2x1"},
        {"t_s": 10.0, "launch": 2, "why": "grow", "drained": True, "stopped_s": 11.0, "launched_s": 11.1,
         "layout": "2x2"},
    ]
    first, second = restart_records(tmp_path, t0, restarts, rows, [], {"2x1": 0.1})
    assert first["stop_s"] == pytest.approx(0.1) and first["relaunch_s"] == pytest.approx(4.0)
    assert first["warmup_s"] == pytest.approx(0.4) and first["warmup_steps"] == 2
    assert first["phases_s"] == pytest.approx(
        {"spawn": 0.2, "imports": 2.0, "setup_and_rendezvous": 1.0, "restore": 0.5, "first_step": 0.4})
    assert second["relaunch_s"] is None and second["stop_s"] == pytest.approx(1.0)  # never trained
    assert median_by([first, second], "why", "stop_s") == pytest.approx({"grow": 1.0, "kill": 0.1})


def test_event_warmup_follows_the_new_layout() -> None:
    rows = [(1, 1.0, "2x2", "m0"), (1, 1.01, "2x2", "m1"), (2, 3.0, "2+1", "m0"), (3, 3.4, "2+1", "m0"),
            (4, 3.6, "2+1", "m0"), (5, 3.7, "2x2", "m0")]
    (warm,) = event_warmups(rows, [3.0], [10.0], {"2+1": 0.1})
    assert warm == {"layout": "2+1", "warmup_s": pytest.approx(0.6 - 0.2), "warmup_steps": 2}
