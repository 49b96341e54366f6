"""The Cora recipes learn on real data on 2 graph servers (GCN and GAT); bounded staleness keeps accuracy.

One 2-process job (``scripts/cora_run.py --model gcn,gat --seeds 1``) runs ``experiment=dorylus_<model>_cora``
as ``python -m recipes.train`` does (``NormalizeFeatures``, PyG's example hyper-parameters, 200 epochs, the
test accuracy of the best validation epoch through ``ModelCheckpoint`` + ``trainer.test(ckpt_path="best")``)
for seed 0 of each model, tensor ops on the inline executor. Seed 0 reaches GCN 81.6 %, GAT 81.4 %
(docs/dorylus-accuracy.md); the bar of 80.0 % proves learning on real data with margin. The published-accuracy
claim (mean of 5 seeds >= 80.5 / 82.0) is a statistic, measured by ``python benchmarks/cora_accuracy.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dorylus.scripts.launch import run_script

_REPO = Path(__file__).resolve().parents[2]
# the copy carried in the repository (data/planetoid), else the shared one beside the checkout
PLANETOID = next(
    (
        p
        for p in (_REPO / "data" / "planetoid", _REPO.parent / "shared" / "data" / "planetoid")
        if (p / "Cora" / "raw").is_dir()
    ),
    _REPO / "data" / "planetoid",
)


@pytest.fixture(scope="module")
def cora_seed0(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Both recipes, seed 0, in one launch of the 2 graph servers (the imports and the group paid once)."""
    out = tmp_path_factory.mktemp("cora")
    args = [str(out), "--model", "gcn,gat", "--seeds", "1"]
    run_script("cora_run.py", args, timeout=900, cwd=out, nprocs=2)  # both servers started together
    return json.loads((out / "cora.json").read_text())["models"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(("model", "bar"), [("gcn", 0.80), ("gat", 0.80)])
def test_cora_recipe_learns_on_two_graph_servers(cora_seed0: dict, model: str, bar: float) -> None:
    (run,) = cora_seed0[model]["runs"]
    assert run["seed"] == 0
    print(f"{model} seed 0: best-val test accuracy {run['test_acc']:.4f} ({run['seconds']:.0f} s)")
    assert run["test_acc"] >= bar, f"{model} seed 0: best-val test accuracy {run['test_acc']} below {bar}"


def epochs_to_reach(curve: list[float], target: float) -> int:
    """1-based epoch at which ``curve`` first reaches ``target`` (``len + 1`` if never)."""
    return next((i + 1 for i, v in enumerate(curve) if v >= target), len(curve) + 1)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(1800)
@pytest.mark.skipif(
    not (PLANETOID / "Cora" / "raw").is_dir(), reason=f"Cora raw files not found in {PLANETOID}"
)
def test_bounded_staleness_keeps_gcn_accuracy_and_epochs(tmp_path: Path) -> None:
    """GCN, 2 graph servers, 5 seeds: the pipeline engine with staleness 0 and 1 lands within 1.0 point of
    the synchronous mean test accuracy, and its mean validation curve reaches the synchronous one's best
    (minus 1 point) in at most 1.2x the synchronous epochs. 100 epochs (GCN's best validation epoch on Cora
    comes well before that) keep the trainings cheap.

    staleness=0 is exact (values, not just accuracy: ``test_strategy.py``'s
    ``test_pipeline_engine_staleness_zero_is_exact``, with dropout), so each of its seeds IS the synchronous
    run of that seed: it trains seed 0 only, and the test asserts its whole validation curve and its test
    accuracy equal synchronous seed 0's, on real Cora over 100 epochs; its 5-seed mean then equals the
    synchronous mean (0 points apart), which is what the 1.0-point and 1.2x bars ask. That saves 4 of the
    5 staleness-0 trainings, the dearest ones (the per-interval pipeline costs more per epoch on 2 cores).

    staleness=1 reads with ``stale_reads="oldest"``: every ghost row and ghost gradient after epoch 0 is the
    previous epoch's (the worst case the bound allows, and reproducible, so the bars do not depend on the
    machine's timing); the test checks the runs read exactly that."""
    args = [
        str(tmp_path),
        str(PLANETOID),
        "--model",
        "gcn",
        "--servers",
        "2",
        "--seeds",
        "5",
        "--epochs",
        "100",
        "--staleness",
        "none,0,1",
        "--seeds-of",
        "0=1",
        "--stale-reads",
        "oldest",
    ]
    run_script("cora_staleness_run.py", args, timeout=1800, cwd=tmp_path, nprocs=2)
    configs = json.loads((tmp_path / "cora.json").read_text())["configs"]
    sync = configs["none"]
    target = max(sync["mean_val_curve"]) - 0.01
    sync_epochs = epochs_to_reach(sync["mean_val_curve"], target)
    print(
        f"staleness=None: mean test acc {sync['mean_test_acc']:.4f}, {sync_epochs} epochs to val {target:.4f}"
    )
    assert len(sync["runs"]) == 5
    (exact,) = configs["0"]["runs"]
    assert exact["seed"] == sync["runs"][0]["seed"] == 0
    assert exact["val_curve"] == sync["runs"][0]["val_curve"], "staleness=0 left the synchronous run"
    assert exact["test_acc"] == sync["runs"][0]["test_acc"]
    assert exact["best_epoch"] == sync["runs"][0]["best_epoch"]
    print(f"staleness=0: seed 0 equals synchronous seed 0 at every epoch, test acc {exact['test_acc']:.4f}")
    got = configs["1"]
    epochs = epochs_to_reach(got["mean_val_curve"], target)
    print(f"staleness=1: mean test acc {got['mean_test_acc']:.4f}, {epochs} epochs to val {target:.4f}")
    assert len(got["runs"]) == 5
    for run in got["runs"]:  # "oldest": epoch 0 exact, then every SC/∇SC read uses last epoch's ghosts
        assert run["stale_reads"]["ages"] == {"0": 4, "1": 4 * 99}, run["stale_reads"]
    assert abs(got["mean_test_acc"] - sync["mean_test_acc"]) <= 0.01, got["mean_test_acc"]
    assert epochs <= 1.2 * sync_epochs, (epochs, sync_epochs)
