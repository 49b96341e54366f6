"""The Dorylus recipes run end to end through the real entry point, as a user launches them.

Each run is ``python -m recipes.train experiment=...`` in a subprocess (Lightning starts the second graph
server by re-running that command), with a timeout and a process-group kill so a hung server cannot hang CI.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from tests.dorylus.planetoid_raw import write_planetoid_raw
from tests.process import REPO as REPO_ROOT
from tests.process import run_process, run_ranks
from tests.warnings_check import warning_lines

TEST_ACC = re.compile(r"test_acc\W+(\d+\.\d+)")  # plain or rich table row


def run_recipe(
    experiment: str, overrides: list[str], tmp_path: Path, timeout: float = 300, nprocs: int | None = None
) -> str:
    """Runs one recipe with its outputs and caches under ``tmp_path``; returns stdout + stderr.

    ``nprocs``: start that many graph servers together, as torchrun would (else Lightning's popen launcher
    starts them from the one command, as ``make demo`` does). Fresh interpreters, not the test zygote: the
    tests check that nothing, importing included, prints a Python warning."""
    command = [
        sys.executable, "-m", "recipes.train", f"experiment={experiment}",
        f"hydra.run.dir={tmp_path / 'run'}", f"paths.cache={tmp_path / 'cache'}", *overrides,
    ]
    if nprocs is not None:
        return run_ranks(command, nprocs, timeout=timeout, cwd=REPO_ROOT, fresh=True).stdout
    return run_process(command, timeout=timeout, cwd=REPO_ROOT, fresh=True).stdout


def printed_test_accuracy(output: str) -> float:
    """The ``test_acc`` value of the table ``trainer.test`` prints."""
    match = TEST_ACC.search(output)
    assert match is not None, f"no test accuracy printed:\n{output[-3000:]}"
    return float(match.group(1))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_powerlaw_demo_recipe_trains_and_tests(tmp_path: Path) -> None:
    """The offline demo recipe, shrunk: 2 graph servers, local executor, a printed test accuracy, quiet."""
    output = run_recipe(
        "dorylus_gcn_powerlaw",
        ["data.data.num_nodes=1500", "trainer.max_epochs=3", "++trainer.enable_progress_bar=false"],
        tmp_path,
    )
    assert 0.0 <= printed_test_accuracy(output) <= 1.0
    assert warning_lines(output) == [], output[-4000:]  # the demo's Dorylus half prints no Python warning


@pytest.mark.slow
@pytest.mark.multiprocess
def test_planetoid_recipe_runs_another_graph_by_name(tmp_path: Path) -> None:
    """``data.data.name`` (and where its raw files are) is all a user overrides for another Planetoid graph.

    The graph is a small synthetic one written in Planetoid's raw format as "CiteSeer" (only Cora ships);
    the model's channels come from its data (24 features, 3 classes, not Cora's 1433 / 7), the best
    validation checkpoint is tested, and nothing prints a warning. Accuracy on Cora: test_cora_accuracy.py.
    """
    write_planetoid_raw(tmp_path / "planetoid", "CiteSeer", num_features=24, num_classes=3)
    output = run_recipe(
        "dorylus_gcn_cora",
        ["data.data.name=CiteSeer", f"data.data.root={tmp_path / 'planetoid'}",
         "trainer.max_epochs=3", "++trainer.enable_progress_bar=false"],
        tmp_path,
        nprocs=2,
    )
    assert warning_lines(output) == [], output[-4000:]
    assert 0.0 <= printed_test_accuracy(output) <= 1.0
    checkpoint = re.search(r"Restoring states from the checkpoint path at (\S+best-epoch=\S+\.ckpt)", output)
    assert checkpoint is not None, output[-3000:]
    state = torch.load(checkpoint.group(1), map_location="cpu", weights_only=True)["state_dict"]
    shapes = sorted(tuple(t.shape) for name, t in state.items() if t.dim() == 2)
    assert shapes == [(16, 3), (24, 16)], shapes  # GCN 24 -> 16 -> 3 (weights stored in x out)
