"""Train from a recipe: compose the config, instantiate model, data and trainer, call ``fit``.

    python -m recipes.train experiment=plain_mlp
    python -m recipes.train experiment=bamboo_gpt trainer.max_steps=20
    python -m recipes.train experiment=dorylus_gcn_cora --cfg job     # print the composed config
    python -m recipes.train experiment=bamboo_gpt ckpt_path=<checkpoint>  # resume a fit

The entry point does nothing else: every choice lives in ``recipes/conf``.
"""

from __future__ import annotations

from typing import Any

import hydra
import lightning.pytorch as pl
from omegaconf import DictConfig, OmegaConf

from recipes.paths import register_resolvers

register_resolvers()


# model argument left missing (``???``) -> data module attribute that supplies it
SHAPE_FROM_DATA = {"in_channels": "num_features", "out_channels": "num_classes"}


def instantiate_components(cfg: DictConfig) -> tuple[pl.LightningModule, pl.LightningDataModule, pl.Trainer]:
    """Build the model, data module and trainer (with its strategy) that ``cfg`` describes.

    The data comes first: a model argument the config leaves missing (``in_channels: ???``) is taken from the
    data module (``num_features``, ``num_classes``), so a recipe runs on another graph with only the data
    overridden.
    """
    data = hydra.utils.instantiate(cfg.data)
    for argument, value in shape_from_data(cfg.model, data).items():
        cfg.model[argument] = value  # in the config too, so the saved config records it
    model = hydra.utils.instantiate(cfg.model)
    trainer_cfg = cfg.trainer
    extra: dict[str, Any] = {}
    if isinstance(trainer_cfg.get("callbacks"), DictConfig):  # named callbacks, in config order
        named = trainer_cfg.callbacks.values()
        extra["callbacks"] = [hydra.utils.instantiate(c) for c in named if c is not None]
        trainer_cfg = OmegaConf.masked_copy(trainer_cfg, [k for k in trainer_cfg if k != "callbacks"])
    trainer = hydra.utils.instantiate(trainer_cfg, strategy=build_strategy(cfg.strategy), **extra)
    return model, data, trainer


def shape_from_data(model_cfg: DictConfig, data: pl.LightningDataModule) -> dict[str, int]:
    """The missing model arguments of :data:`SHAPE_FROM_DATA`, read from ``data``."""
    filled = {}
    for argument, attribute in SHAPE_FROM_DATA.items():
        if OmegaConf.is_missing(model_cfg, argument):  # False when the model has no such argument
            if not hasattr(data, attribute):
                raise ValueError(
                    f"model.{argument} is missing (???) and the data module {type(data).__name__} has no "
                    f"{attribute!r} to take it from: set model.{argument} in the recipe"
                )
            filled[argument] = int(getattr(data, attribute))
    return filled


def build_strategy(strategy_cfg: DictConfig) -> Any:
    """A ``_target_`` config becomes a Strategy object; ``{name: auto}`` stays a registry name."""
    if "_target_" in strategy_cfg:
        return hydra.utils.instantiate(strategy_cfg)
    return strategy_cfg.name


def run(cfg: DictConfig) -> dict[str, float]:
    """Seed, build, ``fit`` (resumed from ``cfg.ckpt_path`` if set), then ``test`` if the recipe asks; returns
    the test metrics (``{}`` without)."""
    pl.seed_everything(cfg.seed, workers=True)
    model, data, trainer = instantiate_components(cfg)
    trainer.fit(model, datamodule=data, ckpt_path=cfg.ckpt_path)
    if not cfg.test_after_fit:
        return {}
    # ckpt_path "best": the weights ModelCheckpoint kept (e.g. the best val_acc epoch); null: current ones
    (metrics,) = trainer.test(model, datamodule=data, ckpt_path=cfg.test_ckpt_path, weights_only=True)
    return metrics


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
