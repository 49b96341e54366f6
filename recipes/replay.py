"""Replay a spot trace from a recipe: ``python -m recipes.replay [trace=aws_g4dn] [prices.spot=0.8]``.

The config (``recipes/conf/replay.yaml``) becomes the arguments of ``python -m lightning_bamboo.simulate``.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from lightning_bamboo.simulate.__main__ import main as replay
from recipes.paths import register_resolvers

register_resolvers()


def replay_args(cfg: DictConfig) -> list[str]:
    """The command-line arguments of ``lightning_bamboo.simulate`` that ``cfg`` describes."""
    args = [str(cfg.trace.path), "--costs", str(cfg.costs), "--spot", str(cfg.prices.spot),
            "--on-demand", str(cfg.prices.on_demand), "--compression", str(cfg.compression)]
    for key, flag in (("stages", "--stages"), ("on_demand_nodes", "--on-demand-nodes"),
                      ("max_pipelines", "--max-pipelines"), ("plot", "--plot")):
        if cfg.get(key) is not None:
            args += [flag, str(cfg[key])]
    return args


@hydra.main(version_base="1.3", config_path="conf", config_name="replay")
def main(cfg: DictConfig) -> None:
    code = replay(replay_args(cfg))
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
