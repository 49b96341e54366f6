"""Every tensor op (ApplyVertex, ApplyEdge) as ONE autograd node whose work is done by a tensor-op executor.

The op's :class:`~lightning_dorylus.ops.spec.OpSpec` says how it splits over the partition's vertex intervals
(row, edge and pointer inputs; concatenated and summed outputs) and which op is its backward, so this module
is the only place that slices inputs, submits one request per interval and puts the results back together
(:func:`submit_each`, :func:`collect`, :func:`merge_outputs`); every stage's node (``TensorOp`` here,
``GatherApply``, ``ApplyGather``, ``ApplyEdgeGather``), in every mode, submits through them.
The backward sends the mirrored op per interval with everything it needs passed explicitly (inputs, weights,
saved outputs, output gradients); weight gradients come back per interval and are summed on the graph
server. No autograd state crosses the executor boundary, only named arrays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_dorylus.executors import TensorOpExecutor, TensorOpRequest
from lightning_dorylus.graph.structure import TransposedSum
from lightning_dorylus.nn.row_buffers import RowBuffers
from lightning_dorylus.nn.runahead import Prefetch, RunAhead
from lightning_dorylus.ops.handlers import OPS
from lightning_dorylus.ops.spec import OpSpec

Span = tuple[int, int, int, int]  # rows a:b, edges e0:e1 of one interval


def op_spec(op: str) -> OpSpec:
    """The declaration of ``op``; raises naming the valid ops."""
    spec = OPS.get(op)
    if spec is None:
        raise ValueError(f"unknown op {op!r}; valid ops are {sorted(OPS)}")
    return spec


def interval_spans(
    spec: OpSpec, tensors: dict[str, Tensor], intervals: Sequence[tuple[int, int]]
) -> list[Span]:
    """``(a, b, e0, e1)`` per interval (edge span from the op's CSR pointer input; 0, 0 for vertex-only ops).

    No intervals (an empty partition) gives one empty span, so the op still runs once and the outputs get
    their widths.
    """
    ptr = tensors[spec.ptr_inputs[0]].tolist() if spec.ptr_inputs else None
    spans = [(a, b, ptr[a], ptr[b]) if ptr else (a, b, 0, 0) for a, b in intervals]
    return spans or [(0, 0, 0, 0)]


def slice_inputs(spec: OpSpec, tensors: dict[str, Tensor], span: Span) -> dict[str, Tensor]:
    """One interval's inputs: rows ``[a:b]``, edges ``[e0:e1]``, pointers rebased, the rest whole."""
    a, b, e0, e1 = span
    out = {}
    for name, t in tensors.items():
        kind = spec.split_kind(name)
        if kind == "row":
            out[name] = t[a:b]
        elif kind == "edge":
            out[name] = t[e0:e1]
        elif kind == "ptr":
            out[name] = (t[a : b + 1] - e0).contiguous()
        else:
            out[name] = t
    return out


PerInterval = Callable[[int, Span], "dict[str, Tensor] | None"]
OnResult = Callable[[int, Span, "dict[str, Tensor]"], None]


def submit_each(
    executor: TensorOpExecutor,
    op: str,
    attrs: dict[str, Any],
    shared: dict[str, Tensor],
    spans: Sequence[Span],
    per_interval: PerInterval | None = None,
    on_submit: Callable[[Future[dict[str, Tensor]]], None] | None = None,
) -> tuple[list[tuple[int, Span]], list[Future[dict[str, Tensor]]]]:
    """The one per-interval submit loop of every interval op, forward and backward: interval ``i``'s request
    is ``shared`` cut to its span (as ``op`` declares) plus ``per_interval(i, span)``, server work made just
    before the request goes out (its GA, its rows, its ∇GA; ``None``: no request for this interval), so the
    server's work on ``i + 1`` overlaps ``i``'s request. All are submitted before any is waited for;
    ``on_submit`` sees each request's future as it goes out. Returns the ``(interval, span)`` of each
    request sent, and their futures."""
    spec = op_spec(op)
    sent: list[tuple[int, Span]] = []
    futures: list[Future[dict[str, Tensor]]] = []
    for i, span in enumerate(spans):
        extra = per_interval(i, span) if per_interval is not None else {}
        if extra is None:
            continue
        inputs = {**extra, **slice_inputs(spec, shared, span)}
        futures.append(executor.submit(TensorOpRequest(op, inputs, attrs, interval=i)))
        sent.append((i, span))
        if on_submit is not None:
            on_submit(futures[-1])
    return sent, futures


def collect(
    executor: TensorOpExecutor,
    op: str,
    sent: Sequence[tuple[int, Span]],
    futures: Sequence[Future[dict[str, Tensor]]],
    on_result: OnResult | None = None,
) -> dict[str, Tensor]:
    """The results of :func:`submit_each`'s requests, merged as ``op`` declares. With ``on_result``, taken
    one by one in interval order (deterministic sums) and handed to it first, so the server's share of each
    (e.g. its GA, added into a buffer; it pops what it consumes) overlaps the later requests."""
    if not futures:
        return {}
    if on_result is None:
        return merge_outputs(op_spec(op), executor.wait(list(futures)))
    outs = []
    for (i, span), future in zip(sent, futures):
        (out,) = executor.wait([future])
        on_result(i, span, out)
        outs.append(out)
    return merge_outputs(op_spec(op), outs)


def merge_outputs(spec: OpSpec, outs: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Concatenate row/edge outputs and add up summed outputs, over the intervals' results (in order)."""
    merged: dict[str, Tensor] = {}
    for name in outs[0]:
        parts = [o[name] for o in outs]
        if spec.merge_kind(name) == "sum":
            total = parts[0].clone()
            for part in parts[1:]:
                total += part
            merged[name] = total
        else:
            merged[name] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return merged


def run_intervals(
    executor: TensorOpExecutor,
    op: str,
    tensors: dict[str, Tensor],
    attrs: dict[str, Any],
    intervals: Sequence[tuple[int, int]],
) -> dict[str, Tensor]:
    """Run ``op`` on every interval (CPU tensors in and out) and merge the results."""
    sent, futures = submit_each(executor, op, attrs, tensors, interval_spans(op_spec(op), tensors, intervals))
    return collect(executor, op, sent, futures)


def kept_for_backward(spec: OpSpec, tensors: Iterable[tuple[str, Tensor]]) -> dict[str, Tensor]:
    """The named ``tensors`` that ``spec``'s backward op reads: what a forward keeps for it (by name)."""
    assert spec.backward is not None, "a forward op with no declared backward keeps nothing"
    bwd = op_spec(spec.backward)
    wanted = set(bwd.required) | set(bwd.optional)
    return {name: t for name, t in tensors if name in wanted}


def to_host(t: Tensor) -> Tensor:
    """A detached, contiguous CPU copy (or view): what a tensor request carries."""
    return t.detach().to("cpu").contiguous()


def output_grads(
    bwd: OpSpec, output_names: Sequence[str], grads: Sequence[Tensor | None],
    output_like: dict[str, tuple[tuple[int, ...], torch.dtype]],
) -> dict[str, Tensor]:
    """The ``grad_<output>`` inputs the backward op ``bwd`` declares, on the host; an output autograd gave
    no gradient for gets zeros of its shape."""
    tensors: dict[str, Tensor] = {}
    for name, grad in zip(output_names, grads):
        key = f"grad_{name}"
        if key in bwd.required or key in bwd.optional:
            shape, dtype = output_like[name]
            tensors[key] = to_host(grad) if grad is not None else torch.zeros(shape, dtype=dtype)
    return tensors


def submit_rows(
    call: OpCall, source: Any, input_name: str, shared: dict[str, Tensor], spans: Sequence[Span]
) -> list[Future]:
    """Interval ``i``'s row input made by ``source.rows(a, b)`` (a ``RowSource``) and its ``call.op`` request
    sent, then ``i + 1``'s while ``i``'s is out; ``shared`` (weights) go as the op declares them. The rows go
    into buffers reused once their request is answered (:class:`RowBuffers`) and are not kept: a backward
    makes them again (:func:`remade_rows`). The futures."""
    buffers = RowBuffers()

    def make_rows(i: int, span: Span) -> dict[str, Tensor]:
        rows = source.rows(span[0], span[1], buffers.take(source, span))
        return {input_name: buffers.lend(to_host(rows))}

    return submit_each(call.executor, call.op, call.attrs, shared, spans, make_rows, buffers.answered_by)[1]


def remade_rows(
    source: Any, input_name: str
) -> tuple[PerInterval, Callable[[Future[dict[str, Tensor]]], None]]:
    """A backward's ``per_interval`` and ``on_submit`` (:func:`interval_backward`) sending interval ``i``'s
    rows of ``source`` made again (``source.remake``: from the kept entries' bits, equal to the forward's
    rows bit for bit) in reused buffers, instead of rows kept since the forward (``n x F_in`` per layer)."""
    buffers = RowBuffers()

    def rows(i: int, span: Span) -> dict[str, Tensor]:
        made = source.remake(span[0], span[1], buffers.take(source, span))
        return {input_name: buffers.lend(to_host(made))}

    return rows, buffers.answered_by


def send_ahead(
    call: OpCall, source: Any, input_name: str, params: dict[str, Tensor], spans: Sequence[Span], cut: list,
    runahead: RunAhead, layer: int,
) -> None:
    """Send the next step's first-layer requests now (rows from ``source`` under its ``next_key``), with
    ``params`` as they are: copied, as the optimizer updates them in place while the requests may still wait
    to be encoded, and the next backward may need exactly this version. Kept in ``runahead`` under
    ``layer``, with ``cut`` (what the requests were cut by) for the next forward to match, and the source
    that made the rows (it holds their kept-entry bits, so the next backward remakes them cheaply)."""
    source = dataclasses.replace(source, key=source.next_key, next_key=None)
    version = {n: p.detach().to("cpu", copy=True).contiguous() for n, p in params.items()}
    futures = submit_rows(call, source, input_name, version, spans)
    runahead.put(layer, Prefetch(source.key, cut, source, futures, version))


def row_spans(intervals: Sequence[tuple[int, int]]) -> list[Span]:
    """The spans of a vertex op's requests (no edge span); no intervals (an empty partition): one empty
    span, so the op still runs once and its outputs get their widths."""
    return [(a, b, 0, 0) for a, b in intervals] or [(0, 0, 0, 0)]


@dataclass
class OpCall:
    """Where and how to run one differentiable tensor op: op name, executor, intervals, JSON attrs."""

    op: str
    executor: TensorOpExecutor
    intervals: Sequence[tuple[int, int]]
    attrs: dict[str, Any] = field(default_factory=dict)


def interval_backward(
    call: OpCall,
    shared: dict[str, Tensor],
    attrs: dict[str, Any],
    spans: Sequence[Span],
    per_interval: PerInterval | None = None,
    while_out: Callable[[], None] | None = None,
    on_result: OnResult | None = None,
    on_submit: Callable[[Future[dict[str, Tensor]]], None] | None = None,
) -> dict[str, Tensor]:
    """The backward of every interval op: ``call.op``'s declared backward op, one request per span.

    Interval ``i``'s request carries ``shared`` cut to its span plus ``per_interval(i, span)``, server work
    made just before the request goes out (∇GA of its rows, its saved rows; ``None``: no request for this
    interval), so the server's work on ``i + 1`` overlaps ``i``'s request. ``while_out`` runs once every
    request is out (the run-ahead). Results are taken in interval order, so sums are deterministic:
    ``on_result(i, span, out)`` consumes its part (e.g. adds ∇GA into ``∇H``, popping it); the rest is merged
    as the backward op declares (concatenated or summed). ``on_submit``: as :func:`submit_each`'s."""
    bwd_name = op_spec(call.op).backward
    assert bwd_name is not None, f"op {call.op!r} declares no backward"
    sent, futures = submit_each(call.executor, bwd_name, attrs, shared, spans, per_interval, on_submit)
    if while_out is not None:
        while_out()
    return collect(call.executor, bwd_name, sent, futures, on_result)


def input_grads(
    names: Sequence[str], needs: Sequence[bool], merged: dict[str, Tensor], device: torch.device
) -> list[Tensor | None]:
    """Autograd's gradients of the named inputs: ``grad_<name>`` of the merged backward outputs on
    ``device`` where an input needs one, else ``None``."""
    result: list[Tensor | None] = []
    for name, need in zip(names, needs):
        grad = merged.get(f"grad_{name}")
        result.append(grad.to(device) if need and grad is not None else None)
    return result


@dataclass(frozen=True)
class RowInput:
    """A row input made per interval: ``source`` (a ``RowSource``: a first layer's dropped-out features,
    needing no gradient) makes interval ``i``'s rows of input ``name`` just before its request goes out,
    and they are not kept: the backward makes them again from the kept entries' bits
    (:meth:`RowSource.remake`, equal bit for bit). ``runahead`` (``staleness >= 1``, training): the graph
    server's :class:`~lightning_dorylus.nn.runahead.RunAhead`, under ``layer``."""

    source: Any
    name: str
    runahead: RunAhead | None = None
    layer: int = 0


class TensorOp(torch.autograd.Function):
    """``op`` forward per interval on the executor; its declared backward op per interval in backward: AV
    or AE alone, every interval's request in flight at once.

    With a :class:`RowInput` the row input is made per interval (and made again in the backward), and with
    its ``runahead`` (``source.next_key`` known) the backward also sends the next step's requests while its
    own are out, with the other inputs (weights) as they are then; the next forward takes them
    (:mod:`.runahead`). A forward made from such a prefetch keeps the version its requests carried, so its
    backward sends that version too (``gat.project``'s backward reads ``att_src``/``att_dst``/``weight``):
    each interval's forward and backward use one weight version.
    """

    @staticmethod
    def forward(
        ctx: Any, call: OpCall, names: tuple[str, ...], rows: RowInput | None, *values: Tensor | None
    ) -> tuple[Tensor, ...]:
        spec = op_spec(call.op)
        if spec.backward is None:
            raise ValueError(f"op {call.op!r} is not a forward op (it declares no backward)")
        present = {n: to_host(v) for n, v in zip(names, values) if v is not None}
        made_by = None
        if rows is None:
            outs = run_intervals(call.executor, call.op, present, call.attrs, call.intervals)
        else:
            runahead = rows.runahead
            prefetch = runahead.take(rows.layer, rows.source.key, list(call.intervals)) if runahead else None
            if prefetch is not None:  # sent during the previous step's backward, with that step's weights
                present, futures, made_by = prefetch.weights, prefetch.futures, prefetch.source
            else:  # each interval's rows live until its request is answered; the backward makes them again
                futures = submit_rows(call, rows.source, rows.name, present, row_spans(call.intervals))
                made_by = rows.source
            outs = merge_outputs(spec, call.executor.wait(futures))
        device = next(v.device for v in values if v is not None)
        saved = kept_for_backward(spec, (*present.items(), *outs.items()))  # the version this forward used
        live = {n: v for n, v in zip(names, values) if v is not None} if rows is not None else {}
        ctx.call, ctx.names, ctx.device, ctx.rows, ctx.made_by = call, names, device, rows, made_by
        ctx.has = {f"has_{n}": n in present for n in spec.optional}
        ctx.saved_names, ctx.live_names = tuple(saved), tuple(live)
        ctx.output_names = spec.outputs
        ctx.output_like = {n: (tuple(outs[n].shape), outs[n].dtype) for n in spec.outputs}
        ctx.save_for_backward(*saved.values(), *live.values())  # then the live parameters (run-ahead)
        return tuple(outs[n].to(device) for n in spec.outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        call: OpCall = ctx.call
        bwd = op_spec(op_spec(call.op).backward)  # type: ignore[arg-type]
        n_saved = len(ctx.saved_names)
        saved = dict(zip(ctx.saved_names, ctx.saved_tensors[:n_saved]))
        live = dict(zip(ctx.live_names, ctx.saved_tensors[n_saved:]))
        tensors = output_grads(bwd, ctx.output_names, grads, ctx.output_like)
        tensors.update({n: t for n, t in saved.items() if n in bwd.required or n in bwd.optional})
        attrs = {**call.attrs, **ctx.has}
        needs = ctx.needs_input_grad[3:]
        for name in bwd.grad_flags:  # a RowInput's rows are not among the names: they need no gradient
            attrs[f"needs_grad_{name}"] = bool(dict(zip(ctx.names, needs)).get(name, False))
        rows: RowInput | None = ctx.rows
        if rows is None:
            merged = interval_backward(call, tensors, attrs, interval_spans(bwd, tensors, call.intervals))
        else:
            remade, answered_by = remade_rows(ctx.made_by, rows.name)
            spans = row_spans(call.intervals)

            def run_ahead() -> None:
                if rows.runahead is not None and rows.source.next_key is not None:
                    send_ahead(call, rows.source, rows.name, live, spans, list(call.intervals), rows.runahead,
                               rows.layer)

            merged = interval_backward(call, tensors, attrs, spans, remade, run_ahead, on_submit=answered_by)
        del tensors, saved  # the inputs are no longer needed once the results are back
        return (None, None, None, *input_grads(ctx.names, needs, merged, ctx.device))


def tensor_op(call: OpCall, **tensors: Tensor | None) -> tuple[Tensor, ...]:
    """Differentiable ``call.op`` on named tensors (``None`` = an absent optional input); outputs in the
    order of the op's declared ``outputs``."""
    names = tuple(tensors)
    return TensorOp.apply(call, names, None, *tensors.values())


def rows_op(call: OpCall, rows: RowInput, **shared: Tensor) -> tuple[Tensor, ...]:
    """Differentiable ``call.op`` (the same :class:`TensorOp`) whose row input ``rows.name`` is made per
    interval of ``call.intervals`` by ``rows.source``; ``shared`` are the op's other inputs (weights, sent
    whole). Outputs in the order of the op's declared ``outputs``."""
    if not call.intervals:
        raise ValueError("rows_op needs at least one interval")
    if not shared:
        raise ValueError("rows_op needs the op's weights (shared inputs): none were given")
    return TensorOp.apply(call, tuple(shared), rows, *shared.values())


class GatherApply(torch.autograd.Function):
    """GA then AV: the engine's unit of overlap between graph and tensor work, at the GA granularity of
    ``blocks`` (:meth:`~lightning_dorylus.graph.GraphContext.blocks`), with one request per interval.

    Forward: at interval ``i`` the server runs the GA of the block holding its rows if not done yet
    (``z = Â[block] h_full``), then submits AV ``op`` on rows ``z[a:b]`` at once, and goes on with the next
    interval while ``i``'s request is in flight. Per-interval blocks: GA of ``i + 1`` overlaps AV of ``i``
    (the pipeline); one whole block: the whole GA, then every request in flight at once (synchronous).
    Backward: every interval's ``*.backward`` request is submitted at once; results are taken in interval
    order (so sums are deterministic) and each group's ∇GA ``Â[a0:b1]ᵀ grad_z`` is added into
    ``grad_h_full`` when its last interval is in (:class:`TransposedSum`), while later intervals are still
    in flight. The values do not depend on the granularity (the backward's sum runs per group).
    """

    @staticmethod
    def forward(
        ctx: Any,
        call: OpCall,
        blocks: list,
        gather_input: str,
        h_full: Tensor,
        names: tuple[str, ...],
        *values: Tensor | None,
    ) -> tuple[Tensor, ...]:
        spec = op_spec(call.op)
        assert spec.backward is not None
        present = {n: to_host(v) for n, v in zip(names, values) if v is not None}
        h_cpu = to_host(h_full)
        zs: list[Tensor] = []  # the GA of each block, in order

        def gather_rows(i: int, span: Span) -> dict[str, Tensor]:
            a, b = span[0], span[1]
            while not zs or b > blocks[len(zs) - 1].rows[1]:  # GA of the block holding these rows
                zs.append(torch.sparse.mm(blocks[len(zs)].adj, h_cpu))
            a0 = blocks[len(zs) - 1].rows[0]
            return {gather_input: zs[-1][a - a0 : b - a0]}

        spans = row_spans(call.intervals)
        sent, futures = submit_each(call.executor, call.op, call.attrs, present, spans, gather_rows)
        outs = collect(call.executor, call.op, sent, futures)
        z = torch.cat(zs) if len(zs) > 1 else zs[0]
        saved = kept_for_backward(spec, [*present.items(), (gather_input, z), *outs.items()])
        ctx.call, ctx.blocks, ctx.gather_input, ctx.names = call, blocks, gather_input, names
        ctx.device, ctx.n_full, ctx.width = h_full.device, h_full.size(0), h_full.size(1)
        ctx.dtype, ctx.spans = h_cpu.dtype, spans
        ctx.has = {f"has_{n}": n in present for n in spec.optional}
        ctx.saved_names, ctx.output_names = tuple(saved), spec.outputs
        ctx.save_for_backward(*saved.values())
        return tuple(outs[n].to(h_full.device) for n in spec.outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        call: OpCall = ctx.call
        bwd = op_spec(op_spec(call.op).backward)  # type: ignore[arg-type]
        tensors = dict(zip(ctx.saved_names, ctx.saved_tensors))
        for out_name, grad in zip(ctx.output_names, grads):
            key = f"grad_{out_name}"
            if key in bwd.required or key in bwd.optional:
                tensors[key] = to_host(grad)
        attrs = {**call.attrs, **ctx.has}
        needs = ctx.needs_input_grad[5:]
        needs_h = bool(ctx.needs_input_grad[3])
        for name in bwd.grad_flags:
            attrs[f"needs_grad_{name}"] = (
                needs_h if name == ctx.gather_input else bool(dict(zip(ctx.names, needs)).get(name, False))
            )
        grad_h = torch.zeros((ctx.n_full, ctx.width), dtype=ctx.dtype) if needs_h else None

        gather_grads = TransposedSum(ctx.blocks, grad_h) if grad_h is not None else None

        def add_gather_grad(i: int, span: Span, out: dict[str, Tensor]) -> None:
            if gather_grads is not None:  # ∇GA of this interval's group, over the rows it touches
                gather_grads.add(out.pop(f"grad_{ctx.gather_input}"), span[1])

        merged = interval_backward(call, tensors, attrs, ctx.spans, on_result=add_gather_grad)
        grad_h_out = grad_h.to(ctx.device) if grad_h is not None else None
        return (None, None, None, grad_h_out, None, *input_grads(ctx.names, needs, merged, ctx.device))


def gather_apply(
    call: OpCall, blocks: list, gather_input: str, h_full: Tensor, **tensors: Tensor | None
) -> tuple[Tensor, ...]:
    """Differentiable GA (``blocks``: per interval, or one whole block) + AV ``call.op`` per interval of
    ``call.intervals``; the GA result feeds input ``gather_input``; other row inputs and the weights are
    ``tensors``."""
    if not blocks:
        raise ValueError("gather_apply needs at least one adjacency block")
    return GatherApply.apply(call, blocks, gather_input, h_full, tuple(tensors), *tensors.values())


class ApplyGather(torch.autograd.Function):
    """AV ``P = x W`` per interval, and the local columns' part of GA as the results come back: the
    weight-first GCN layer's unit of overlap.

    Forward: interval ``i``'s rows ``x[a:b]`` (or ``source.rows(a, b)``, made just before its request goes
    out) are submitted as AV ``P_i = x_i W`` at once; results are taken in interval order (so sums are
    deterministic) and, with per-interval column ``blocks``, each group's column block
    ``Â[:, a0:b1] P[a0:b1]`` is added into ``Z_local`` when its last interval is in (:class:`TransposedSum`),
    while later intervals are still in flight. Returns ``(P, Z_local)``: the caller scatters ``P`` (SC) and
    adds the remaining columns' share (:func:`column_gather`: the ghost block; without ``blocks``, the
    synchronous granularity, the whole ``Â`` after SC, and ``Z_local`` is an empty ``(0, F_out)``
    placeholder). Backward: for interval ``i``,
    ∇GA of its rows ``Âᵀ[a:b] ∇Z`` (per-interval blocks) plus the gradient SC brought back (``∇P``) form
    ``∇P_i``, whose ∇AV request goes out at once, so ∇GA of interval ``i + 1`` overlaps ∇AV of ``i``. With
    ``runahead`` (``staleness >= 1``, a first layer fed by a ``RowSource``) the backward also sends the next
    epoch's AV requests while its own ∇AV requests are out (:mod:`.runahead`).
    """

    @staticmethod
    def forward(
        ctx: Any, call: OpCall, blocks: list, source: Any, runahead: Any, layer: int, x: Tensor | None,
        weight: Tensor,
    ) -> tuple[Tensor, Tensor]:
        spans = row_spans(call.intervals)
        cut = list(call.intervals)
        prefetch = runahead.take(layer, source.key, cut) if runahead is not None else None
        xs: list[Tensor] | None = None  # the rows of an input tensor (views); a source's are made again
        if prefetch is not None:  # sent during the previous epoch's backward, with that epoch's weights
            w, futures, made_by = prefetch.weights["weight"], prefetch.futures, prefetch.source
        elif x is None:
            w, made_by = to_host(weight), source
            futures = submit_rows(call, source, "z", {"weight": w}, spans)
        else:
            w, made_by = to_host(weight), None
            xs = [to_host(x[a:b]) for a, b, _, _ in spans]
            futures = submit_each(call.executor, call.op, call.attrs, {"weight": w}, spans,
                                  lambda i, span: {"z": xs[i]})[1]
        # without local column blocks (synchronous) GA runs whole after SC: Z_local stays an empty placeholder
        z = torch.zeros((spans[-1][1] if blocks else 0, w.size(1)), dtype=w.dtype)
        columns = TransposedSum(blocks, z)

        def gather_columns(i: int, span: Span, out: dict[str, Tensor]) -> None:
            columns.add(out["h"], span[1])  # GA share of these columns (of the group's, at its last interval)

        p = collect(call.executor, call.op, list(enumerate(spans)), futures, gather_columns)["h"]
        ps = [p[a:b] for a, b, _, _ in spans]  # the backward reads views of P; the merged pieces are freed
        ctx.call, ctx.blocks, ctx.xs, ctx.made_by, ctx.ps, ctx.w = call, blocks, xs, made_by, ps, w
        ctx.source, ctx.runahead, ctx.layer, ctx.spans, ctx.cut = source, runahead, layer, spans, cut
        ctx.save_for_backward(weight)
        ctx.device = weight.device
        return p.to(weight.device), z.to(weight.device)

    @staticmethod
    def backward(ctx: Any, grad_p: Tensor | None, grad_z: Tensor | None) -> tuple[Tensor | None, ...]:
        call: OpCall = ctx.call
        needs_x = bool(ctx.needs_input_grad[5])
        attrs = {**call.attrs, "has_bias": False, "needs_grad_z": needs_x}
        width = ctx.w.size(1)
        grad_z = to_host(grad_z) if grad_z is not None and ctx.blocks else None
        grad_p = to_host(grad_p) if grad_p is not None else None

        remade, answered_by = remade_rows(ctx.made_by, "z") if ctx.xs is None else (None, None)

        def grad_rows(i: int, span: Span) -> dict[str, Tensor]:
            a, b = span[0], span[1]
            g_i = (torch.sparse.mm(ctx.blocks[i].adj, grad_z) if grad_z is not None  # ∇GA of these rows
                   else torch.zeros((b - a, width), dtype=ctx.w.dtype))
            if grad_p is not None:
                g_i += grad_p[a:b]
            rows = remade(i, span) if remade is not None else {"z": ctx.xs[i]}
            return {**rows, "h": ctx.ps[i], "grad_h": g_i}

        def run_ahead() -> None:
            del ctx.xs, ctx.ps
            if ctx.runahead is not None and ctx.source.next_key is not None:
                send_ahead(call, ctx.source, "z", {"weight": ctx.saved_tensors[0]}, ctx.spans, ctx.cut,
                           ctx.runahead, ctx.layer)

        merged = interval_backward(call, {"weight": ctx.w}, attrs, ctx.spans, grad_rows, run_ahead,
                                   on_submit=answered_by)
        grad_x = merged["grad_z"].to(ctx.device) if needs_x else None
        return None, None, None, None, None, grad_x, merged["grad_weight"].to(ctx.device)


class _ColumnGather(torch.autograd.Function):
    """``Z = Â[:, cols] P_cols`` with a column block (the ghost block, or the whole ``Â``); backward
    ``Âᵀ[cols] ∇Z``."""

    @staticmethod
    def forward(ctx: Any, p_cols: Tensor, block: Any, n_local: int) -> Tensor:
        ctx.block = block
        z = p_cols.new_zeros((n_local, p_cols.size(1)))
        return block.add_transposed(z, p_cols.contiguous())

    @staticmethod
    def backward(ctx: Any, grad_z: Tensor) -> tuple[Tensor | None, None, None]:
        return torch.sparse.mm(ctx.block.adj, grad_z.contiguous()), None, None


def apply_gather(
    call: OpCall,
    blocks: list,
    weight: Tensor,
    x: Tensor | None = None,
    source: Any = None,
    runahead: Any = None,
    layer: int = 0,
) -> tuple[Tensor, Tensor]:
    """Differentiable AV ``x W`` per interval of ``call.intervals`` + GA over the local columns
    (``blocks``: the local intervals' column blocks; ``[]``: none, GA runs whole after SC); a
    ``RowSource`` ``source`` stands in for ``x`` when the input needs no gradient and is cheaper made per
    interval (first-layer dropout). ``runahead`` (with ``source``): the graph server's
    :class:`~lightning_dorylus.nn.runahead.RunAhead`, under ``layer``. Returns ``(P, Z_local)``."""
    if blocks and len(blocks) != len(call.intervals):
        raise ValueError(f"apply_gather got {len(blocks)} column blocks for {len(call.intervals)} intervals; "
                         "expected one per interval, or none")
    if (x is None) == (source is None):
        raise ValueError("apply_gather takes exactly one of x (a tensor) and source (rows a:b on demand)")
    if runahead is not None and source is None:
        raise ValueError("apply_gather runs ahead only for a RowSource input (a first layer's features)")
    return ApplyGather.apply(call, blocks, source, runahead, layer, x, weight)


def column_gather(p_cols: Tensor, block: Any, n_local: int) -> Tensor:
    """Differentiable share of a column block's columns in ``Z = Â P`` (``block``: the ghost column block,
    or a whole-``Âᵀ`` block for all of ``Â P_full``)."""
    return _ColumnGather.apply(p_cols, block, n_local)
