"""AV on a first layer's input rows made per interval, just before each request goes out.

A first layer's input is the features after dropout: it needs no gradient and each interval's rows can be
made on their own (:class:`~lightning_dorylus.nn.dropout.RowSource`, hashed from global coordinates). So in
the pipeline engine the graph server makes interval ``i``'s rows and sends its request, then makes interval
``i + 1``'s while ``i``'s is in flight, instead of making the whole ``(n, F_in)`` input before the first
request (the weight-first GCN layer does the same inside ``ApplyGather``; this is the form for an AV op with
no GA fused to it, e.g. GAT's ``gat.project``). Slicing, per-interval submission and merging go through
:mod:`~lightning_dorylus.nn.functions` and the op's declaration.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_dorylus.executors import TensorOpRequest
from lightning_dorylus.nn.dropout import RowSource
from lightning_dorylus.nn.functions import OpCall, kept_for_backward, merge_outputs, op_spec, slice_inputs


def _cpu(t: Tensor) -> Tensor:
    return t.detach().to("cpu").contiguous()


class ApplyRows(torch.autograd.Function):
    """``call.op`` per interval with row input ``input_name`` made by ``source`` per interval (no gradient
    flows to it); gradients of the other (shared) inputs from the declared backward op, per interval."""

    @staticmethod
    def forward(
        ctx: Any, call: OpCall, source: RowSource, input_name: str, names: tuple[str, ...], *values: Tensor
    ) -> tuple[Tensor, ...]:
        spec = op_spec(call.op)
        assert spec.backward is not None
        shared = {n: _cpu(v) for n, v in zip(names, values)}
        spans = [(a, b, 0, 0) for a, b in call.intervals]
        xs, futures = [], []
        for i, span in enumerate(spans):  # interval i's rows are made while i - 1's request is out
            x_i = _cpu(source.rows(span[0], span[1]))
            xs.append(x_i)
            inputs = {input_name: x_i, **slice_inputs(spec, shared, span)}
            futures.append(call.executor.submit(TensorOpRequest(call.op, inputs, call.attrs, interval=i)))
        outs = merge_outputs(spec, call.executor.wait(futures))
        saved = kept_for_backward(spec, (*shared.items(), *outs.items()))
        ctx.call, ctx.input_name, ctx.names, ctx.spans, ctx.xs = call, input_name, names, spans, xs
        ctx.saved_names, ctx.output_names, ctx.device = tuple(saved), spec.outputs, values[0].device
        ctx.output_like = {n: (tuple(outs[n].shape), outs[n].dtype) for n in spec.outputs}
        ctx.save_for_backward(*saved.values())
        return tuple(outs[n].to(ctx.device) for n in spec.outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        call: OpCall = ctx.call
        bwd_name = op_spec(call.op).backward
        assert bwd_name is not None
        bwd = op_spec(bwd_name)
        tensors = dict(zip(ctx.saved_names, ctx.saved_tensors))
        for name, grad in zip(ctx.output_names, grads):
            if f"grad_{name}" in bwd.required or f"grad_{name}" in bwd.optional:
                shape, dtype = ctx.output_like[name]
                tensors[f"grad_{name}"] = _cpu(grad) if grad is not None else torch.zeros(shape, dtype=dtype)
        attrs = dict(call.attrs)
        if ctx.input_name in bwd.grad_flags:
            attrs[f"needs_grad_{ctx.input_name}"] = False  # rows from a RowSource need no gradient
        futures = []
        for i, span in enumerate(ctx.spans):
            inputs = {ctx.input_name: ctx.xs[i], **slice_inputs(bwd, tensors, span)}
            futures.append(call.executor.submit(TensorOpRequest(bwd_name, inputs, attrs, interval=i)))
        del ctx.xs
        merged = merge_outputs(bwd, call.executor.wait(futures))
        needs = dict(zip(ctx.names, ctx.needs_input_grad[4:]))
        result: list[Tensor | None] = [None, None, None, None]
        for name, need in needs.items():
            grad = merged.get(f"grad_{name}")
            result.append(grad.to(ctx.device) if need and grad is not None else None)
        return tuple(result)


def apply_rows(call: OpCall, source: RowSource, input_name: str, **shared: Tensor) -> tuple[Tensor, ...]:
    """Differentiable ``call.op`` per interval of ``call.intervals`` whose row input ``input_name`` is made
    by ``source`` per interval; ``shared`` are the op's other inputs (weights, sent whole). Outputs in the
    order of the op's declared ``outputs``."""
    if not call.intervals:
        raise ValueError("apply_rows needs at least one interval")
    if not shared:
        raise ValueError("apply_rows needs the op's weights (shared inputs): none were given")
    return ApplyRows.apply(call, source, input_name, tuple(shared), *shared.values())
