"""``benchmarks/cora_accuracy.py``'s arithmetic: the GAT gap against PyG per block of 10 seeds (the runs it
compares are the recipes' and PyG's own, timed and measured by the benchmark, not here)."""

from __future__ import annotations

from benchmarks.cora_accuracy import block_gaps


def test_block_gaps_name_each_block_of_seeds_and_its_gap_in_points() -> None:
    ours = [0.70] * 10 + [0.72] * 10 + [0.71] * 5  # a partial last block is left out
    pyg = [0.71] * 25
    assert block_gaps(ours, pyg, first_seed=30) == "30-39: -1.00, 40-49: +1.00"
