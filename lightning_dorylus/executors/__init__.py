"""Executors for Dorylus tensor ops, behind one interface (``TensorOpExecutor``).

``build_executor("inline")`` runs ops on the graph server; ``build_executor("local", num_workers=2)``
runs them in worker processes that execute exactly the code a Lambda function would;
``build_executor("lambda", function_name=...)`` invokes that code on AWS Lambda through boto3.
"""

from __future__ import annotations

from typing import Any

from .aws_lambda import LambdaExecutor
from .base import ExecutorError, RemoteOpError, RetryableError, TensorOpExecutor, TensorOpRequest
from .inline import InlineExecutor
from .local import LocalPoolExecutor
from .resilient import FaultPolicy, ResilientExecutor

EXECUTORS: dict[str, str] = {
    "inline": "InlineExecutor: ops run in the graph-server process (no serialization)",
    "local": "LocalPoolExecutor: a pool of worker processes, wire-encoded bytes over pipes",
    "lambda": "LambdaExecutor: AWS Lambda invocations through boto3 (payloads over 6 MB via S3)",
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
    if name == "lambda":
        return LambdaExecutor(**kwargs)
    raise ValueError(f"unknown executor {name!r}; valid executors are {sorted(EXECUTORS)}")


__all__ = ["EXECUTORS", "ExecutorError", "FaultPolicy", "InlineExecutor", "LambdaExecutor",
           "LocalPoolExecutor",
           "RemoteOpError", "ResilientExecutor", "RetryableError", "TensorOpExecutor", "TensorOpRequest",
           "build_executor"]
