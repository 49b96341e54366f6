"""Request planning: cut one interval's request into row pieces that fit a payload limit, merge the answers.

The one place where requests are split and merged, for every executor. What may be cut comes from the op
table (``OpSpec.row_inputs`` / ``row_outputs`` / ``summed_outputs`` / ``output_shapes`` in
``lightning_dorylus.ops.handlers``): row inputs are sliced along axis 0 (zero-copy views), every other input
travels whole with each piece; row outputs are concatenated again and summed outputs (weight gradients) are
added up in piece order. Sizes are exact: ``wire.encoded_size`` of the request and of the response (whose
shapes ``output_shapes`` gives before anything runs), after base64 (Lambda's JSON payloads carry binary as
base64: 4/3) plus the JSON envelope. A piece that still cannot fit (an op with no row inputs, or a single row
too large) is marked ``oversize``: the Lambda executor sends it through S3.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .. import wire
from ..ops.handlers import OPS, request_header, response_header

#: Bytes of JSON around the base64 payload (``{"payload": "..."}`` plus the S3 fields), with room to spare.
ENVELOPE_BYTES = 1024


@dataclass(frozen=True)
class Piece:
    """One request that is actually sent: rows ``[start, stop)`` of the interval (all rows if not cut).

    Attributes:
        request_bytes / response_bytes: exact wire sizes (before base64).
        oversize: does not fit the limit even alone; must travel out of band (S3).
    """

    index: int
    start: int
    stop: int
    inputs: dict[str, np.ndarray]
    request_bytes: int
    response_bytes: int
    oversize: bool


def payload_fits(nbytes: int, limit: int | None) -> bool:
    """Whether a wire payload of ``nbytes`` fits ``limit`` once base64-encoded in a JSON envelope."""
    return limit is None or wire.base64_size(nbytes) + ENVELOPE_BYTES <= limit


def _specs(inputs: Mapping[str, np.ndarray], rows: int | None, row_names: Sequence[str]
           ) -> dict[str, wire.ArraySpec]:
    out = {}
    for name, arr in inputs.items():
        shape = tuple(arr.shape)
        if rows is not None and name in row_names:
            shape = (rows, *shape[1:])
        out[name] = wire.ArraySpec(shape, np.dtype(arr.dtype).name)
    return out


def _sizes(op: str, inputs: Mapping[str, np.ndarray], attrs: Mapping[str, Any], interval: int,
           rows: int | None) -> tuple[int, int]:
    """Exact (request, response) wire sizes for a piece of ``rows`` rows (``None``: the whole request)."""
    spec = OPS[op]
    specs = _specs(inputs, rows, spec.row_inputs)
    req = wire.encoded_size(request_header(op, attrs, interval), specs)
    if spec.output_shapes is None:
        return req, 0
    float_dtypes = [s.dtype for k, s in specs.items() if k not in spec.integer_inputs]
    dtype = float_dtypes[0] if float_dtypes else "float64"
    try:
        shapes = spec.output_shapes({k: s.shape for k, s in specs.items()}, attrs)
    except (KeyError, IndexError, TypeError):
        return req, 0  # a malformed request: the handler names what is wrong, no need to plan it
    resp = wire.encoded_size(response_header(op), {k: wire.ArraySpec(v, dtype) for k, v in shapes.items()})
    return req, resp


def plan_request(op: str, inputs: Mapping[str, np.ndarray], attrs: Mapping[str, Any], interval: int,
                 limit: int | None, max_rows: int | None = None) -> list[Piece]:
    """Cut a request into the fewest equal row pieces whose request and response both fit ``limit``.

    Args:
        op, inputs, attrs, interval: the request (numpy views of its tensors).
        limit: bytes per payload after base64 (Lambda: ``wire.LAMBDA_SYNC_PAYLOAD_LIMIT``); ``None``: none.
        max_rows: also cut so that no piece has more rows than this (``None``: only the limit cuts).

    Returns:
        pieces in row order; a single piece (maybe ``oversize``) when the op cannot be cut.
    """
    spec = OPS.get(op)
    whole_req, whole_resp = _sizes(op, inputs, attrs, interval, None) if spec else (0, 0)
    rows_of = {k: inputs[k].shape[0] for k in (spec.row_inputs if spec else ()) if k in inputs
               and inputs[k].ndim > 0}
    n = next(iter(rows_of.values()), 0)
    splittable = bool(rows_of) and len(set(rows_of.values())) == 1 and n > 1
    whole_fits = payload_fits(whole_req, limit) and payload_fits(whole_resp, limit)
    if not splittable or (whole_fits and (max_rows is None or n <= max_rows)):
        return [Piece(0, 0, n, dict(inputs), whole_req, whole_resp, not whole_fits)]

    def fits(rows: int) -> bool:
        req, resp = _sizes(op, inputs, attrs, interval, rows)
        return payload_fits(req, limit) and payload_fits(resp, limit)

    lo, hi = 0, n if max_rows is None else min(n, max_rows)  # largest r in [1, hi] that fits (monotone)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    best = max(lo, 1)
    count = math.ceil(n / best)
    chunk = math.ceil(n / count)  # equal pieces (<= best rows each, so they fit as well)
    pieces = []
    for i, start in enumerate(range(0, n, chunk)):
        stop = min(start + chunk, n)
        part = {k: (v[start:stop] if k in rows_of else v) for k, v in inputs.items()}
        req, resp = _sizes(op, inputs, attrs, interval, stop - start)
        pieces.append(Piece(i, start, stop, part, req, resp, lo == 0))
    return pieces


def merge_outputs(op: str, outputs: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Merge the pieces' outputs (in row order): row outputs concatenated, summed outputs added up.

    Raises:
        ValueError: an output of a cut op that is neither a row output nor a summed output.
    """
    if len(outputs) == 1:
        return outputs[0]
    spec = OPS[op]
    merged: dict[str, Tensor] = {}
    for name in outputs[0]:
        parts = [o[name] for o in outputs]
        if name in spec.row_outputs:
            merged[name] = torch.cat(parts, dim=0)
        elif name in spec.summed_outputs:
            total = parts[0].clone()
            for p in parts[1:]:
                total += p
            merged[name] = total
        else:
            raise ValueError(f"op {op!r} output {name!r} is neither in row_outputs nor in summed_outputs; "
                             f"its request cannot be cut into pieces")
    return merged
