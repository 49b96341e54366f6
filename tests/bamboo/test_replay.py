"""The spot-trace replay: both trace formats (and malformed lines), the cost model worked out by hand on a
small fixture, the validation against the live segment, and the CLI."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from lightning_bamboo.simulate import (
    Prices,
    TraceFormatError,
    load_costs,
    parse_events,
    parse_trace,
    replay,
    validate,
)
from lightning_bamboo.simulate.__main__ import main
from lightning_bamboo.simulate.model import simulate_bamboo, simulate_checkpoint_restart, young_daly_interval
from tests.process import REPO

FIXTURE = Path(__file__).parent / "data" / "bamboo_preemption_fixture.json"
TRACES = REPO / "data" / "spot-traces"


def test_aws_traces_parse() -> None:
    p3 = parse_trace(TRACES / "aws-p3-trace.csv")
    assert len(p3.events) == 344 and p3.duration_s == 40920.0
    assert p3.removal_groups() == 79
    assert p3.events[0].kind == "add" and p3.events[0].node == "node1" and p3.events[0].t_s == 0.0
    g4dn = parse_trace(TRACES / "aws-g4dn-trace.csv")
    assert len(g4dn.events) == 153 and g4dn.removal_groups() == 48


def test_gce_count_samples_become_events(tmp_path: Path) -> None:
    path = tmp_path / "gce.csv"
    path.write_text(
        "2019-05-01, 10:00:00, 3\n# comment\n\n2019-05-01, 10:00:30, 1\n2019-05-01, 10:01:00, 2\n"
    )
    trace = parse_trace(path)
    assert [(e.t_s, e.kind, e.node) for e in trace.events] == [
        (0.0, "add", "gce-1"), (0.0, "add", "gce-2"), (0.0, "add", "gce-3"),
        (30.0, "remove", "gce-3"), (30.0, "remove", "gce-2"), (60.0, "add", "gce-4"),
    ]
    assert trace.duration_s == 60.0
    assert trace.mean_nodes() == pytest.approx((3 * 30 + 1 * 30) / 60)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0,add,node1\n5,add,node2\n7,reboot,node1\n",
         ":3: expected 'time_ms,add|remove,node' (AWS trace line), got '7,reboot,node1'"),
        ("0,add,node1\n5,remove,node2\n", ":2: expected a remove of an alive node (node2 is not alive)"),
        ("0,add,node1\n5,add,node1\n", ":2: expected an add of a node that is not alive (node1 already is)"),
        ("2019-05-01, 10:00:00, 3\n2019-05-01 10:00:30 1\n",
         ":2: expected 'YYYY-MM-DD, HH:MM:SS, count' (GCE count sample), got '2019-05-01 10:00:30 1'"),
        ("2019-05-01, 10:00:00, 3\n2019-02-30, 10:00:30, 1\n", ":2: expected a valid date and time"),
    ],
)
def test_malformed_lines_name_the_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "trace.csv"
    path.write_text(text)
    with pytest.raises(TraceFormatError, match=re.escape(f"{path}{message}")):
        parse_trace(path)


def test_missing_trace_and_costs_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"trace file .*nope\.csv' does not exist"):
        parse_trace(tmp_path / "nope.csv")
    message = (f"costs file '{tmp_path / 'x.json'}' does not exist; produce it with the live benchmark: "
               "python benchmarks/bamboo_preemption.py --out benchmarks/results/bamboo_preemption.json")
    with pytest.raises(FileNotFoundError, match=re.escape(message)):
        load_costs(tmp_path / "x.json")


def test_costs_file_is_checked(tmp_path: Path) -> None:
    data = json.loads(FIXTURE.read_text())
    del data["costs"]["restart_s"]
    (tmp_path / "a.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=re.escape("missing key costs.'restart_s'")):
        load_costs(tmp_path / "a.json")
    data = json.loads(FIXTURE.read_text())
    data["costs"]["failover_s"] = -1
    (tmp_path / "b.json").write_text(json.dumps(data))
    message = "costs.failover_s must be a number of seconds >= 0, got -1"
    with pytest.raises(ValueError, match=re.escape(message)):
        load_costs(tmp_path / "b.json")
    data = json.loads(FIXTURE.read_text())
    data["costs"]["relaunch_s_by_layout"]["2x1"] = "slow"
    (tmp_path / "c.json").write_text(json.dumps(data))
    message = "costs.relaunch_s_by_layout['2x1'] must be a number of seconds >= 0, got 'slow'"
    with pytest.raises(ValueError, match=re.escape(message)):
        load_costs(tmp_path / "c.json")


def fixture_trace(duration_s: float = 40.0):  # type: ignore[no-untyped-def]
    costs = load_costs(FIXTURE)
    return parse_events(costs.raw["events"], duration_s), costs


def test_bamboo_model_by_hand() -> None:
    """4 nodes (2x2, 64 samples/s); node4 lost at 10 s: failover 1.5 s + its warm-up 0.5 s, then 2x1 (32/s);
    node5 joins at 20 s: rejoin 2.5 s + warm-up 0.5 s, then 2x2 again. 10*64 + 8*32 + 17*64 = 1984 samples
    in 40 s."""
    trace, costs = fixture_trace()
    result = simulate_bamboo(trace, costs, 2, price=0.91, cap=2)
    assert result.samples == pytest.approx(1984.0)
    assert result.counts == {"failovers": 1, "rejoins": 1}
    assert result.node_seconds == pytest.approx(10 * 4 + 10 * 3 + 20 * 4)
    assert result.dollars_per_hour == pytest.approx(3.75 * 0.91)


def test_checkpoint_restart_model_by_hand() -> None:
    """Checkpoint every 8 s of training (1 s each): 8 s (512), checkpoint, 1 s (576); the loss at 10 s rolls
    back to 512 and restarts: kill 0.5 s + relaunch at 2x1 3.5 s + its warm-up 1 s = 5 s; 5 s at 32/s (672);
    the join at 20 s drains (1 s: boundary, checkpoint, exit) and relaunches at 2x2 (4.5 s + warm-up 0.5 s):
    6 s; 8 s at 64/s (1184), checkpoint, 5 s (1504)."""
    trace, costs = fixture_trace()
    result = simulate_checkpoint_restart(trace, costs, 2, price=0.91, cap=2, checkpoint_interval_s=8.0)
    assert result.samples == pytest.approx(1504.0)
    assert result.counts == {"checkpoints": 2, "restarts": 2}


def test_a_grow_during_a_relaunch_kills_it_instead_of_draining(tmp_path: Path) -> None:
    """As the benchmark's checkpoint-restart: a launch that has not trained yet is stopped at once (the
    ``kill`` stop, not the drain). Checkpoint every 8 s: 8 s (512), checkpoint, 1 s (576); node4 lost at
    10 s: back to 512, restart until 15 s (0.5 + 3.5 + 1); node5 added at 12 s, the 2x1 launch still
    starting: kill 0.5 + relaunch at 2x2 4.5 + warm-up 0.5 = 5.5 s from 12 s; 17.5-20 s at 64/s: 672."""
    trace_path = tmp_path / "t.csv"
    trace_path.write_text("0,add,a\n0,add,b\n0,add,c\n0,add,d\n10000,remove,d\n12000,add,e\n")
    costs = load_costs(FIXTURE)
    trace = parse_trace(trace_path, duration_s=20.0)
    result = simulate_checkpoint_restart(trace, costs, 2, price=0.91, cap=2, checkpoint_interval_s=8.0)
    assert result.counts == {"checkpoints": 1, "restarts": 2}
    assert result.samples == pytest.approx(512 + 2.5 * 64)


def test_restart_parts_are_the_measured_ones() -> None:
    costs = load_costs(FIXTURE)
    assert costs.restart_parts("kill", 2, 1) == (0.5, 3.5, 1.0)
    assert costs.restart_parts("drain", 2, 2) == (1.0, 4.5, 0.5)
    assert costs.restart_parts(None, 2, 16) == (0.0, 4.5, 0.5)  # wider than measured: the widest measured
    with pytest.raises(KeyError, match=re.escape("no measured restart stop of kind 'preempt'")):
        costs.restart_parts("preempt", 2, 2)
    with pytest.raises(KeyError, match=re.escape("costs.relaunch_s_by_layout has no layout with 4 stages")):
        costs.restart_parts("kill", 4, 1)


def test_schema_1_files_are_refused(tmp_path: Path) -> None:
    data = json.loads(FIXTURE.read_text())
    data["schema"] = 1
    (tmp_path / "old.json").write_text(json.dumps(data))
    message = (f"{tmp_path / 'old.json'}: schema must be 2 (per-restart costs: stop, relaunch, warm-up), "
               "got 1; re-measure with the live benchmark: python benchmarks/bamboo_preemption.py")
    with pytest.raises(ValueError, match=re.escape(message)):
        load_costs(tmp_path / "old.json")


def test_young_daly_interval_uses_the_trace_mtbf() -> None:
    trace, costs = fixture_trace()
    result = simulate_checkpoint_restart(trace, costs, 2, price=0.91, cap=2)
    assert result.checkpoint_interval_s == pytest.approx(math.sqrt(2 * 1.0 * 40.0 / 1))
    assert young_daly_interval(30.0, 3600.0) == pytest.approx(math.sqrt(2 * 30 * 3600))


def test_adjacent_stages_lost_together_drop_the_pipeline(tmp_path: Path) -> None:
    """As the runtime's ownership rules: a pipeline that loses both its positions is dropped (a failover, the
    other pipeline runs on); when no pipeline is left, the survivors fall back to the checkpoint."""
    trace_path = tmp_path / "t.csv"
    trace_path.write_text("0,add,a\n0,add,b\n0,add,c\n0,add,d\n10000,remove,a\n10000,remove,b\n")
    costs = load_costs(FIXTURE)
    result = simulate_bamboo(parse_trace(trace_path, duration_s=20.0), costs, 2, price=0.91, cap=2)
    assert result.counts == {"failovers": 1}
    assert result.samples == pytest.approx(10 * 64 + 8 * 32)  # failover 2 s, then 2x1


def test_no_pipeline_left_falls_back(tmp_path: Path) -> None:
    trace_path = tmp_path / "t.csv"
    trace_path.write_text("0,add,a\n0,add,b\n0,add,c\n10000,remove,a\n10000,remove,b\n")
    costs = load_costs(FIXTURE)
    result = simulate_bamboo(parse_trace(trace_path, duration_s=20.0), costs, 2, price=0.91, cap=2)
    assert result.counts == {"fallbacks": 1}
    # no checkpoint was ever taken: everything before the fallback is lost; restart 5 s; then the spare c
    # runs both stages alone (1x1, 16/s) for 5 s
    assert result.samples == pytest.approx(5 * 16)


def test_without_rejoin_new_nodes_stay_spares(tmp_path: Path) -> None:
    data = json.loads(FIXTURE.read_text())
    data["costs"]["rejoin_s"] = None
    (tmp_path / "c.json").write_text(json.dumps(data))
    costs = load_costs(tmp_path / "c.json")
    result = simulate_bamboo(parse_events(costs.raw["events"], 40.0), costs, 2, price=0.91, cap=2)
    assert result.counts == {"failovers": 1}
    assert result.samples == pytest.approx(10 * 64 + 28 * 32)  # 2+1 (the fused pipeline) to the end


def test_validation_against_the_fixture_live_numbers() -> None:
    v = validate(load_costs(FIXTURE))
    assert v.predicted == pytest.approx({"bamboo": 49.6, "checkpoint_restart": 37.6})
    assert v.errors["bamboo"] == pytest.approx(1.6 / 48.0)
    assert v.sim_error == pytest.approx(1.6 / 48.0)


def test_replay_compares_the_three_systems() -> None:
    trace, costs = fixture_trace()
    comparison = replay(trace, costs, prices=Prices(spot=1.0, on_demand=3.0), max_pipelines=2)
    assert comparison.on_demand.samples_per_s == pytest.approx(64.0)  # 4 nodes (mean 3.75 -> 2 pipelines)
    assert comparison.on_demand.dollars_per_hour == pytest.approx(12.0)
    assert comparison.vs_checkpoint_restart == pytest.approx(
        comparison.bamboo.samples_per_s / comparison.checkpoint_restart.samples_per_s)
    assert comparison.vs_on_demand_value == pytest.approx(
        (1984 / (150 / 3600 * 1.0)) / (64 * 40 / (160 / 3600 * 3.0)))


def test_cli_prints_the_comparison_and_saves_the_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot = tmp_path / "p3.png"
    trace = str(TRACES / "aws-p3-trace.csv")
    code = main([trace, "--costs", str(FIXTURE), "--plot", str(plot), "--validate"])
    out = capsys.readouterr().out
    assert code == 0
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "validation bamboo: predicted 49.600 samples/s, live 48.000, error 0.033" in out
    assert re.fullmatch(r"vs_checkpoint_restart=\d+\.\d\d vs_on_demand_value=\d+\.\d\d", out.splitlines()[-1])
    assert main([str(TRACES / "aws-p3-trace.csv"), "--costs", str(tmp_path / "none.json")]) == 2
    assert "does not exist; produce it with the live benchmark" in capsys.readouterr().err


def test_unmeasured_stage_count_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(TRACES / "aws-p3-trace.csv"), "--costs", str(FIXTURE), "--stages", "4"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: no measured step time for a layout with 4 stages (for 4x4, stages x pipelines); "
        "measured layouts: ['1x1', '2x1', '2x2'] (choose --stages among them)"
    )


def _with_recovery_costs(tmp_path: Path) -> Path:
    """The fixture with the other two modes' steps: ``recovery="replica"`` 0.45 s at 2x2 (the replica kept
    current without its forwards), ``"peers"`` (no replica: checkpoint-restart's step) 0.4 s, and a peers
    failover of 2 s."""
    data = json.loads(FIXTURE.read_text())
    data["costs"]["replica_step_s_by_layout"] = {"2x2": 0.45, "2x1": 0.9}
    data["costs"]["checkpoint_restart_step_s_by_layout"] = {"2x2": 0.4, "2x1": 0.8}
    data["costs"]["peers_failover_s"] = 2.0
    path = tmp_path / "modes.json"
    path.write_text(json.dumps(data))
    return path


def test_each_recovery_mode_by_hand(tmp_path: Path) -> None:
    """The fixture's trace (2x2 at 32 samples a step; node4 lost at 10 s, node5 joins at 20 s) under each
    mode: its full layout's rate, the degraded map (one pipeline fused, FR's 32/s) scaled by the same
    speed-up, and its failover's pause (+ the 0.5 s warm-up); the rejoin pauses 3 s in every mode."""
    costs = load_costs(_with_recovery_costs(tmp_path))
    trace, _ = fixture_trace()
    samples = {mode: simulate_bamboo(trace, costs, 2, price=0.91, cap=2, recovery=mode).samples
               for mode in ("replica+forward", "replica", "peers")}
    full, degraded = 32 / 0.45, 32 * 0.5 / 0.45
    assert samples == pytest.approx({
        "replica+forward": 10 * 64 + 8 * 32 + 17 * 64,
        "replica": 10 * full + 8 * degraded + 17 * full,
        "peers": 10 * 80 + 7.5 * 40 + 17 * 80,  # failover 2 + 0.5 s: degraded from 12.5 s
    })


def test_peers_fall_back_where_only_a_replica_covers(tmp_path: Path) -> None:
    """Without a replica a stage is recovered only from another pipeline: the same stage lost in both
    pipelines at once, and any loss of a one-pipeline job, fall back to the checkpoint under ``"peers"``
    where the replica modes fail over."""
    costs = load_costs(_with_recovery_costs(tmp_path))
    same_stage = tmp_path / "same.csv"  # members 1 and 3: stage 1 of both pipelines
    same_stage.write_text("0,add,a\n0,add,b\n0,add,c\n0,add,d\n10000,remove,b\n10000,remove,d\n")
    one_pipeline = tmp_path / "one.csv"
    one_pipeline.write_text("0,add,a\n0,add,b\n10000,remove,b\n")
    for path, cap in ((same_stage, 2), (one_pipeline, 1)):
        trace = parse_trace(path, duration_s=20.0)
        kinds = {"replica": "failovers", "replica+forward": "failovers", "peers": "fallbacks"}
        for mode, kind in kinds.items():
            result = simulate_bamboo(trace, costs, 2, price=0.91, cap=cap, recovery=mode)
            assert result.counts == {kind: 1}, (path.name, mode)
    with pytest.raises(ValueError, match="recovery must be one of 'replica', 'replica\\+forward', 'peers'"):
        costs.recovery_steps("none")


def test_costs_measured_under_another_mode_price_that_mode_and_say_what_they_lack(tmp_path: Path) -> None:
    """A costs file names the mode Bamboo ran (``recovery``): its ``step_s_by_layout`` is that mode's, the
    replay prices it by default, and a mode the file did not measure is an error naming it and the command
    that measures it (not a step silently borrowed from another mode)."""
    data = json.loads(FIXTURE.read_text())
    data["recovery"] = "replica"
    path = tmp_path / "replica.json"
    path.write_text(json.dumps(data))
    costs = load_costs(path)
    trace, fr = fixture_trace()  # the same numbers, read as replica+forward's (a file that does not say)
    assert (costs.recovery, fr.recovery) == ("replica", "replica+forward")
    assert costs.recovery_steps("replica") == fr.recovery_steps("replica+forward")
    assert simulate_bamboo(trace, costs, 2, price=0.91, cap=2).samples == pytest.approx(
        simulate_bamboo(trace, fr, 2, price=0.91, cap=2).samples)
    with pytest.raises(KeyError, match=r"no failure-free step under recovery='replica\+forward' \(they were "
                                        r"measured under recovery='replica'\); measure it: python benchmarks/"
                                        r"bamboo_preemption.py --recovery replica\+forward"):
        simulate_bamboo(trace, costs, 2, price=0.91, cap=2, recovery="replica+forward")
    data["recovery"] = "fr"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"replica.json: recovery must be one of 'replica', "
                                         r"'replica\+forward', 'peers', got 'fr'"):
        load_costs(path)
