"""The Dorylus recipes run end to end through the real entry point, as a user launches them.

Each run is ``python -m recipes.train experiment=...`` in a subprocess (Lightning starts the second graph
server by re-running that command), with a timeout and a process-group kill so a hung server cannot hang CI.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.process import REPO as REPO_ROOT
from tests.process import run_process

TEST_ACC = re.compile(r"test_acc\W+(\d+\.\d+)")  # plain or rich table row


def run_recipe(experiment: str, overrides: list[str], tmp_path: Path, timeout: float = 300) -> str:
    """Runs one recipe with its outputs and caches under ``tmp_path``; returns stdout + stderr."""
    command = [
        sys.executable, "-m", "recipes.train", f"experiment={experiment}",
        f"hydra.run.dir={tmp_path / 'run'}", f"paths.cache={tmp_path / 'cache'}", *overrides,
    ]
    return run_process(command, timeout=timeout, cwd=REPO_ROOT).stdout


def printed_test_accuracy(output: str) -> float:
    """The ``test_acc`` value of the table ``trainer.test`` prints."""
    match = TEST_ACC.search(output)
    assert match is not None, f"no test accuracy printed:\n{output[-3000:]}"
    return float(match.group(1))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_powerlaw_demo_recipe_trains_and_tests(tmp_path: Path) -> None:
    """The offline demo recipe, shrunk: 2 graph servers, local executor, a printed test accuracy."""
    output = run_recipe(
        "dorylus_gcn_powerlaw",
        ["data.data.num_nodes=1500", "trainer.max_epochs=3", "++trainer.enable_progress_bar=false"],
        tmp_path,
    )
    assert 0.0 <= printed_test_accuracy(output) <= 1.0


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("experiment", ["dorylus_gcn_cora", "dorylus_gat_cora"])
def test_cora_recipe_reaches_published_accuracy_range(experiment: str, tmp_path: Path) -> None:
    """The full Cora recipes (200 epochs, 2 graph servers, local executor) as shipped.

    Published: GCN 81.5%, GAT 83.0% (best validation epoch); the last epoch of one seed lands a little below
    (measured: GCN 78.6%, GAT 81.0%), while a broken gradient or ghost exchange lands far below.
    """
    output = run_recipe(experiment, ["++trainer.enable_progress_bar=false"], tmp_path, timeout=600)
    assert printed_test_accuracy(output) >= 0.75
