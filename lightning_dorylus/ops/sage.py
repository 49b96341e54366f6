"""GraphSAGE's tensor op (mean aggregator): ``h = act(agg @ weight_l + x @ weight_r + bias)`` + backward.

PyG vocabulary (``torch_geometric.nn.SAGEConv``): the graph server's ``message`` (``x_j``) and ``aggregate``
(mean over in-neighbours) give ``agg``; this op is ``update``: ``lin_l(agg) + lin_r(x)`` (the root weight),
then the activation. Per vertex row, so an interval of rows goes to any executor. Numpy only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .spec import OpSpec, Shape
from .vertex import activate, activation_grad, check_activation


def update_forward(inputs: dict[str, np.ndarray], attrs: dict[str, Any]) -> dict[str, np.ndarray]:
    """agg, x (n, fi); weight_l, weight_r (fi, fo); optional bias (fo,) -> h (n, fo)."""
    agg, x, w_l, w_r, bias = (
        inputs["agg"],
        inputs["x"],
        inputs["weight_l"],
        inputs["weight_r"],
        inputs.get("bias"),
    )
    activation = check_activation(attrs.get("activation", "none"))
    _check(agg, x, w_l, w_r)
    pre = agg @ w_l
    pre += x @ w_r
    if bias is not None:
        if bias.shape != (w_l.shape[1],):
            raise ValueError(
                f"bias has shape {bias.shape}; expected ({w_l.shape[1]},) to match weight_l {w_l.shape}"
            )
        pre += bias
    return {"h": activate(pre, activation)}


def update_backward(inputs: dict[str, np.ndarray], attrs: dict[str, Any]) -> dict[str, np.ndarray]:
    """Gradients of ``update_forward`` given ``grad_h``; ``needs_grad_agg``/``_x`` false skip those."""
    agg, x, w_l, w_r = inputs["agg"], inputs["x"], inputs["weight_l"], inputs["weight_r"]
    h, grad_h = inputs["h"], inputs["grad_h"]
    activation = check_activation(attrs.get("activation", "none"))
    _check(agg, x, w_l, w_r)
    expected = (agg.shape[0], w_l.shape[1])
    for name, arr in (("h", h), ("grad_h", grad_h)):
        if arr.shape != expected:
            raise ValueError(
                f"{name} has shape {arr.shape}; expected {expected} = (agg rows, weight_l columns)"
            )
    flags = {}
    for name in ("has_bias", "needs_grad_agg", "needs_grad_x"):
        flags[name] = attrs.get(name, name != "has_bias")
        if not isinstance(flags[name], bool):
            raise ValueError(f"{name}={flags[name]!r} must be true or false")
    grad_pre = activation_grad(h, grad_h, activation)
    out = {"grad_weight_l": agg.T @ grad_pre, "grad_weight_r": x.T @ grad_pre}
    if flags["needs_grad_agg"]:
        out["grad_agg"] = grad_pre @ w_l.T
    if flags["needs_grad_x"]:
        out["grad_x"] = grad_pre @ w_r.T
    if flags["has_bias"]:
        out["grad_bias"] = grad_pre.sum(axis=0)
    return out


def _check(agg: np.ndarray, x: np.ndarray, w_l: np.ndarray, w_r: np.ndarray) -> None:
    if agg.ndim != 2 or x.shape != agg.shape:
        raise ValueError(f"agg {agg.shape} and x {x.shape} must be 2-D arrays of the same shape")
    if w_l.ndim != 2 or w_l.shape[0] != agg.shape[1] or w_r.shape != w_l.shape:
        raise ValueError(
            f"weight_l {w_l.shape} and weight_r {w_r.shape} must both be (agg.shape[1], fo) = "
            f"({agg.shape[1]}, fo)"
        )


def _forward_shapes(s: Mapping[str, Shape], attrs: Mapping[str, Any]) -> dict[str, Shape]:
    return {"h": (s["agg"][0], s["weight_l"][1])}


def _backward_shapes(s: Mapping[str, Shape], attrs: Mapping[str, Any]) -> dict[str, Shape]:
    out: dict[str, Shape] = {}
    for name in ("agg", "x"):
        if attrs.get(f"needs_grad_{name}", True):
            out[f"grad_{name}"] = tuple(s[name])
    out.update(grad_weight_l=tuple(s["weight_l"]), grad_weight_r=tuple(s["weight_r"]))
    if attrs.get("has_bias", False):
        out["grad_bias"] = (s["weight_l"][1],)
    return out


OPS = {
    "sage.update.forward": OpSpec(
        update_forward,
        ("agg", "x", "weight_l", "weight_r"),
        ("bias",),
        outputs=("h",),
        backward="sage.update.backward",
        row_inputs=("agg", "x"),
        row_outputs=("h",),
        output_shapes=_forward_shapes,
    ),
    "sage.update.backward": OpSpec(
        update_backward,
        ("agg", "x", "weight_l", "weight_r", "h", "grad_h"),
        outputs=("grad_agg", "grad_x", "grad_weight_l", "grad_weight_r", "grad_bias"),
        row_inputs=("agg", "x", "h", "grad_h"),
        row_outputs=("grad_agg", "grad_x"),
        summed_outputs=("grad_weight_l", "grad_weight_r", "grad_bias"),
        grad_flags=("agg", "x"),
        output_shapes=_backward_shapes,
    ),
}
