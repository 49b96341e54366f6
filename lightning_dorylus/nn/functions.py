"""Tensor operations (ApplyVertex, ApplyEdge) as autograd nodes whose work is done by a tensor-op executor.

Each forward cuts its input into the partition's vertex intervals, sends one request per interval through
``executor.map`` (so a pool or a fleet of Lambdas works on them in parallel) and concatenates the results.
Each backward sends the mirrored op (``*.backward``) per interval with everything it needs passed explicitly
(inputs, weights, saved outputs, output gradients); weight gradients come back per interval and are summed on
the graph server. No autograd state crosses the executor boundary, only named arrays.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_dorylus.executors import TensorOpExecutor, TensorOpRequest


def _cpu(t: Tensor) -> Tensor:
    return t.detach().to("cpu").contiguous()


def _cat(parts: list[Tensor], like: Tensor, width: tuple[int, ...]) -> Tensor:
    if not parts:
        return like.new_zeros((0, *width))
    return torch.cat(parts, dim=0).to(like.device)


def _sum(parts: list[Tensor], like: Tensor) -> Tensor:
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total.to(like.device)


class ApplyVertex(torch.autograd.Function):
    """AV: ``h = act(z @ weight + bias)`` per interval on the executor (op ``apply_vertex``)."""

    @staticmethod
    def forward(
        ctx: Any,
        z: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        executor: TensorOpExecutor,
        intervals: list[tuple[int, int]],
        activation: str,
    ) -> Tensor:
        z_cpu, w_cpu = _cpu(z), _cpu(weight)
        shared = {"weight": w_cpu} if bias is None else {"weight": w_cpu, "bias": _cpu(bias)}
        requests = [
            TensorOpRequest(
                "apply_vertex.forward", {"z": z_cpu[a:b], **shared}, {"activation": activation}, interval=i
            )
            for i, (a, b) in enumerate(intervals)
        ]
        h_cpu = _cat([out["h"] for out in executor.map(requests)], w_cpu, (weight.size(1),))
        ctx.executor, ctx.intervals, ctx.activation, ctx.has_bias = (
            executor,
            intervals,
            activation,
            bias is not None,
        )
        ctx.save_for_backward(z_cpu, w_cpu, h_cpu)
        ctx.device = z.device
        return h_cpu.to(z.device)

    @staticmethod
    def backward(ctx: Any, grad_h: Tensor) -> tuple[Tensor | None, ...]:
        z_cpu, w_cpu, h_cpu = ctx.saved_tensors
        g_cpu = _cpu(grad_h)
        needs_grad_z = bool(ctx.needs_input_grad[0])  # False for a first layer: features need no gradient
        attrs = {"activation": ctx.activation, "has_bias": ctx.has_bias, "needs_grad_z": needs_grad_z}
        requests = [
            TensorOpRequest(
                "apply_vertex.backward",
                {"z": z_cpu[a:b], "weight": w_cpu, "h": h_cpu[a:b], "grad_h": g_cpu[a:b]},
                attrs,
                interval=i,
            )
            for i, (a, b) in enumerate(ctx.intervals)
        ]
        outs = ctx.executor.map(requests)
        del z_cpu, h_cpu, g_cpu, requests  # the inputs are no longer needed once the results are back
        grad_z = None
        if needs_grad_z:
            grad_z = _cat([o.pop("grad_z") for o in outs], w_cpu, (w_cpu.size(0),)).to(ctx.device)
        grad_w = _sum([o["grad_weight"] for o in outs], w_cpu) if outs else torch.zeros_like(w_cpu)
        grad_b = None
        if ctx.has_bias:
            grad_b = _sum([o["grad_bias"] for o in outs], w_cpu) if outs else w_cpu.new_zeros(w_cpu.size(1))
            grad_b = grad_b.to(ctx.device)
        return grad_z, grad_w.to(ctx.device), grad_b, None, None, None


class GATProject(torch.autograd.Function):
    """GAT's AV: ``h = x @ weight`` and per-head scores ``alpha_src``, ``alpha_dst`` (op ``gat.project``)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        att_src: Tensor,
        att_dst: Tensor,
        executor: TensorOpExecutor,
        intervals: list[tuple[int, int]],
    ) -> tuple[Tensor, Tensor, Tensor]:
        x_cpu = _cpu(x)
        params = {"weight": _cpu(weight), "att_src": _cpu(att_src), "att_dst": _cpu(att_dst)}
        requests = [
            TensorOpRequest("gat.project.forward", {"x": x_cpu[a:b], **params}, {}, interval=i)
            for i, (a, b) in enumerate(intervals)
        ]
        outs = executor.map(requests)
        heads = att_src.size(0)
        h_cpu = _cat([o["h"] for o in outs], x_cpu, (weight.size(1),))
        a_src = _cat([o["alpha_src"] for o in outs], x_cpu, (heads,))
        a_dst = _cat([o["alpha_dst"] for o in outs], x_cpu, (heads,))
        ctx.executor, ctx.intervals, ctx.device = executor, intervals, x.device
        ctx.save_for_backward(x_cpu, params["weight"], params["att_src"], params["att_dst"], h_cpu)
        return h_cpu.to(x.device), a_src.to(x.device), a_dst.to(x.device)

    @staticmethod
    def backward(
        ctx: Any, grad_h: Tensor | None, grad_a_src: Tensor | None, grad_a_dst: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        x_cpu, w_cpu, att_src, att_dst, h_cpu = ctx.saved_tensors
        g_h = _cpu(grad_h) if grad_h is not None else torch.zeros_like(h_cpu)
        n, heads = h_cpu.size(0), att_src.size(0)
        g_src = _cpu(grad_a_src) if grad_a_src is not None else h_cpu.new_zeros((n, heads))
        g_dst = _cpu(grad_a_dst) if grad_a_dst is not None else h_cpu.new_zeros((n, heads))
        shared = {"weight": w_cpu, "att_src": att_src, "att_dst": att_dst}
        needs_grad_x = bool(ctx.needs_input_grad[0])  # False for a first layer: features need no gradient
        requests = [
            TensorOpRequest(
                "gat.project.backward",
                {
                    "x": x_cpu[a:b],
                    **shared,
                    "h": h_cpu[a:b],
                    "grad_h": g_h[a:b],
                    "grad_alpha_src": g_src[a:b],
                    "grad_alpha_dst": g_dst[a:b],
                },
                {"needs_grad_x": needs_grad_x},
                interval=i,
            )
            for i, (a, b) in enumerate(ctx.intervals)
        ]
        outs = ctx.executor.map(requests)
        dev = ctx.device
        grad_x = None
        if needs_grad_x:
            grad_x = _cat([o["grad_x"] for o in outs], x_cpu, (x_cpu.size(1),)).to(dev)
        if not outs:
            zeros = (torch.zeros_like(w_cpu), torch.zeros_like(att_src), torch.zeros_like(att_dst))
            return grad_x, *(z.to(dev) for z in zeros), None, None
        return (
            grad_x,
            _sum([o["grad_weight"] for o in outs], w_cpu).to(dev),
            _sum([o["grad_att_src"] for o in outs], w_cpu).to(dev),
            _sum([o["grad_att_dst"] for o in outs], w_cpu).to(dev),
            None,
            None,
        )


class ApplyEdge(torch.autograd.Function):
    """AE: GAT attention per interval: softmax over each dst's in-edges of ``leaky_relu(a_src + a_dst)``."""

    @staticmethod
    def forward(
        ctx: Any,
        alpha_src_e: Tensor,
        alpha_dst: Tensor,
        dst_ptr: Tensor,
        executor: TensorOpExecutor,
        intervals: list[tuple[int, int]],
        negative_slope: float,
    ) -> Tensor:
        src_cpu, dst_cpu, ptr_cpu = _cpu(alpha_src_e), _cpu(alpha_dst), _cpu(dst_ptr)
        attrs = {"negative_slope": negative_slope}
        requests, spans = [], []
        for i, (a, b) in enumerate(intervals):
            e0, e1 = int(ptr_cpu[a]), int(ptr_cpu[b])
            spans.append((a, b, e0, e1))
            requests.append(
                TensorOpRequest(
                    "apply_edge.forward",
                    {
                        "alpha_src_e": src_cpu[e0:e1],
                        "alpha_dst": dst_cpu[a:b],
                        "dst_ptr": (ptr_cpu[a : b + 1] - e0).contiguous(),
                    },
                    attrs,
                    interval=i,
                )
            )
        att = _cat([o["attention"] for o in executor.map(requests)], src_cpu, (src_cpu.size(1),))
        if att.size(0) != src_cpu.size(0):
            raise RuntimeError(
                f"intervals cover {att.size(0)} of {src_cpu.size(0)} edges; they must cover all"
            )
        ctx.executor, ctx.spans, ctx.attrs, ctx.device = executor, spans, attrs, alpha_src_e.device
        ctx.save_for_backward(src_cpu, dst_cpu, ptr_cpu, att)
        return att.to(alpha_src_e.device)

    @staticmethod
    def backward(ctx: Any, grad_att: Tensor) -> tuple[Tensor | None, ...]:
        src_cpu, dst_cpu, ptr_cpu, att = ctx.saved_tensors
        g_cpu = _cpu(grad_att)
        requests = [
            TensorOpRequest(
                "apply_edge.backward",
                {
                    "alpha_src_e": src_cpu[e0:e1],
                    "alpha_dst": dst_cpu[a:b],
                    "dst_ptr": (ptr_cpu[a : b + 1] - e0).contiguous(),
                    "attention": att[e0:e1],
                    "grad_attention": g_cpu[e0:e1],
                },
                ctx.attrs,
                interval=i,
            )
            for i, (a, b, e0, e1) in enumerate(ctx.spans)
        ]
        outs = ctx.executor.map(requests)
        heads = src_cpu.size(1)
        grad_src = _cat([o["grad_alpha_src_e"] for o in outs], src_cpu, (heads,)).to(ctx.device)
        grad_dst = _cat([o["grad_alpha_dst"] for o in outs], dst_cpu, (heads,)).to(ctx.device)
        return grad_src, grad_dst, None, None, None, None
