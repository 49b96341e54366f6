"""Compose a recipe's config from Python as ``python -m recipes.train`` would (for scripts and tests).

``@hydra.main`` also fills the ``hydra`` node (``${hydra:runtime.output_dir}`` in the trainer config); this
does the same with an explicit output directory, so a script can run several recipes (e.g. one per seed) in
one process and one launch of its graph servers. The result is resolved and Hydra is left uninitialised:
Lightning's ``popen`` launcher re-runs a script with ``hydra.run.dir=...`` arguments whenever Hydra is
initialised, which a plain script would reject.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from recipes.paths import CONFIG_DIR, register_resolvers


def compose_recipe(experiment: str, output_dir: str | Path, overrides: Sequence[str] = ()) -> DictConfig:
    """The composed, resolved config of ``experiment=<experiment> *overrides`` (no ``hydra`` node), its
    outputs under ``output_dir``. Mandatory values left missing (``???``) stay missing."""
    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(
            config_name="train", overrides=[f"experiment={experiment}", *overrides], return_hydra_config=True
        )
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(output_dir)
        cfg.hydra.job.num = 0
    HydraConfig.instance().set_config(cfg)
    try:
        resolved = {
            key: OmegaConf.to_container(cfg[key], resolve=True) if OmegaConf.is_config(cfg[key]) else cfg[key]
            for key in cfg
            if key != "hydra"
        }
    finally:
        HydraConfig.instance().cfg = None  # type: ignore[assignment]
    return OmegaConf.create(resolved)
