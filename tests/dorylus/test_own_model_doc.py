"""``docs/dorylus-own-model.md`` shows tested code: each of its ``python`` blocks that starts with a
``# docs/examples/<file>`` line is a verbatim piece of that file (the files the tests run), and
``docs/examples/own_gcn.py`` runs as its docstring says: on 2 graph servers (a DorylusDataModule, the local
executor, ``trainer.predict``) it predicts what it predicts under ``strategy="auto"``."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from tests.process import REPO, run_process, run_ranks

DOC = REPO / "docs" / "dorylus-own-model.md"
BLOCK = re.compile(r"```python\n# (docs/examples/[\w.]+\.py)\n(.*?)```", re.S)


def test_doc_code_blocks_are_pieces_of_the_tested_files() -> None:
    blocks = BLOCK.findall(DOC.read_text())
    assert {path for path, _ in blocks} == {"docs/examples/own_gcn.py", "docs/examples/gin_ops.py",
                                            "docs/examples/gin_conv.py"}
    for path, code in blocks:
        assert code in (REPO / path).read_text(), f"a block of {DOC.name} is no longer in {path}:\n{code}"


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
    expected = torch.load(tmp_path / "one" / "probs.pt", weights_only=True)
    got = torch.load(tmp_path / "two" / "probs.pt", weights_only=True)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)  # float32: summation order differs
