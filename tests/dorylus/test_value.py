"""lightning_dorylus.value: measured op times (TimedExecutor) and the CPU-only vs Lambda pricing model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lightning_dorylus.executors import InlineExecutor, TensorOpRequest
from lightning_dorylus.value import (
    FORMAT,
    GpuServer,
    LambdaModel,
    Prices,
    TimedExecutor,
    load_run,
    main,
    price,
    replay_service_times,
)


def test_service_times_of_one_worker_are_replayed_exactly() -> None:
    # three requests submitted at once, results at 1, 3 and 4 s: each waited for the one before it
    assert replay_service_times([0.0, 0.0, 0.0], [1.0, 3.0, 4.0], workers=1) == [1.0, 2.0, 1.0]
    # a request submitted after the worker went idle is served from its submission
    assert replay_service_times([0.0, 5.0], [1.0, 5.5], workers=1) == [1.0, 0.5]
    # two workers: the first two start at once
    assert replay_service_times([0.0, 0.0, 0.0], [1.0, 2.0, 3.0], workers=2) == [1.0, 2.0, 2.0]


def test_timed_executor_records_requests_and_stages_per_epoch() -> None:
    executor = TimedExecutor(InlineExecutor(), workers=1)
    weight = torch.randn(8, 4)
    requests = [TensorOpRequest("apply_vertex.forward", {"z": torch.randn(10, 8), "weight": weight},
                                {"activation": "relu"}, interval=i) for i in range(3)]
    with executor:
        executor.start_epoch(0)
        outs = executor.map(requests)
        row = executor.end_epoch(epoch_seconds=1.0)
    assert [o["h"].shape for o in outs] == [(10, 4)] * 3
    assert row["epoch"] == 0 and row["epoch_s"] == 1.0 and 0 < row["blocked_s"] < 1.0
    op = row["ops"]["apply_vertex.forward"]
    assert op["count"] == 3
    assert op["bytes_in"] == 3 * (10 * 8 + 8 * 4) * 4 and op["bytes_out"] == 3 * 10 * 4 * 4
    (stage,) = row["stages"]
    assert stage["requests"] == 3 and stage["op"] == "apply_vertex.forward"
    assert 0 < stage["service_max_s"] <= stage["service_sum_s"] <= stage["wall_s"] + 1e-6
    assert executor.epochs == [row]


def _run(graph_s: float, stages: list[tuple[int, float, float]]) -> dict:
    """A one-server, one-epoch op-times file: ``stages`` as (requests, service sum, service max)."""
    rows = [{"op": "apply_vertex.forward", "requests": n, "wall_s": total, "service_sum_s": total,
             "service_max_s": most, "bytes_in": 0, "bytes_out": 0} for n, total, most in stages]
    blocked = sum(total for _, total, _ in stages)
    return {"format": FORMAT, "graph": {"nodes": 10, "edges": 20}, "epochs": [
        {"rank": 0, "epoch": 1, "epoch_s": graph_s + blocked, "blocked_s": blocked, "ops": {},
         "stages": rows}]}


def test_pricing_model_by_hand() -> None:
    run = _run(graph_s=2.0, stages=[(10, 1.0, 0.2), (10, 1.0, 0.1)])
    prices = Prices(server_per_hour=3.6, lambda_per_gb_s=0.5, lambda_per_million_requests=1e6)
    report = price(run, prices, LambdaModel(memory_mb=1024, latency_s=0.05, concurrency=5, overlap=0.0))
    cpu, lam = report["deployments"]
    assert cpu["epoch_s"] == pytest.approx(4.0)  # G + all service, one after another
    assert cpu["dollars"] == pytest.approx(4.0 * 0.001)
    slowdown = 1769 / 1024  # a 1 GB Lambda has 58 % of a vCPU
    tensor = 2 * (0.2 * slowdown + 0.05) + 2 * (0.1 * slowdown + 0.05)  # two waves of 5 per stage
    assert lam["epoch_s"] == pytest.approx(2.0 + tensor)
    assert lam["lambda_requests"] == 20 and lam["lambda_gb_s"] == pytest.approx(2.0 * slowdown * 1.0)
    assert lam["dollars"] == pytest.approx(0.001 * (2.0 + tensor) + 0.5 * 2.0 * slowdown + 20)
    assert report["value_ratio"] == pytest.approx(lam["value"] / cpu["value"])
    assert lam["value"] == pytest.approx(1 / (lam["epoch_s"] * lam["dollars"]))
    full = price(run, prices, LambdaModel(memory_mb=1024, latency_s=0.05, concurrency=5, overlap=1.0))
    assert full["deployments"][1]["epoch_s"] == pytest.approx(max(2.0, tensor))


def test_gpu_row_and_crossover_by_hand() -> None:
    """The GPU row scales the measured epoch by edges; the crossover is the GPU's memory over the measured
    peak, and the break-even efficiency the GPU's dollars per epoch over Dorylus's cheaper deployment's."""
    run = _run(graph_s=2.0, stages=[(10, 1.0, 0.2)])  # 20 edges
    gpu = GpuServer(epoch_s=0.5, graph_nodes=5, graph_edges=40, peak_gib=2.0, memory_gib=80.0, per_hour=36.0)
    report = price(run, Prices(server_per_hour=3.6), LambdaModel(), gpu)
    assert report["gpu"]["epoch_s"] == pytest.approx(0.25)  # half the measured graph's edges
    assert report["gpu"]["dollars"] == pytest.approx(0.25 * 0.01)
    cheaper = min(report["deployments"], key=lambda d: d["dollars"])
    c = report["crossover"]
    assert c["dorylus"] == cheaper["name"]
    assert c["max_edges"] == pytest.approx(40 * 80 / 2) and c["max_nodes"] == pytest.approx(5 * 80 / 2)
    assert c["bytes_per_edge"] == pytest.approx(2 * 2**30 / 40)
    assert c["gpu_faster"] == pytest.approx(cheaper["epoch_s"] / 0.25)
    assert c["break_even_efficiency"] == pytest.approx(0.0025 / cheaper["dollars"])
    assert "gpu" not in price(run, Prices(), LambdaModel())  # no GPU asked for: the two rows only
    with pytest.raises(ValueError, match="memory_gib=0 must be > 0"):
        GpuServer(memory_gib=0)


def test_bad_inputs_name_what_was_expected(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=r"overlap=1.5 must be in \[0, 1\]"):
        LambdaModel(overlap=1.5)
    with pytest.raises(ValueError, match="memory_mb=64: Lambda memory is at least 128 MB"):
        LambdaModel(memory_mb=64)
    with pytest.raises(FileNotFoundError, match=r"write one with benchmarks/dorylus_epoch\.py --op-times"):
        load_run(tmp_path / "missing.json")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": "something"}))
    with pytest.raises(ValueError, match=r"is not a 'dorylus-op-times/1' file"):
        load_run(other)
    with pytest.raises(SystemExit):
        main([str(other)])
    assert "is not a 'dorylus-op-times/1' file" in capsys.readouterr().err


def test_command_line_prints_the_report_and_saves_the_plot(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_run(graph_s=1.0, stages=[(4, 0.4, 0.1)])))
    report = main([str(path), "--plot", str(tmp_path / "value.png"), "--json", str(tmp_path / "r.json")])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == f"plot: {tmp_path / 'value.png'}"
    assert lines[-1].startswith(f"value_ratio={report['value_ratio']:.2f} speedup=")
    assert lines[-2].startswith("crossover: one 80 GiB GPU holds up to 395M edges / 19.5M vertices")
    assert report["gpu"]["model"] == {**GpuServer().__dict__}
    assert (tmp_path / "value.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert math.isclose(json.loads((tmp_path / "r.json").read_text())["speedup"], report["speedup"])
