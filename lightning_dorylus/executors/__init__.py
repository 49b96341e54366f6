"""Executors for Dorylus tensor ops, behind one interface (``TensorOpExecutor``).

``build_executor("inline")`` runs ops on the graph server; ``build_executor("local", num_workers=2)``
runs them in worker processes that execute exactly the code a Lambda function would.
"""

from __future__ import annotations

from typing import Any

from .base import ExecutorError, RemoteOpError, RetryableError, TensorOpExecutor, TensorOpRequest
from .inline import InlineExecutor
from .local import LocalPoolExecutor
from .resilient import FaultPolicy, ResilientExecutor

EXECUTORS: dict[str, str] = {
    "inline": "InlineExecutor: ops run in the graph-server process (no serialization)",
    "local": "LocalPoolExecutor: a pool of worker processes, wire-encoded bytes over pipes",
}


def build_executor(name: str, **kwargs: Any) -> TensorOpExecutor:
    """Build an executor by name; ``kwargs`` go to its constructor.

    Raises:
        ValueError: ``name`` is not one of ``EXECUTORS``.
    """
    if name == "inline":
        return InlineExecutor(**kwargs)
    if name == "local":
        return LocalPoolExecutor(**kwargs)
    raise ValueError(f"unknown executor {name!r}; valid executors are {sorted(EXECUTORS)}")


__all__ = ["EXECUTORS", "ExecutorError", "FaultPolicy", "InlineExecutor", "LocalPoolExecutor",
           "RemoteOpError", "ResilientExecutor", "RetryableError", "TensorOpExecutor", "TensorOpRequest",
           "build_executor"]
