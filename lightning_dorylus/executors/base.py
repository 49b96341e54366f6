"""The executor interface: where a graph server sends ApplyVertex / ApplyEdge work, one interval at a time.

An executor takes a ``TensorOpRequest`` (op name, CPU tensors, JSON attrs) and returns a future of the
op's output tensors. Nothing autograd-related crosses this boundary: the layer passes every tensor the
op needs and builds the graph's autograd on its side. Implementations: ``InlineExecutor`` (on the graph
server itself), ``LocalPoolExecutor`` (worker processes, real serialization), and in part 2 an AWS
Lambda executor (same wire payload, sent over HTTPS).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import numpy as np
import torch
from torch import Tensor
from typing_extensions import Self

#: torch dtypes that map onto ``wire.ALLOWED_DTYPES``.
WIRE_DTYPES = frozenset({torch.float16, torch.float32, torch.float64, torch.int32, torch.int64, torch.bool,
                         torch.uint8})


class ExecutorError(RuntimeError):
    """A tensor op could not be run: the executor is closed, a worker died, or the op failed remotely."""


class RemoteOpError(ExecutorError):
    """The op raised inside the executor; ``error_type`` is the remote exception's class name."""

    def __init__(self, message: str, error_type: str) -> None:
        super().__init__(message)
        self.error_type = error_type


class RetryableError(ExecutorError):
    """A failure worth another attempt of the same request.

    ``kind``: ``"throttled"`` (Lambda's HTTP 429; does not use up ``max_attempts``), ``"lost"`` (a worker
    process went away, a read timed out), ``"connection"`` (the endpoint could not be reached or dropped the
    connection: retried for ``outage_s`` without using up ``max_attempts``), ``"deadline"`` (no result within
    the per-request deadline).
    """

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class TensorOpRequest:
    """One tensor op on one interval.

    Args:
        op: a name from ``lightning_dorylus.ops.handlers.OPS`` (e.g. ``"apply_vertex.forward"``).
        tensors: named CPU tensors. The executor may read them until the future resolves, so the caller
            must not modify them in place before that.
        attrs: JSON-serializable op attributes (e.g. ``{"activation": "relu"}``).
        interval: which interval this is (for tracing; part 2 uses it to drop late duplicates).
    """

    op: str
    tensors: dict[str, Tensor]
    attrs: dict[str, Any] = field(default_factory=dict)
    interval: int = -1

    def __repr__(self) -> str:  # shapes, not tensor contents, in logs and error messages
        tensors = ", ".join(f"{k}: {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                            for k, t in self.tensors.items())
        return (f"TensorOpRequest(op={self.op!r}, interval={self.interval}, attrs={self.attrs}, "
                f"tensors={{{tensors}}})")

    def numpy_inputs(self) -> dict[str, np.ndarray]:
        """Zero-copy numpy views of the tensors (contiguous ones; others are made contiguous)."""
        out: dict[str, np.ndarray] = {}
        for name, t in self.tensors.items():
            if not isinstance(t, Tensor):
                raise TypeError(f"request {self.op!r} tensor {name!r} must be a torch.Tensor, "
                                f"got {type(t).__name__}")
            if t.device.type != "cpu":
                raise ValueError(f"request {self.op!r} tensor {name!r} is on {t.device}; executors take CPU "
                                 f"tensors (the caller moves them)")
            if t.dtype not in WIRE_DTYPES:
                raise ValueError(f"request {self.op!r} tensor {name!r} has dtype {t.dtype}; executors take "
                                 f"{sorted(str(d) for d in WIRE_DTYPES)}")
            out[name] = t.detach().contiguous().numpy()
        return out


def to_tensors(arrays: dict[str, np.ndarray]) -> dict[str, Tensor]:
    """Wrap numpy outputs as CPU tensors without copying."""
    return {name: torch.from_numpy(arr) for name, arr in arrays.items()}


class TensorOpExecutor(ABC):
    """Runs tensor ops somewhere and hands back futures of their outputs (CPU tensors)."""

    def start(self) -> None:  # noqa: B027 - optional hook, idempotent
        """Acquire resources (spawn workers, open clients). Idempotent; ``submit`` calls it."""

    @abstractmethod
    def submit(self, request: TensorOpRequest) -> Future[dict[str, Tensor]]:
        """Queue one request; the future resolves to the op's outputs or to an exception."""

    def map(self, requests: Sequence[TensorOpRequest],
            timeout: float | None = None) -> list[dict[str, Tensor]]:
        """Submit all requests at once (so they run concurrently) and return their outputs in order.

        Args:
            requests: the requests, typically one per interval.
            timeout: seconds to wait for each result; ``None`` waits as long as it takes.
        """
        return self.wait([self.submit(r) for r in requests], timeout)

    def wait(self, futures: Sequence[Future[dict[str, Tensor]]],
             timeout: float | None = None) -> list[dict[str, Tensor]]:
        """Block until ``futures`` (from :meth:`submit`) resolve and return their outputs in order.

        The one place a graph server waits for tensor ops, so a wrapper (``lightning_dorylus.value.OpTimer``)
        can measure how long the server was blocked on its executor.

        Args:
            futures: futures returned by this executor's ``submit``.
            timeout: seconds to wait for each result; ``None`` waits as long as it takes.
        """
        return [f.result(timeout=timeout) for f in futures]

    def close(self) -> None:  # noqa: B027 - optional hook, idempotent
        """Release resources. Idempotent; pending futures fail with ``ExecutorError``."""

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
