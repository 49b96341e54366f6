"""Cut a batch into equal micro-batches along dimension 0.

Equal sizes matter for exactness: the pipeline's loss is the mean of the micro-batch losses, which equals the
full-batch mean (and its gradient the full-batch gradient) only when every micro-batch has the same size.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_bamboo.layout.plan import validate_microbatches


def batch_size_of(batch: Any) -> int:
    """Size of dimension 0 of the first tensor found in ``batch``.

    Raises:
        TypeError: if ``batch`` holds no tensor.
    """
    tensor = _first_tensor(batch)
    if tensor is None:
        raise TypeError(f"cannot split a batch with no tensor into micro-batches: got {type(batch).__name__}")
    if tensor.dim() == 0:
        raise ValueError("cannot split a batch whose first tensor is a scalar into micro-batches")
    return int(tensor.shape[0])


def split_microbatches(batch: Any, num_microbatches: int) -> list[Any]:
    """Split every tensor in ``batch`` (nested tuples, lists and dicts) into ``num_microbatches`` chunks.

    Non-tensor leaves are repeated in every micro-batch.

    Raises:
        ValueError: if ``num_microbatches`` does not divide the batch size, or tensors disagree on it.
    """
    size = batch_size_of(batch)
    validate_microbatches(size, num_microbatches)
    return [_take(batch, index, num_microbatches, size) for index in range(num_microbatches)]


def microbatch_shares(total: int, pipelines: int, shapes: Sequence[tuple[int, int]] | None = None
                      ) -> list[range]:
    """Which of a job's ``total`` global micro-batches each of ``pipelines`` pipelines runs: consecutive
    runs, as even as the pipelines' speeds allow.

    The global batch is cut into ``total`` micro-batches whatever the number of pipelines (the job's
    ``num_microbatches`` x its pipelines at the start), so a sample is in the same micro-batch, drawing the
    same dropout masks (:mod:`lightning_bamboo.pipeline.keyed_rng`), however many pipelines share the batch.

    ``shapes``: per pipeline ``(positions, widest)``, its positions and the most stages one of them runs
    (fused after a failover; :meth:`~lightning_bamboo.layout.ownership.OwnershipMap.shapes`). A 1F1B step
    of ``m`` micro-batches then takes about ``(m + positions - 1) x widest`` stage-times, and every pipeline
    waits for the slowest at the gradient all-reduce: each micro-batch goes, one at a time, where it ends
    soonest (ties to the lower pipeline), when that makes the step shorter than the even split (the first
    ``total % pipelines`` one more than the others; a tie keeps it, and with it the gradient sums of the
    uninterrupted layout, bit for bit). So a pipeline running two stages fused gets fewer micro-batches
    instead of holding the whole job back (Oobleck's batch distribution over pipelines of unequal lengths).

    Raises:
        ValueError: more pipelines than micro-batches (a pipeline would have nothing to run).
    """
    if not isinstance(total, int) or total < 1:
        raise ValueError(f"the global micro-batch count must be an integer >= 1, got {total!r}")
    if not isinstance(pipelines, int) or not 1 <= pipelines <= total:
        raise ValueError(
            f"{pipelines!r} pipelines cannot share {total} global micro-batches: each pipeline needs at "
            "least one (the job's global micro-batches are num_microbatches x its pipelines at the start)"
        )
    if shapes is None:
        shapes = [(1, 1)] * pipelines
    if len(shapes) != pipelines or any(positions < 1 or widest < 1 for positions, widest in shapes):
        raise ValueError(f"shapes must give (positions >= 1, widest >= 1) for each of {pipelines} pipelines, "
                         f"got {list(shapes)!r}")
    def end(m: int, shape: tuple[int, int]) -> int:  # stage-times of m micro-batches through one pipeline
        positions, widest = shape
        return (m + positions - 1) * widest

    def step(split: list[int]) -> int:
        return max(end(m, shape) for m, shape in zip(split, shapes))

    base, extra = divmod(total, pipelines)
    even = [base + (p < extra) for p in range(pipelines)]
    counts = [1] * pipelines
    for _ in range(total - pipelines):
        ends = [end(counts[p] + 1, shapes[p]) for p in range(pipelines)]  # with one more
        counts[ends.index(min(ends))] += 1
    if step(counts) >= step(even):  # no faster: the even split (which also sums gradients as before)
        counts = even
    starts = list(itertools.accumulate(counts, initial=0))
    return [range(starts[p], starts[p + 1]) for p in range(pipelines)]


def _take(batch: Any, index: int, parts: int, size: int) -> Any:
    if isinstance(batch, Tensor):
        if batch.dim() == 0 or batch.shape[0] != size:
            raise ValueError(
                f"every tensor in the batch must have batch size {size} on dimension 0 to be split into "
                f"micro-batches; found one of shape {tuple(batch.shape)}"
            )
        step = size // parts
        return batch[index * step : (index + 1) * step]
    if isinstance(batch, Mapping):
        return type(batch)({key: _take(value, index, parts, size) for key, value in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_take(value, index, parts, size) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_take(value, index, parts, size) for value in batch)
    return batch


def join_microbatches(parts: list[Any]) -> Any:
    """The inverse of :func:`split_microbatches` for outputs: tensors concatenated on dimension 0 (nested
    tuples, lists and dicts element by element); other leaves taken from the first part.

    Raises:
        ValueError: for an empty list, or a tensor without a batch dimension (a scalar per micro-batch).
    """
    if not parts:
        raise ValueError("join_microbatches needs at least one micro-batch")
    first = parts[0]
    if isinstance(first, Tensor):
        if first.dim() == 0:
            raise ValueError(
                "cannot join per-micro-batch outputs that are scalars into the batch's output; the pipeline "
                "body's output needs the batch on dimension 0"
            )
        return torch.cat(parts) if len(parts) > 1 else first
    if isinstance(first, Mapping):
        return type(first)({key: join_microbatches([p[key] for p in parts]) for key in first})  # type: ignore[call-arg]
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(join_microbatches([p[i] for p in parts]) for i in range(len(first))))
    if isinstance(first, (list, tuple)):
        return type(first)(join_microbatches([p[i] for p in parts]) for i in range(len(first)))
    return first


def _first_tensor(batch: Any) -> Tensor | None:
    if isinstance(batch, Tensor):
        return batch
    values = (
        batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    )
    for value in values:
        found = _first_tensor(value)
        if found is not None:
            return found
    return None


def check_train_batches(dataloaders: Any, num_microbatches: int, num_pipelines: int = 1) -> None:
    """Refuse, before training starts, batch sizes that the pipelines' micro-batches would fail to split
    mid-epoch (every member loads the global batch; each of ``num_pipelines`` takes its share and splits it
    into ``num_microbatches``).

    A ``DataLoader`` with ``drop_last=False`` ends its epoch with ``len(sampler) % batch_size`` samples; that
    last batch splits exactly (equal micro-batches keep the mean of means equal to the batch mean) only if
    ``num_microbatches`` divides it. Loaders without a sized sampler and a fixed ``batch_size`` are not
    checked.

    Args:
        dataloaders: ``trainer.train_dataloader``: a ``DataLoader`` or a list/tuple/dict of them.
        num_microbatches: the strategy's ``num_microbatches``.
        num_pipelines: the pipelines the batch is shared between.

    Raises:
        ValueError: naming ``batch_size``, ``drop_last``, ``num_microbatches`` (and the pipelines) and the
            arithmetic.
    """
    splits = f"num_microbatches ({num_microbatches})"
    if num_pipelines > 1:
        splits = f"num_pipelines x num_microbatches ({num_pipelines} x {num_microbatches})"
    num_microbatches *= num_pipelines
    for loader in _dataloaders(dataloaders):
        batch_sampler = getattr(loader, "batch_sampler", None)
        batch_size = getattr(batch_sampler, "batch_size", None)
        sampler = getattr(batch_sampler, "sampler", None)
        if not isinstance(batch_size, int) or sampler is None or not hasattr(sampler, "__len__"):
            continue
        if batch_size % num_microbatches:
            raise ValueError(
                f"the train dataloader's batch_size ({batch_size}, the global batch) is not divisible by "
                f"{splits}: {batch_size} % {num_microbatches} = {batch_size % num_microbatches}"
            )
        remainder = len(sampler) % batch_size
        if not getattr(batch_sampler, "drop_last", False) and remainder % num_microbatches:
            raise ValueError(
                f"the train dataloader's batch_size ({batch_size}) with drop_last=False leaves a last batch "
                f"of {remainder} samples ({len(sampler)} samples), which {splits} does not divide; pass "
                "drop_last=True to the DataLoader, or choose batch_size, num_microbatches or the dataset "
                "size so that it does"
            )


def _dataloaders(value: Any) -> list[Any]:
    if isinstance(value, Mapping):
        return [loader for item in value.values() for loader in _dataloaders(item)]
    if isinstance(value, (list, tuple)):
        return [loader for item in value for loader in _dataloaders(item)]
    return [] if value is None else [value]
