"""The recipes' ``TextSample`` callback: it continues a prompt through the whole model, the same under
``strategy="bamboo"`` as under ``strategy="auto"``.

The multi-process tests run ``scripts/generate_gpt.py`` (the example ``GPT``, float64, 4 steps; greedy
samples after every step and top-k samples from a seeded generator every second step) under auto and under
Bamboo (2 stages untied and tied, and the tied model on 1 stage x 2 pipelines); every rank's samples must
equal auto's token for token.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_bamboo.models import GPT
from recipes.components.sample_text import TextSample
from recipes.components.text import VOCAB_SIZE
from tests.bamboo.launch import run_script

TINY = {"block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}


def _run(out: Path, strategy: str, tie: str, stages: int = 1, pipelines: int = 1) -> Path:
    args = ["--out", str(out), "--strategy", strategy, "--tie", tie, "--stages", str(stages),
            "--pipelines", str(pipelines)]
    nprocs = stages * pipelines if strategy == "bamboo" else None
    run_script("generate_gpt.py", args, timeout=420, nprocs=nprocs)
    return out


def _samples(run: Path, rank: int) -> dict[str, list]:
    return json.loads((run / f"samples_rank{rank}.json").read_text())


def _check_against_auto(run: Path, ref: Path, nprocs: int) -> None:
    expected = _samples(ref, 0)
    # steps 1-4 greedy, steps 2 and 4 top-k; all continue the prompt "def "
    assert [s[0] for s in expected["greedy"]] == [1, 2, 3, 4]
    assert [s[0] for s in expected["top_k"]] == [2, 4]
    for _, tokens, text in expected["greedy"] + expected["top_k"]:
        assert text.startswith("def ") and len(tokens) == 4 + 12
    for rank in range(nprocs):
        assert _samples(run, rank) == expected, f"rank {rank}"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sample_matches_auto_2_stages_untied(tmp_path: Path) -> None:
    ref = _run(tmp_path / "auto", "auto", "untied")
    _check_against_auto(_run(tmp_path / "bamboo", "bamboo", "untied", stages=2), ref, nprocs=2)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sample_matches_auto_tied_one_stage_2_pipelines(tmp_path: Path) -> None:
    """The tie inside one stage: each pipeline's process holds the whole tied model."""
    ref = _run(tmp_path / "auto", "auto", "tied", pipelines=2)
    _check_against_auto(_run(tmp_path / "bamboo", "bamboo", "tied", pipelines=2), ref, nprocs=2)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sample_matches_auto_2_stages_tied(tmp_path: Path) -> None:
    """The tie across stages: the head's copy on stage 1, the embedding's on stage 0."""
    ref = _run(tmp_path / "auto", "auto", "tied")
    _check_against_auto(_run(tmp_path / "bamboo", "bamboo", "tied", stages=2), ref, nprocs=2)


# ---------------------------------------------------------------------------------------- single process
def _model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(vocab_size=VOCAB_SIZE, **TINY).double()
    model.trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    return model


def test_greedy_sample_is_the_argmax_continuation() -> None:
    model = _model()
    tokens = TextSample("def ", max_new_tokens=6).generate(model)
    idx = torch.tensor([list(b"def ")])
    with torch.no_grad():
        for _ in range(6):
            idx = torch.cat([idx, model(idx)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert tokens == idx[0].tolist()


def test_top_k_draws_from_its_own_generator_and_restores_the_mode() -> None:
    model = _model()
    sample = TextSample("x = ", max_new_tokens=20, top_k=8, seed=3)
    state = torch.get_rng_state()
    first = sample.generate(model)
    assert torch.equal(torch.get_rng_state(), state)  # the training's random state is left alone
    assert model.training  # put back after the eval-mode forwards
    assert sample.generate(model) == first  # re-seeded per sample: depends on the weights only
    assert TextSample("x = ", max_new_tokens=20, top_k=8, seed=4).generate(model) != first
    greedy = TextSample("x = ", max_new_tokens=20).generate(model)
    assert TextSample("x = ", max_new_tokens=20, top_k=1, seed=3).generate(model) == greedy


def test_context_is_cropped_to_block_size() -> None:
    """A prompt longer than the position table is cut to its last block_size tokens, as nanoGPT does."""
    model = _model()
    long_prompt = "0123456789abcdefghij"  # 20 bytes > block_size 16
    tokens = TextSample(long_prompt, max_new_tokens=3).generate(model)
    assert tokens[:20] == list(long_prompt.encode()) and len(tokens) == 23


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prompt": ""}, r"TextSample: prompt must be a non-empty string"),
        ({"max_new_tokens": 0}, r"TextSample: max_new_tokens must be >= 1, got 0"),
        ({"every_n_steps": -1}, r"TextSample: every_n_steps must be >= 0 \(0: at epoch ends only\), got -1"),
        ({"top_k": 0}, r"TextSample: top_k must be None \(greedy\) or >= 1, got 0"),
        ({"temperature": 0.0}, r"TextSample: temperature must be positive, got 0.0"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TextSample(**kwargs)
