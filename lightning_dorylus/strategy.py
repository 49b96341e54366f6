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
import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from torch import Tensor
from typing_extensions import override

from lbd_common.broadcast import broadcast_object
from lightning_dorylus import lost_server
from lightning_dorylus._lightning import (
    destroy_dist_connection,
    distributed_is_initialized,
    flatten_dense_tensors,
    sync_module_states,
    unflatten_dense_tensors,
)
from lightning_dorylus.autotune import TuneResult
from lightning_dorylus.data.partition import GraphPartition
from lightning_dorylus.data.validation import check_world_size
from lightning_dorylus.executors import TensorOpExecutor
from lightning_dorylus.first_step import FirstStepChecks, training_partition
from lightning_dorylus.graph.stale import StaleReads
from lightning_dorylus.loss_share import resolve_loss_reduction, train_share
from lightning_dorylus.lost_server import collective
from lightning_dorylus.memory import apply_mmap_threshold
from lightning_dorylus.model_checks import check_foreign_layers
from lightning_dorylus.nn import DorylusLayer, DorylusRuntime
from lightning_dorylus.nn.norm import check_vertex_norms, convert_batchnorm, revert_batchnorm
from lightning_dorylus.options import DorylusOptions, LossReduction
from lightning_dorylus.precision import check_precision
from lightning_dorylus.predict import gather_vertex_rows
from lightning_dorylus.reduce import all_reduce, check_group
from lightning_dorylus.server import GraphServer
from lightning_dorylus.threads import limit_server_threads

if TYPE_CHECKING:
    from lightning_dorylus._lightning import StrategyRegistry

log = logging.getLogger(__name__)


class DorylusStrategy(DDPStrategy):
    """One process per graph server; tensor ops go to an executor; weight gradients are SUM-all-reduced.

    Lightning's ``DDPStrategy`` without its wrapper: its launcher (``start_method``), process group
    (``process_group_backend``, ``timeout``), ranks and devices are DDP's; what differs is overridden here
    (no ``DistributedDataParallel``: :meth:`configure_ddp`, :meth:`post_backward`; broadcasts without
    pickle; every collective named when a graph server is lost, :mod:`lightning_dorylus.lost_server`).

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: Set by the
            Trainer (``accelerator``: ``"cpu"`` or ``"gpu"`` for the graph servers; one device per graph
            server on this node).
        process_group_backend: ``"gloo"`` / ``"nccl"``; default: gloo on CPU, nccl on CUDA.
        timeout: Collective timeout of the process group: a graph server that stops answering fails the job
            after this long instead of hanging it.
        start_method: How processes are started: ``"popen"`` (default, re-runs the script like ``ddp``),
            ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        executor, executor_options, mmap_threshold, num_threads, staleness, stale_reads, intervals,
            max_in_flight, loss_reduction: The Dorylus options, each documented and checked in
            :class:`~lightning_dorylus.options.DorylusOptions`: where the tensor ops run and with which
            arguments; each server's mmap threshold and threads; synchronous (``None``), pipelined (``0``)
            or bounded-stale (``S >= 1``) training and which stale ghosts a read takes; intervals and
            requests in flight; whether each server's loss is a local mean or a share of the global loss.
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
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)
        self._options = DorylusOptions(
            executor=executor, executor_options=executor_options or {}, start_method=start_method,
            mmap_threshold=mmap_threshold, num_threads=num_threads, staleness=staleness,
            stale_reads=stale_reads, intervals=intervals, max_in_flight=max_in_flight,
            loss_reduction=loss_reduction,
        )
        self._loss_reduction: LossReduction = loss_reduction or "mean"  # resolved with the module in setup
        self._grad_weight = 1.0  # backward's loss scale: the share of the train vertices ("mean"), per step
        self._server = GraphServer(self._options)
        self._first_step: FirstStepChecks | None = None  # one per setup

    @property
    def options(self) -> DorylusOptions:
        """The Dorylus options this strategy was built with (checked)."""
        return self._options

    @property
    def executor(self) -> TensorOpExecutor | None:
        """The executor of this graph server's tensor ops (``None`` outside ``setup`` .. ``teardown``)."""
        return self._server.executor

    @property
    def runtime(self) -> DorylusRuntime | None:
        """What the layers run on (``None`` outside ``setup`` .. ``teardown``)."""
        return self._server.runtime

    @property
    def tuned(self) -> TuneResult | None:
        """With ``intervals="auto"``: the intervals and requests in flight chosen after the timed epoch(s)."""
        return self._server.tuned

    @property
    def staleness(self) -> int | None:
        """``None`` (synchronous) or the bound ``S`` (GA per interval; ``S >= 1``: stale ghosts)."""
        return self._options.staleness

    @property
    def stale_reads(self) -> StaleReads:
        """Which ghost buffer a ``staleness >= 1`` read uses: ``"freshest"`` arrived or ``"oldest"``."""
        return self._options.stale_reads

    @property
    def loss_reduction(self) -> LossReduction:
        """``"mean"`` or ``"sum"``: what this fit's training loss is (see the module docstring)."""
        return self._loss_reduction

    @override
    def setup_distributed(self) -> None:
        """DDP's process group (ranks, backend, timeout), with this server's host set up before it joins
        (mmap threshold, BLAS/OpenMP threads), and after: the group destroyed at exit (Lightning does that
        only for NCCL; a gloo group left to interpreter shutdown can abort the process, "terminate called
        without an active exception", after training has finished) and, on several servers, the directory
        that names a server lost mid-fit (:mod:`lightning_dorylus.lost_server`)."""
        apply_mmap_threshold(self._options.mmap_threshold)
        threads = limit_server_threads(self._options.num_threads, self.num_processes)
        log.debug("graph server %d: %d BLAS/OpenMP threads", self.global_rank, threads)
        super().setup_distributed()
        atexit.register(destroy_dist_connection)
        if self.world_size > 1:
            lost_server.start(lost_server.process_group_store(), self.global_rank, self.world_size,
                              lambda: getattr(self.lightning_module, "trainer", None))

    @override
    def setup(self, trainer: Trainer) -> None:
        """Checks the module and data, converts its BatchNorm layers (to :class:`GraphBatchNorm`, as DDP's
        ``sync_batchnorm=True`` but on CPU too and in every stage; reverted in teardown), then DDP's setup
        (precision, device, optimizers; :meth:`configure_ddp` wraps nothing), then starts the runtime."""
        self._check_datamodule(trainer)
        self._loss_reduction = resolve_loss_reduction(self.lightning_module, self._options.loss_reduction)
        self._first_step = FirstStepChecks(self.world_size, self.root_device)
        if self.root_device.type == "cpu":  # CUDA half/mixed precision: untested, left to the user
            check_precision(str(getattr(self.precision_plugin, "precision", "32-true")))
        assert self.model is not None
        check_vertex_norms(self.model)
        check_foreign_layers(self.model)
        self.model = convert_batchnorm(self.model)
        self._layer_sync = None  # Trainer(sync_batchnorm=True)'s plugin: GraphBatchNorm already syncs
        super().setup(trainer)
        self._start_runtime()

    @override
    def configure_ddp(self) -> None:
        """No ``DistributedDataParallel``: :meth:`post_backward` reduces the gradients. What the wrapper's
        construction would do is done here: every weight replica starts from rank 0's values."""
        assert self.model is not None
        sync_module_states(self.model)

    def _check_datamodule(self, trainer: Trainer) -> None:
        num_parts = getattr(trainer.datamodule, "num_parts", None)
        if num_parts is not None:
            check_world_size(num_parts, self.world_size)

    def _dorylus_layers(self) -> list[DorylusLayer]:
        module = self.lightning_module
        return [] if module is None else [m for m in module.modules() if isinstance(m, DorylusLayer)]

    def _start_runtime(self) -> None:
        """Starts the executor and lends it, with the ghost exchange, to every Dorylus layer of the model."""
        layers = self._dorylus_layers()
        if not layers:
            raise TypeError(
                f"{type(self.lightning_module).__name__} has no DorylusLayer (lightning_dorylus.nn.GCNConv, "
                "GATConv, ...): DorylusStrategy only trains models built from Dorylus layers"
            )
        self._server.start(self.lightning_module, layers, self.world_size, self.num_processes,
                           self.global_rank)

    def drain(self, discard: bool = False) -> None:
        """Waits for every stale SC/∇SC message and every request sent ahead (before evaluation and
        checkpoints); ``discard`` also drops the requests sent ahead for the next epoch and the held ghost
        buffers (checkpoints, so a run resumed from one computes that epoch as the uninterrupted run does:
        with the saved weights and exact ghosts)."""
        self._server.drain(discard)

    @override
    def on_train_start(self) -> None:
        """Before the first epoch: a last layer with fewer outputs than the graph's labels need raises
        :class:`~lightning_dorylus.model_checks.LabelRangeError` on every server, where both are known
        without a step; else the first step checks (:mod:`lightning_dorylus.first_step`)."""
        super().on_train_start()
        assert self._first_step is not None and self.lightning_module is not None
        self._first_step.before_fit(self.lightning_module, training_partition(self.lightning_module.trainer))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs.get("batch")
        if isinstance(batch, GraphPartition) and self.world_size > 1:
            mean = self._loss_reduction == "mean"
            self._grad_weight = train_share(batch, self.global_rank) if mean else 1.0
        if self.lightning_module is not None:
            self._server.before_step(self.lightning_module, batch)
        assert self._first_step is not None
        with collective("training_step (the forward pass)"), self._first_step.around_step(batch):
            out = super().training_step(*args, **kwargs)
        self._log_recoveries()
        return out

    def _log_recoveries(self) -> None:
        """Logs ``executor_recoveries``: the dead workers this server's executor has replaced so far (the
        local pool's ``respawns``; each one's requests were retried, results unchanged). This server's own
        count, logged per step without a collective (Lightning's loggers record rank 0's)."""
        count = getattr(self.executor, "respawns", None)
        if isinstance(count, int) and self.lightning_module is not None:
            self.lightning_module.log("executor_recoveries", float(count), on_step=True, on_epoch=False,
                                      batch_size=1)

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
        if not grads or not distributed_is_initialized() or self.world_size == 1:
            return
        bucket = flatten_dense_tensors(grads)
        with collective("the all_reduce of the weight gradients (post_backward)"):
            dist.all_reduce(bucket, op=dist.ReduceOp.SUM)
        for grad, reduced in zip(grads, unflatten_dense_tensors(bucket, grads)):
            grad.copy_(reduced)

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """All-reduces ``tensor`` over graph servers (``"sum"`` or ``"mean"``); non-tensors pass through.
        ``reduce(t, "sum")`` (the op passed as ``group``) raises on any number of servers, naming the fix."""
        check_group(group)
        if isinstance(tensor, Tensor) and distributed_is_initialized():
            with collective("the all_reduce of strategy.reduce (a logged metric)"):
                return all_reduce(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """DDP's barrier, named if a graph server is lost while the others wait in it."""
        with collective(f"barrier({args[0] if args else kwargs.get('name', '')!r})"):
            super().barrier(*args, **kwargs)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        """Broadcasts a tensor, or a JSON-representable object / path, without pickling
        (:func:`lbd_common.broadcast.broadcast_object`).

        Lightning broadcasts directories, flags and numbers; anything else raises ``TypeError`` on every rank.
        """
        if not distributed_is_initialized():
            return obj
        return broadcast_object(obj, src, self.root_device, name="DorylusStrategy.broadcast")

    @override
    def teardown(self) -> None:
        lost_server.stop()
        self._server.stop(self._dorylus_layers())
        if self.model is not None:
            self.model = revert_batchnorm(self.model)  # the user's module gets its own BatchNorm classes back
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        """Registers ``"dorylus"`` (local worker-pool executor) and ``"dorylus_inline"`` (CPU baseline)."""
        entries = (
            ("dorylus", "local", "on a local pool of Lambda-handler workers"),
            ("dorylus_inline", "inline", "inline on the graph server (CPU-only)"),
        )
        for name, executor, where in entries:
            if name not in strategy_registry:
                description = f"Dorylus graph servers; tensor ops {where}"
                strategy_registry.register(name, cls, description=description, executor=executor)
