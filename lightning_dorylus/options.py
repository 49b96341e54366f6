"""``DorylusOptions``: every option of ``DorylusStrategy`` that Lightning's ``DDPStrategy`` does not have,
documented and checked in one place, before any process starts.

The constructor passes its arguments here unchanged; a bad value raises the same ``ValueError``/``TypeError``
whether the strategy is built in a script, from a recipe or from the strategy registry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_dorylus.executors import EXECUTORS, TensorOpExecutor
from lightning_dorylus.graph.stale import StaleReads, check_stale_reads
from lightning_dorylus.memory import MMAP_THRESHOLD_MAX

LossReduction = Literal["mean", "sum"]
LOSS_REDUCTIONS = ("mean", "sum")
StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
START_METHODS = ("popen", "spawn", "fork", "forkserver")


@dataclass(frozen=True)
class DorylusOptions:
    """The Dorylus options of one ``DorylusStrategy`` (checked on construction).

    Attributes:
        executor: Where ApplyVertex/ApplyEdge run: ``"local"`` (default; a pool of worker processes running
            the numpy Lambda handler behind a real serialization boundary), ``"inline"`` (on the graph
            server: the CPU-only baseline), or a ``TensorOpExecutor`` instance (started here; its owner
            closes it).
        executor_options: Keyword arguments of the named executor, e.g. ``{"num_workers": 2}`` (``"local"``).
        start_method: How processes are started: ``"popen"`` (default, re-runs the script like ``ddp``),
            ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        mmap_threshold: Bytes (glibc only): every graph server sets ``mallopt(M_MMAP_THRESHOLD, ...)`` so
            host buffers at least this large come from ``mmap`` and go back to the OS when freed. glibc's
            default threshold grows after the first large free, after which an epoch's many 1-32 MiB
            buffers (per-interval pieces, 16-wide layer outputs) fragment the heap and a server's peak
            creeps up epoch after epoch (+500 MiB over 4 epochs on the 1M-vertex benchmark). ``None``
            leaves the allocator alone. A C library without ``mallopt`` logs a warning. Such buffers are
            faulted in 4 KiB at a time: ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` in the environment that
            starts training backs them with huge pages (synchronous server CPU -15 % on the 1M-vertex
            benchmark, same peak memory; docs/dorylus-pipeline-benchmark.md, "Huge pages").
        num_threads: BLAS/OpenMP (and torch intra-op) threads of each graph server; ``None``: the
            environment's ``OMP_NUM_THREADS`` if set, else available cores / graph servers on this machine
            (``lightning_dorylus.threads``); with ``staleness`` set, less the threads of the ``local``
            executor's workers that may run on the server's cores (they compute while it does, and an
            OpenMP pool with more threads than free cores spins at its barriers). A BLAS library whose own
            variable (``OPENBLAS_NUM_THREADS``...) the user set keeps that count.
        staleness: ``None`` (default): synchronous: each GCN/GraphSAGE layer's GA in one whole-partition
            product (no per-interval copies of the adjacency), every request of a layer in flight at once;
            exactly the single-process computation. ``0``: the same engine with GA per interval from epoch 1
            on, so the graph server's GA of one interval overlaps the executor's AV of others (forward and
            backward); values stay exact. Epoch 0 gathers whole while a background thread builds the
            per-interval blocks: built in the foreground they lengthened it by about a third.
            ``S >= 1``: also bounded-stale SC/∇SC while training: ghost rows and ghost gradients may be up
            to ``S`` epochs old, so a graph server waits for a peer only when it is more than ``S`` epochs
            behind; and, on one server from ``S = 1``, on several from ``S = 2`` (it takes one epoch of the
            bound, ghosts then get ``S - 1``), a weight-first first layer sends the next epoch's requests
            during this epoch's last wait, with the weights one update behind (see ``docs/dorylus-engine.md``,
            "Bounded asynchrony"). What it buys: it hides waiting, not compute: a server does not wait
            for a slower peer's ghosts, and the executors' work overlaps the server's GA. It costs the
            per-interval blocks' memory (13-16 % more on 2 servers). Where the executors share the
            servers' cores (the ``local`` pool) there is little waiting to hide. Measured on 2 servers of
            a 2-core machine (100k vertices, GCN to val acc 0.85, 4 interleaved runs of
            ``benchmarks/dorylus_tta.py``): ``staleness=1`` needs the synchronous 9 epochs and takes 1.07x
            the synchronous time to the target without a round trip and 0.96x with 20 ms per request
            (``benchmarks/results/dorylus_first_epoch.json``). ``staleness=2`` needs one more epoch and
            pays only with round trips of 100 ms or more. Keep ``None`` unless waiting (round trips,
            uneven servers) dominates a long run (``docs/dorylus-value.md``, "Which should I use").
            Validation, test and checkpoints first drain the pipeline and then run synchronously;
            checkpoints also drop the requests sent ahead and the held ghost buffers.
        stale_reads: Which ghost rows/gradients a ``staleness >= 1`` read uses among those stamped
            ``>= e - S``: ``"freshest"`` (default, Dorylus) the freshest that has arrived, waiting only when
            none that fresh has (timing decides: not reproducible); ``"oldest"`` always epoch ``e - S``'s,
            waiting for them if needed (reproducible; the worst case the bound allows).
        intervals: ``None`` (default): each partition's own intervals (the DataModule's ``interval_size``);
            an int ``k``: every partition cut into ``k`` even intervals; ``"auto"``: the first training epoch
            runs on the partition's intervals while every request is timed, then ``k`` and ``max_in_flight``
            are chosen from the measured latency and per-row cost (:mod:`lightning_dorylus.autotune`;
            logged). An explicit ``max_in_flight`` overrides the tuned one.
        max_in_flight: At most this many tensor-op requests in flight per graph server (``None``: no cap,
            or the tuned value with ``intervals="auto"``).
        loss_reduction: What each server's training loss is, so that the summed gradients are the full-graph
            gradient: ``"mean"`` a mean over this partition's train vertices (the usual
            ``F.cross_entropy(out[mask], y[mask])``; backward runs on the loss times ``n_train_local /
            num_train_global``, the logged loss is left alone); ``"sum"`` already a share of a
            global mean or sum (``NodeClassifier``'s ``Σ_local CE / num_train_global``; no weighting).
            ``None`` (default): the module's ``dorylus_loss_reduction`` attribute if it has one
            (``NodeClassifier``: ``"sum"``), else ``"mean"``. A value that contradicts the module's raises.
    """

    executor: str | TensorOpExecutor = "local"
    executor_options: dict[str, Any] = field(default_factory=dict)
    start_method: StartMethod = "popen"
    mmap_threshold: int | None = 1 << 20
    num_threads: int | None = None
    staleness: int | None = None
    stale_reads: StaleReads = "freshest"
    intervals: int | Literal["auto"] | None = None
    max_in_flight: int | None = None
    loss_reduction: LossReduction | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "executor_options", dict(self.executor_options or {}))
        _check_executor(self.executor, self.executor_options)
        if self.start_method not in START_METHODS:
            raise ValueError(
                f"start_method={self.start_method!r}; expected 'popen', 'spawn', 'fork' or 'forkserver'"
            )
        if self.mmap_threshold is not None and not 0 <= self.mmap_threshold <= MMAP_THRESHOLD_MAX:
            raise ValueError(
                f"mmap_threshold={self.mmap_threshold} must be None or between 0 and {MMAP_THRESHOLD_MAX} "
                "bytes (glibc's largest M_MMAP_THRESHOLD on 64-bit)"
            )
        if self.num_threads is not None and not _positive_int(self.num_threads):
            raise ValueError(f"num_threads={self.num_threads!r} must be None (automatic) or an integer >= 1")
        if self.staleness is not None and not (_int(self.staleness) and self.staleness >= 0):
            raise ValueError(f"staleness={self.staleness!r}: expected None (synchronous) or an int >= 0")
        check_stale_reads(self.stale_reads)
        if self.stale_reads != "freshest" and not self.staleness:
            raise ValueError(
                f"stale_reads={self.stale_reads!r} needs staleness >= 1 "
                f"(staleness={self.staleness!r} reads no stale ghosts)"
            )
        if not (self.intervals is None or self.intervals == "auto" or _positive_int(self.intervals)):
            raise ValueError(f"intervals={self.intervals!r}: expected None, 'auto' or an int >= 1")
        if self.max_in_flight is not None and not _positive_int(self.max_in_flight):
            raise ValueError(f"max_in_flight={self.max_in_flight!r}: expected None or an int >= 1")
        if self.loss_reduction is not None and self.loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(
                f"loss_reduction={self.loss_reduction!r}: expected 'mean' (a mean over the partition's train "
                "vertices), 'sum' (already a share of a global mean, as NodeClassifier's) or None"
            )

    @property
    def owns_executor(self) -> bool:
        """Whether the strategy builds (and so closes) its executor: a named one; an instance's owner closes
        it."""
        return isinstance(self.executor, str)

    @property
    def timed(self) -> bool:
        """Whether requests are timed and capped (``intervals`` or ``max_in_flight`` set)."""
        return self.intervals is not None or self.max_in_flight is not None


def _check_executor(executor: Any, options: dict[str, Any]) -> None:
    if isinstance(executor, str):
        if executor not in EXECUTORS:
            raise ValueError(f"executor={executor!r} is not known; valid executors are {sorted(EXECUTORS)}")
    elif not isinstance(executor, TensorOpExecutor):
        raise TypeError(
            f"executor must be a name in {sorted(EXECUTORS)} or a TensorOpExecutor, "
            f"got {type(executor).__name__}"
        )
    elif options:
        raise ValueError(
            "executor_options only apply to a named executor, not to a TensorOpExecutor instance"
        )


def _int(value: Any) -> bool:
    """An ``int`` that is not a ``bool`` (``True`` is no count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value: Any) -> bool:
    return _int(value) and value >= 1
