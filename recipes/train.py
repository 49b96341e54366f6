"""Train from a recipe: compose the config, instantiate model, data and trainer, call ``fit``.

    python -m recipes.train experiment=plain_mlp
    python -m recipes.train experiment=bamboo_gpt trainer.max_steps=20
    python -m recipes.train experiment=dorylus_gcn_cora --cfg job     # print the composed config

The entry point does nothing else: every choice lives in ``recipes/conf``.
"""

from __future__ import annotations

from typing import Any

import hydra
import lightning.pytorch as pl
from omegaconf import DictConfig, OmegaConf

from recipes.paths import register_resolvers

register_resolvers()


def instantiate_components(cfg: DictConfig) -> tuple[pl.LightningModule, pl.LightningDataModule, pl.Trainer]:
    """Build the model, data module and trainer (with its strategy) that ``cfg`` describes."""
    model = hydra.utils.instantiate(cfg.model)
    data = hydra.utils.instantiate(cfg.data)
    trainer_cfg = cfg.trainer
    extra: dict[str, Any] = {}
    if isinstance(trainer_cfg.get("callbacks"), DictConfig):  # named callbacks, in config order
        named = trainer_cfg.callbacks.values()
        extra["callbacks"] = [hydra.utils.instantiate(c) for c in named if c is not None]
        trainer_cfg = OmegaConf.masked_copy(trainer_cfg, [k for k in trainer_cfg if k != "callbacks"])
    trainer = hydra.utils.instantiate(trainer_cfg, strategy=build_strategy(cfg.strategy), **extra)
    return model, data, trainer


def build_strategy(strategy_cfg: DictConfig) -> Any:
    """A ``_target_`` config becomes a Strategy object; ``{name: auto}`` stays a registry name."""
    if "_target_" in strategy_cfg:
        return hydra.utils.instantiate(strategy_cfg)
    return strategy_cfg.name


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    pl.seed_everything(cfg.seed, workers=True)
    model, data, trainer = instantiate_components(cfg)
    trainer.fit(model, datamodule=data)
    if cfg.test_after_fit:
        trainer.test(model, datamodule=data)


if __name__ == "__main__":
    main()
