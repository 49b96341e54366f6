"""GIN's MLP as a Dorylus tensor op: ``h = relu(z @ w1 + b1) @ w2 + b2`` per vertex row, and its backward.

A user op module: it runs inside the executors (local worker processes, AWS Lambda), so it imports only the
standard library, numpy and ``lightning_dorylus.ops``. Importing it registers the two ops.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from lightning_dorylus.ops import OpSpec, register_ops

Shape = tuple[int, ...]


def mlp_forward(inputs: dict[str, np.ndarray], attrs: dict[str, Any]) -> dict[str, np.ndarray]:
    """z (n, fi), w1 (fi, hid), b1 (hid,), w2 (hid, fo), b2 (fo,) -> h (n, fo)."""
    z, w1, b1, w2, b2 = (inputs[k] for k in ("z", "w1", "b1", "w2", "b2"))
    hidden = np.maximum(z @ w1 + b1, 0)  # (n, hid)
    return {"h": hidden @ w2 + b2}


def mlp_backward(inputs: dict[str, np.ndarray], attrs: dict[str, Any]) -> dict[str, np.ndarray]:
    """Gradients given grad_h (n, fo); the hidden layer is recomputed from z (it never travels)."""
    z, w1, b1, w2, grad_h = (inputs[k] for k in ("z", "w1", "b1", "w2", "grad_h"))
    pre = z @ w1 + b1  # (n, hid)
    grad_pre = np.where(pre > 0, grad_h @ w2.T, 0.0).astype(z.dtype)
    out = {"grad_w1": z.T @ grad_pre, "grad_b1": grad_pre.sum(axis=0),
           "grad_w2": np.maximum(pre, 0).T @ grad_h, "grad_b2": grad_h.sum(axis=0)}
    if attrs.get("needs_grad_z", True):  # a first layer's input (the features) needs none
        out["grad_z"] = grad_pre @ w1.T
    return out


def _forward_shapes(s: Mapping[str, Shape], attrs: Mapping[str, Any]) -> dict[str, Shape]:
    return {"h": (s["z"][0], s["w2"][1])}


def _backward_shapes(s: Mapping[str, Shape], attrs: Mapping[str, Any]) -> dict[str, Shape]:
    out = {f"grad_{k}": tuple(s[k]) for k in ("w1", "b1", "w2", "b2")}
    if attrs.get("needs_grad_z", True):
        out["grad_z"] = tuple(s["z"])
    return out


register_ops({
    "gin.mlp.forward": OpSpec(
        mlp_forward, ("z", "w1", "b1", "w2", "b2"), outputs=("h",), backward="gin.mlp.backward",
        row_inputs=("z",), row_outputs=("h",), output_shapes=_forward_shapes,
    ),
    "gin.mlp.backward": OpSpec(
        mlp_backward, ("z", "w1", "b1", "w2", "b2", "grad_h"),
        outputs=("grad_z", "grad_w1", "grad_b1", "grad_w2", "grad_b2"),
        row_inputs=("z", "grad_h"), row_outputs=("grad_z",),
        summed_outputs=("grad_w1", "grad_b1", "grad_w2", "grad_b2"), grad_flags=("z",),
        output_shapes=_backward_shapes,
    ),
})
