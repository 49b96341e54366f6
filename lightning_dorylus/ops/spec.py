"""``OpSpec``: the one declaration of a tensor op, read by the handler, the graph server and every executor.

A layer's numpy module (``vertex.py``, ``gat.py``, ``sage.py``) declares its ops in a module-level ``OPS``
dict; ``handlers.OPS`` merges them. Besides the function and its input names, a spec says how the op splits
over vertex intervals, so the graph server's single slice/submit/concatenate code
(``lightning_dorylus.nn.functions``) and request planners need no per-op code:

* ``row_inputs`` / ``row_outputs``: one row per vertex: sliced ``[a:b]`` per interval, outputs concatenated;
  a request may also be cut further into row pieces (``executors.planning``: payload limits);
* ``edge_inputs`` / ``edge_outputs``: one row per in-edge (edges sorted by destination): sliced by the
  interval's edge span ``[e0:e1]``, outputs concatenated;
* ``dst_inputs`` / ``dst_outputs``: one row per destination vertex of an edge op: sliced ``[a:b]`` per
  interval like row inputs, but never cut inside a request (a cut at a row is not a cut at an edge);
* ``ptr_inputs``: a CSR pointer over the interval's rows: ``ptr[a:b+1] - e0``;
* ``summed_outputs``: per-interval partial sums (weight gradients): added up on the graph server;
* every other input is shared (the weights): sent whole with each interval.

A forward op names its ``backward`` op; the backward op takes the forward inputs it lists, the forward
outputs, and ``grad_<output>``, and returns ``grad_<input>``. Its ``grad_flags`` are the inputs whose
gradient may be skipped with the attr ``needs_grad_<input>`` (a first layer's features need none).
``output_shapes`` gives the outputs' shapes from the inputs' shapes and attrs, so a response's size is
known before it is computed. Numpy-free and torch-free: only the standard library.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

OpFn = Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]
Shape = tuple[int, ...]
ShapeFn = Callable[[Mapping[str, Shape], Mapping[str, Any]], dict[str, Shape]]


@dataclass(frozen=True)
class OpSpec:
    """An op's function, the array names it needs (``required``) or accepts (``optional``), and its split."""

    fn: OpFn
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    integer_inputs: tuple[str, ...] = ()  # everything else must share one floating dtype
    outputs: tuple[str, ...] = ()  # every output name, in the order a graph server returns them
    backward: str | None = None  # name of the mirrored op (forward ops only)
    row_inputs: tuple[str, ...] = ()
    row_outputs: tuple[str, ...] = ()
    edge_inputs: tuple[str, ...] = ()
    edge_outputs: tuple[str, ...] = ()
    ptr_inputs: tuple[str, ...] = ()
    summed_outputs: tuple[str, ...] = ()
    grad_flags: tuple[str, ...] = ()
    dst_inputs: tuple[str, ...] = ()
    dst_outputs: tuple[str, ...] = ()
    output_shapes: ShapeFn | None = None  # outputs' shapes from inputs' shapes and attrs (request planning)

    def split_kind(self, name: str) -> str:
        """``"row"``, ``"edge"``, ``"ptr"`` or ``"shared"``: how input ``name`` is cut per interval."""
        if name in self.row_inputs or name in self.dst_inputs:
            return "row"
        if name in self.edge_inputs:
            return "edge"
        if name in self.ptr_inputs:
            return "ptr"
        return "shared"

    def merge_kind(self, name: str) -> str:
        """``"concat"`` (row and edge outputs) or ``"sum"``: how per-interval output ``name`` is combined."""
        if name in self.summed_outputs:
            return "sum"
        if name in self.row_outputs or name in self.edge_outputs or name in self.dst_outputs:
            return "concat"
        raise ValueError(f"output {name!r} is neither a row/edge output nor a summed output of its op")
