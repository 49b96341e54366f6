"""The tensor-op handler: the code that runs inside an executor (local worker or AWS Lambda).

``handle(payload) -> bytes`` decodes a request ``{"op": str, "attrs": {...}, "fingerprint": str}`` + named
arrays (see ``lightning_dorylus.wire``), refuses an op whose fingerprint differs from the sender's
(``fingerprint.py``), runs the op, and encodes ``{"op": str, "ok": true, "fingerprint": str}`` + the outputs.
``run_op`` is the same dispatch without the encoding (the "inline" executor calls it directly).

Imports only the standard library, numpy, and sibling modules, so this package ships into a
Lambda zip without torch (see ``lightning_dorylus.ops.bundle``).

Ops (inputs -> outputs; every tensor needed for backward is an explicit input):

================== ========================================================= ==========================
op                 inputs [optional]                                         outputs [optional]
================== ========================================================= ==========================
apply_vertex.fwd   z, weight, [bias]; attrs activation                       h
apply_vertex.bwd   z, weight, h, grad_h; attrs activation, has_bias,         [grad_z], grad_weight,
                   [needs_grad_z] (default true)                             [grad_bias]
gat.project.fwd    x, weight, att_src, att_dst                               h, alpha_src, alpha_dst
gat.project.bwd    x, weight, att_src, att_dst, h, grad_h, grad_alpha_src,   [grad_x], grad_weight,
                   grad_alpha_dst; attrs [needs_grad_x] (default true)       grad_att_src, grad_att_dst
apply_edge.fwd     alpha_src_e, alpha_dst, dst_ptr; attrs negative_slope     attention
apply_edge.bwd     alpha_src_e, alpha_dst, dst_ptr, attention,               grad_alpha_src_e,
                   grad_attention; attrs negative_slope                      grad_alpha_dst
sage.update.fwd    agg, x, weight_l, weight_r, [bias]; attrs activation      h
sage.update.bwd    agg, x, weight_l, weight_r, h, grad_h; attrs activation,  [grad_agg], [grad_x],
                   has_bias, [needs_grad_agg], [needs_grad_x]                grad_weight_l, grad_weight_r,
                                                                             [grad_bias]
================== ========================================================= ==========================
(".fwd"/".bwd" abbreviate ".forward"/".backward".) Each op is declared once, as an ``OpSpec`` in its
module's ``OPS`` (see ``spec.py``: inputs, outputs, how it splits over intervals, its backward op). Ops of
the user's own modules join ``OPS`` through ``registry.register_ops``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import wire
from . import gat, sage, vertex
from .fingerprint import check_fingerprint, op_fingerprint
from .spec import OpSpec

__all__ = ["OPS", "OpSpec", "handle", "run_op"]

OPS: dict[str, OpSpec] = {**vertex.OPS, **gat.OPS, **sage.OPS}

FLOAT_DTYPES = ("float16", "float32", "float64")
#: Error messages sent back to the caller are cut to this many characters (see ``error_header``).
MAX_ERROR_MESSAGE = 16_384


def run_op(op: str, inputs: Mapping[str, np.ndarray], attrs: Mapping[str, Any] | None = None
           ) -> dict[str, np.ndarray]:
    """Validate and run one op on numpy arrays; outputs have the inputs' floating dtype.

    Raises:
        ValueError: unknown ``op`` (the message lists the valid ones), a missing or unexpected input
            (named), mixed floating dtypes, or shapes that do not fit the op.
    """
    spec = OPS.get(op) if isinstance(op, str) else None
    if spec is None:
        raise ValueError(unknown_op_message(op))
    missing = [k for k in spec.required if k not in inputs]
    if missing:
        raise ValueError(f"op {op!r} is missing input(s) {missing}; it needs {list(spec.required)}"
                         + (f" and accepts {list(spec.optional)}" if spec.optional else ""))
    unexpected = [k for k in inputs if k not in spec.required and k not in spec.optional]
    if unexpected:
        raise ValueError(f"op {op!r} got unexpected input(s) {unexpected}; it takes "
                         f"{list(spec.required + spec.optional)}")
    dtypes = {k: np.dtype(v.dtype).name for k, v in inputs.items() if k not in spec.integer_inputs}
    if len(set(dtypes.values())) > 1 or not set(dtypes.values()) <= set(FLOAT_DTYPES):
        raise ValueError(f"op {op!r} needs its floating inputs to share one dtype of {list(FLOAT_DTYPES)}; "
                         f"got {dtypes}")
    for k in spec.integer_inputs:
        if np.dtype(inputs[k].dtype).kind not in "iu":
            raise ValueError(f"op {op!r} input {k!r} must be an integer array, got {inputs[k].dtype}")
    return spec.fn(dict(inputs), dict(attrs or {}))


def unknown_op_message(op: Any) -> str:
    """Why ``op`` is not here and what to do: ops from the user's own module ship by module name."""
    return (f"unknown op {op!r}: this handler has {sorted(OPS)}. An op from your own module must be "
            "registered with lightning_dorylus.ops.register_ops in that module, and the executor must import "
            "the module: the local pool ships every op module imported before it starts; a Lambda function "
            "needs a redeploy with `python -m lightning_dorylus.deploy --op-module <module>`")


def handle(payload: bytes | bytearray | memoryview) -> bytes:
    """Decode a request, run its op, encode the response (the core of the Lambda entry point).

    Errors propagate as exceptions (Lambda reports them as ``FunctionError``); the local worker
    catches them and sends ``error_header`` back instead.
    """
    return wire.join_frames(*handle_frames(payload))


def handle_frames(payload: bytes | bytearray | memoryview) -> tuple[int, list[Any]]:
    """``handle`` without joining the response: ``(total_len, frames)`` for streaming into a pipe."""
    header, arrays = wire.decode(payload)
    op = header.get("op")
    if not isinstance(op, str):
        raise wire.WireError(f"request header 'op' must be a str naming one of {sorted(OPS)}, "
                             f"got {type(op).__name__}")
    attrs = header.get("attrs", {})
    if not isinstance(attrs, dict):
        raise wire.WireError(f"request header 'attrs' must be a JSON object, got {type(attrs).__name__}")
    if op in OPS:  # the graph server's code and this handler's must be the same (fingerprint.py)
        check_fingerprint(op, OPS[op], header.get("fingerprint"))
    outputs = run_op(op, arrays, attrs)  # type: ignore[arg-type]
    return wire.encode_frames(response_header(op), outputs)  # type: ignore[arg-type]


def request_header(op: str, attrs: Mapping[str, Any] | None = None, interval: int = -1) -> dict[str, Any]:
    """The header of a request payload (what executors send): with the sender's fingerprint of ``op``."""
    return {"op": op, "attrs": dict(attrs or {}), "interval": interval, "fingerprint": fingerprint(op)}


def response_header(op: str) -> dict[str, Any]:
    """The header of a successful response: with the fingerprint of the op this handler ran."""
    return {"op": op, "ok": True, "fingerprint": fingerprint(op)}


def fingerprint(op: str) -> str | None:
    """This process's fingerprint of ``op`` (``None`` for an op it does not have)."""
    spec = OPS.get(op)
    return None if spec is None else op_fingerprint(op, spec)


def error_header(op: Any, err: BaseException) -> dict[str, Any]:
    """The header of a failed response: the error's type and message travel back, not a traceback object.

    ``op`` is echoed only when it is a str, and the message is cut to ``MAX_ERROR_MESSAGE`` characters,
    so a forged request cannot make the reply's header exceed the wire limits.
    """
    message = str(err)
    if len(message) > MAX_ERROR_MESSAGE:
        message = message[:MAX_ERROR_MESSAGE] + f"... [{len(message) - MAX_ERROR_MESSAGE} more characters]"
    return {"op": op if isinstance(op, str) else None, "ok": False, "error_type": type(err).__name__,
            "message": message}
