"""Buffers (BatchNorm running statistics, ``num_batches_tracked``, any user buffer) as model state: one value
across the data-parallel pipelines after every training batch.

Parameters are equal across the pipelines because their gradients are averaged; buffers change in the
forward, from the samples each pipeline ran, so without a rule each pipeline would keep its own running
statistics and a checkpoint, a validation or a prediction would see a model that never existed. The rule,
applied by :class:`StageBuffers` at the end of every training batch's schedule (before the replica exchange,
so the successor's replica receives the agreed values; inside the batch's retry, so an aborted batch's
updates are undone with its other buffer changes):

* ``batch_norm="broadcast"`` (the default, DDP's ``broadcast_buffers=True``): each original stage's buffers
  are broadcast from the member with the lowest rank holding that stage (pipeline 0's, as DDP takes rank
  0's). BatchNorm's running statistics are then updated by the micro-batches of that pipeline only, once per
  micro-batch, as under DDP by rank 0's batch; they change when the pipelines' shares of the batch change
  (a whole pipeline lost or joined), as DDP's change with the world size.
* ``batch_norm="deferred"`` (torchgpipe's deferred batch normalization): every micro-batch is still
  normalized by its own statistics (inherent to a pipeline), but the running statistics are not updated
  per micro-batch: each BatchNorm layer's input sums over the whole global batch (every micro-batch of
  every pipeline, all-reduced over the stage's holders) update them once per batch, as one process with the
  whole batch updates them, and as ``SyncBatchNorm``'s are. They do not depend on how many pipelines share
  the batch, so a run that loses or gains a pipeline keeps the uninterrupted run's statistics. The other
  buffers follow the broadcast rule.

A job with one pipeline and one micro-batch has nothing to agree on and is left to BatchNorm itself (so it
stays bit-equal to ``strategy="auto"``).

The hooks are forward hooks on this member's own BatchNorm layers (registered and removed by this module):
the pre-hook accumulates the input's shifted sums and lends the forward copies of the running statistics to
update, the hook gives the layer its own buffers back, unchanged (never written in place: the forward's graph
may hold them). The replica's layers carry no hooks: the replica receives its successor's buffers after every
step (:mod:`lightning_bamboo.pipeline.replica`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lbd_common import codec

BATCH_NORM_MODES = ("broadcast", "deferred")
_BatchNorm = nn.modules.batchnorm._BatchNorm
_RUNNING = ("running_mean", "running_var", "num_batches_tracked")


def check_batch_norm_mode(batch_norm: str) -> None:
    """``BambooStrategy(batch_norm=...)``: one of :data:`BATCH_NORM_MODES`."""
    if batch_norm not in BATCH_NORM_MODES:
        raise ValueError(
            f"batch_norm must be one of {', '.join(map(repr, BATCH_NORM_MODES))}, got {batch_norm!r}: "
            "'broadcast' keeps pipeline 0's buffers (DDP's rule), 'deferred' updates BatchNorm's running "
            "statistics once per batch from the whole global batch"
        )


def refuse_sync_batchnorm(layer_sync: object, body: nn.Module, owner: str, attr: str) -> None:
    """Refuse ``Trainer(sync_batchnorm=True)`` and ``nn.SyncBatchNorm`` layers, naming what is possible.

    SyncBatchNorm normalizes every forward by statistics all-reduced over the ranks at that moment; in a
    pipeline a stage's micro-batches reach it one at a time and the other pipelines' at other times, so no
    global batch exists to normalize by. What is possible is its running statistics, which
    ``batch_norm="deferred"`` gives."""
    sync = [f"{attr}.{name}" for name, m in body.named_modules() if isinstance(m, nn.SyncBatchNorm)]
    if layer_sync is None and not sync:
        return
    what = ("Trainer(sync_batchnorm=True)" if layer_sync is not None
            else f"nn.SyncBatchNorm ({', '.join(sync)})")
    raise ValueError(
        f"{what} with BambooStrategy ({owner}): a pipeline stage normalizes each micro-batch while the "
        "others are elsewhere in the pipeline, so BatchNorm cannot normalize by the global batch's "
        "statistics. Use plain BatchNorm layers with BambooStrategy(batch_norm='deferred'): running "
        "statistics over the whole global batch (every micro-batch of every pipeline), as SyncBatchNorm's "
        "running statistics are; or a per-sample normalization (LayerNorm, GroupNorm)"
    )


def batch_norm_split_warning(owner: str, attr: str, body: nn.Module, num_microbatches: int,
                             num_pipelines: int, batch_norm: str) -> str | None:
    """The warning for BatchNorm layers meeting a split batch (``num_microbatches`` x ``num_pipelines`` > 1),
    or ``None``: each micro-batch is normalized by its own statistics, so training differs from one process
    on the whole batch whatever the buffer rule."""
    split = num_microbatches * num_pipelines
    norms = [f"{attr}.{name}" for name, layer in body.named_modules() if isinstance(layer, _BatchNorm)]
    if split == 1 or not norms:
        return None
    running = (
        "its running statistics are updated once per batch from the whole global batch "
        "(batch_norm='deferred')"
        if batch_norm == "deferred" else
        "its running statistics are updated once per micro-batch, by pipeline 0's micro-batches only, and "
        "broadcast to the other pipelines (batch_norm='broadcast'; batch_norm='deferred' updates them from "
        "the whole global batch)"
    )
    return (
        f"{owner}.{attr} has BatchNorm layers ({', '.join(norms)}): the global batch is split into {split} "
        f"micro-batches (num_microbatches={num_microbatches} x {num_pipelines} pipelines), and each layer "
        "normalizes every micro-batch by the micro-batch's own statistics, so the losses and gradients "
        f"differ from a single process on the whole batch; {running}. For training equal to one process use "
        "one pipeline with num_microbatches=1, or a per-sample normalization (LayerNorm, GroupNorm)"
    )


class _Sums:
    """One BatchNorm layer's input sums over a batch's micro-batches: sample count, and per channel the sum
    and sum of squares of the input minus ``shift`` (the running mean at the batch's start, the same on every
    pipeline), which keeps the variance free of cancellation when the mean is large."""

    def __init__(self, shift: Tensor) -> None:
        self.shift = shift.detach().to(torch.float64).clone()
        self.count = 0.0
        self.sum = torch.zeros_like(self.shift)
        self.squares = torch.zeros_like(self.shift)

    def add(self, x: Tensor) -> None:
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        centered = x.detach().to(torch.float64) - self.shift.view(shape)
        self.count += x.numel() / x.shape[1]
        self.sum += centered.sum(dims)
        self.squares += (centered * centered).sum(dims)

    def flat(self) -> Tensor:
        return torch.cat([self.sum.new_tensor([self.count]), self.sum, self.squares])


def apply_deferred(layer: _BatchNorm, flat: Tensor, shift: Tensor) -> None:
    """Update ``layer``'s running statistics once with the batch statistics in ``flat`` (``count, sums,
    sums of squares`` of the input minus ``shift``), as ``F.batch_norm`` updates them from one batch:
    ``num_batches_tracked += 1``; factor ``momentum`` (or ``1 / num_batches_tracked`` when ``None``); the
    unbiased variance."""
    channels = (flat.numel() - 1) // 2
    count = float(flat[0])
    if count <= 0:
        return
    sums, squares = flat[1 : 1 + channels], flat[1 + channels :]
    mean = sums / count
    biased = (squares / count - mean * mean).clamp_min(0)
    unbiased = biased * (count / (count - 1)) if count > 1 else biased
    mean = mean + shift
    with torch.no_grad():
        assert layer.running_mean is not None and layer.running_var is not None
        if layer.num_batches_tracked is not None:
            layer.num_batches_tracked.add_(1)
        factor = (1.0 / float(layer.num_batches_tracked) if layer.momentum is None
                  else float(layer.momentum))
        layer.running_mean.mul_(1 - factor).add_(mean.to(layer.running_mean.dtype), alpha=factor)
        layer.running_var.mul_(1 - factor).add_(unbiased.to(layer.running_var.dtype), alpha=factor)


class DeferredStatistics:
    """Deferred running statistics of a set of BatchNorm layers (forward hooks, see the module docstring).

    ``attach(layers)`` hooks exactly those layers (earlier ones not among them are unhooked); between
    ``begin()`` and ``take()`` a training forward accumulates the input's sums and leaves the running
    statistics as they were; ``take()`` returns each layer's sums (and stops accumulating)."""

    def __init__(self) -> None:
        self._handles: dict[int, tuple[_BatchNorm, list[RemovableHandle]]] = {}
        self._sums: dict[int, _Sums] = {}
        self._saved: dict[int, dict[str, Tensor]] = {}
        self.active = False

    def attach(self, layers: Iterable[_BatchNorm]) -> None:
        wanted = {id(layer): layer for layer in layers if layer.track_running_stats}
        for key in [k for k in self._handles if k not in wanted]:
            for handle in self._handles.pop(key)[1]:
                handle.remove()
        for key, layer in wanted.items():
            if key not in self._handles:
                self._handles[key] = (layer, [layer.register_forward_pre_hook(self._before),
                                              layer.register_forward_hook(self._after)])

    def detach(self) -> None:
        self.attach(())

    def begin(self) -> None:
        self._sums, self._saved, self.active = {}, {}, True

    def take(self, layer: _BatchNorm) -> _Sums:
        """``layer``'s sums over the batch (zero samples if it ran no training forward)."""
        assert layer.running_mean is not None
        return self._sums.get(id(layer)) or _Sums(layer.running_mean)

    def end(self) -> None:
        self.active = False

    def _before(self, layer: nn.Module, args: tuple[Any, ...]) -> None:
        if not (self.active and layer.training) or id(layer) not in self._handles or not args:
            return
        assert isinstance(layer, _BatchNorm) and layer.running_mean is not None
        sums = self._sums.get(id(layer))
        if sums is None:
            sums = self._sums[id(layer)] = _Sums(layer.running_mean)
        sums.add(args[0])
        # the forward updates throw-away copies: the buffers themselves are never written in place (the
        # graph of this forward may hold them, and the step's snapshot refers to these very tensors)
        originals = {name: getattr(layer, name) for name in _RUNNING if getattr(layer, name) is not None}
        self._saved[id(layer)] = originals
        for name, buffer in originals.items():
            setattr(layer, name, buffer.detach().clone())

    def _after(self, layer: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        for name, buffer in self._saved.pop(id(layer), {}).items():
            setattr(layer, name, buffer)


class StageBuffers:
    """One member's buffer rule (see the module docstring) over the original stages it holds.

    The step session calls :meth:`begin` before a training batch's schedule and :meth:`finish` after it
    (collective over each stage's holders in every pipeline, stages in increasing order on every member, like
    the gradient average)."""

    def __init__(self, batch_norm: str = "broadcast") -> None:
        check_batch_norm_mode(batch_norm)
        self.mode = batch_norm
        self.deferred = DeferredStatistics()
        self._deferring = False

    def begin(self, stage_modules: dict[int, Sequence[nn.Module]], split: int) -> None:
        """Before a batch: hook this member's BatchNorm layers (``stage_modules``: original stage -> its
        layers this member holds) when deferring applies (``split``: the job's global micro-batches)."""
        self._deferring = self.mode == "deferred" and split > 1
        layers = [m for mods in stage_modules.values() for layer in mods for m in layer.modules()
                  if isinstance(m, _BatchNorm)] if self._deferring else []
        self.deferred.attach(layers)
        if self._deferring:
            self.deferred.begin()

    def finish(self, stage_modules: dict[int, Sequence[nn.Module]], stage_groups: dict[int, Any],
               sources: dict[int, int], num_pipelines: int) -> None:
        """After a batch: the deferred update (sums all-reduced over ``stage_groups[s]``) and the broadcast
        of every buffer of stage ``s`` from global rank ``sources[s]``."""
        self.deferred.end()
        for stage in sorted(stage_modules):
            modules = stage_modules[stage]
            group = stage_groups.get(stage) if num_pipelines > 1 else None
            if self._deferring:
                self._update(modules, group)
            if group is not None:
                broadcast_buffers([b for m in modules for b in m.buffers()], sources[stage], group)

    def _update(self, modules: Sequence[nn.Module], group: Any) -> None:
        layers = [m for layer in modules for m in layer.modules() if isinstance(m, _BatchNorm)
                  and m.track_running_stats]
        if not layers:
            return
        sums = [self.deferred.take(layer) for layer in layers]
        parts = [s.flat() for s in sums]
        device = layers[0].running_mean.device  # type: ignore[union-attr]
        flat = torch.cat(parts).to(device)
        if group is not None:
            dist.all_reduce(flat, group=group)
        offset = 0
        for layer, s, part in zip(layers, sums, parts, strict=True):
            apply_deferred(layer, flat[offset : offset + part.numel()], s.shift.to(device))
            offset += part.numel()


def stage_modules(layers: dict[int, nn.Module], stage_layers: Sequence[range],
                  stages: Iterable[int]) -> dict[int, list[nn.Module]]:
    """Original stage -> its layers (``layers[i]`` for ``i`` in ``stage_layers[stage]``), for ``stages``."""
    return {s: [layers[i] for i in stage_layers[s]] for s in stages}


def stage_sources(pipelines: dict[int, dict[int, int]], rank_of: Any) -> dict[int, int]:
    """Original stage -> the lowest global rank holding it in any pipeline (whose buffers the others take)."""
    stages = next(iter(pipelines.values())).keys() if pipelines else ()
    return {s: min(rank_of(owners[s]) for owners in pipelines.values()) for s in stages}


def broadcast_buffers(buffers: Sequence[Tensor], src: int, group: Any) -> None:
    """``buffers`` set to global rank ``src``'s values over ``group`` (one flat broadcast per dtype)."""
    unique = list({id(b): b for b in buffers}.values())
    for bucket in codec.by_dtype(unique):
        dtype = bucket[0].dtype
        flat = torch.cat([b.detach().reshape(-1).to(torch.uint8 if dtype == torch.bool else dtype)
                          for b in bucket])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        with torch.no_grad():
            for b in bucket:
                b.copy_(flat[offset : offset + b.numel()].view_as(b).to(dtype))
                offset += b.numel()
