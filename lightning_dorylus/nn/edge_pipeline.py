"""AE then GA, pipelined per vertex interval: the GAT layer's one implementation and unit of overlap.

A GAT layer's graph work after SC is per destination: interval ``i``'s ApplyEdge (attention softmax over its
destinations' in-edges) needs only the source scores of those edges, and its Gather (attention-weighted sum)
only that interval's attention. So the graph server sends every interval's AE request as soon as it has
gathered the interval's source scores, and as each comes back (in interval order) drops out and gathers that
interval while later ones are still in flight. The backward mirrors it: for interval ``i`` the server
computes ∇GA (the gradient of the attention-weighted sum w.r.t. the rows ``h`` and the attention) and sends
its ∇AE request at once, so ∇GA of interval ``i + 1`` overlaps ∇AE of ``i``; the results are added in
interval order (deterministic sums). The requests go through the op declarations (``ops/gat.py``'s
``apply_edge.*``) and :mod:`~lightning_dorylus.nn.functions`'s span and slicing helpers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_dorylus.graph import SelfLoopEdges
from lightning_dorylus.nn.dropout import dropout_mask
from lightning_dorylus.nn.functions import (
    OpCall,
    Span,
    collect,
    interval_backward,
    interval_spans,
    op_spec,
    submit_each,
    to_host,
)


@dataclass(frozen=True)
class EdgeDropout:
    """Dropout of the attention: probability ``p``, site ``key``, edges' global ids ``edge_ids`` ``(E',)``."""

    p: float
    key: int
    edge_ids: Tensor


class ApplyEdgeGather(torch.autograd.Function):
    """``out[v, k] = Σ_{e: u -> v} drop(AE(alpha_src, alpha_dst))[e, k] * h[u, k]``, per interval."""

    @staticmethod
    def forward(
        ctx: Any,
        call: OpCall,
        edges: SelfLoopEdges,
        dropout: EdgeDropout | None,
        h_full: Tensor,
        alpha_src_full: Tensor,
        alpha_dst: Tensor,
    ) -> Tensor:
        spec = op_spec(call.op)
        h, a_src = to_host(h_full), to_host(alpha_src_full)  # (n_full, H, C), (n_full, H)
        per_dst = {"alpha_dst": to_host(alpha_dst), "dst_ptr": to_host(edges.dst_ptr)}
        src, dst = to_host(edges.src), to_host(edges.dst)
        edge_ids = to_host(dropout.edge_ids) if dropout is not None else None
        spans = interval_spans(spec, per_dst, call.intervals)
        a_src_es: list[Tensor] = []

        def gather_scores(i: int, span: Span) -> dict[str, Tensor]:
            """The server gathers the interval's source scores; its AE request goes out."""
            a_src_es.append(a_src.index_select(0, src[span[2] : span[3]]))
            return {"alpha_src_e": a_src_es[-1]}

        sent, futures = submit_each(call.executor, call.op, call.attrs, per_dst, spans, gather_scores)
        out = h.new_zeros((per_dst["alpha_dst"].size(0), *h.shape[1:]))
        attentions: list[Tensor] = []
        masks: list[Tensor | None] = []

        def drop_and_gather(i: int, span: Span, result: dict[str, Tensor]) -> None:
            """Dropout + GA of an interval as it comes back (in interval order)."""
            _, _, e0, e1 = span
            attention = result.pop("attention")  # (E_i, H)
            mask = (dropout_mask(edge_ids[e0:e1], attention.size(1), dropout.p, dropout.key, attention.dtype)
                    if dropout is not None and edge_ids is not None else None)
            weights = attention * mask if mask is not None else attention
            messages = h.index_select(0, src[e0:e1]) * weights.unsqueeze(-1)  # (E_i, H, C)
            out.index_add_(0, dst[e0:e1], messages)
            attentions.append(attention)
            masks.append(mask)

        collect(call.executor, call.op, sent, futures, drop_and_gather)
        ctx.call, ctx.spans, ctx.masks, ctx.device = call, spans, masks, h_full.device
        ctx.a_src_es, ctx.attentions, ctx.n_full = a_src_es, attentions, h.size(0)
        ctx.save_for_backward(h, per_dst["alpha_dst"], per_dst["dst_ptr"], src, dst)
        return out.to(h_full.device)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        call: OpCall = ctx.call
        h, a_dst, dst_ptr, src, dst = ctx.saved_tensors
        needs_h, needs_src, needs_dst = ctx.needs_input_grad[3:6]
        needs_alpha = needs_src or needs_dst
        grad_out = to_host(grad_out)
        grad_h = torch.zeros_like(h) if needs_h else None
        grad_src = torch.zeros((ctx.n_full, a_dst.size(1)), dtype=a_dst.dtype) if needs_src else None
        grad_dst = torch.zeros_like(a_dst) if needs_dst else None

        def grad_gather(i: int, span: Span) -> dict[str, Tensor] | None:
            """∇GA on the server; then this interval's ∇AE request (if the scores need a gradient)."""
            _, _, e0, e1 = span
            src_i, mask = src[e0:e1], ctx.masks[i]
            grad_msg = grad_out.index_select(0, dst[e0:e1])  # (E_i, H, C)
            if grad_h is not None:
                weights = ctx.attentions[i] * mask if mask is not None else ctx.attentions[i]
                grad_h.index_add_(0, src_i, grad_msg * weights.unsqueeze(-1))
            if not needs_alpha:
                return None
            grad_attention = (grad_msg * h.index_select(0, src_i)).sum(-1)  # (E_i, H)
            if mask is not None:
                grad_attention *= mask
            return {"alpha_src_e": ctx.a_src_es[i], "attention": ctx.attentions[i],
                    "grad_attention": grad_attention}

        def release() -> None:
            del ctx.a_src_es, ctx.attentions, ctx.masks

        def add_score_grads(i: int, span: Span, result: dict[str, Tensor]) -> None:
            a, b, e0, e1 = span  # ∇AE results added in interval order; nothing is left to merge
            g_src, g_dst = result.pop("grad_alpha_src_e", None), result.pop("grad_alpha_dst", None)
            if grad_src is not None and g_src is not None:  # ∇ of the server's gather of source scores
                grad_src.index_add_(0, src[e0:e1], g_src)
            if grad_dst is not None and g_dst is not None:
                grad_dst[a:b] = g_dst

        per_dst = {"alpha_dst": a_dst, "dst_ptr": dst_ptr}
        interval_backward(call, per_dst, call.attrs, ctx.spans, grad_gather, release, add_score_grads)
        return (None, None, None, *(g.to(ctx.device) if g is not None else None
                                    for g in (grad_h, grad_src, grad_dst)))


def apply_edge_gather(
    call: OpCall,
    edges: SelfLoopEdges,
    h_full: Tensor,
    alpha_src_full: Tensor,
    alpha_dst: Tensor,
    dropout: EdgeDropout | None = None,
) -> Tensor:
    """Differentiable per-interval-pipelined AE ``call.op`` (``apply_edge.forward``) + attention dropout +
    GA over ``edges`` (the self-loop-augmented in-edges, sorted by destination).

    Args:
        call: The AE op, its executor, the local intervals and attrs (``negative_slope``).
        edges: ``src`` (local/ghost ids), ``dst`` and ``dst_ptr`` of the in-edges.
        h_full: ``(n_local + n_ghost, H, C)`` projected rows after SC.
        alpha_src_full: ``(n_local + n_ghost, H)`` source scores after SC.
        alpha_dst: ``(n_local, H)`` destination scores.
        dropout: The attention dropout (training), or ``None``.

    Returns:
        ``(n_local, H, C)``: ``out_v = Σ_{u -> v} drop(attention)_uv h_u`` per head.
    """
    if h_full.dim() != 3 or alpha_src_full.shape != h_full.shape[:2]:
        raise ValueError(f"h_full {tuple(h_full.shape)} must be (n, H, C) and alpha_src_full "
                         f"{tuple(alpha_src_full.shape)} (n, H) with the same n and H")
    if dropout is not None and dropout.edge_ids.shape != edges.src.shape:
        raise ValueError(f"dropout.edge_ids has shape {tuple(dropout.edge_ids.shape)}; expected "
                         f"{tuple(edges.src.shape)} (one id per in-edge)")
    return ApplyEdgeGather.apply(call, edges, dropout, h_full, alpha_src_full, alpha_dst)
