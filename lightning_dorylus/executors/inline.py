"""The "inline" executor: tensor ops run on the graph server itself (the CPU-only baseline).

It calls the same numpy handlers as the worker pool and the Lambda function, on zero-copy numpy views
of the request tensors, with no encoding, so its outputs are bit-identical to theirs.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from torch import Tensor
from typing_extensions import override

from ..ops.handlers import run_op
from ..threads import one_blas_thread
from .base import ExecutorError, TensorOpExecutor, TensorOpRequest, to_tensors


class InlineExecutor(TensorOpExecutor):
    """Run ops in this process.

    Args:
        num_threads: 0 (default) runs each op synchronously inside ``submit``; ``n > 0`` runs ops on a
            pool of ``n`` threads (numpy releases the GIL in matmuls, so intervals can overlap).
    """

    def __init__(self, num_threads: int = 0) -> None:
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 0:
            raise ValueError(f"num_threads={num_threads!r}: expected an int >= 0")
        self.num_threads = num_threads
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    @override
    def start(self) -> None:
        if self._closed:
            raise ExecutorError("InlineExecutor is closed")
        if self.num_threads and self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="dorylus-inline")

    @override
    def submit(self, request: TensorOpRequest) -> Future[dict[str, Tensor]]:
        self.start()
        if self._pool is not None:
            return self._pool.submit(self._run, request)
        future: Future[dict[str, Tensor]] = Future()
        try:
            future.set_result(self._run(request))
        except Exception as err:
            future.set_exception(err)
        return future

    @staticmethod
    def _run(request: TensorOpRequest) -> dict[str, Tensor]:
        with one_blas_thread:  # beside this process's torch pool (lightning_dorylus.threads.OneBlasThread)
            return to_tensors(run_op(request.op, request.numpy_inputs(), request.attrs))

    @override
    def close(self) -> None:
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __repr__(self) -> str:
        return f"InlineExecutor(num_threads={self.num_threads})"
