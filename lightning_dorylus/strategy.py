"""``DorylusStrategy``: every Lightning process is one Dorylus graph server owning one graph partition.

Roles (see ``docs/dorylus.md``):

* **graph server** = this process: holds partition ``global_rank`` (features, local + ghost rows, adjacency),
  runs the graph operations Gather/Scatter (and their mirrors) and the loss;
* **tensor-op executor** = where ApplyVertex/ApplyEdge run per interval: a pool of worker processes running
  the Lambda handler code (``"local"``), the graph server itself (``"inline"``) or any ``TensorOpExecutor``;
* **weight server** = replicated: every graph server keeps the full (small) weights as the LightningModule's
  parameters and ships them with each tensor-op request, as a Lambda would fetch them from a weight server.
  After backward the strategy SUM-all-reduces the weight gradients over graph servers in one flat bucket, so
  every replica applies the same optimizer step (the paper's WU). With ``loss_reduction="mean"`` (a user
  module's ``F.cross_entropy(out[train_mask], y[train_mask])``: a mean over this partition's train vertices)
  each server's loss is scaled by its share of the train vertices, ``n_train_local / num_train_global``,
  before backward (so are the ghost gradients it sends); with ``"sum"`` (``NodeClassifier``: local sums
  divided by ``num_train_global``) the losses already add up to the full-graph mean. Either way the sum is
  the full-graph gradient.

``predict_step`` outputs (one row per owned vertex) are gathered into global vertex order on every rank.

No DDP wrapper: gradients are reduced explicitly in :meth:`DorylusStrategy.post_backward`.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import logging
from contextlib import ExitStack
from datetime import timedelta
from pathlib import PurePath
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _destroy_dist_connection,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from typing_extensions import override

from lbd_common import codec
from lightning_dorylus import lost_server
from lightning_dorylus.autotune import TimedExecutor, TuneResult, autotune
from lightning_dorylus.data.partition import GraphPartition
from lightning_dorylus.data.validation import check_world_size
from lightning_dorylus.dropout_check import TorchDropoutCheck
from lightning_dorylus.executors import EXECUTORS, TensorOpExecutor, build_executor
from lightning_dorylus.graph import GhostExchange, GraphCache
from lightning_dorylus.graph.stale import StaleGhostExchange, StaleReads, check_stale_reads
from lightning_dorylus.lost_server import collective
from lightning_dorylus.model_checks import (
    LabelRangeCheck,
    check_foreign_layers,
    check_output_width,
    num_labels,
)
from lightning_dorylus.nn import DorylusLayer, DorylusRuntime
from lightning_dorylus.nn.base import ghost_staleness
from lightning_dorylus.nn.norm import check_vertex_norms, convert_batchnorm, revert_batchnorm
from lightning_dorylus.precision import check_precision
from lightning_dorylus.predict import gather_vertex_rows
from lightning_dorylus.reduce import all_reduce, check_group
from lightning_dorylus.threads import (
    colocated_worker_threads,
    limit_server_threads,
    pipelined_server_threads,
    server_threads,
)

log = logging.getLogger(__name__)

LossReduction = Literal["mean", "sum"]
LOSS_REDUCTIONS = ("mean", "sum")


class DorylusStrategy(ParallelStrategy):
    """One process per graph server; tensor ops go to an executor; weight gradients are SUM-all-reduced.

    Args:
        accelerator: Set by the Trainer (``"cpu"`` or ``"gpu"`` for the graph servers).
        parallel_devices: Set by the Trainer: one device per graph server on this node.
        cluster_environment: Set by the Trainer.
        checkpoint_io: Set by the Trainer.
        precision_plugin: Set by the Trainer.
        executor: Where ApplyVertex/ApplyEdge run: ``"local"`` (default; a pool of worker processes running
            the numpy Lambda handler behind a real serialization boundary), ``"inline"`` (on the graph
            server: the CPU-only baseline), or a ``TensorOpExecutor`` instance (started here; its owner
            closes it).
        executor_options: Keyword arguments of the named executor, e.g. ``{"num_workers": 2}`` (``"local"``).
        process_group_backend: ``"gloo"`` / ``"nccl"``; default: gloo on CPU, nccl on CUDA.
        timeout: Collective timeout of the process group: a graph server that stops answering fails the job
            after this long instead of hanging it.
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

    strategy_name = "dorylus"

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        executor: str | TensorOpExecutor = "local",
        executor_options: dict[str, Any] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        mmap_threshold: int | None = 1 << 20,
        num_threads: int | None = None,
        staleness: int | None = None,
        stale_reads: StaleReads = "freshest",
        intervals: int | Literal["auto"] | None = None,
        max_in_flight: int | None = None,
        loss_reduction: LossReduction | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if isinstance(executor, str):
            if executor not in EXECUTORS:
                raise ValueError(
                    f"executor={executor!r} is not known; valid executors are {sorted(EXECUTORS)}"
                )
        elif not isinstance(executor, TensorOpExecutor):
            raise TypeError(
                f"executor must be a name in {sorted(EXECUTORS)} or a TensorOpExecutor, "
                f"got {type(executor).__name__}"
            )
        elif executor_options:
            raise ValueError(
                "executor_options only apply to a named executor, not to a TensorOpExecutor instance"
            )
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(
                f"start_method={start_method!r}; expected 'popen', 'spawn', 'fork' or 'forkserver'"
            )
        if mmap_threshold is not None and not 0 <= mmap_threshold <= _MMAP_THRESHOLD_MAX:
            raise ValueError(
                f"mmap_threshold={mmap_threshold} must be None or between 0 and {_MMAP_THRESHOLD_MAX} bytes "
                "(glibc's largest M_MMAP_THRESHOLD on 64-bit)"
            )
        if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                        or num_threads < 1):
            raise ValueError(f"num_threads={num_threads!r} must be None (automatic) or an integer >= 1")
        self._num_threads = num_threads
        if staleness is not None and (isinstance(staleness, bool) or not isinstance(staleness, int)
                                      or staleness < 0):
            raise ValueError(f"staleness={staleness!r}: expected None (synchronous) or an int >= 0")
        self._staleness = staleness
        check_stale_reads(stale_reads)
        if stale_reads != "freshest" and not staleness:
            raise ValueError(
                f"stale_reads={stale_reads!r} needs staleness >= 1 "
                f"(staleness={staleness!r} reads no stale ghosts)"
            )
        self._stale_reads: StaleReads = stale_reads
        if not (intervals is None or intervals == "auto" or _positive_int(intervals)):
            raise ValueError(f"intervals={intervals!r}: expected None, 'auto' or an int >= 1")
        if max_in_flight is not None and not _positive_int(max_in_flight):
            raise ValueError(f"max_in_flight={max_in_flight!r}: expected None or an int >= 1")
        self._intervals = intervals
        self._max_in_flight = max_in_flight
        if loss_reduction is not None and loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(
                f"loss_reduction={loss_reduction!r}: expected 'mean' (a mean over the partition's train "
                "vertices), 'sum' (already a share of a global mean, as NodeClassifier's) or None"
            )
        self._loss_reduction_arg: LossReduction | None = loss_reduction
        self._loss_reduction: LossReduction = loss_reduction or "mean"
        self._grad_weight = 1.0  # backward's loss scale: the share of the train vertices ("mean"), per step
        self._dropout_checked = False
        self._labels_checked = False  # the output width was checked before the first epoch
        self._timed: TimedExecutor | None = None
        self.tuned: TuneResult | None = None
        self._stale_group: Any | None = None
        self._runtime: DorylusRuntime | None = None
        self._mmap_threshold = mmap_threshold
        self._executor_spec = executor
        self._executor_options = dict(executor_options or {})
        self._executor: TensorOpExecutor | None = None
        self._exchange: GhostExchange | None = None
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method

    @property
    def executor(self) -> TensorOpExecutor | None:
        """The executor of this graph server's tensor ops (``None`` outside ``setup`` .. ``teardown``)."""
        return self._executor

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def is_distributed(self) -> bool:
        """Read by Lightning (custom strategies): ``self.log(..., sync_dist=True)`` then reduces over graph
        servers; without it Lightning silently drops ``sync_dist`` (as for a single-device strategy)."""
        return True

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self._mmap_threshold is not None and not set_mmap_threshold(self._mmap_threshold):
            log.warning(
                "mmap_threshold=%d not applied: this C library has no glibc mallopt", self._mmap_threshold
            )
        threads = limit_server_threads(self._num_threads, self.num_processes)
        log.debug("graph server %d: %d BLAS/OpenMP threads", self.global_rank, threads)
        self.setup_distributed()

    def setup_distributed(self) -> None:
        """Creates the process group (gloo on CPU, nccl on GPU) with the configured collective timeout."""
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = (
            self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        )
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        # Lightning registers this only for NCCL; a gloo group left to interpreter shutdown can abort the
        # process ("terminate called without an active exception") after training has finished
        atexit.register(_destroy_dist_connection)
        if self.world_size > 1:  # a server lost mid-fit is then named (lightning_dorylus.lost_server)
            lost_server.start(lost_server.process_group_store(), self.global_rank, self.world_size,
                              lambda: getattr(self.lightning_module, "trainer", None))

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self._check_datamodule(trainer)
        self._loss_reduction = self._resolve_loss_reduction()
        self._dropout_checked = False
        self._labels_checked = False
        if self.root_device.type == "cpu":  # CUDA half/mixed precision: untested, left to the user
            check_precision(str(getattr(self.precision_plugin, "precision", "32-true")))
        assert self.model is not None
        check_vertex_norms(self.model)
        check_foreign_layers(self.model)
        # as DDP's sync_batchnorm=True (Lightning's TorchSyncBatchNorm), but on CPU too; reverted in teardown
        self.model = convert_batchnorm(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        _sync_module_states(self.model)  # every weight replica starts from rank 0's values
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        self._start_runtime()

    def _check_datamodule(self, trainer: Trainer) -> None:
        num_parts = getattr(trainer.datamodule, "num_parts", None)
        if num_parts is not None:
            check_world_size(num_parts, self.world_size)

    @property
    def loss_reduction(self) -> LossReduction:
        """``"mean"`` or ``"sum"``: what this fit's training loss is (see the class docstring)."""
        return self._loss_reduction

    def _resolve_loss_reduction(self) -> LossReduction:
        declared = getattr(self.lightning_module, "dorylus_loss_reduction", None)
        name = type(self.lightning_module).__name__
        if declared is not None and declared not in LOSS_REDUCTIONS:
            raise ValueError(f"{name}.dorylus_loss_reduction={declared!r}: expected 'mean' or 'sum'")
        chosen = self._loss_reduction_arg
        if chosen is not None and declared is not None and chosen != declared:
            raise ValueError(
                f"DorylusStrategy(loss_reduction={chosen!r}) but {name}.dorylus_loss_reduction={declared!r}: "
                f"the module says what its loss is; drop the strategy argument, or set the module's attribute"
            )
        return chosen or declared or "mean"

    def _start_runtime(self) -> None:
        """Starts the executor and lends it, with the ghost exchange, to every Dorylus layer of the model."""
        layers = self._dorylus_layers()
        if not layers:
            raise TypeError(
                f"{type(self.lightning_module).__name__} has no DorylusLayer (lightning_dorylus.nn.GCNConv, "
                "GATConv, ...): DorylusStrategy only trains models built from Dorylus layers"
            )
        if self._executor is None:
            spec = self._executor_spec
            self._executor = build_executor(spec, **self._executor_options) if isinstance(spec, str) else spec
        self._executor.start()
        if self._staleness is not None and self._num_threads is None:  # no count given: leave the workers
            colocated = colocated_worker_threads(self._executor)  # that share this server's cores theirs
            if colocated:
                threads = pipelined_server_threads(server_threads(None, self.num_processes), colocated)
                limit_server_threads(threads, self.num_processes)
                log.debug("graph server %d: %d threads (pipelined, %d executor worker threads share its "
                          "cores)", self.global_rank, threads, colocated)
        self._exchange = GhostExchange()
        stale = None
        if self._staleness and self.world_size > 1:
            if self._stale_group is None:  # its own group: stale P2P never interleaves with collectives
                self._stale_group = dist.new_group(backend="gloo")
            stale = StaleGhostExchange(ghost_staleness(self._staleness), self._stale_group, self._stale_reads)
        executor: TensorOpExecutor = self._executor
        if self._intervals is not None or self._max_in_flight is not None:
            self._timed = TimedExecutor(self._executor, self._max_in_flight)
            executor = self._timed
            self._set_num_intervals(None if self._intervals == "auto" else self._intervals)  # type: ignore[arg-type]
        runtime = DorylusRuntime(
            executor=executor, exchange=self._exchange, staleness=self._staleness, stale_exchange=stale,
            build_ahead=self._intervals != "auto",
        )
        self._runtime = runtime
        for index, layer in enumerate(layers):
            layer.attach(runtime, layer_index=index)

    @property
    def staleness(self) -> int | None:
        """``None`` (synchronous) or the bound ``S`` (GA per interval; ``S >= 1``: stale ghosts)."""
        return self._staleness

    @property
    def stale_reads(self) -> StaleReads:
        """Which ghost buffer a ``staleness >= 1`` read uses: ``"freshest"`` arrived or ``"oldest"``."""
        return self._stale_reads

    @property
    def runtime(self) -> DorylusRuntime | None:
        """What the layers run on (``None`` outside ``setup`` .. ``teardown``)."""
        return self._runtime

    def drain(self, discard: bool = False) -> None:
        """Waits for every stale SC/∇SC message and every request sent ahead (before evaluation and
        checkpoints); ``discard`` also drops the requests sent ahead for the next epoch and the held ghost
        buffers (checkpoints, so a run resumed from one computes that epoch as the uninterrupted run does:
        with the saved weights and exact ghosts)."""
        if self._runtime is None:
            return
        self._runtime.runahead.drain(discard)
        if self._runtime.stale_exchange is not None:
            self._runtime.stale_exchange.drain(discard)

    @override
    def on_train_start(self) -> None:
        """Before the first epoch: a last layer with fewer outputs than the graph's labels need raises
        :class:`~lightning_dorylus.model_checks.LabelRangeError` on every server (the labels of this
        server's partition, all-reduced), where both are known without a step; else the first step's loss
        checks (:meth:`training_step`)."""
        super().on_train_start()
        partition = self._training_partition()
        # [labels, no partition here]: every server takes part, and all fall back if any lacks one
        count = torch.tensor([num_labels(partition.y) if partition is not None else 0, partition is None],
                             device=self.root_device)
        if self.world_size > 1 and _distributed_is_initialized():
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
        if not count[1]:
            assert self.lightning_module is not None
            self._labels_checked = check_output_width(self.lightning_module, int(count[0]))

    def _training_partition(self) -> GraphPartition | None:
        """This server's partition before the first step, where it is at hand: a ``DorylusDataModule``'s,
        or that of the train loader it gives (``PartitionLoader``); a user's own loader is not iterated."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        for holder in (getattr(trainer, "datamodule", None), getattr(trainer, "train_dataloader", None)):
            partition = getattr(holder, "partition", None)
            if isinstance(partition, GraphPartition):
                return partition
        return None

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs.get("batch")
        if isinstance(batch, GraphPartition) and self.world_size > 1:
            self._grad_weight = self._train_share(batch) if self._loss_reduction == "mean" else 1.0
        if self._runtime is not None and self.lightning_module is not None:
            epoch = self.lightning_module.current_epoch
            self._runtime.epoch = epoch  # stamps this step's stale messages
            if self._intervals == "auto" and self._timed is not None and self.tuned is None:
                if epoch == 0 or len(self._timed.samples) < 2:
                    self._timed.recording = True  # measure the first epoch(s) on the partition's intervals
                else:
                    self._autotune(batch)
        if self._dropout_checked:
            with collective("training_step (the forward pass)"):
                out = super().training_step(*args, **kwargs)
        else:
            self._dropout_checked = True  # the first step only: a model calling F.dropout does so every step
            with ExitStack() as checks:
                checks.enter_context(collective("training_step (the forward pass)"))
                if not self._labels_checked:  # the output width was unknown before the step
                    checks.enter_context(LabelRangeCheck(self._num_labels(batch)))
                if self.world_size > 1:
                    checks.enter_context(TorchDropoutCheck(self.world_size))
                out = super().training_step(*args, **kwargs)
        self._log_recoveries()
        return out

    def _log_recoveries(self) -> None:
        """Logs ``executor_recoveries``: the dead workers this server's executor has replaced so far (the
        local pool's ``respawns``; each one's requests were retried, results unchanged). This server's own
        count, logged per step without a collective (Lightning's loggers record rank 0's)."""
        count = getattr(self._executor, "respawns", None)
        if isinstance(count, int) and self.lightning_module is not None:
            self.lightning_module.log("executor_recoveries", float(count), on_step=True, on_epoch=False,
                                      batch_size=1)

    def _num_labels(self, batch: Any) -> int:
        """The whole graph's ``max(y) + 1`` (all-reduced: every server checks against the same count)."""
        count = torch.tensor(num_labels(getattr(batch, "y", None)), device=self.root_device)
        if self.world_size > 1 and _distributed_is_initialized():
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return int(count)

    def _train_share(self, batch: GraphPartition) -> float:
        """``n_train_local / num_train_global``: the weight of this server's local-mean loss."""
        n_train = int(batch.train_mask.sum())
        if n_train == 0 and batch.num_train_global > 0:
            raise ValueError(
                f"graph server {self.global_rank} owns no train vertex, so a mean over its train vertices is "
                "0 / 0 (NaN, and NaN ghost gradients for every server) with loss_reduction='mean': compute "
                "the loss as F.cross_entropy(out[mask], y[mask], reduction='sum') / batch.num_train_global "
                "and set loss_reduction='sum' (as NodeClassifier), or partition so that every server has some"
            )
        return n_train / batch.num_train_global if batch.num_train_global else 1.0

    def _autotune(self, batch: Any) -> None:
        """Choose intervals and requests in flight from the timed requests (this graph server's own)."""
        assert self._timed is not None
        self._timed.recording = False
        inner = self._executor
        workers = getattr(inner, "num_workers", None)  # local pool; a wrapper's inner pool; else 1
        workers = workers or getattr(getattr(inner, "inner", None), "num_workers", 1)
        self.tuned = autotune(self._timed.samples, max(1, int(batch.n_local)), int(workers))
        self._set_num_intervals(self.tuned.num_intervals)
        self._timed.set_max_in_flight(self._max_in_flight or self.tuned.max_in_flight)

    def _set_num_intervals(self, num_intervals: int | None) -> None:
        """Re-cuts the intervals of every ``GraphCache`` the module holds (``NodeClassifier``'s, or a user
        module's own, under any attribute name)."""
        for value in vars(self.lightning_module).values():
            if isinstance(value, GraphCache):
                value.set_num_intervals(num_intervals)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self.drain()
        with collective("validation_step"):
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self.drain()
        with collective("test_step"):
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``predict_step`` (a tensor with one row per owned vertex, in ``batch.local_nodes``
        order), gathered from every graph server into global vertex order: ``(num_global_nodes, ...)`` on
        every rank, what one process computes on the whole graph. Any other output passes through as is."""
        self.drain()
        with collective("predict_step"):
            out = super().predict_step(*args, **kwargs)
            batch = args[0] if args else kwargs.get("batch")
            if not isinstance(out, Tensor) or not isinstance(batch, GraphPartition):
                return out
            return gather_vertex_rows(out, batch.local_nodes, batch.num_global_nodes)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        self.drain(discard=True)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _dorylus_layers(self) -> list[DorylusLayer]:
        module = self.lightning_module
        return [] if module is None else [m for m in module.modules() if isinstance(m, DorylusLayer)]

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        if not isinstance(batch, GraphPartition):
            raise TypeError(
                f"DorylusStrategy expects each batch to be a GraphPartition (from DorylusDataModule), got "
                f"{type(batch).__name__}"
            )
        if batch.num_parts != self.world_size or batch.part_id != self.global_rank:
            raise ValueError(
                f"graph server {self.global_rank} of world_size ({self.world_size}) got partition "
                f"{batch.part_id} of num_parts ({batch.num_parts}); expected partition {self.global_rank} of "
                f"{self.world_size}"
            )
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """A local-mean loss (``loss_reduction="mean"``) is scaled by this server's share of the train
        vertices BEFORE backward, not its weight gradients after: the ghost-row gradients this server sends
        to the rows' owners (∇SC) are part of the owners' weight gradients and need the sender's weight, not
        the owner's. The logged and returned loss stays the user's."""
        if self._grad_weight != 1.0:
            closure_loss = closure_loss * self._grad_weight
        with collective("backward"):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        """Weight update step's reduction: SUM the weight gradients of all graph servers (one flat bucket)."""
        assert self.lightning_module is not None
        grads = [p.grad for p in self.lightning_module.parameters() if p.grad is not None]
        if not grads or not _distributed_is_initialized() or self.world_size == 1:
            return
        bucket = _flatten_dense_tensors(grads)
        with collective("the all_reduce of the weight gradients (post_backward)"):
            dist.all_reduce(bucket, op=dist.ReduceOp.SUM)
        for grad, reduced in zip(grads, _unflatten_dense_tensors(bucket, grads)):
            grad.copy_(reduced)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """All-reduces ``tensor`` over graph servers (``"sum"`` or ``"mean"``); non-tensors pass through.
        ``reduce(t, "sum")`` (the op passed as ``group``) raises on any number of servers, naming the fix."""
        check_group(group)
        if isinstance(tensor, Tensor) and _distributed_is_initialized():
            with collective("the all_reduce of strategy.reduce (a logged metric)"):
                return all_reduce(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not _distributed_is_initialized():
            return
        with collective(f"barrier({args[0] if args else kwargs.get('name', '')!r})"):
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        """Broadcasts a tensor, or a JSON-representable object / path, without pickling.

        Lightning broadcasts directories, flags and numbers; anything else raises ``TypeError`` on every rank.
        """
        if not _distributed_is_initialized():
            return obj
        header = b""
        if self.global_rank == src:
            header = _encode_broadcast_header(obj)
        size = torch.tensor([len(header)], dtype=torch.long, device=self.root_device)
        dist.broadcast(size, src)
        what = f"DorylusStrategy.broadcast from rank {src}"
        if codec.check_header_length(int(size), what) == 0:
            raise TypeError(
                f"DorylusStrategy.broadcast sends tensors and JSON-representable objects (no pickle); "
                f"rank {src} "
                f"tried to broadcast an object of another type "
                f"({type(obj).__name__ if self.global_rank == src else 'see rank ' + str(src)})"
            )
        if self.global_rank == src:
            buf = codec.bytes_tensor(header, self.root_device)
        else:
            buf = torch.empty(int(size), dtype=torch.uint8, device=self.root_device)
        dist.broadcast(buf, src)
        meta = codec.parse_json(buf, what)
        if not isinstance(meta, dict) or meta.get("kind") not in ("tensor", "path", "json"):
            raise codec.MalformedHeader(f"corrupt {what}: {codec.shorten(meta)}")
        if meta["kind"] == "tensor":
            tensor = obj if self.global_rank == src else None
            spec = codec.Spec.from_json([meta.get("dtype"), meta.get("shape")], what)
            out = (
                tensor.detach().clone().to(self.root_device)  # type: ignore[union-attr]
                if tensor is not None
                else torch.empty(spec.shape, dtype=spec.dtype, device=self.root_device)
            )
            dist.broadcast(out, src)
            return out  # type: ignore[return-value]
        if meta["kind"] == "path":
            return type(obj)(meta["value"]) if isinstance(obj, PurePath) else meta["value"]  # type: ignore[return-value]
        return meta["value"]

    @override
    def teardown(self) -> None:
        lost_server.stop()
        self.drain(discard=True)
        for layer in self._dorylus_layers():
            layer.attach(None)
        if self._executor is not None and isinstance(self._executor_spec, str):
            self._executor.close()
        self.drain()
        self._executor = None
        self._exchange = None
        self._runtime = None
        if self.model is not None:
            self.model = revert_batchnorm(self.model)  # the user's module gets its own BatchNorm classes back
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Registers ``"dorylus"`` (local worker-pool executor) and ``"dorylus_inline"`` (CPU baseline)."""
        entries = (
            (
                "dorylus",
                "local",
                "Dorylus graph servers; tensor ops on a local pool of Lambda-handler workers",
            ),
            (
                "dorylus_inline",
                "inline",
                "Dorylus graph servers; tensor ops inline on the graph server (CPU-only)",
            ),
        )
        for name, executor, description in entries:
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, executor=executor)


_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's HEAP_MAX_SIZE / 2 on 64-bit
_M_MMAP_THRESHOLD = -3  # glibc <malloc.h>


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def set_mmap_threshold(threshold: int) -> bool:
    """Calls glibc's ``mallopt(M_MMAP_THRESHOLD, threshold)`` for this process (fixes the threshold, which
    also turns off glibc's dynamic raising of it). Returns ``False`` where there is no glibc ``mallopt``.
    """
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))


def _encode_broadcast_header(obj: Any) -> bytes:
    """JSON description of ``obj`` for :meth:`DorylusStrategy.broadcast` (:mod:`lbd_common.codec`); ``b""``
    if it cannot be sent (not JSON, a tensor of a dtype outside the codec's allow-list, over the header
    limit), so every rank raises the same ``TypeError``."""
    try:
        if isinstance(obj, Tensor):
            dtype, shape = codec.Spec.of(obj, "by DorylusStrategy.broadcast").to_json()
            meta = {"kind": "tensor", "dtype": dtype, "shape": shape}
        elif isinstance(obj, PurePath):
            meta = {"kind": "path", "value": str(obj)}
        else:
            meta = {"kind": "json", "value": obj}
        return codec.json_bytes(meta, "DorylusStrategy.broadcast")
    except (TypeError, ValueError):
        return b""
