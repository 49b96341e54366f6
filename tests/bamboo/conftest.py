"""Session fixtures: the batched launches behind the Bamboo exactness tests (tests/bamboo/pipe_runs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bamboo.pipe_runs import run_bamboo, run_references


@pytest.fixture(scope="session")
def pipe_references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Case name -> folder of its single-process reference run (all in one process)."""
    return run_references(tmp_path_factory.mktemp("pipe-references"))


@pytest.fixture(scope="session")
def pipe_bamboo_2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Case name -> folder of its 2-process Bamboo run (all in one launch)."""
    return run_bamboo(tmp_path_factory.mktemp("pipe-bamboo-2"), devices=2)


@pytest.fixture(scope="session")
def pipe_bamboo_4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Case name -> folder of its 4-process Bamboo run (all in one launch)."""
    return run_bamboo(tmp_path_factory.mktemp("pipe-bamboo-4"), devices=4)
