"""The Dorylus docs' Python blocks are code the tests run on 2 graph servers, so a recipe that only works in
one process fails CI (issue 32: ``strategy.reduce(t, "sum")`` from a doc crashed on 2 servers only).

Every ```python block of ``docs/dorylus.md``, ``docs/dorylus-own-model.md`` and the README's Dorylus example
is one of two kinds:

* a **piece**: its first line is ``# <path>`` and the rest is a verbatim piece of that file, which the test
  named in :data:`RUN_BY` runs on 2 graph servers against ``strategy="auto"``;
* a **script**: a whole training script with ``devices=2``, run here as written on 2 graph servers with its
  ``max_epochs`` cut to 2 (the README's example also runs in ``tests/test_fresh_clone.py``, 60 epochs, from a
  fresh clone, so it is not run twice).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.process import REPO, launch_env, run_process
from tests.warnings_check import warning_lines

PAGES = ("docs/dorylus.md", "docs/dorylus-own-model.md", "README.md")
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
PIECE = re.compile(r"# ((?:docs/examples|lightning_dorylus)/[\w/.]+\.py)\n")
# the file a piece is cut from -> the test that runs it on 2 graph servers
RUN_BY = {
    "docs/examples/own_gcn.py": "tests/dorylus/test_own_model_doc.py",
    "docs/examples/multilabel.py": "tests/dorylus/test_pyg_data.py",
    "docs/examples/gin_ops.py": "tests/dorylus/test_user_ops.py",
    "docs/examples/gin_conv.py": "tests/dorylus/scripts/user_module_run.py",
    "lightning_dorylus/nn/sage_conv.py": "tests/dorylus/test_strategy.py",
}
RUN_ELSEWHERE = {"README.md": "tests/test_fresh_clone.py"}
TEST_ACC = re.compile(r"test_acc\W+(\d+\.\d+)")


def blocks(page: str) -> list[str]:
    """The ```python blocks of ``page``; of the README only those of the Dorylus section (it also documents
    Bamboo)."""
    found = BLOCK.findall((REPO / page).read_text())
    return [code for code in found if "lightning_dorylus" in code] if page == "README.md" else found


def scripts(page: str) -> list[str]:
    return [code for code in blocks(page) if not PIECE.match(code)]


def test_every_block_is_a_piece_of_a_tested_file_or_a_two_server_script() -> None:
    pieces = 0
    for page in PAGES:
        assert blocks(page), f"{page} has no Dorylus python block"
        for code in blocks(page):
            match = PIECE.match(code)
            if match is None:
                assert "devices=2" in code and "max_epochs=200" in code, f"a script of {page} is not:\n{code}"
                continue
            pieces += 1
            path = match.group(1)
            assert path in RUN_BY, f"{page} quotes {path}, which no test listed in RUN_BY runs"
            piece = code[match.end():]
            assert piece in (REPO / path).read_text(), f"a block of {page} is no longer in {path}:\n{piece}"
    assert pieces >= 6
    for path, test in RUN_BY.items():  # the runner still runs the file
        name = Path(path).stem if path.startswith("docs/") else "sage"
        assert name in (REPO / test).read_text(), f"{test} no longer runs {path}"
    for page, test in RUN_ELSEWHERE.items():
        assert 'example("DorylusStrategy(")' in (REPO / test).read_text(), f"{test} no longer runs {page}'s"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_dorylus_page_scripts_train_on_two_graph_servers(tmp_path: Path) -> None:
    """``docs/dorylus.md``'s scripts as written (2 epochs), from a folder holding the checkout's ``data/``."""
    (tmp_path / "data").symlink_to(REPO / "data")
    env = launch_env({"XDG_CACHE_HOME": str(tmp_path / "xdg-cache")})  # load_planetoid / the partition cache
    [code] = scripts("docs/dorylus.md")
    script = tmp_path / "using_it.py"
    script.write_text(code.replace("max_epochs=200", "max_epochs=2"))
    out = run_process([sys.executable, str(script)], timeout=420, cwd=tmp_path, env=env).stdout
    assert warning_lines(out) == [], out[-4000:]
    assert "Restoring states from the checkpoint path" in out, out[-3000:]  # ckpt_path="best" on 2 servers
    assert 0.0 < float(TEST_ACC.search(out).group(1)) <= 1.0, out[-3000:]  # type: ignore[union-attr]
