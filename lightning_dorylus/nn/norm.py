"""Normalisation over vertices on N graph servers: batch statistics of the whole graph, not of a partition.

A ``BatchNorm1d`` over a layer's output rows normalises with the mean and variance of the rows it sees. On a
graph server those are its partition's owned vertices, so N servers would train N different models (issue 32:
CiteSeer 59.7 % on 2 servers vs 66.0 % under ``"auto"``) and keep N different running statistics. Torch's
``SyncBatchNorm`` all-gathers the statistics but runs on CUDA only (``batch_norm_stats`` has no CPU kernel),
and the graph servers are CPU processes on gloo; :class:`GraphBatchNorm` is the same idea for any device:

* forward (batch statistics in use): SUM-all-reduce ``[count, Σx]`` per channel, then ``Σ(x - mean)²``
  (two passes: no ``Σx² - n·mean²`` cancellation), so every server normalises with the whole graph's mean
  and biased variance; the all-reduce is differentiable (its backward all-reduces the gradients), so each
  server's input gradient carries every server's loss through the shared statistics, as one process's does;
* running statistics: updated from the global mean and unbiased variance, identical on every server;
* eval with running statistics: the plain, per-row batch norm (nothing to synchronise).

The rows are what the module passes in: a Dorylus layer's output has the partition's owned rows only
(ghost rows live inside the layers), so every vertex is counted once, whatever the partitions' sizes.

:func:`convert_batchnorm` and :func:`revert_batchnorm` swap the module's ``torch.nn`` batch norms for
:class:`GraphBatchNorm` and back, reusing the same parameter and buffer tensors (the optimizer, checkpoints
and ``state_dict`` keys are unchanged), as Lightning's ``TorchSyncBatchNorm`` layer-sync plugin does under
``Trainer(sync_batchnorm=True)``. :func:`check_vertex_norms` refuses layers whose statistics span the
vertices of a graph in a way this cannot make exact (PyG's ``GraphNorm``, ``LayerNorm(mode="graph")``...).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx
from torch.nn.modules.batchnorm import _BatchNorm


class _SumOverServers(torch.autograd.Function):
    """SUM-all-reduce whose backward SUM-all-reduces the gradient (the sum's input gradient on each server
    is the sum of every server's output gradient)."""

    @staticmethod
    def forward(ctx: FunctionCtx, tensor: Tensor, group: Any) -> Tensor:
        ctx.group = group  # type: ignore[attr-defined]
        out = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return _SumOverServers.apply(grad, ctx.group), None  # type: ignore[attr-defined]


class GraphBatchNorm(_BatchNorm):
    """Batch norm whose batch statistics are the whole graph's (every graph server's rows), see the module
    docstring. Input ``(n_local, C)`` or ``(n_local, C, L)``; one process: exactly ``BatchNorm1d``."""

    def __init__(self, *args: Any, process_group: Any | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.process_group = process_group
        self.replaces: type[_BatchNorm] | None = None  # set by convert_batchnorm: the class it gives back

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            shape = tuple(input.shape)
            raise ValueError(f"{type(self).__name__} expects (vertices, channels, ...), got {shape}")

    def forward(self, input: Tensor) -> Tensor:
        batch_stats = self.training or self.running_mean is None
        if not batch_stats or not dist.is_available() or not dist.is_initialized():
            return super().forward(input)
        group = self.process_group or dist.group.WORLD
        if dist.get_world_size(group) == 1:
            return super().forward(input)
        self._check_input_dim(input)
        dims = [0, *range(2, input.dim())]
        shape = [1, -1] + [1] * (input.dim() - 2)
        count = torch.full((1,), input.numel() / max(input.shape[1], 1), dtype=input.dtype,
                           device=input.device)
        totals = _SumOverServers.apply(torch.cat([count, input.sum(dims)]), group)
        n, mean = totals[0], totals[1:] / totals[0]
        centred = input - mean.view(shape)
        var = _SumOverServers.apply(centred.pow(2).sum(dims), group) / n  # biased: what normalises
        out = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        if self.training and self.track_running_stats:
            self._update_running(mean.detach(), var.detach() * n.detach() / (n.detach() - 1))
        return out

    def _update_running(self, mean: Tensor, unbiased_var: Tensor) -> None:
        """``BatchNorm``'s update (momentum, or the cumulative average when ``momentum=None``)."""
        assert self.num_batches_tracked is not None and self.running_mean is not None
        assert self.running_var is not None
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        with torch.no_grad():
            self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
            self.running_var.mul_(1 - factor).add_(unbiased_var, alpha=factor)


_CONVERTED = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def convert_batchnorm(module: nn.Module, process_group: Any | None = None) -> nn.Module:
    """``module`` with every ``torch.nn`` ``BatchNorm1d/2d/3d`` below it replaced (in place, by
    ``setattr`` on its parent, like ``SyncBatchNorm.convert_sync_batchnorm``) by a :class:`GraphBatchNorm`
    sharing its parameters and buffers. Returns ``module`` (or its replacement if it is a batch norm)."""
    if type(module) in _CONVERTED:
        return _swap(module, GraphBatchNorm, process_group)
    for name, child in module.named_children():
        replaced = convert_batchnorm(child, process_group)
        if replaced is not child:
            setattr(module, name, replaced)
    return module


def revert_batchnorm(module: nn.Module) -> nn.Module:
    """Undoes :func:`convert_batchnorm`: each :class:`GraphBatchNorm` it made becomes its original class
    again, with the trained parameters and running statistics."""
    if isinstance(module, GraphBatchNorm) and module.replaces is not None:
        return _swap(module, module.replaces, None)
    for name, child in module.named_children():
        replaced = revert_batchnorm(child)
        if replaced is not child:
            setattr(module, name, replaced)
    return module


def _swap(old: _BatchNorm, cls: type[_BatchNorm], process_group: Any | None) -> _BatchNorm:
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    for key in ("num_features", "eps", "momentum", "affine", "track_running_stats"):
        setattr(new, key, getattr(old, key))
    if isinstance(new, GraphBatchNorm):
        new.process_group, new.replaces = process_group, type(old)
    new.weight, new.bias = old.weight, old.bias  # the same Parameters: the optimizer keeps them
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        new.register_buffer(key, getattr(old, key))
    new.train(old.training)
    if hasattr(old, "qconfig"):
        new.qconfig = old.qconfig
    return new


def _alternative(layer: nn.Module) -> str | None:
    """What to use instead of ``layer`` if its statistics span a graph's vertices in a way this module cannot
    make exact (PyG's norms, if PyG is installed), else ``None``."""
    try:
        from torch_geometric.nn import norm as pyg
    except ImportError:  # pragma: no cover - PyG comes with the package's models
        return None
    per_vertex = "a per-vertex norm (torch.nn.LayerNorm, or torch_geometric.nn.LayerNorm(mode='node'))"
    batch_norm = "torch.nn.BatchNorm1d (DorylusStrategy makes its statistics the whole graph's)"
    if isinstance(layer, pyg.LayerNorm):
        return f"{per_vertex}, or {batch_norm}" if layer.mode == "graph" else None
    if isinstance(layer, pyg.GraphSizeNorm):
        return "a constant computed from batch.num_global_nodes, or no size norm"
    if isinstance(layer, (pyg.GraphNorm, pyg.InstanceNorm, pyg.PairNorm, pyg.MeanSubtractionNorm)):
        return f"{batch_norm}, or {per_vertex}"
    return None


def check_vertex_norms(module: nn.Module) -> None:
    """Raises ``TypeError`` naming the first layer of ``module`` whose statistics over a graph's vertices a
    graph server would compute from its own partition only, and what to use instead."""
    for name, child in module.named_modules():
        instead = _alternative(child)
        if instead is not None:
            raise TypeError(
                f"{type(module).__name__}.{name} ({type(child).__module__}.{type(child).__name__}) takes "
                "statistics over the vertices of a graph; a graph server sees only its partition, so N "
                f"servers would train another model than one process. Use {instead}"
            )
