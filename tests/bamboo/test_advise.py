"""The preflight advisor (lightning_bamboo.advise): the probe's measurements of a run's own steps and the
costs file it writes, every candidate replayed with the measured costs, the most samples per dollar
recommended, the validation's sim_error, and its last line; end to end on the GPT recipe."""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import hydra
import pytest
import torch
from omegaconf import OmegaConf

from lightning_bamboo.advise import AdvisorProbe, advise, costs_file
from lightning_bamboo.advise.__main__ import main
from lightning_bamboo.advise.costs_file import RankReport, Run
from lightning_bamboo.advise.timing import median_of_means, optimizer_state_bytes, step_parts
from lightning_bamboo.simulate import Prices, load_costs, parse_trace, validate
from lightning_bamboo.simulate.model import young_daly_interval
from tests.bamboo.launch_record import NAME, Record, record_env
from tests.process import DATA, REPO, run_process, run_ranks

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
        "bamboo:stages=2:recovery=replica+forward",
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


def test_every_priced_recovery_mode_is_a_candidate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Costs that measured the step of ``recovery="replica"`` and of a run without a replica make each mode
    a candidate of its own; the fixture's trace loses one stage of one pipeline, which every mode covers,
    so the cheapest failure-free step (peers) trains the most and is recommended."""
    data = json.loads(FIXTURE.read_text())
    data["costs"]["replica_step_s_by_layout"] = {"2x2": 0.45}
    data["costs"]["checkpoint_restart_step_s_by_layout"] = {"2x2": 0.4, "2x1": 0.8}
    (tmp_path / "modes.json").write_text(json.dumps(data))
    costs = load_costs(tmp_path / "modes.json")
    advice = advise(parse_trace(trace_file(tmp_path)), costs, Prices(spot=1.0, on_demand=3.0), 1.0, 2)
    bamboo = {c.recovery: c.result.samples_per_s for c in advice.candidates if c.name.startswith("bamboo")}
    assert list(bamboo) == ["replica", "replica+forward", "peers"]
    assert bamboo["peers"] > bamboo["replica"] > bamboo["replica+forward"]
    assert advice.recommended.name == "bamboo:stages=2:recovery=peers"
    command = ["--costs", str(tmp_path / "modes.json"), "--trace", str(trace_file(tmp_path)),
               "--compression", "1", "--max-pipelines", "2"]
    (tmp_path / "no_medians.json").write_text(json.dumps({"modes": {}}))
    assert main([*command, "--modes", str(tmp_path / "no_medians.json")]) == 0
    out = capsys.readouterr().out
    assert "WARNING: recovery='peers' failovers PRICED AS THE REPLICA'S" in out  # assumed, and said so
    assert out.splitlines()[-1].startswith("advice=bamboo:stages=2:recovery=peers ")
    # the recovery modes benchmark's medians price it instead: the reference's failover x their ratio
    bench = {"modes": {"peers": {"failover_median_s": 0.6}, "replica+forward": {"failover_median_s": 0.8}}}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    assert main([*command, "--modes", str(tmp_path / "bench.json")]) == 0
    out = capsys.readouterr().out
    assert "PRICED AS THE REPLICA'S" not in out
    assert f"peers_failover_s {costs.failover_s * 0.75:.3f} s: reference: failover_s x 0.750" in out
    assert main([*command, "--modes", str(tmp_path / "none.json")]) == 2
    assert "--modes" in capsys.readouterr().err


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


# ---------------------------------------------------------------------------------------------- the probe
def test_step_parts_split_the_engine_trace_into_compute_replica_forward_and_waiting() -> None:
    trace = [("wait A0", 0.0, 0.5), ("F1,0", 0.0, 1.0), ("FR0,0", 1.0, 1.25), ("wait G0", 1.25, 1.5),
             ("B1,0", 1.25, 2.0), ("finish", 2.0, 2.125), ("allreduce+loss", 2.125, 2.5)]
    parts = step_parts(trace)
    # F and B take 1.0 + 0.75 s, of which 0.5 + 0.25 s blocked on a receive: 1.0 s of compute
    assert (parts.compute_s, parts.fr_s, parts.wait_s, parts.allreduce_s) == (1.0, 0.25, 0.875, 0.375)


def test_state_bytes_are_the_parameters_and_the_optimizer_state_the_rank_trains() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2, dtype=torch.float64))
    optimizer = torch.optim.AdamW(model.parameters())
    assert optimizer_state_bytes([optimizer]) == (16 + 10, 16 * 4 + 10 * 8, 0)  # no state before a step
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    # AdamW: exp_avg and exp_avg_sq like each parameter, and a float32 step counter per parameter tensor
    assert optimizer_state_bytes([optimizer]) == (26, 144, 2 * 144 + 4 * 4)


def run_of(redundancy: bool, layout: tuple[int, int] = (2, 1), **probe: int) -> Run:
    settings = {"warmup_steps": 3, "steps": 10, **probe}
    return Run(model="m", num_stages=layout[0], pipelines=layout[1], num_microbatches=4,
               redundancy=redundancy, samples_per_step=16.0, checkpoint_bytes=1000, **settings)


def rank(stage: int, step_s: float, fr_s: float, without_fr_s: float = 0.0) -> RankReport:
    return RankReport(stage=stage, pipeline=0, step_s=step_s, compute_s=0.02, fr_s=fr_s, wait_s=0.01,
                      allreduce_s=0.005, parameters=10, parameter_bytes=40, optimizer_bytes=120,
                      replica_bytes=40, startup_s=2.0, first_step_s=0.3, checkpoint_s=0.05 * (stage + 1),
                      without_fr_s=without_fr_s)


def test_costs_file_is_the_replays_format_with_every_costs_source(tmp_path: Path) -> None:
    data = costs_file.build(run_of(True), [rank(0, 0.1, 0.01), rank(1, 0.1, 0.02)], load_costs(FIXTURE),
                            "ref.json")
    (tmp_path / "c.json").write_text(json.dumps(data))
    costs = load_costs(tmp_path / "c.json")  # the replay's own reader accepts it
    assert costs.step_s_by_layout == {"2x1": pytest.approx(0.1)}
    # without redundancy: less the smallest per-stage FR time (estimated, and said so)
    assert costs.cr_step_s_by_layout == {"2x1": pytest.approx(0.09)}
    assert data["sources"]["checkpoint_restart_step_s_by_layout[2x1]"].startswith("estimated")
    assert costs.checkpoint_s == pytest.approx(0.1)  # the slowest rank's save
    # relaunch: start-up + restore (priced as the save) + the first step's excess over a steady one
    assert costs.relaunch_s_by_layout == {"2x1": pytest.approx(2.0 + 0.1 + 0.2)}
    reference = load_costs(FIXTURE)
    assert costs.failover_s == reference.failover_s and data["sources"]["failover_s"] == "reference: ref.json"
    assert set(data["sources"]) >= {"step_s", "checkpoint_s", "failover_s", "rejoin_s", "restart_s"}
    assert [s["bubble_share"] for s in data["stages"]["2x1"]] == [pytest.approx(0.1), pytest.approx(0.1)]


def test_a_peers_failover_is_priced_from_the_recovery_modes_benchmark(tmp_path: Path) -> None:
    """With the modes benchmark's results, a peers failover is the reference's failover times the ratio of
    the two modes' medians measured on the same machines, and its source says so; without them (or with a
    median missing) none is written and the advisor warns that it prices the replica's."""
    modes = {"modes": {"peers": {"failover_median_s": 0.6}, "replica+forward": {"failover_median_s": 0.8}}}
    reports = [rank(0, 0.1, 0.01), rank(1, 0.1, 0.02)]
    data = costs_file.build(run_of(True), reports, load_costs(FIXTURE), "ref.json", modes, "modes.json")
    (tmp_path / "c.json").write_text(json.dumps(data))
    costs = load_costs(tmp_path / "c.json")
    assert costs.peers_failover_s == pytest.approx(load_costs(FIXTURE).failover_s * 0.75)
    assert data["sources"]["peers_failover_s"].startswith("reference: failover_s x 0.750, the peers / ")
    assert "modes.json" in data["sources"]["peers_failover_s"]
    for broken in ({}, {"modes": {"peers": {"failover_median_s": float("nan")},
                                  "replica+forward": {"failover_median_s": 0.8}}}):
        data = costs_file.build(run_of(True), reports, load_costs(FIXTURE), "ref.json", broken, "m.json")
        assert "peers_failover_s" not in data["costs"]


def test_the_probes_modes_reference_must_exist_when_named(tmp_path: Path) -> None:
    probe = AdvisorProbe(tmp_path / "c.json", modes_reference=tmp_path / "none.json")
    strategy = SimpleNamespace(num_stages=2, redundancy=True)
    with pytest.raises(FileNotFoundError, match=r"AdvisorProbe\(modes_reference=...\): .*none.json"):
        probe.setup(SimpleNamespace(strategy=strategy), None, "fit")  # type: ignore[arg-type]


def test_steps_measured_with_fr_switched_off_are_the_step_without_redundancy(tmp_path: Path) -> None:
    run = run_of(True, warmup_steps=2, steps=5, block_steps=2, without_fr_steps=5)
    data = costs_file.build(run, [rank(0, 0.1, 0.01, 0.07), rank(1, 0.1, 0.02, 0.08)], load_costs(FIXTURE),
                            "ref.json")
    (tmp_path / "c.json").write_text(json.dumps(data))
    costs = load_costs(tmp_path / "c.json")
    assert costs.step_s_by_layout == {"2x1": pytest.approx(0.1)}
    assert costs.cr_step_s_by_layout == {"2x1": pytest.approx(0.075)}  # the mean over ranks, not estimated
    assert costs.replica_step_s_by_layout == {"2x1": pytest.approx(0.075)}  # recovery="replica"'s own step
    source = data["sources"]["checkpoint_restart_step_s_by_layout[2x1]"]
    # blocks of 2 in turn: with FR (3-4, 9-10, 15), without (5-6, 11-12, 17), validation (7-8, 13-14, 16)
    assert source.startswith("measured with FR switched off: 5 of steps 5-17 (one block in 3 of 2) of this")
    assert data["sources"]["step_s_by_layout[2x1]"].startswith("measured: 5 of steps 3-15 (one block in 3")
    # a run without redundancy measures that step more directly (no replica at all): it is kept, either order
    off = costs_file.build(run_of(False), [rank(0, 0.06, 0.0), rank(1, 0.06, 0.0)], load_costs(FIXTURE), "r")
    for merged in (costs_file.merge(off, data), costs_file.merge(data, off)):
        assert merged["costs"]["checkpoint_restart_step_s_by_layout"] == {"2x1": pytest.approx(0.06)}
        assert merged["costs"]["step_s_by_layout"] == {"2x1": pytest.approx(0.1)}
        assert merged["costs"]["replica_step_s_by_layout"] == {"2x1": pytest.approx(0.075)}  # three modes
    estimated = costs_file.build(run_of(True), [rank(0, 0.1, 0.01), rank(1, 0.1, 0.02)], load_costs(FIXTURE),
                                 "r")
    merged = costs_file.merge(data, estimated)  # and the measured one is kept over a later estimate
    assert merged["costs"]["checkpoint_restart_step_s_by_layout"] == {"2x1": pytest.approx(0.075)}


def test_a_measured_step_is_kept_when_the_other_run_only_estimates_it() -> None:
    ref = load_costs(FIXTURE)
    on = costs_file.build(run_of(True), [rank(0, 0.1, 0.01), rank(1, 0.1, 0.02)], ref, "ref")
    off = costs_file.build(run_of(False), [rank(0, 0.08, 0.0), rank(1, 0.08, 0.0)], ref, "ref")
    merged = costs_file.merge(off, on)  # the redundant run comes second: its estimate does not win
    assert merged["costs"]["step_s_by_layout"] == {"2x1": 0.1}
    assert merged["costs"]["checkpoint_restart_step_s_by_layout"] == {"2x1": 0.08}
    assert merged["sources"]["checkpoint_restart_step_s_by_layout[2x1]"].startswith("measured")
    wider = costs_file.build(run_of(True, (2, 2)), [rank(0, 0.2, 0.01), rank(1, 0.2, 0.02)], ref, "ref")
    assert sorted(costs_file.merge(merged, wider)["costs"]["step_s_by_layout"]) == ["2x1", "2x2"]
    other_job = json.loads(json.dumps(on))
    other_job["fingerprint"]["model"] = "another model"
    assert costs_file.merge(other_job, off) == off  # another job's file is replaced, never mixed in


def test_validation_replays_the_probes_window_with_its_checkpoints(tmp_path: Path) -> None:
    data = costs_file.build(run_of(True), [rank(0, 0.1, 0.01), rank(1, 0.1, 0.01)], load_costs(FIXTURE), "r")
    # 10 s of steps of 0.1 s, a checkpoint (0.1 s, the slowest rank's) after every 5 steps: 16 cycles of
    # 0.6 s, then 4 more steps: (16 * 5 + 4) * 16 samples in 10 s
    data["live"] = {"bamboo": {"layout": "2x1", "wall_s": 10.0, "samples_per_s": 130.0, "events": [],
                               "initial_nodes": ["rank0", "rank1"], "checkpoint_interval_s": 0.5}}
    (tmp_path / "c.json").write_text(json.dumps(data))
    check = validate(load_costs(tmp_path / "c.json"))
    assert check.predicted == {"bamboo": pytest.approx(84 * 16 / 10.0)}
    assert check.sim_error == pytest.approx(abs(134.4 - 130.0) / 130.0)


def test_measured_and_validation_steps_alternate_in_blocks_until_the_measurement_is_done() -> None:
    probe = AdvisorProbe(reference=FIXTURE, steps=5, warmup_steps=2, block_steps=2)
    # by default, a block of steps with FR switched off follows each measured one
    assert [probe._role(done) for done in range(1, 20)] == (
        ["warmup"] * 2 + ["measure"] * 2 + ["without_fr"] * 2 + ["validate"] * 2
        + ["measure"] * 2 + ["without_fr"] * 2 + ["validate"] * 2
        + ["measure"] + ["validate"] + ["without_fr"] + ["validate"] * 2)
    probe = AdvisorProbe(reference=FIXTURE, steps=5, warmup_steps=2, block_steps=2, measure_without_fr=False)
    assert [probe._role(done) for done in range(1, 16)] == (
        ["warmup"] * 2 + ["measure"] * 2 + ["validate"] * 2 + ["measure"] * 2 + ["validate"] * 2
        + ["measure"] + ["validate"] * 4)
    label = run_of(True, warmup_steps=2, steps=5, block_steps=2).measured_steps
    assert label == "5 of steps 3-11 (alternate blocks of 2)"  # the steps measured above
    contiguous = AdvisorProbe(reference=FIXTURE, steps=3, warmup_steps=1)
    assert [contiguous._role(done) for done in range(1, 10)] == \
        ["warmup"] + ["measure"] * 3 + ["without_fr"] * 3 + ["validate"] * 2


def test_probe_arguments_and_its_strategy_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=re.escape("AdvisorProbe(steps=...) must be an integer >= 1, got 0")):
        AdvisorProbe(steps=0)
    with pytest.raises(ValueError, match=re.escape("AdvisorProbe(checkpoint_every=...) must be None or an")):
        AdvisorProbe(checkpoint_every=0)
    with pytest.raises(ValueError, match=re.escape("AdvisorProbe measures a Bamboo pipeline: "
                                                   "Trainer(strategy='bamboo'), got SimpleNamespace")):
        AdvisorProbe(reference=FIXTURE).setup(SimpleNamespace(strategy=SimpleNamespace()), None, "fit")
    with pytest.raises(ValueError, match=re.escape("AdvisorProbe(measure_without_fr=...) must be True or")):
        AdvisorProbe(measure_without_fr=1)
    bamboo = SimpleNamespace(num_stages=2, redundancy=True)
    missing = r"AdvisorProbe\(reference=...\): '.*none.json' does not exist"
    with pytest.raises(FileNotFoundError, match=missing):
        AdvisorProbe(reference=tmp_path / "none.json").setup(SimpleNamespace(strategy=bamboo), None, "fit")


GPT_TINY = REPO / "recipes" / "conf" / "model" / "gpt_tiny.yaml"
PROBE_STEPS, WARMUP, EVERY, BLOCK = 20, 3, 6, 1
WINDOW = PROBE_STEPS - BLOCK  # the validation blocks up to the last measured step


@pytest.mark.slow
@pytest.mark.multiprocess
def test_probe_on_the_gpt_recipe_writes_sane_costs_and_the_advisor_validates_against_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The GPT recipe (2 stages, FR on: recovery="replica+forward") with the probe, two ranks started as
    torchrun would; then the advisor on its costs file and the shipped p3 trace. Measured steps, steps with
    the replica forwards switched off and validation steps take turns step by step, so that all see the
    shared machine's load alike; the window's last of 3 checkpoints is one step before its end."""
    costs_path = tmp_path / "costs.json"
    out = tmp_path / "run"
    run_ranks([sys.executable, "-m", "recipes.train", "experiment=bamboo_gpt",
               "strategy.recovery=replica+forward",
               f"trainer.max_steps={WARMUP + 2 * PROBE_STEPS + WINDOW + 2}", "trainer.limit_val_batches=0",
               "trainer.logger=false", "trainer.enable_checkpointing=false", f"hydra.run.dir={out}",
               "+trainer.callbacks.advisor._target_=lightning_bamboo.advise.AdvisorProbe",
               f"+trainer.callbacks.advisor.path={costs_path}",
               f"+trainer.callbacks.advisor.steps={PROBE_STEPS}",
               f"+trainer.callbacks.advisor.warmup_steps={WARMUP}",
               f"+trainer.callbacks.advisor.checkpoint_every={EVERY}",
               f"+trainer.callbacks.advisor.block_steps={BLOCK}"], 2, timeout=240)
    data = json.loads(costs_path.read_text())
    assert not (out / "advisor-probe").exists()  # the timed checkpoints were removed
    costs = load_costs(costs_path)
    assert (costs.num_stages, costs.max_pipelines, costs.samples_per_step) == (2, 1, 16.0)
    step = costs.step_s_by_layout["2x1"]
    # the step without redundancy is measured in this run, on the steps with FR switched off
    without_fr = data["probe"]["2x1"]["without_fr_step_s_each_rank0"]
    assert len(without_fr) == len(data["probe"]["2x1"]["step_s_each_rank0"]) == PROBE_STEPS
    assert data["sources"]["checkpoint_restart_step_s_by_layout[2x1]"].startswith(
        f"measured with FR switched off: {PROBE_STEPS} of steps {WARMUP + 2}-{WARMUP + 3 * PROBE_STEPS - 1} ")
    assert costs.cr_step_s_by_layout["2x1"] > 0  # the mean over ranks (rank 0's steps are listed above)
    assert costs.replica_step_s_by_layout == {"2x1": costs.cr_step_s_by_layout["2x1"]}  # recovery="replica"
    assert costs.checkpoint_s > 0 and costs.relaunch_s_by_layout["2x1"] > costs.checkpoint_s
    stages = data["stages"]["2x1"]
    assert [s["stage"] for s in stages] == [0, 1]
    for s in stages:
        assert s["step_s"] > 0 and s["compute_s"] > 0 and s["fr_s"] > 0 and 0 <= s["bubble_share"] < 1
    # bytes: each stage's parameters and AdamW state; together the whole GPT's, and each replica is the
    # successor stage's parameters (a ring of 2)
    model = hydra.utils.instantiate(OmegaConf.load(GPT_TINY))
    params = list(model.parameters())
    assert sum(s["parameters"] for s in stages) == sum(p.numel() for p in params)
    assert data["model"] == f"GPT ({sum(p.numel() for p in params)} parameters)"  # the merge key's name
    assert sum(s["parameter_bytes"] for s in stages) == sum(p.numel() * p.element_size() for p in params)
    for s in stages:
        assert s["state_bytes"] == s["parameter_bytes"] + s["optimizer_bytes"]
    assert sum(s["optimizer_bytes"] for s in stages) == 2 * sum(s["parameter_bytes"] for s in stages) + \
        4 * len(params)
    successors = [stages[1]["parameter_bytes"], stages[0]["parameter_bytes"]]
    assert [s["replica_bytes"] for s in stages] == successors
    live = data["live"]["bamboo"]
    assert live["steps"] == WINDOW and live["checkpoints"] == WINDOW // EVERY
    # the window as it ran, and as the costs are taken (a step: median of 5 means; a save: the median)
    steps, saves = live["step_s_each_rank0"], live["checkpoint_s_each"]
    assert live["wall_s_total"] == pytest.approx(sum(steps) + sum(saves))
    robust = WINDOW * median_of_means(steps) + len(saves) * statistics.median(saves)
    assert live["wall_s"] == pytest.approx(robust)
    assert live["samples_per_s"] == pytest.approx(WINDOW * 16 / live["wall_s"])
    assert data["probe"]["2x1"]["step_s_each_rank0"] and step > 0
    assert live["checkpoint_interval_s"] == pytest.approx(EVERY * step)

    assert main(["--costs", str(costs_path), "--trace", str(DATA / "spot-traces" / "aws-p3-trace.csv"),
                 "--plot", str(tmp_path / "advice.png")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert (tmp_path / "advice.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    match = re.fullmatch(r"advice=(\S+) projected_value_vs_on_demand=(\d+\.\d\d) sim_error=(\d\.\d{3})",
                         lines[-1])
    assert match is not None, "\n".join(lines)
    assert next(line for line in lines if "<- recommended" in line).startswith(f"{match[1]} ")
    assert not any("ESTIMATED" in line for line in lines), "\n".join(lines)  # nothing estimated to warn of
    # the line's sim_error is the replay of this run's window against what the window measured; its size is
    # a wall-clock comparison on a shared machine, not asserted here (figures: docs/bamboo-advise.md)
    check = validate(costs)
    assert float(match[3]) == pytest.approx(check.sim_error, abs=5e-4)
    assert check.live == {"bamboo": pytest.approx(live["samples_per_s"])}
    assert f"  bamboo: projected {check.predicted['bamboo']:.3f} samples/s, measured " in "\n".join(lines)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("fault_step", [20, 12])
def test_a_failover_ends_the_probe_and_training_goes_on(tmp_path: Path, fault_step: int) -> None:
    """The elastic GPT recipe on 2 members; member 1 is SIGKILLed at step ``fault_step``: after the measured
    steps (3 warm-up + 6 + 6 with FR switched off) the validation window ends at the failover, during them
    nothing is written (step 12: a step with FR switched off); either way the probe's collectives do not hang
    the survivor, which trains on alone to the last step."""
    costs_path = tmp_path / "costs.json"
    out = run_process([sys.executable, "-m", "lightning_bamboo.launch", "--nproc", "2", "-m", "recipes.train",
                       "experiment=bamboo_gpt_elastic", "strategy.recovery=replica+forward",
                       "trainer.max_steps=30", "trainer.logger=false",
                       f"hydra.run.dir={tmp_path / 'run'}",
                       "+trainer.callbacks.advisor._target_=lightning_bamboo.advise.AdvisorProbe",
                       f"+trainer.callbacks.advisor.path={costs_path}", "+trainer.callbacks.advisor.steps=6",
                       "+trainer.callbacks.advisor.warmup_steps=3"],
                      timeout=240, env=record_env(tmp_path, f"1:{fault_step}:forward")).stdout
    assert Record.read(tmp_path / NAME).summary() == [("failover", [1])]
    assert "`Trainer.fit` stopped: `max_steps=30` reached" in out
    if fault_step > 15:
        live = json.loads(costs_path.read_text())["live"]["bamboo"]
        assert live["steps"] == fault_step - 15  # steps 16..fault_step, none after the failover
    else:
        assert not costs_path.exists()
        assert "AdvisorProbe: a failover before the measurement ended: nothing written" in out


def test_median_of_means_drops_a_one_off_stall_and_keeps_what_slows_every_run_of_steps() -> None:
    steady = [0.05] * 20
    assert median_of_means(steady) == pytest.approx(0.05)
    stalled = steady.copy()
    stalled[7] += 0.369  # one scheduler stall: the mean moves by 37 %, the estimate not at all
    assert statistics.fmean(stalled) == pytest.approx(0.06845)
    assert median_of_means(stalled) == pytest.approx(0.05)
    every_fourth = [0.05, 0.05, 0.05, 0.13] * 5  # a slow step in every run of 4 (a collector): a throughput
    assert median_of_means(every_fourth) == pytest.approx(statistics.fmean(every_fourth))  # pays it
    assert median_of_means([0.2, 0.1]) == pytest.approx(0.15)  # fewer values than runs: one run each
    assert median_of_means([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], groups=3) == pytest.approx(4.5)  # 3+2+2
    with pytest.raises(ValueError, match="median_of_means: no values"):
        median_of_means([])


def test_cli_warns_when_the_validation_error_is_above_ten_percent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The fixture's live Bamboo run measured at half its samples: the replay is 2x off, which is said before
    the last line (the last line stays the advice)."""
    raw = json.loads(FIXTURE.read_text())
    live = raw["live"]["bamboo"]
    live["samples"], live["samples_per_s"] = live["samples"] // 2, live["samples_per_s"] / 2
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps(raw))
    assert main(["--costs", str(costs), "--trace", str(trace_file(tmp_path)), "--compression", "1",
                 "--max-pipelines", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    warning = next(line for line in lines if "validation error is" in line)
    assert warning.startswith("WARNING:") and "above 10%" in warning
    assert lines[-1].startswith("advice=") and float(lines[-1].rsplit("=", 1)[1]) > 0.1
    assert main(["--costs", str(FIXTURE), "--trace", str(trace_file(tmp_path)), "--compression", "1",
                 "--max-pipelines", "2"]) == 0
    assert "validation error is" not in capsys.readouterr().out  # 3.3 %: no warning


def test_cli_finds_its_default_trace_and_costs_from_any_directory(tmp_path: Path) -> None:
    """Run from outside the checkout: the defaults are found next to the package, not in the cwd."""
    done = run_process([sys.executable, "-m", "lightning_bamboo.advise"], timeout=300, cwd=tmp_path)
    assert done.stdout.splitlines()[-1].startswith("advice="), done.stdout[-2000:]
    assert "aws-p3-trace" in done.stdout
