"""AV on a first layer's input rows made per interval, just before each request goes out.

A first layer's input is the features after dropout: it needs no gradient and each interval's rows can be
made on their own (:class:`~lightning_dorylus.nn.dropout.RowSource`, hashed from global coordinates). So the
graph server makes interval ``i``'s rows and sends its request, then makes interval ``i + 1``'s while ``i``'s
is in flight, instead of making the whole ``(n, F_in)`` input before the first request, and keeps none of
them for the backward, which makes them again from the kept entries' bits (1/32 of float32 rows). That is
GAT's ``gat.project`` on a first layer's input, in every mode (the weight-first GCN layer does the same
inside ``ApplyGather``).
Slicing, per-interval submission and merging go through :mod:`~lightning_dorylus.nn.functions` and the op's
declaration.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_dorylus.nn.dropout import RowSource
from lightning_dorylus.nn.functions import (
    OpCall,
    input_grads,
    interval_backward,
    kept_for_backward,
    merge_outputs,
    op_spec,
    output_grads,
    remade_rows,
    send_ahead,
    submit_rows,
    to_host,
)
from lightning_dorylus.nn.runahead import RunAhead


class ApplyRows(torch.autograd.Function):
    """``call.op`` per interval with row input ``input_name`` made by ``source`` per interval (no gradient
    flows to it); gradients of the other (shared) inputs from the declared backward op, per interval, whose
    requests carry the rows made again (:meth:`RowSource.remake`), equal to the forward's bit for bit.

    With ``runahead`` (``staleness >= 1``, training, ``source.next_key`` known) the backward also sends the
    next step's requests while its own backward requests are out, with the shared inputs (weights) as they
    are then; the next forward takes them (:mod:`.runahead`). A forward made from such a prefetch keeps the
    version its requests carried, so its backward sends that version too (``gat.project``'s backward reads
    ``att_src``/``att_dst``/``weight``): each interval's forward and backward use one weight version.
    """

    @staticmethod
    def forward(
        ctx: Any, call: OpCall, source: RowSource, input_name: str, runahead: RunAhead | None, layer: int,
        names: tuple[str, ...], *values: Tensor
    ) -> tuple[Tensor, ...]:
        spec = op_spec(call.op)
        assert spec.backward is not None
        spans = [(a, b, 0, 0) for a, b in call.intervals]
        prefetch = runahead.take(layer, source.key, list(call.intervals)) if runahead is not None else None
        if prefetch is not None:  # sent during the previous step's backward, with that step's weights
            shared, futures, made_by = prefetch.weights, prefetch.futures, prefetch.source
        else:  # each interval's rows live until its request is answered; the backward makes them again
            shared = {n: to_host(v) for n, v in zip(names, values)}
            futures, made_by = submit_rows(call, source, input_name, shared, spans), source
        outs = merge_outputs(spec, call.executor.wait(futures))
        saved = kept_for_backward(spec, (*shared.items(), *outs.items()))  # the version this forward used
        ctx.call, ctx.input_name, ctx.names, ctx.spans, ctx.made_by = call, input_name, names, spans, made_by
        ctx.has = {f"has_{n}": n in shared for n in spec.optional}
        ctx.source, ctx.runahead, ctx.layer = source, runahead, layer
        ctx.saved_names, ctx.output_names, ctx.device = tuple(saved), spec.outputs, values[0].device
        ctx.output_like = {n: (tuple(outs[n].shape), outs[n].dtype) for n in spec.outputs}
        ctx.save_for_backward(*saved.values(), *values)  # then the live parameters (for the run-ahead)
        return tuple(outs[n].to(ctx.device) for n in spec.outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        call: OpCall = ctx.call
        bwd = op_spec(op_spec(call.op).backward)  # type: ignore[arg-type]
        n_saved = len(ctx.saved_names)
        tensors = dict(zip(ctx.saved_names, ctx.saved_tensors[:n_saved]))
        live = ctx.saved_tensors[n_saved:]
        tensors.update(output_grads(bwd, ctx.output_names, grads, ctx.output_like))
        attrs = {**call.attrs, **ctx.has}
        if ctx.input_name in bwd.grad_flags:
            attrs[f"needs_grad_{ctx.input_name}"] = False  # rows from a RowSource need no gradient

        rows, answered_by = remade_rows(ctx.made_by, ctx.input_name)

        def run_ahead() -> None:
            if ctx.runahead is not None and ctx.source.next_key is not None:
                send_ahead(call, ctx.source, ctx.input_name, dict(zip(ctx.names, live)), ctx.spans,
                           list(call.intervals), ctx.runahead, ctx.layer)

        merged = interval_backward(call, tensors, attrs, ctx.spans, rows, run_ahead, on_submit=answered_by)
        return (None,) * 6 + tuple(input_grads(ctx.names, ctx.needs_input_grad[6:], merged, ctx.device))


def apply_rows(
    call: OpCall, source: RowSource, input_name: str, runahead: RunAhead | None = None, layer: int = 0,
    **shared: Tensor,
) -> tuple[Tensor, ...]:
    """Differentiable ``call.op`` per interval of ``call.intervals`` whose row input ``input_name`` is made
    by ``source`` per interval; ``shared`` are the op's other inputs (weights, sent whole). ``runahead``:
    the graph server's :class:`~lightning_dorylus.nn.runahead.RunAhead` (``staleness >= 1``, training),
    under ``layer``. Outputs in the order of the op's declared ``outputs``."""
    if not call.intervals:
        raise ValueError("apply_rows needs at least one interval")
    if not shared:
        raise ValueError("apply_rows needs the op's weights (shared inputs): none were given")
    return ApplyRows.apply(call, source, input_name, runahead, layer, tuple(shared), *shared.values())
