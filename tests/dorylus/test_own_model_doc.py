"""``docs/dorylus-own-model.md`` shows tested code (``test_doc_examples.py`` checks that each ``python`` block
is a verbatim piece of a file the tests run), and ``docs/examples/own_gcn.py`` runs as its docstring says: on
2 graph servers (a DorylusDataModule, the local executor, the whole-graph validation accuracy through
``strategy.reduce``, ``trainer.predict``) it logs and predicts what it does under ``strategy="auto"``."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from tests.process import REPO, run_process, run_ranks


def test_doc_is_linked_from_the_index_and_the_dorylus_page() -> None:
    for page in ("index.md", "dorylus.md"):
        assert "(dorylus-own-model.md)" in (REPO / "docs" / page).read_text(), page


@pytest.mark.multiprocess
@pytest.mark.slow
def test_own_gcn_example_predicts_on_two_servers_what_it_predicts_alone(tmp_path: Path) -> None:
    script = [sys.executable, str(REPO / "docs" / "examples" / "own_gcn.py"), "--epochs", "4"]
    alone = run_process([*script, "--devices", "1", "--out", str(tmp_path / "one")], timeout=300)
    two = run_ranks([*script, "--devices", "2", "--out", str(tmp_path / "two")], 2, timeout=400)
    assert "predictions=(600, 4)" in alone.stdout and "predictions=(600, 4)" in two.stdout
    one_loss = float(re.search(r"train_loss=([\d.]+)", alone.stdout).group(1))  # type: ignore[union-attr]
    two_loss = float(re.search(r"train_loss=([\d.]+)", two.stdout).group(1))  # type: ignore[union-attr]
    assert one_loss == pytest.approx(two_loss, abs=2e-4)  # printed with 4 decimals; float32 sums
    one_acc = float(re.search(r"val_acc=([\d.]+)", alone.stdout).group(1))  # type: ignore[union-attr]
    assert float(re.search(r"val_acc=([\d.]+)", two.stdout).group(1)) == one_acc  # type: ignore[union-attr]
    expected = torch.load(tmp_path / "one" / "probs.pt", weights_only=True)
    got = torch.load(tmp_path / "two" / "probs.pt", weights_only=True)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)  # float32: summation order differs
