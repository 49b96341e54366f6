"""Issue 7's "bugs found by trying it": each case failed before its fix (2 processes, float64).

Each runs ``scripts/train_pipe.py`` under ``strategy="auto"`` (one process) and under Bamboo (2 stages), and
checks every parameter, optimizer state, buffer and replica after every step against the reference, as
``test_strategy.py`` does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.bamboo.launch import snapshot
from tests.bamboo.test_strategy import STEPS, assert_matches_reference, bamboo, reference

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _matches(tmp_path: Path, optimizer: str, flags: list[str]) -> None:
    ref = reference(tmp_path, optimizer, 1, flags)
    run = bamboo(tmp_path, 2, 1, optimizer, flags)
    assert_matches_reference(run, ref, 2, 1, True)


def test_accumulate_grad_batches(tmp_path: Path) -> None:
    """accumulate_grad_batches=2: Lightning scales the loss by 1/2; the pipeline's gradients must be too."""
    _matches(tmp_path, "sgd", ["--accumulate", "2"])
