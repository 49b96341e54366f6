"""ApplyVertex (AV): the dense per-vertex tensor op ``h = act(z @ W + b)`` and its backward.

In PyG's vocabulary this is ``update`` (and the ``self.lin(x)`` before ``propagate``): work that
touches one vertex row at a time, so an interval of rows can go to any executor. Numpy only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .spec import OpSpec, Shape

ACTIVATIONS = ("relu", "elu", "none")


def check_activation(activation: Any) -> str:
    """Return ``activation`` if it is supported, else raise naming the value and the choices."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported; expected one of {list(ACTIVATIONS)}")
    return activation


def activate(pre: np.ndarray, activation: str) -> np.ndarray:
    """Apply ``activation`` to ``pre`` (in place when possible; ``pre`` must be a fresh array)."""
    if activation == "relu":
        return np.maximum(pre, 0, out=pre)
    if activation == "elu":  # alpha = 1: x if x > 0 else exp(x) - 1
        neg = pre <= 0
        pre[neg] = np.expm1(pre[neg])
        return pre
    return pre


def activation_grad(h: np.ndarray, grad_h: np.ndarray, activation: str) -> np.ndarray:
    """``grad_h * act'(pre)`` computed from the activation's OUTPUT ``h`` (so ``pre`` need not travel).

    relu: 1 where h > 0; elu (alpha = 1): 1 where h > 0 else h + 1 (= exp(pre)); none: 1.
    """
    if activation == "relu":
        return np.where(h > 0, grad_h, np.zeros((), dtype=grad_h.dtype))
    if activation == "elu":
        return np.where(h > 0, grad_h, grad_h * (h + 1))
    return grad_h


def apply_vertex_forward(inputs: dict[str, np.ndarray], attrs: dict[str, Any]) -> dict[str, np.ndarray]:
    """``h = act(z @ weight + bias)``: z (n, fi), weight (fi, fo), optional bias (fo,) -> h (n, fo)."""
    z, weight, bias = inputs["z"], inputs["weight"], inputs.get("bias")
    activation = check_activation(attrs.get("activation", "none"))
    _check_matmul(z, weight, "z", "weight")
    pre = z @ weight  # (n, fo), a fresh array
    if bias is not None:
        if bias.shape != (weight.shape[1],):
            raise ValueError(f"bias has shape {bias.shape}; expected ({weight.shape[1]},) to match weight "
                             f"{weight.shape}")
        pre += bias
    return {"h": activate(pre, activation)}


def apply_vertex_backward(inputs: dict[str, np.ndarray], attrs: dict[str, Any]) -> dict[str, np.ndarray]:
    """Gradients of ``h = act(z @ weight + bias)`` given ``grad_h``.

    grad_pre = grad_h * act'(h); grad_z = grad_pre @ weight.T; grad_weight = z.T @ grad_pre;
    grad_bias = sum over rows of grad_pre (only when ``attrs["has_bias"]``). ``attrs["needs_grad_z"]``
    (default true) false skips ``grad_z``: a first layer's input (the features) needs no gradient, and its
    ``(n, fi)`` product is the widest one of the op.
    """
    z, weight, h, grad_h = inputs["z"], inputs["weight"], inputs["h"], inputs["grad_h"]
    activation = check_activation(attrs.get("activation", "none"))
    _check_matmul(z, weight, "z", "weight")
    expected = (z.shape[0], weight.shape[1])
    for name, arr in (("h", h), ("grad_h", grad_h)):
        if arr.shape != expected:
            raise ValueError(f"{name} has shape {arr.shape}; expected {expected} = (z rows, weight columns)")
    has_bias = attrs.get("has_bias", False)
    if not isinstance(has_bias, bool):
        raise ValueError(f"has_bias={has_bias!r} must be true or false")
    needs_grad_z = attrs.get("needs_grad_z", True)
    if not isinstance(needs_grad_z, bool):
        raise ValueError(f"needs_grad_z={needs_grad_z!r} must be true or false")
    grad_pre = activation_grad(h, grad_h, activation)  # (n, fo)
    out = {"grad_weight": z.T @ grad_pre}
    if needs_grad_z:
        out["grad_z"] = grad_pre @ weight.T
    if has_bias:
        out["grad_bias"] = grad_pre.sum(axis=0)
    return out


def _check_matmul(a: np.ndarray, b: np.ndarray, a_name: str, b_name: str) -> None:
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"{a_name} {a.shape} @ {b_name} {b.shape}: expected 2-D arrays with "
                         f"{a_name}.shape[1] == {b_name}.shape[0]")


def _forward_shapes(s: Mapping[str, Shape], attrs: Mapping[str, Any]) -> dict[str, Shape]:
    return {"h": (s["z"][0], s["weight"][1])}


def _backward_shapes(s: Mapping[str, Shape], attrs: Mapping[str, Any]) -> dict[str, Shape]:
    out: dict[str, Shape] = {}
    if attrs.get("needs_grad_z", True):
        out["grad_z"] = (s["z"][0], s["weight"][0])
    out["grad_weight"] = tuple(s["weight"])
    if attrs.get("has_bias", False):
        out["grad_bias"] = (s["weight"][1],)
    return out


OPS = {
    "apply_vertex.forward": OpSpec(apply_vertex_forward, ("z", "weight"), ("bias",), outputs=("h",),
                                   backward="apply_vertex.backward", row_inputs=("z",), row_outputs=("h",),
                                   output_shapes=_forward_shapes),
    "apply_vertex.backward": OpSpec(apply_vertex_backward, ("z", "weight", "h", "grad_h"),
                                    outputs=("grad_z", "grad_weight", "grad_bias"),
                                    row_inputs=("z", "h", "grad_h"), row_outputs=("grad_z",),
                                    summed_outputs=("grad_weight", "grad_bias"), grad_flags=("z",),
                                    output_shapes=_backward_shapes),
}
