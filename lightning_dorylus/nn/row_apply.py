"""AV on a first layer's input rows made per interval, just before each request goes out.

A first layer's input is the features after dropout: it needs no gradient and each interval's rows can be
made on their own (:class:`~lightning_dorylus.nn.dropout.RowSource`, hashed from global coordinates). So the
graph server makes interval ``i``'s rows and sends its request, then makes interval ``i + 1``'s while ``i``'s
is in flight, instead of making the whole ``(n, F_in)`` input before the first request, and keeps none of
them for the backward, which makes them again from the kept entries' bits (1/32 of float32 rows). That is
the synchronous engine's form of the weight-first GCN layer's first AV and GAT's ``gat.project``, and the
pipeline engine's form of the latter (its weight-first GCN layer does the same inside ``ApplyGather``).
Slicing, per-interval submission and merging go through :mod:`~lightning_dorylus.nn.functions` and the op's
declaration.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch
from torch import Tensor

from lightning_dorylus.nn.dropout import RowSource
from lightning_dorylus.nn.functions import (
    OpCall,
    Span,
    input_grads,
    interval_backward,
    kept_for_backward,
    merge_outputs,
    op_spec,
    output_grads,
    send_ahead,
    submit_each,
    to_host,
)
from lightning_dorylus.nn.runahead import RunAhead


class RowBuffers:
    """Row buffers lent to interval requests and reused once a request is answered.

    Why: a first layer's rows are made per interval (4 MiB at 8192 x 128 float32), in the forward and
    again in the backward. A fresh buffer that large is a fresh ``mmap`` whose pages the kernel faults in
    and zeroes (nearly half the cost of making the rows); with one executor worker requests are answered
    about as fast as they are made, so a handful of buffers serve every interval. An answered request's
    buffer is read by nobody: the answer came after the request was sent, and a late duplicate's answer is
    dropped. One whose answer shares its memory (an inline op returning its input) is never reused.
    """

    def __init__(self) -> None:
        self._lent: list[tuple[Tensor, Future[dict[str, Tensor]]]] = []
        self._unanswered: Tensor | None = None  # lent, its request not submitted yet

    def take(self, source: RowSource, span: Span) -> Tensor | None:
        """A buffer for rows ``span`` of ``source`` whose request was answered; ``None``: make a new one."""
        x = source.graph.partition.x
        shape = (span[1] - span[0], *x.shape[1:])
        for k, (buffer, future) in enumerate(self._lent):
            if (future.done() and buffer.shape == shape and buffer.dtype == x.dtype
                    and not _shares_memory(future, buffer)):
                del self._lent[k]
                return buffer
        return None

    def lend(self, rows: Tensor) -> Tensor:
        """``rows`` go out with the next request submitted (see :meth:`answered_by`)."""
        self._unanswered = rows
        return rows

    def answered_by(self, future: Future[dict[str, Tensor]]) -> None:
        """The request just submitted carries the rows lent last: reusable once ``future`` is done."""
        rows, self._unanswered = self._unanswered, None
        if rows is not None and rows.device.type == "cpu" and rows._base is None:  # a buffer, not a view of x
            self._lent.append((rows, future))


def _shares_memory(future: Future[dict[str, Tensor]], buffer: Tensor) -> bool:
    if future.exception() is not None:
        return False
    storage = buffer.untyped_storage().data_ptr()
    return any(t.untyped_storage().data_ptr() == storage for t in future.result().values())


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
            shared, xs, futures = prefetch.weights, prefetch.xs, prefetch.futures
        else:  # each interval's rows live until its request is answered; the backward makes them again
            shared = {n: to_host(v) for n, v in zip(names, values)}
            xs, buffers = None, RowBuffers()

            def make_rows(i: int, span: Span) -> dict[str, Tensor]:
                rows = source.rows(span[0], span[1], buffers.take(source, span))
                return {input_name: buffers.lend(to_host(rows))}

            futures = submit_each(call.executor, call.op, call.attrs, shared, spans, make_rows,
                                  buffers.answered_by)[1]
        outs = merge_outputs(spec, call.executor.wait(futures))
        saved = kept_for_backward(spec, (*shared.items(), *outs.items()))  # the version this forward used
        ctx.call, ctx.input_name, ctx.names, ctx.spans, ctx.xs = call, input_name, names, spans, xs
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

        buffers = RowBuffers()

        def rows(i: int, span: Span) -> dict[str, Tensor]:
            if ctx.xs is not None:
                return {ctx.input_name: ctx.xs[i]}
            rows = ctx.source.remake(span[0], span[1], buffers.take(ctx.source, span))
            return {ctx.input_name: buffers.lend(to_host(rows))}

        def run_ahead() -> None:
            del ctx.xs
            if ctx.runahead is not None and ctx.source.next_key is not None:
                send_ahead(call, ctx.source, ctx.input_name, dict(zip(ctx.names, live)), ctx.spans,
                           list(call.intervals), ctx.runahead, ctx.layer)

        merged = interval_backward(call, tensors, attrs, ctx.spans, rows, run_ahead,
                                   on_submit=buffers.answered_by)
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
