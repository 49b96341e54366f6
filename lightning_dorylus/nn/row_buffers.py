"""Row buffers for a first layer's per-interval input rows, lent to requests and reused once answered.

Used wherever a :class:`~lightning_dorylus.nn.dropout.RowSource` makes an interval's rows just before
its request goes out: GAT's first layer (``TensorOp`` with a ``RowInput``), the weight-first GCN layer and
the run-ahead (:mod:`.functions`), forward and backward, in every mode.
"""

from __future__ import annotations

from concurrent.futures import Future

from torch import Tensor

from lightning_dorylus.nn.dropout import RowSource


class RowBuffers:
    """Row buffers lent to interval requests and reused once a request is answered.

    Why: a first layer's rows are made per interval (4 MiB at 8192 x 128 float32), in the forward and
    again in the backward. A fresh buffer that large is a fresh ``mmap`` whose pages the kernel faults in
    and zeroes (nearly half the cost of making the rows); with one executor worker requests are answered
    about as fast as they are made, so a handful of buffers serve every interval. An answered request's
    buffer is read by nobody: the answer came after the request was sent, and a late duplicate's answer is
    dropped. One whose answer shares its memory (an inline op returning its input) is never reused.
    """

    def __init__(self) -> None:
        self._lent: list[tuple[Tensor, Future[dict[str, Tensor]]]] = []
        self._unanswered: Tensor | None = None  # lent, its request not submitted yet

    def take(self, source: RowSource, span: tuple[int, ...]) -> Tensor | None:
        """A buffer for rows ``span`` of ``source`` whose request was answered; ``None``: make a new one.

        Only a buffer on the features' device: a graph server on a GPU makes its rows there and lends the
        requests their host copies, which cannot take the next rows (the first CUDA run failed on it).
        """
        x = source.graph.partition.x
        shape = (span[1] - span[0], *x.shape[1:])
        for k, (buffer, future) in enumerate(self._lent):
            if (future.done() and buffer.shape == shape and buffer.dtype == x.dtype
                    and buffer.device == x.device and not _shares_memory(future, buffer)):
                del self._lent[k]
                return buffer
        return None

    def lend(self, rows: Tensor) -> Tensor:
        """``rows`` go out with the next request submitted (see :meth:`answered_by`)."""
        self._unanswered = rows
        return rows

    def answered_by(self, future: Future[dict[str, Tensor]]) -> None:
        """The request just submitted carries the rows lent last: reusable once ``future`` is done."""
        rows, self._unanswered = self._unanswered, None
        if rows is not None and rows.device.type == "cpu" and rows._base is None:  # a buffer, not a view of x
            self._lent.append((rows, future))


def _shares_memory(future: Future[dict[str, Tensor]], buffer: Tensor) -> bool:
    if future.exception() is not None:
        return False
    storage = buffer.untyped_storage().data_ptr()
    return any(t.untyped_storage().data_ptr() == storage for t in future.result().values())
