"""Byte-level language-model data from Python's own standard library: text that ships offline.

The corpus is the source of a fixed list of pure-Python stdlib modules (code, comments and docstrings),
read as UTF-8 bytes, so the vocabulary is always the 256 byte values and no tokenizer is needed.
The same Python version gives the same bytes, hence the same data on every rank and every run.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

VOCAB_SIZE = 256
"""Byte-level tokens: every value of a byte."""

DEFAULT_MODULES = (
    "argparse", "textwrap", "functools", "dataclasses", "enum", "difflib", "heapq", "fractions",
)
"""About 420 KB of source with Python 3.11."""


def stdlib_source(module: str) -> bytes:
    """The source file of a pure-Python stdlib module, as bytes (the module is located, not imported)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        origin = None if spec is None else spec.origin
        raise ValueError(f"modules: {module!r} has no Python source file (origin={origin!r}); "
                         "expected a pure-Python standard-library module such as 'argparse'")
    return Path(spec.origin).read_bytes()


def corpus_tokens(modules: Sequence[str]) -> Tensor:
    """Concatenate the modules' sources into one (N,) int64 tensor of byte values."""
    if not modules:
        raise ValueError("modules: expected at least one module name, got an empty list")
    data = b"\n".join(stdlib_source(m) for m in modules)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()  # (N,)


class TokenWindows(Dataset[tuple[Tensor, Tensor]]):
    """Non-overlapping windows of ``block_size`` tokens and their next-token targets.

    Args:
        tokens: (N,) int64 token stream.
        block_size: window length T.
    """

    def __init__(self, tokens: Tensor, block_size: int) -> None:
        if tokens.numel() < block_size + 1:
            raise ValueError(f"TokenWindows: {tokens.numel()} tokens are too few for one window of "
                             f"block_size + 1 = {block_size + 1}")
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = index * self.block_size
        chunk = self.tokens[start : start + self.block_size + 1]  # (T + 1,)
        return chunk[:-1], chunk[1:]  # (T,), (T,)


class TokenDataModule(pl.LightningDataModule):
    """Byte tokens of stdlib sources, split into a training head and a validation tail.

    Batches are ``(inputs, targets)``, both (B, T) int64 with ``targets`` shifted one byte ahead.
    Shuffling uses its own seeded generator, so every rank of a pipeline draws the same batches.

    Args:
        modules: pure-Python standard-library modules whose source makes the corpus.
        block_size: sequence length T; must not exceed the model's ``block_size``.
        batch_size: sequences per batch; training batches are always full (``drop_last``).
        val_fraction: share of the token stream (the tail) held out for validation, in (0, 1).
        seed: seed of the shuffling generator.
    """

    vocab_size = VOCAB_SIZE

    def __init__(
        self,
        modules: Sequence[str] = DEFAULT_MODULES,
        block_size: int = 64,
        batch_size: int = 16,
        val_fraction: float = 0.1,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if block_size < 1:
            raise ValueError(f"TokenDataModule: block_size must be >= 1, got {block_size}")
        if batch_size < 1:
            raise ValueError(f"TokenDataModule: batch_size must be >= 1, got {batch_size}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"TokenDataModule: val_fraction must be in (0, 1), got {val_fraction}")
        self.modules = tuple(modules)
        self.block_size, self.batch_size = block_size, batch_size
        self.val_fraction, self.seed = val_fraction, seed

    @override
    def setup(self, stage: str) -> None:
        tokens = corpus_tokens(self.modules)  # (N,)
        n_train = int(tokens.numel() * (1.0 - self.val_fraction))
        self.train_set = TokenWindows(tokens[:n_train], self.block_size)
        self.val_set = TokenWindows(tokens[n_train:], self.block_size)
        if len(self.train_set) < self.batch_size:
            raise ValueError(f"TokenDataModule: {len(self.train_set)} training windows are fewer than "
                             f"batch_size ({self.batch_size})")

    @override
    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True, generator=gen
        )

    @override
    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, drop_last=True)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(modules={list(self.modules)}, block_size={self.block_size}, "
                f"batch_size={self.batch_size}, val_fraction={self.val_fraction}, seed={self.seed})")
