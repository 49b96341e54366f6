"""The preflight advisor's first cut (lightning_bamboo.advise): every candidate replayed with the measured
costs, the most samples per dollar recommended, the validation's sim_error, and its last line."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from lightning_bamboo.advise import advise
from lightning_bamboo.advise.__main__ import main
from lightning_bamboo.simulate import Prices, load_costs, parse_trace
from lightning_bamboo.simulate.model import young_daly_interval

FIXTURE = Path(__file__).parent / "data" / "bamboo_preemption_fixture.json"


def trace_file(tmp_path: Path) -> Path:
    """4 nodes (2x2 at the fixture's 64 samples/s); node d lost at 10 s, e joins at 20 s; ends at 40 s."""
    path = tmp_path / "t.csv"
    path.write_text("0,add,a\n0,add,b\n0,add,c\n0,add,d\n10000,remove,d\n20000,add,e\n40000,remove,e\n")
    return path


def test_every_candidate_is_replayed_and_the_best_value_recommended(tmp_path: Path) -> None:
    costs = load_costs(FIXTURE)
    trace = parse_trace(trace_file(tmp_path))
    advice = advise(trace, costs, Prices(spot=1.0, on_demand=3.0), compression=1.0, max_pipelines=2)
    interval = young_daly_interval(costs.checkpoint_s, 40.0 / trace.removal_groups())
    names = [c.name for c in advice.candidates]
    assert names == [
        "bamboo:stages=2",
        f"checkpoint_restart:stages=2:checkpoint_every={interval * 0.5:.3g}s",
        f"checkpoint_restart:stages=2:checkpoint_every={interval:.3g}s",
        f"checkpoint_restart:stages=2:checkpoint_every={interval * 2:.3g}s",
        "on_demand:stages=2:nodes=4",
    ]
    assert [c.result.checkpoint_interval_s for c in advice.candidates[1:4]] == pytest.approx(
        [interval * 0.5, interval, interval * 2])
    assert advice.recommended.result.value == max(c.result.value for c in advice.candidates)
    assert advice.value_vs_on_demand == pytest.approx(
        advice.recommended.result.value / advice.on_demand.result.value)
    assert advice.validation.sim_error == pytest.approx(1.6 / 48.0)  # the fixture's worked-out validation


def test_cli_prints_the_table_and_its_last_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "advice.png"
    code = main(["--costs", str(FIXTURE), "--trace", str(trace_file(tmp_path)), "--compression", "1",
                 "--max-pipelines", "2", "--plot", str(plot)])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("WARNING: FIXTURE COSTS, NOT MEASURED")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.count("<- recommended") == 1
    match = re.fullmatch(r"advice=(\S+) projected_value_vs_on_demand=(\d+\.\d\d) sim_error=(\d\.\d{3})",
                         out.splitlines()[-1])
    assert match is not None, out.splitlines()[-1]
    recommended = next(line for line in out.splitlines() if "<- recommended" in line)
    assert recommended.startswith(f"{match[1]} ")
    assert float(match[3]) == pytest.approx(0.033, abs=1e-3) and not math.isinf(float(match[2]))


def test_cli_names_the_missing_costs_and_the_command_that_measures_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--costs", str(tmp_path / "none.json")]) == 2
    assert "does not exist; produce it with the live benchmark: python benchmarks/bamboo_preemption.py" in \
        capsys.readouterr().err


def test_costs_without_a_usable_stage_count_are_refused(tmp_path: Path) -> None:
    data = json.loads(FIXTURE.read_text())
    data["costs"]["relaunch_s_by_layout"] = {}
    data["costs"]["relaunch_warmup_s_by_layout"] = {}
    (tmp_path / "c.json").write_text(json.dumps(data))
    costs = load_costs(tmp_path / "c.json")
    with pytest.raises(ValueError, match=re.escape("the costs measure no stage count >= 2 with and without "
                                                   "redundancy and a relaunch")):
        advise(parse_trace(trace_file(tmp_path)), costs, Prices(), compression=1.0)
