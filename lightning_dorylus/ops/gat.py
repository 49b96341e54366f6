"""GAT's tensor ops: the projection (an ApplyVertex) and the attention softmax (an ApplyEdge).

PyG vocabulary (``torch_geometric.nn.GATConv``): ``project`` is ``self.lin(x)`` plus the per-head
scores ``alpha_src``/``alpha_dst``; ``apply_edge`` is what GATConv's ``edge_update`` computes
(``leaky_relu`` then ``softmax`` over each destination's in-edges). The weighted sum over edges
(``message`` * attention, then ``aggregate``) stays on the graph server. Numpy only.

Edges of an interval arrive sorted by destination with an interval-local CSR pointer ``dst_ptr``
(n + 1,): edges of destination v are ``dst_ptr[v]:dst_ptr[v + 1]``. Segment reductions use
``ufunc.reduceat`` over the non-empty segments, which is exact and vectorized.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .spec import OpSpec, Shape


def project_forward(inputs: dict[str, np.ndarray], attrs: dict[str, Any]) -> dict[str, np.ndarray]:
    """h = x @ weight (n, H*C); alpha_src[v, k] = <h[v, k, :], att_src[k]>; same for alpha_dst."""
    x, weight, att_src, att_dst = inputs["x"], inputs["weight"], inputs["att_src"], inputs["att_dst"]
    heads, channels = _check_project(x, weight, att_src, att_dst)
    h = x @ weight  # (n, H*C)
    hv = h.reshape(-1, heads, channels)  # (n, H, C)
    return {"h": h, "alpha_src": np.einsum("nhc,hc->nh", hv, att_src),
            "alpha_dst": np.einsum("nhc,hc->nh", hv, att_dst)}


def project_backward(inputs: dict[str, np.ndarray], attrs: dict[str, Any]) -> dict[str, np.ndarray]:
    """Gradients of ``project_forward`` given grad_h (n, H*C), grad_alpha_src/dst (n, H).

    ``attrs["needs_grad_x"]`` (default true) false skips ``grad_x`` (a first layer's features need none).
    """
    x, weight, att_src, att_dst = inputs["x"], inputs["weight"], inputs["att_src"], inputs["att_dst"]
    h, grad_h = inputs["h"], inputs["grad_h"]
    ga_src, ga_dst = inputs["grad_alpha_src"], inputs["grad_alpha_dst"]
    heads, channels = _check_project(x, weight, att_src, att_dst)
    n = x.shape[0]
    _check_shape("h", h, (n, heads * channels))
    _check_shape("grad_h", grad_h, (n, heads * channels))
    _check_shape("grad_alpha_src", ga_src, (n, heads))
    _check_shape("grad_alpha_dst", ga_dst, (n, heads))
    hv = h.reshape(n, heads, channels)
    # Total gradient reaching h: directly, and through both score dot products.
    g = grad_h.reshape(n, heads, channels) + ga_src[:, :, None] * att_src + ga_dst[:, :, None] * att_dst
    g = g.reshape(n, heads * channels)  # (n, H*C)
    needs_grad_x = attrs.get("needs_grad_x", True)
    if not isinstance(needs_grad_x, bool):
        raise ValueError(f"needs_grad_x={needs_grad_x!r} must be true or false")
    out = {"grad_weight": x.T @ g,
           "grad_att_src": np.einsum("nhc,nh->hc", hv, ga_src),
           "grad_att_dst": np.einsum("nhc,nh->hc", hv, ga_dst)}
    if needs_grad_x:
        out["grad_x"] = g @ weight.T
    return out


def apply_edge_forward(inputs: dict[str, np.ndarray], attrs: dict[str, Any]) -> dict[str, np.ndarray]:
    """attention[e] = softmax over dst(e)'s in-edges of leaky_relu(alpha_src_e[e] + alpha_dst[dst(e)])."""
    a_src, a_dst, dst_ptr = inputs["alpha_src_e"], inputs["alpha_dst"], inputs["dst_ptr"]
    slope = _negative_slope(attrs)
    dst, starts = _segments(dst_ptr, a_src, a_dst)
    score = a_src + a_dst[dst]  # (E, H)
    score = np.where(score > 0, score, score * slope)  # leaky_relu
    if score.shape[0] == 0:
        return {"attention": score}
    # Stable softmax: subtract each destination's max before exp.
    seg_max = np.maximum.reduceat(score, starts, axis=0)  # (n_nonempty, H)
    ex = np.exp(score - _expand(seg_max, dst_ptr)[dst])
    seg_sum = np.add.reduceat(ex, starts, axis=0)
    ex /= _expand(seg_sum, dst_ptr)[dst]
    return {"attention": ex}


def apply_edge_backward(inputs: dict[str, np.ndarray], attrs: dict[str, Any]) -> dict[str, np.ndarray]:
    """Gradients of ``apply_edge_forward`` w.r.t. alpha_src_e (E, H) and alpha_dst (n, H).

    softmax: grad_score = a * (g - sum_{edges of dst} a * g); leaky_relu: times 1 where score > 0
    else negative_slope; alpha_dst's gradient sums grad_score over each destination's edges.
    """
    a_src, a_dst, dst_ptr = inputs["alpha_src_e"], inputs["alpha_dst"], inputs["dst_ptr"]
    att, grad_att = inputs["attention"], inputs["grad_attention"]
    slope = _negative_slope(attrs)
    dst, starts = _segments(dst_ptr, a_src, a_dst)
    _check_shape("attention", att, a_src.shape)
    _check_shape("grad_attention", grad_att, a_src.shape)
    if a_src.shape[0] == 0:
        return {"grad_alpha_src_e": np.zeros_like(a_src), "grad_alpha_dst": np.zeros_like(a_dst)}
    ag = att * grad_att  # (E, H)
    grad_score = ag - att * _expand(np.add.reduceat(ag, starts, axis=0), dst_ptr)[dst]
    score = a_src + a_dst[dst]
    grad_score = np.where(score > 0, grad_score, grad_score * slope)
    return {"grad_alpha_src_e": grad_score,
            "grad_alpha_dst": _expand(np.add.reduceat(grad_score, starts, axis=0), dst_ptr)}


def _negative_slope(attrs: dict[str, Any]) -> float:
    slope = attrs.get("negative_slope", 0.2)
    if isinstance(slope, bool) or not isinstance(slope, (int, float)):
        raise ValueError(f"negative_slope={slope!r} must be a number")
    return float(slope)


def _segments(dst_ptr: np.ndarray, a_src: np.ndarray, a_dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Validate the CSR pointer; return the destination of each edge and the non-empty segment starts."""
    if a_src.ndim != 2 or a_dst.ndim != 2 or a_src.shape[1] != a_dst.shape[1]:
        raise ValueError(f"alpha_src_e {a_src.shape} and alpha_dst {a_dst.shape} must be 2-D (E, H) and "
                         f"(n, H) with the same number of heads")
    n, num_edges = a_dst.shape[0], a_src.shape[0]
    if dst_ptr.dtype.kind not in "iu" or dst_ptr.shape != (n + 1,):
        raise ValueError(f"dst_ptr has shape {dst_ptr.shape} and dtype {dst_ptr.dtype}; expected integer "
                         f"({n + 1},) = (alpha_dst rows + 1,)")
    counts = np.diff(dst_ptr)
    if dst_ptr[0] != 0 or dst_ptr[-1] != num_edges or (counts < 0).any():
        raise ValueError(f"dst_ptr must be non-decreasing from 0 to the number of edges ({num_edges}); "
                         f"got dst_ptr[0]={dst_ptr[0]}, dst_ptr[-1]={dst_ptr[-1]}")
    dst = np.repeat(np.arange(n), counts)  # (E,)
    return dst, dst_ptr[:-1][counts > 0]


def _expand(per_segment: np.ndarray, dst_ptr: np.ndarray) -> np.ndarray:
    """Scatter per-non-empty-segment rows back to one row per destination (zeros for empty ones)."""
    nonempty = np.diff(dst_ptr) > 0
    if nonempty.all():
        return per_segment
    out = np.zeros((nonempty.shape[0], *per_segment.shape[1:]), dtype=per_segment.dtype)
    out[nonempty] = per_segment
    return out


def _check_project(x: np.ndarray, weight: np.ndarray, att_src: np.ndarray,
                   att_dst: np.ndarray) -> tuple[int, int]:
    if att_src.ndim != 2 or att_dst.shape != att_src.shape:
        raise ValueError(f"att_src {att_src.shape} and att_dst {att_dst.shape} must both be (H, C)")
    heads, channels = att_src.shape
    if x.ndim != 2 or weight.shape != (x.shape[1], heads * channels):
        raise ValueError(f"weight has shape {weight.shape}; expected (x.shape[1], H*C) = "
                         f"({x.shape[1] if x.ndim == 2 else '?'}, {heads}*{channels})")
    return heads, channels


def _check_shape(name: str, arr: np.ndarray, expected: tuple[int, ...]) -> None:
    if arr.shape != tuple(expected):
        raise ValueError(f"{name} has shape {arr.shape}; expected {tuple(expected)}")


def _project_forward_shapes(s: Mapping[str, Shape], attrs: Mapping[str, Any]) -> dict[str, Shape]:
    n, heads = s["x"][0], s["att_src"][0]
    return {"h": (n, s["weight"][1]), "alpha_src": (n, heads), "alpha_dst": (n, heads)}


def _project_backward_shapes(s: Mapping[str, Shape], attrs: Mapping[str, Any]) -> dict[str, Shape]:
    out: dict[str, Shape] = {}
    if attrs.get("needs_grad_x", True):
        out["grad_x"] = tuple(s["x"])
    out.update(grad_weight=tuple(s["weight"]), grad_att_src=tuple(s["att_src"]),
               grad_att_dst=tuple(s["att_dst"]))
    return out


def _edge_forward_shapes(s: Mapping[str, Shape], attrs: Mapping[str, Any]) -> dict[str, Shape]:
    return {"attention": tuple(s["alpha_src_e"])}


def _edge_backward_shapes(s: Mapping[str, Shape], attrs: Mapping[str, Any]) -> dict[str, Shape]:
    return {"grad_alpha_src_e": tuple(s["alpha_src_e"]), "grad_alpha_dst": tuple(s["alpha_dst"])}


OPS = {
    "gat.project.forward": OpSpec(project_forward, ("x", "weight", "att_src", "att_dst"),
                                  outputs=("h", "alpha_src", "alpha_dst"), backward="gat.project.backward",
                                  row_inputs=("x",), row_outputs=("h", "alpha_src", "alpha_dst"),
                                  output_shapes=_project_forward_shapes),
    "gat.project.backward": OpSpec(project_backward, ("x", "weight", "att_src", "att_dst", "h", "grad_h",
                                                      "grad_alpha_src", "grad_alpha_dst"),
                                   outputs=("grad_x", "grad_weight", "grad_att_src", "grad_att_dst"),
                                   row_inputs=("x", "h", "grad_h", "grad_alpha_src", "grad_alpha_dst"),
                                   row_outputs=("grad_x",),
                                   summed_outputs=("grad_weight", "grad_att_src", "grad_att_dst"),
                                   grad_flags=("x",), output_shapes=_project_backward_shapes),
    "apply_edge.forward": OpSpec(apply_edge_forward, ("alpha_src_e", "alpha_dst", "dst_ptr"),
                                 integer_inputs=("dst_ptr",), outputs=("attention",),
                                 backward="apply_edge.backward", dst_inputs=("alpha_dst",),
                                 edge_inputs=("alpha_src_e",), ptr_inputs=("dst_ptr",),
                                 edge_outputs=("attention",), output_shapes=_edge_forward_shapes),
    "apply_edge.backward": OpSpec(apply_edge_backward, ("alpha_src_e", "alpha_dst", "dst_ptr", "attention",
                                                        "grad_attention"),
                                  integer_inputs=("dst_ptr",), outputs=("grad_alpha_src_e", "grad_alpha_dst"),
                                  dst_inputs=("alpha_dst",), edge_inputs=("alpha_src_e", "attention",
                                                                          "grad_attention"),
                                  ptr_inputs=("dst_ptr",), edge_outputs=("grad_alpha_src_e",),
                                  dst_outputs=("grad_alpha_dst",), output_shapes=_edge_backward_shapes),
}
