"""Every shipped recipe composes and instantiates with CPU/tiny overrides; the baseline recipe trains."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig

from recipes.compose import compose_recipe
from recipes.paths import CONFIG_DIR, REPO_ROOT, register_resolvers
from recipes.train import build_strategy, instantiate_components

EXPERIMENTS = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))


def test_every_recipe_is_listed() -> None:
    assert "plain_mlp" in EXPERIMENTS


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_recipe_composes_and_instantiates(experiment: str, tmp_path: Path) -> None:
    cfg = compose_recipe(experiment, tmp_path, ["trainer.max_steps=1", "trainer.max_epochs=1"])
    assert cfg.paths.repo_root == str(REPO_ROOT)
    model, data, trainer = instantiate_components(cfg)
    if experiment.endswith("_cora"):  # channels left missing in the recipe, taken from the data
        assert (cfg.model.in_channels, cfg.model.out_channels) == (1433, 7)
    assert isinstance(model, pl.LightningModule)
    assert isinstance(data, pl.LightningDataModule)
    assert isinstance(trainer, pl.Trainer)
    strategy = build_strategy(cfg.strategy)
    if isinstance(strategy, str):
        assert strategy == cfg.strategy.name
    else:
        assert type(trainer.strategy) is type(strategy)


def test_baseline_recipe_trains_and_tests(tmp_path: Path) -> None:
    """The plain recipe end to end through the real entry point (a subprocess, as a user runs it)."""
    proc = subprocess.run(
        [sys.executable, "-m", "recipes.train", "experiment=plain_mlp", "trainer.max_epochs=2",
         f"hydra.run.dir={tmp_path}", "+trainer.enable_progress_bar=false"],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "test_acc" in proc.stdout
    accuracy = float(proc.stdout.split("test_acc")[1].split()[1])
    assert accuracy > 0.8


def test_tied_gpt_recipe_ties_the_head_and_samples_text(tmp_path: Path) -> None:
    from recipes.components.sample_text import TextSample

    model, _, trainer = instantiate_components(compose_recipe("bamboo_gpt_tied", tmp_path))
    assert model.pipeline[-1].lm.weight is model.pipeline[0].tok.weight
    (sample,) = [c for c in trainer.callbacks if isinstance(c, TextSample)]
    assert (sample.prompt, sample.every_n_steps, sample.top_k) == ("def ", 10, 10)
    untied, _, _ = instantiate_components(compose_recipe("bamboo_gpt", tmp_path))
    assert untied.pipeline[-1].lm.weight is not untied.pipeline[0].tok.weight  # the figures' model


def test_spot_recipe_wires_notices_and_metrics(tmp_path: Path) -> None:
    from lightning_bamboo.callbacks import BambooMetrics, BambooNotices

    cfg = compose_recipe("bamboo_gpt_spot", tmp_path, ["notices@trainer.callbacks.notices=fault_demo"])
    _, _, trainer = instantiate_components(cfg)
    ours = [c for c in trainer.callbacks if isinstance(c, (BambooNotices, BambooMetrics))]
    assert [type(c) for c in ours] == [BambooNotices, BambooMetrics]  # metrics after notices
    assert ours[0]._config["faults"] == [{"rank": 1, "at_step": 10, "action": "drain"}]
    cloud = compose_recipe("bamboo_gpt_spot", tmp_path)
    assert cloud.trainer.callbacks.notices.aws.enabled == "auto"
    assert cloud.trainer.callbacks.notices.gce.enabled == "auto"


def test_elastic_spot_recipe_drains_through_the_elastic_strategy(tmp_path: Path) -> None:
    from lightning_bamboo.callbacks import BambooEventLog, BambooMetrics, BambooNotices
    from lightning_bamboo.strategy import BambooStrategy

    demo = ["notices@trainer.callbacks.notices=fault_demo"]
    cfg = compose_recipe("bamboo_gpt_elastic_spot", tmp_path, demo)
    _, _, trainer = instantiate_components(cfg)
    assert isinstance(trainer.strategy, BambooStrategy)  # its drain is the announced departure
    ours = [c for c in trainer.callbacks if isinstance(c, (BambooNotices, BambooMetrics, BambooEventLog))]
    assert [type(c) for c in ours] == [BambooNotices, BambooMetrics, BambooEventLog]
    assert ours[0]._config["faults"] == [{"rank": 1, "at_step": 10, "action": "drain"}]


@pytest.mark.parametrize("trace", sorted(p.stem for p in (CONFIG_DIR / "trace").glob("*.yaml")))
def test_replay_recipe_composes_and_runs(trace: str, tmp_path: Path) -> None:
    from recipes.replay import replay, replay_args

    register_resolvers()
    GlobalHydra.instance().clear()
    fixture = REPO_ROOT / "tests" / "bamboo" / "data" / "bamboo_preemption_fixture.json"
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        overrides = [f"trace={trace}", f"costs={fixture}", f"plot={tmp_path / 'out.png'}"]
        cfg = compose(config_name="replay", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    args = replay_args(cfg)
    trace_file = REPO_ROOT / "data" / "spot-traces" / f"{trace.replace('_', '-')}-trace.csv"
    assert args[:2] == [str(trace_file), "--costs"]
    assert args[args.index("--spot") + 1] == "0.91" and args[args.index("--on-demand") + 1] == "3.06"
    assert replay(args) == 0
    assert (tmp_path / "out.png").exists()
