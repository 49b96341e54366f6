"""The GPT example model, its byte-level token data, and the ``bamboo_gpt`` recipe end to end."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor

from lightning_bamboo.models import GPT, build_pipeline
from lightning_bamboo.models.gpt import warmup_cosine
from recipes.components.text import VOCAB_SIZE, TokenDataModule, TokenWindows, corpus_tokens
from tests.process import run_ranks

TINY = {"block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}


def test_pipeline_elements_take_and_return_one_tensor() -> None:
    pipeline = build_pipeline(vocab_size=VOCAB_SIZE, **TINY)
    assert len(pipeline) == TINY["n_layer"] + 2
    x: Tensor = torch.randint(0, VOCAB_SIZE, (3, 16))  # (B, T)
    shapes = []
    for layer in pipeline:
        x = layer(x)
        shapes.append(tuple(x.shape))
    assert shapes == [(3, 16, 32), (3, 16, 32), (3, 16, 32), (3, 16, VOCAB_SIZE)]


def test_attention_is_causal() -> None:
    """Changing the last token must leave the logits of every earlier position unchanged."""
    torch.manual_seed(0)
    model = GPT(**TINY).eval()
    idx = torch.randint(0, VOCAB_SIZE, (1, 16))
    changed = idx.clone()
    changed[0, -1] = (idx[0, -1] + 1) % VOCAB_SIZE
    torch.testing.assert_close(model(idx)[:, :-1], model(changed)[:, :-1])
    assert not torch.allclose(model(idx)[:, -1], model(changed)[:, -1])


def test_training_step_is_the_pipeline_contract() -> None:
    """training_step is pipeline_loss(pipeline(pipeline_inputs(batch)), batch): the pipeline contract."""
    torch.manual_seed(0)
    model = GPT(**TINY)
    inputs, targets = torch.randint(0, VOCAB_SIZE, (2, 4, 16))
    batch = (inputs, targets)
    assert model.pipeline_inputs(batch) is inputs
    logits = model.pipeline(inputs)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1))
    torch.testing.assert_close(model.pipeline_loss(logits, batch), expected)
    model.log = lambda *args, **kwargs: None  # type: ignore[method-assign]  # no trainer attached
    torch.testing.assert_close(model.training_step(batch, 0), expected)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_head": 3, "n_embd": 32}, r"n_head \(3\) does not divide n_embd \(32\): n_embd % n_head = 2"),
        ({"n_layer": 0}, r"n_layer must be a positive integer, got 0"),
        ({"dropout": 1.0}, r"dropout must be in \[0, 1\), got 1.0"),
        ({"lr": 0.0}, r"lr must be positive, got 0.0"),
    ],
)
def test_bad_hyperparameters_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GPT(**{**TINY, **kwargs})


def test_sequence_longer_than_block_size_is_rejected() -> None:
    model = GPT(**TINY)
    with pytest.raises(ValueError, match=r"sequence length \(17\) exceeds block_size \(16\)"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_optimizer_groups_have_the_same_shape_on_every_stage() -> None:
    """A stage holding only the embedding still gets two groups (the second empty), like every other stage."""
    model = GPT(**TINY, tie_embeddings=False)
    full = model.optimizer_groups()
    assert [len(g["params"]) for g in full] == [2 + 2 * 4 + 1, 2 * 8 + 2]  # matrices; biases and LN params
    tied = GPT(**TINY).optimizer_groups()  # the head's matrix is the token embedding: listed once
    assert [len(g["params"]) for g in tied] == [2 + 2 * 4, 2 * 8 + 2]
    model.pipeline = model.pipeline[:1]  # what a pipeline strategy leaves on stage 0
    groups = model.optimizer_groups()
    assert [len(g["params"]) for g in groups] == [2, 0]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]


def test_head_is_tied_to_the_token_embedding_by_default() -> None:
    """nanoGPT's tie: one parameter, both uses' gradients summed into it; untied, the head has its own."""
    torch.manual_seed(0)
    tied = GPT(**TINY)
    embedding, head = tied.pipeline[0].tok.weight, tied.pipeline[-1].lm.weight
    assert head is embedding and tied.hparams["tie_embeddings"] is True
    untied = GPT(**TINY, tie_embeddings=False)
    assert untied.pipeline[-1].lm.weight is not untied.pipeline[0].tok.weight
    count = sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in tied.parameters())
    assert count == VOCAB_SIZE * TINY["n_embd"]
    # the tied gradient is the sum of the gradients of the untied model's two copies at the same values
    untied.load_state_dict(tied.state_dict())
    inputs, targets = torch.randint(0, VOCAB_SIZE, (2, 3, 16))
    for model in (tied, untied):
        model.pipeline_loss(model.pipeline(inputs), (inputs, targets)).backward()
    expected = untied.pipeline[0].tok.weight.grad + untied.pipeline[-1].lm.weight.grad
    torch.testing.assert_close(embedding.grad, expected)


def test_warmup_cosine_schedule() -> None:
    factor = warmup_cosine(warmup=4, decay_steps=14, min_ratio=0.1)
    assert [factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert factor(9) == pytest.approx(0.55)  # half way through the cosine
    assert factor(14) == factor(100) == pytest.approx(0.1)


def test_decay_steps_need_a_finite_run() -> None:
    model = GPT(**TINY)
    trainer = pl.Trainer(max_steps=-1, max_epochs=-1, logger=False, enable_checkpointing=False)
    model.trainer = trainer
    match = r"decay_steps is None and trainer.estimated_stepping_batches is inf"
    with pytest.raises(ValueError, match=match):
        model.configure_optimizers()


def test_token_windows_are_shifted_bytes() -> None:
    tokens = corpus_tokens(["textwrap"])
    assert tokens.dtype == torch.int64 and int(tokens.max()) < VOCAB_SIZE
    windows = TokenWindows(tokens, block_size=8)
    assert len(windows) == (tokens.numel() - 1) // 8
    x, y = windows[3]
    torch.testing.assert_close(x, tokens[24:32])
    torch.testing.assert_close(y, tokens[25:33])


def test_data_module_batches_are_seeded_and_full(tmp_path: Path) -> None:
    data = TokenDataModule(modules=["textwrap"], block_size=8, batch_size=5, seed=3)
    data.setup("fit")
    first = [b[0] for b in data.train_dataloader()]
    again = [b[0] for b in data.train_dataloader()]
    assert all(b.shape == (5, 8) for b in first)
    # Same seed, same order: every rank of a pipeline sees the same batches.
    torch.testing.assert_close(torch.stack(first), torch.stack(again))
    assert "TokenDataModule(modules=['textwrap'], block_size=8" in repr(data)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"modules": ["sys"]}, r"modules: 'sys' has no Python source file \(origin='built-in'\)"),
        ({"modules": []}, r"modules: expected at least one module name, got an empty list"),
        ({"val_fraction": 1.0}, r"val_fraction must be in \(0, 1\), got 1.0"),
        ({"modules": ["this"], "batch_size": 1000}, r"training windows are fewer than batch_size \(1000\)"),
    ],
)
def test_bad_data_arguments_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        data = TokenDataModule(**kwargs)
        data.setup("fit")


class _LossRecorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[override]
        self.losses.append(float(outputs["loss"]))


@pytest.mark.slow
def test_gpt_learns_under_the_default_strategy(tmp_path: Path) -> None:
    """30 steps on stdlib bytes take the loss from ~ln(256) = 5.5 well down (source code is predictable)."""
    pl.seed_everything(0)
    model = GPT(**TINY, lr=1e-2, warmup=5)
    data = TokenDataModule(block_size=16, batch_size=16)
    recorder = _LossRecorder()
    trainer = pl.Trainer(
        strategy="auto", accelerator="cpu", devices=1, max_steps=30,
        limit_val_batches=2, val_check_interval=30,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, callbacks=[recorder],
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=data)
    assert len(recorder.losses) == 30
    assert recorder.losses[0] == pytest.approx(5.55, abs=0.15)
    assert sum(recorder.losses[-5:]) / 5 < recorder.losses[0] - 1.5
    assert trainer.callback_metrics["val_loss"] < recorder.losses[0] - 1.5


@pytest.mark.slow
@pytest.mark.multiprocess
def test_bamboo_gpt_recipe_trains_two_cpu_stages(tmp_path: Path) -> None:
    """``python -m recipes.train experiment=bamboo_gpt`` with FR on: 2 processes, layout and schedule grid
    printed.

    Both ranks started together, as torchrun would (Lightning's popen launcher: ``test_readme.py``)."""
    cmd = [sys.executable, "-m", "recipes.train", "experiment=bamboo_gpt",
           "strategy.recovery=replica+forward", "trainer.max_steps=3",
           "trainer.limit_val_batches=0", "+trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path}"]
    output = run_ranks(cmd, 2, timeout=240).stdout
    # The stage layout: 4 layers [embedding, block, block, head], two per stage, each replicating the other.
    assert re.search(r"^stage\s+ranks\s+layers\s+cost\s+replica-of$", output, re.MULTILINE), output[-4000:]
    assert re.search(r"^0\s+0\s+0-1\s+\S+\s+1$", output, re.MULTILINE), output[-4000:]
    assert re.search(r"^1\s+1\s+2-3\s+\S+\s+0$", output, re.MULTILINE), output[-4000:]
    # The schedule grid (rank x step, see lightning_bamboo.schedule.format_grid): 1F1B with FR actions.
    assert re.search(r"^step\s+0\s+1\s+2", output, re.MULTILINE), output[-4000:]
    assert re.search(r"^rank0\s+0F0\b", output, re.MULTILINE), output[-4000:]
    assert re.search(r"^rank1\s.*\b0FR0\b", output, re.MULTILINE), output[-4000:]
    assert "Trainer.fit` stopped: `max_steps=3` reached" in output


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(["strategy.num_stages=1", "strategy.recovery=peers"], id="1-stage-x-2-pipelines"),
        pytest.param([], id="2-stages"),
    ],
)
def test_tied_gpt_recipe_prints_samples_through_the_pipeline(tmp_path: Path, overrides: list[str]) -> None:
    """``experiment=bamboo_gpt_tied`` (the demo's first run): the tied GPT trains and its TextSample callback
    prints a continuation of "def " after step 10 through the whole model."""
    cmd = [sys.executable, "-m", "recipes.train", "experiment=bamboo_gpt_tied", "trainer.max_steps=10",
           "trainer.limit_val_batches=0", "+trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path}",
           *overrides]
    output = run_ranks(cmd, 2, timeout=240).stdout
    # the repr of the text: quoted with " when it holds a ', escapes (\n) longer than the byte
    assert re.search(r"^\[sample step 10\] (['\"])def .+\1$", output, re.MULTILINE), output[-4000:]
    assert "Trainer.fit` stopped: `max_steps=10` reached" in output
