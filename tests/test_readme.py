"""The README's Python examples run as written (as scripts: Lightning's launcher re-runs them per process)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.process import REPO, run_process

README = (REPO / "README.md").read_text()
EXAMPLES = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)


def example(marker: str) -> str:
    matching = [code for code in EXAMPLES if marker in code]
    assert len(matching) == 1, f"expected one README example containing {marker!r}, found {len(matching)}"
    return matching[0]


def test_readme_starts_with_the_two_commands() -> None:
    first_block = README.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first_block.splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    assert "make test" in (REPO / ".ci" / "run").read_text()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_bamboo_example_trains(tmp_path: Path) -> None:
    code = example("BambooStrategy(").replace("max_steps=50", "max_steps=5")
    script = tmp_path / "train_bamboo.py"
    script.write_text("import torch\ntorch.set_num_threads(1)\n" + code)
    out = run_process([sys.executable, str(script)], timeout=240, cwd=tmp_path).stdout
    assert "max_steps=5` reached" in out
    assert "train_loss" in out


# The Dorylus example runs in a fresh clone of the repository: tests/test_fresh_clone.py
