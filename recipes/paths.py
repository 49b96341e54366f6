"""Path resolvers for configs, so recipes find the repo's data wherever they are launched from."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = Path(__file__).resolve().parent / "conf"


def register_resolvers() -> None:
    """Register ``${repo_root:}`` (idempotent): the checkout root, the parent of ``recipes/``."""
    if not OmegaConf.has_resolver("repo_root"):
        OmegaConf.register_new_resolver("repo_root", lambda: str(REPO_ROOT))
