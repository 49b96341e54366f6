"""Projection scenarios (lightning_bamboo.simulate.scenario/projection): the shipped ones load with a source
for
every parameter, an unknown is swept (one table row per value), the scenario's figures reach the replay's
model, and a bad scenario file is refused with its file and key."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import yaml

from lightning_bamboo.simulate import parse_trace
from lightning_bamboo.simulate.__main__ import main
from lightning_bamboo.simulate.model import simulate_bamboo
from lightning_bamboo.simulate.projection import hours, project, report
from lightning_bamboo.simulate.scenario import (
    PARAMETERS,
    SCENARIOS,
    SOURCE_KINDS,
    ScenarioError,
    available,
    load_scenario,
)

GPT2 = SCENARIOS / "gpt2-p3.yaml"


def small_trace(tmp_path: Path) -> Path:
    """16 nodes (two 8-stage pipelines); one lost at 100 s; the trace ends at 200 s."""
    lines = [f"0,add,n{i}" for i in range(16)] + ["100000,remove,n3", "200000,add,n99"]
    path = tmp_path / "t.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def edited(tmp_path: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    data = yaml.safe_load(GPT2.read_text())
    edit(data)
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("name", ["gpt2-p3", "bert-p3"])
def test_shipped_scenarios_name_a_source_for_every_parameter(name: str) -> None:
    assert name in available()
    scenario = load_scenario(name)
    assert set(scenario.parameters) == set(PARAMETERS)
    for p in scenario.parameters.values():
        if p.unknown:
            assert p.sweep and p.value is None and p.note, p.name
        else:
            assert p.source.startswith(SOURCE_KINDS) and p.value is not None, p.name
    assert {p.name for p in scenario.unknowns()} == {"redundancy_overhead", "checkpoint_s", "restart_s"}
    assert len(scenario.combinations()) == 3 * 2 * 3
    assert scenario.trace.is_file() and scenario.trace_source.startswith("published:")


def test_an_unknown_is_swept_one_row_per_value(tmp_path: Path) -> None:
    """Only restart_s unknown: two rows; a longer restart costs checkpoint-restart, not Bamboo (no fallback
    here)."""
    def one_unknown(data: dict) -> None:  # type: ignore[type-arg]
        data["parameters"]["redundancy_overhead"] = {"value": 1.0, "source": "configuration: test"}
        data["parameters"]["checkpoint_s"] = {"value": 30, "source": "configuration: test"}
        data["parameters"]["restart_s"]["sweep"] = [60, 600]
    scenario = load_scenario(edited(tmp_path, one_unknown))
    trace = parse_trace(small_trace(tmp_path))
    rows = project(scenario, trace)
    assert [row.chosen for row in rows] == [{"restart_s": 60.0}, {"restart_s": 600.0}]
    fast, slow = (row.comparison for row in rows)
    assert fast.bamboo.samples == pytest.approx(slow.bamboo.samples)
    assert fast.checkpoint_restart.samples > slow.checkpoint_restart.samples
    lines = report(scenario, trace, rows)
    table = [line for line in lines if re.match(r"^\s+\d+(\.\d+)? \|", line)]
    assert [float(line.split("|")[0]) for line in table] == [60.0, 600.0]
    assert lines[0].startswith("PROJECTION - NOT MEASURED. Scenario gpt2-p3")
    assert lines[-1].startswith("projection=gpt2-p3 rows=2 vs_checkpoint_restart=")


def test_the_scenario_figures_reach_the_model(tmp_path: Path) -> None:
    """On-demand: 24 nodes = 8x3 at 264 samples per 3.08 s. Bamboo on the small trace: 8x2 (264 per 4.20 s)
    for 100 s; the loss: failover 20 s, then the fused map at 1/1.5 of 8x2's rate for 80 s."""
    scenario = load_scenario(GPT2)
    chosen = scenario.combinations()[0]
    trace = parse_trace(small_trace(tmp_path), duration_s=200.0)
    (row,) = [r for r in project(scenario, trace) if r.chosen == chosen]
    od = row.comparison.on_demand
    assert od.samples_per_s == pytest.approx(264 / 3.08 / chosen["redundancy_overhead"])
    assert od.dollars_per_hour == pytest.approx(24 * 3.06)
    assert hours(od) == pytest.approx(1e6 / od.samples_per_s / 3600)
    bamboo = simulate_bamboo(trace, scenario.costs(chosen), 8, price=0.91, cap=3)
    assert bamboo.counts == {"failovers": 1}
    assert bamboo.samples == pytest.approx(100 * 264 / 4.2 + 80 * 264 / 4.2 / 1.5)


def test_cli_prints_the_projection_with_every_source(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--scenario", "gpt2-p3"]) == 0
    out = capsys.readouterr().out
    scenario = load_scenario("gpt2-p3")
    for p in scenario.parameters.values():
        assert re.search(rf"^{p.name}\s+.*{re.escape(p.source)}$", out, re.MULTILINE), p.name
    assert "SWEPT 60, 180, 600" in out and "PROJECTION - NOT MEASURED" in out
    last = out.splitlines()[-1]
    match = re.fullmatch(r"projection=gpt2-p3 rows=18 vs_checkpoint_restart=(\d+\.\d\d)\.\.(\d+\.\d\d) "
                         r"vs_on_demand_value=(\d+\.\d\d)\.\.(\d+\.\d\d) \(PROJECTION, not measured\)", last)
    assert match is not None, last
    assert float(match[1]) <= float(match[2]) and not math.isinf(float(match[2]))


def test_cli_never_mixes_a_scenario_with_measured_costs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--scenario", "gpt2-p3", "--costs", "benchmarks/results/bamboo_preemption.json", "--validate"])
    assert exit_info.value.code == 2
    message = ("--scenario gives every cost and price itself (a projection is never mixed with measured "
               "costs); drop --costs --validate")
    assert message in capsys.readouterr().err
    assert main(["--scenario", "no-such"]) == 2
    assert "error: scenario 'no-such' is neither a file nor a shipped scenario (bert-p3, gpt2-p3)" in \
        capsys.readouterr().err


def _drop_source(data: dict) -> None:  # type: ignore[type-arg]
    del data["parameters"]["failover_s"]["source"]


def _bad_kind(data: dict) -> None:  # type: ignore[type-arg]
    data["parameters"]["failover_s"]["source"] = "a guess"


def _unknown_without_sweep(data: dict) -> None:  # type: ignore[type-arg]
    del data["parameters"]["restart_s"]["sweep"]


def _unknown_with_value(data: dict) -> None:  # type: ignore[type-arg]
    data["parameters"]["restart_s"]["value"] = 60


def _missing(data: dict) -> None:  # type: ignore[type-arg]
    del data["parameters"]["rejoin_s"]


def _typo(data: dict) -> None:  # type: ignore[type-arg]
    data["parameters"]["restart_sec"] = {"value": 1, "source": "configuration: x"}


def _swept_known(data: dict) -> None:  # type: ignore[type-arg]
    data["parameters"]["failover_s"]["sweep"] = [1, 2]


def _bad_layout(data: dict) -> None:  # type: ignore[type-arg]
    data["parameters"]["bamboo_step_s"]["value"] = {"4x1": 2.0}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_drop_source, "parameters.failover_s has no source (expected 'unknown' or one of ('measured here:', "
                       "'published:', 'configuration:'))"),
        (_bad_kind, "parameters.failover_s.source must be 'unknown' or start with one of"),
        (_unknown_without_sweep, "parameters.restart_s is unknown: sweep must be a non-empty list of"),
        (_unknown_with_value, "parameters.restart_s is unknown: give no value, sweep the candidates instead"),
        (_missing, "parameters missing ['rejoin_s'] (each needs a value and a source)"),
        (_typo, "unexpected parameters ['restart_sec']"),
        (_swept_known, "parameters.failover_s has a source, so a value: only an unknown parameter is swept"),
        (_bad_layout, "parameters.bamboo_step_s layout '4x1' must be '8x<pipelines>' (stages = 8)"),
    ],
)
def test_a_bad_scenario_file_is_refused_naming_the_file_and_key(tmp_path: Path, edit, message: str) -> None:  # type: ignore[no-untyped-def]
    path = edited(tmp_path, edit)
    with pytest.raises(ScenarioError, match=re.escape(f"{path}: {message}")):
        load_scenario(path)


def test_a_scenario_that_is_not_yaml_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: [unclosed\n")
    with pytest.raises(ScenarioError, match=re.escape(f"{path}: not valid YAML")):
        load_scenario(path)
    assert main(["--scenario", str(path)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {path}: not valid YAML")


def test_python_m_lightning_bamboo_replay_is_the_same_command(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The name the issues use, ``python -m lightning_bamboo.replay``, runs the replay's own command."""
    import runpy

    assert main(["--scenario", "gpt2-p3"]) == 0
    expected = capsys.readouterr().out
    monkeypatch.setattr("sys.argv", ["lightning_bamboo.replay", "--scenario", "gpt2-p3"])
    with pytest.raises(SystemExit) as stopped:
        runpy.run_module("lightning_bamboo.replay", run_name="__main__")
    assert stopped.value.code == 0
    assert capsys.readouterr().out == expected
