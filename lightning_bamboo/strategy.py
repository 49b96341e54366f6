"""``BambooStrategy``: pipeline-parallel training with Bamboo's redundant layers, as a Lightning strategy.

Launch it like DDP (one process per device); the user's LightningModule follows the contract in
:mod:`lightning_bamboo.contract`::

    import lightning_bamboo  # registers "bamboo"
    Trainer(strategy="bamboo", accelerator="cpu", devices=4).fit(model, data)
    Trainer(strategy=BambooStrategy(num_stages=2, num_microbatches=8), devices=4).fit(model, data)
"""

from __future__ import annotations

import atexit
import logging
import math
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

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
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_bamboo import checkpoint as ckpt
from lightning_bamboo.broadcast import broadcast_batch, broadcast_json
from lightning_bamboo.clipping import NORM, apply_clipping, plan_clipping
from lightning_bamboo.contract import (
    check_contract,
    check_replayed_loss,
    check_stage_split,
    find_pipeline_body,
    outside_call_message,
    replay_predict,
    replay_step,
    sub_sequential,
    warn_batch_statistics,
)
from lightning_bamboo.engine import PipelineEngine
from lightning_bamboo.events import BambooEventsMixin
from lightning_bamboo.groups import BambooGroups
from lightning_bamboo.layout import StageLayout, estimate_layer_costs
from lightning_bamboo.microbatch import (
    batch_size_of,
    check_train_batches,
    join_microbatches,
    split_microbatches,
)
from lightning_bamboo.precision import with_pipeline_clipping
from lightning_bamboo.replica import ReplicaSync
from lightning_bamboo.schedule import add_forward_redundancy, build_1f1b, format_grid

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

_STAGE_MARK = "_bamboo_stage"
"""Attribute set on a stage's Sequential, so a second strategy does not mistake it for the whole body."""


def _refuse_whole_model_callbacks(trainer: pl.Trainer) -> None:
    """Refuse, before any step, the callbacks that keep their own copy of the whole model."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, StochasticWeightAveraging):
            raise ValueError(
                "BambooStrategy does not support StochasticWeightAveraging: the callback copies the whole "
                "model in its setup hook, before BambooStrategy splits it into stages, and later copies the "
                "stage's parameters into that copy by position (it would fail with 'shape [32] doesn't "
                "match [96, 32]' when averaging starts). Train without it, or average consolidated "
                "checkpoints (lightning_bamboo.consolidate_checkpoint) after training"
            )


def _param_group_names(module: pl.LightningModule) -> list[list[str]]:
    """The parameter names of each param group ``configure_optimizers`` builds over the whole model (read
    before the split): an ordinary checkpoint's optimizer state is positional over exactly these groups."""
    optimizers, _ = _init_optimizers_and_lr_schedulers(module)
    if not optimizers:
        return []
    names = {id(p): n for n, p in module.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in optimizers[0].param_groups]


class BambooStrategy(BambooEventsMixin, ParallelStrategy):
    """Pipeline parallelism with Bamboo's redundancy: stage ``s`` also holds stage ``s+1``'s layers.

    The ``world_size`` processes form ``num_stages`` stages x ``world_size / num_stages`` data-parallel
    pipelines (global rank = pipeline * num_stages + stage). Every step runs a 1F1B schedule over
    ``num_microbatches`` micro-batches, averages gradients over the pipelines, and keeps each stage's replica
    (layers and optimizer state) on its predecessor exactly current.

    Args:
        num_stages: pipeline length, >= 1; must divide the world size and be <= the number of layers of the
            pipeline body. 1 means plain data parallelism (and requires ``redundancy=False``).
        num_microbatches: micro-batches per training step, >= 1; must divide the per-pipeline batch size.
        redundancy: ``True`` (default): every stage holds a replica of its successor and runs the eager
            redundant forwards (``FR``) of the Bamboo schedule; ``False``: the plain 1F1B pipeline.
        replica_device: ``"same"`` (default): the replica lives on the stage's device; ``"cpu"``: in host
            memory, as Bamboo's lazy mode, saving accelerator memory.
        pipeline_attr: attribute name of the module's ``nn.Sequential`` body; ``None`` (default): ``pipeline``
            or else the module's only ``nn.Sequential`` child.
        layer_costs: relative cost of each layer of the body, used to split layers into stages; ``None``
            (default): estimated by ``estimate_layer_costs`` from the layers.
        timeout: timeout of the process group's collectives and point-to-point operations, in seconds or as a
            ``timedelta`` (default: PyTorch's default of 30 minutes). Use seconds when a hung peer must be
            noticed fast.
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; ``None`` (default): chosen from the device.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for every
            Lightning ``ParallelStrategy`` (normally set by the Trainer).
    """

    strategy_name = "bamboo"

    def __init__(
        self,
        num_stages: int = 2,
        num_microbatches: int = 4,
        redundancy: bool = True,
        replica_device: Literal["same", "cpu"] = "same",
        pipeline_attr: str | None = None,
        layer_costs: Sequence[float] | None = None,
        timeout: float | timedelta | None = default_pg_timeout,
        process_group_backend: str | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"num_stages must be an integer >= 1, got {num_stages!r}")
        if not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise ValueError(f"num_microbatches must be an integer >= 1, got {num_microbatches!r}")
        if replica_device not in ("same", "cpu"):
            raise ValueError(f"replica_device must be 'same' or 'cpu', got {replica_device!r}")
        if redundancy and num_stages < 2:
            raise ValueError(
                f"redundancy=True needs num_stages >= 2 (a stage replicates its successor), got num_stages "
                f"({num_stages}); pass redundancy=False"
            )
        self._num_stages = num_stages
        self._num_microbatches = num_microbatches
        self._redundancy = redundancy
        self._replica_device_option = replica_device
        self._pipeline_attr = pipeline_attr
        self._layer_costs = list(layer_costs) if layer_costs is not None else None
        self._timeout = timedelta(seconds=timeout) if isinstance(timeout, (int, float)) else timeout
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        # runtime state, built in setup()
        self.layout: StageLayout | None = None
        self.groups: BambooGroups | None = None
        self.engine: PipelineEngine | None = None
        self.replica: nn.Module | None = None
        self.replica_sync: ReplicaSync | None = None
        self._body_attr: str = pipeline_attr or "pipeline"
        self._stashed_grads: list[Tensor | None] | None = None
        self._loaded_path: Path | None = None
        self._loaded_whole: dict[str, Any] | None = None  # an ordinary .ckpt's whole model, for the replica
        self._whole_group_names: list[list[str]] | None = None
        self._stage_module: nn.Module | None = None

    # ------------------------------------------------------------------ properties
    @property
    def num_stages(self) -> int:
        return self._num_stages

    @property
    def num_microbatches(self) -> int:
        return self._num_microbatches

    @property
    def redundancy(self) -> bool:
        return self._redundancy

    @property
    def num_pipelines(self) -> int:
        """Data-parallel pipelines: ``world_size / num_stages``."""
        return max(self.world_size // self._num_stages, 1)

    @property
    def pipeline_index(self) -> int:
        return self.global_rank // self._num_stages

    @property
    def stage_index(self) -> int:
        return self.global_rank % self._num_stages

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
    def is_distributed(self) -> bool:
        """Tells Lightning to insert a distributed sampler (one shard per pipeline)."""
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """All stages of a pipeline read the same batch; each pipeline reads its own shard."""
        return {"num_replicas": self.num_pipelines, "rank": self.pipeline_index}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def replica_device(self) -> torch.device:
        return torch.device("cpu") if self._replica_device_option == "cpu" else self.root_device

    # ------------------------------------------------------------------ environment
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = _SubprocessScriptLauncher(
            self.cluster_environment, self.num_processes, self.num_nodes
        )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.setup_distributed()

    def set_world_ranks(self) -> None:
        """Set ranks (called by the Trainer when it is built), and check the stage arithmetic right away."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        self._check_world_size()

    def _check_world_size(self) -> None:
        if self.world_size % self._num_stages != 0:
            raise ValueError(
                f"num_stages ({self._num_stages}) does not divide world_size ({self.world_size}): "
                f"{self.world_size} % {self._num_stages} = {self.world_size % self._num_stages}; "
                f"world_size must be num_stages x num_pipelines"
            )

    def setup_distributed(self) -> None:
        """Validate the stage arithmetic and start the process group (with ``timeout``)."""
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

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        assert self.lightning_module is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        self._check_precision()
        _refuse_whole_model_callbacks(trainer)
        if not module.automatic_optimization:
            raise TypeError(
                f"BambooStrategy runs the backward pass itself and needs automatic optimization; "
                f"{type(module).__name__}.automatic_optimization is False"
            )
        if self._stage_module is None or module._modules.get(self._body_attr) is not self._stage_module:
            if trainer.state.fn == TrainerFn.FITTING:
                self._whole_group_names = _param_group_names(module)
            self._split_body(module)
        # else: a later fit/validate/test with the same Trainer; the module already holds its stage

        self.model = self.precision_plugin.convert_module(module)
        self.model_to_device()
        if self.replica is not None:
            self.replica = self.precision_plugin.convert_module(self.replica).to(self.replica_device)
        self._sync_stage_across_pipelines()

        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise ValueError(
                    f"BambooStrategy supports exactly one optimizer, configure_optimizers returned "
                    f"{len(self.optimizers)}"
                )
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        self._build_engine()
        if self._redundancy and trainer.state.fn == TrainerFn.FITTING:
            self._build_replica_sync(module)

    def _split_body(self, module: pl.LightningModule) -> None:
        """Plan the layout, build the groups, and keep only this rank's stage (and replica) of the body."""
        attr, body = find_pipeline_body(module, self._pipeline_attr)
        check_contract(module, attr, body)
        if getattr(body, _STAGE_MARK, False):
            raise RuntimeError(
                f"{type(module).__name__}.{attr} holds only the layers of one stage, left by an earlier "
                "BambooStrategy run; build a fresh module (e.g. load consolidate_checkpoint(path) into it)"
            )
        self._body_attr = attr
        costs = self._layer_costs if self._layer_costs is not None else estimate_layer_costs(list(body))
        self.layout = self._plan_layout(body, costs)
        check_stage_split(module, attr, body, self.layout.stage_layers)
        warn_batch_statistics(module, attr, body, self._num_microbatches)
        rank_zero_info(f"BambooStrategy layout:\n{self.layout.describe(costs=costs)}")
        self.groups = BambooGroups.create(self.layout, self.global_rank, self._timeout)
        stage = self.groups.stage
        self._stage_module = sub_sequential(body, self.layout.stage_layers[stage])
        setattr(self._stage_module, _STAGE_MARK, True)
        self._stage_module.outside_call_error = outside_call_message(
            module, attr, self.layout.stage_layers[stage], len(body)
        )
        module._modules[attr] = self._stage_module
        if self._redundancy:
            self.replica = sub_sequential(body, self.layout.stage_layers[self.layout.successor(stage)])
        # the layers of other stages are released with ``body``

    def _check_precision(self) -> None:
        plugin = self.precision_plugin
        if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
            raise ValueError(
                "BambooStrategy does not support precision='16-mixed' (its gradient scaler needs a loss "
                "scaled on every stage); use '32-true', '64-true' or 'bf16-mixed'"
            )

    def _plan_layout(self, body: nn.Sequential, costs: Sequence[float]) -> StageLayout:
        if len(body) < self._num_stages:
            raise ValueError(
                f"num_stages ({self._num_stages}) is more than the {len(body)} layers of the pipeline body; "
                f"each stage needs at least one layer"
            )
        if len(costs) != len(body):
            raise ValueError(
                f"layer_costs has {len(costs)} entries but the pipeline body has {len(body)} layers"
            )
        return StageLayout.plan(costs, self.world_size, self._num_stages)

    def _sync_stage_across_pipelines(self) -> None:
        """Start every pipeline from pipeline 0's copy of the stage (as DDP syncs module states)."""
        assert self.groups is not None and self.lightning_module is not None
        if self.groups.layout.num_pipelines == 1:
            return
        src = self.groups.layout.rank_of(0, self.groups.stage)
        stage = self.lightning_module._modules[self._body_attr]
        assert stage is not None
        for tensor in [*stage.parameters(), *stage.buffers()]:
            dist.broadcast(tensor.data, src, group=self.groups.stage_group)

    def _build_engine(self) -> None:
        assert self.groups is not None and self.lightning_module is not None
        module = self.lightning_module
        schedule = build_1f1b(self._num_stages, self._num_microbatches)
        if self._redundancy:
            schedule = add_forward_redundancy(schedule, self._num_stages, self._num_microbatches)
        rank_zero_info(f"BambooStrategy schedule (rank x step):\n{format_grid(schedule)}")
        stage = module._modules[self._body_attr]
        assert stage is not None
        self.engine = PipelineEngine(
            stage,
            self.groups,
            schedule,
            inputs_fn=module.pipeline_inputs,  # type: ignore[arg-type]
            loss_fn=module.pipeline_loss,  # type: ignore[arg-type]
            device=self.root_device,
            replica=self.replica,
            replica_device=self.replica_device,
        )

    def _build_replica_sync(self, module: pl.LightningModule) -> None:
        """Build the replica's optimizer from the user's ``configure_optimizers`` and sync its parameters.

        ``configure_optimizers`` is called once more with the pipeline body swapped for the replica, so the
        replica's parameters get exactly the param groups and hyper-parameters the successor's own call gave
        the same layers. The schedulers of that call are dropped: the replica copies its hyper-parameters
        from this rank's optimizer at every step.
        """
        assert self.replica is not None and self.groups is not None
        stage = module._modules[self._body_attr]
        module._modules[self._body_attr] = self.replica
        try:
            optimizers, _ = _init_optimizers_and_lr_schedulers(module)
        finally:
            module._modules[self._body_attr] = stage
        if len(optimizers) != 1:
            raise ValueError(
                f"configure_optimizers returned {len(optimizers)} optimizers for the replica, expected 1"
            )
        replica_optimizer = optimizers[0]  # the user's own optimizer, built over the replica's parameters
        assert stage is not None
        self.replica_sync = ReplicaSync(stage, self.replica, replica_optimizer, self.groups, self.root_device)
        self.replica_sync.sync_parameters()

    @property
    @override
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self.precision_plugin = Precision()
        assert self._precision_plugin is not None
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        """Lightning's ``gradient_clip_val`` clips by the norm over ALL stages, not this stage only."""
        self._precision_plugin = (
            None
            if precision_plugin is None
            else with_pipeline_clipping(precision_plugin, self._clip_grad_by_global_norm)
        )

    def _clip_grad_by_global_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        assert self.groups is not None
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
        group = None  # one stage: nothing to reduce
        if self._num_stages > 1:  # BambooGroups leaves pipeline_group None when the pipeline is the world
            group = dist.group.WORLD if self.groups.pipeline_group is None else self.groups.pipeline_group
        apply_clipping(plan_clipping(grads, clip_val, NORM, group, self.root_device), grads)

    # ------------------------------------------------------------------ training
    @override
    def on_train_start(self) -> None:
        """Refuse a last batch that the micro-batches cannot split evenly now, not at the epoch's end."""
        assert self.lightning_module is not None
        check_train_batches(self.lightning_module.trainer.train_dataloader, self._num_microbatches)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the whole schedule for the batch, then replay the user's ``training_step`` to log the loss."""
        assert self.engine is not None and self.lightning_module is not None
        batch, args, kwargs = self._stage0_batch(args, kwargs)
        return self._run_schedule_and_replay(split_microbatches(batch, self._num_microbatches), args, kwargs)

    def _run_schedule_and_replay(self, microbatches: list[Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        """Run the schedule on ``microbatches`` (gradients held aside), then replay the training_step."""
        assert self.engine is not None and self.lightning_module is not None
        params = self._stage_params()
        earlier = [p.grad for p in params]  # accumulated by earlier batches (accumulate_grad_batches > 1)
        for p in params:
            p.grad = None
        with self.precision_plugin.train_step_context():
            loss = self.engine.run_step(microbatches, step=self._forward_key_step())
        # Lightning zeroes gradients AFTER training_step and before backward: hold this step's aside
        self._stashed_grads = [p.grad for p in params]
        for p, grad in zip(params, earlier):
            p.grad = grad
        with replay_step(self.lightning_module, self._body_attr, loss):
            output = self.lightning_module.training_step(*args, **kwargs)
        check_replayed_loss(self.lightning_module, output, loss)
        return output

    def _forward_key_step(self) -> int:
        """The step keying the forwards' random numbers (:mod:`lightning_bamboo.keyed_rng`): the batch's
        index over the whole fit (Lightning's loop state: a resumed run continues it)."""
        assert self.lightning_module is not None
        return self.lightning_module.trainer.fit_loop.total_batch_idx

    def _stage0_batch(self, args: tuple, kwargs: dict[str, Any]) -> tuple[Any, tuple, dict[str, Any]]:
        """Every stage of a pipeline uses stage 0's batch (random augmentation may differ per process)."""
        assert self.groups is not None
        batch = args[0] if args else kwargs["batch"]
        if self.groups.num_stages > 1:
            src = self.groups.rank_of_stage(0)
            batch = broadcast_batch(batch, src, self.root_device, group=self.groups.pipeline_group)
        if args:
            return batch, (batch, *args[1:]), kwargs
        return batch, args, {**kwargs, "batch": batch}

    def _stage_params(self) -> list[nn.Parameter]:
        assert self.lightning_module is not None
        stage = self.lightning_module._modules[self._body_attr]
        assert stage is not None
        return list(stage.parameters())

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        """The schedule already ran every backward; hand its gradients back and run the backward hooks."""
        assert self.lightning_module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        if self._stashed_grads is None:
            raise RuntimeError("BambooStrategy.backward called without a preceding pipelined training_step")
        # Lightning divides the loss by accumulate_grad_batches before backward; the schedule's did not see it
        accumulate = self.lightning_module.trainer.accumulate_grad_batches
        for p, grad in zip(self._stage_params(), self._stashed_grads):
            if grad is None:
                continue
            if accumulate != 1:
                grad = grad / accumulate
            p.grad = grad if p.grad is None else p.grad + grad
        self._stashed_grads = None
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """The usual step, then the replica of this stage on the predecessor applies the same gradients."""
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._update_replica(optimizer)
        return output

    def _update_replica(self, optimizer: Optimizer) -> None:
        """Bring the predecessor's replica of this stage up to the step just taken (posted, applied later)."""
        if self.replica_sync is not None:
            self.replica_sync.step(optimizer)

    # ------------------------------------------------------------------ evaluation
    def _eval_step(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        assert self.engine is not None and self.lightning_module is not None
        batch, args, kwargs = self._stage0_batch(args, kwargs)
        num = math.gcd(batch_size_of(batch), self._num_microbatches)
        microbatches = split_microbatches(batch, num)
        context = (
            self.precision_plugin.val_step_context()
            if hook == "validation_step"
            else self.precision_plugin.test_step_context()
        )
        with context:
            loss = self.engine.run_forward(microbatches)
        with replay_step(self.lightning_module, self._body_attr, loss):
            return getattr(self.lightning_module, hook)(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Forward-only pipeline over the batch's micro-batches; replays ``validation_step`` with the loss."""
        return self._eval_step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """Forward-only pipeline over the batch's micro-batches; replays ``test_step`` with the loss."""
        return self._eval_step("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Forward-only pipeline over the batch; replays ``predict_step`` with the whole body's outputs.

        The last stage's outputs are broadcast over the pipeline, so every rank returns the predictions of
        its pipeline's batches (each pipeline predicts its own shard of the data, as every DDP rank does).
        """
        assert self.engine is not None and self.lightning_module is not None
        module = self.lightning_module
        batch, args, kwargs = self._stage0_batch(args, kwargs)
        num = math.gcd(batch_size_of(batch), self._num_microbatches)
        with self.precision_plugin.predict_step_context():
            outputs = self._pipeline_outputs(split_microbatches(batch, num), None)
            with replay_predict(module, self._body_attr, module.pipeline_inputs(batch), outputs):  # type: ignore[operator]
                return module.predict_step(*args, **kwargs)

    def full_forward(self, inputs: Any) -> Any:
        """The whole pipeline body's output for ``inputs`` (the body's input, as ``pipeline_inputs`` returns
        it), on every rank of this rank's pipeline: a forward-only schedule through all stages, no graph.

        For callbacks that need the whole model (printing a sample, greedy generation): calling the module's
        body on one stage raises, as it holds that stage's layers only. Collective over the pipeline: every
        rank of the pipeline must call it (Lightning runs callback hooks on every rank); stage 0's
        ``inputs`` are used and sent to the others. The module's train/eval mode applies (call
        ``pl_module.eval()`` first for dropout-free outputs, as under any strategy).

        Raises:
            RuntimeError: before the strategy is set up (no stages yet).
        """
        if self.engine is None or self.groups is None:
            raise RuntimeError(
                "BambooStrategy.full_forward needs the pipeline, which exists once fit/validate/test/predict "
                "has set the strategy up; call it from a LightningModule or callback hook"
            )
        if self.groups.num_stages > 1:
            src = self.groups.rank_of_stage(0)
            inputs = broadcast_batch(inputs, src, self.root_device, group=self.groups.pipeline_group)
        num = math.gcd(batch_size_of(inputs), self._num_microbatches)
        with self.precision_plugin.forward_context():
            return self._pipeline_outputs(split_microbatches(inputs, num), _identity)

    def _pipeline_outputs(self, microbatches: list[Any], inputs_fn: Callable[[Any], Any] | None) -> Any:
        """Run the body over ``microbatches`` (forward only); the joined outputs, on every pipeline rank."""
        assert self.engine is not None and self.groups is not None
        outputs = self.engine.run_outputs(microbatches, inputs_fn)
        joined = join_microbatches(outputs) if outputs is not None else None
        if self.groups.num_stages == 1:
            return joined
        src = self.groups.last_stage_rank
        return broadcast_batch(joined, src, self.root_device, group=self.groups.pipeline_group)

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Stages and optimizers must exist before their shards can be loaded."""
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This stage's tensors only, under their original names (``pipeline.3.weight``)."""
        assert self.lightning_module is not None
        return self.lightning_module.state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer state keyed by parameter NAME, so shards of all stages merge without collisions."""
        assert self.lightning_module is not None
        return ckpt.named_optimizer_state(self.lightning_module, optimizer)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Write a sharded checkpoint directory atomically (temporary directory, then rename)."""
        if storage_options is not None:
            raise TypeError("BambooStrategy.save_checkpoint does not take storage_options")
        stage = self.stage_index if self.pipeline_index == 0 else None
        ckpt.save_sharded(checkpoint, filepath, self.is_global_zero, self.barrier, stage=stage)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Read this stage's shard (and its optimizer state) and the trainer state; nothing is unpickled.

        ``checkpoint_path`` is a Bamboo checkpoint (a folder, any stage and pipeline count) or an ordinary
        Lightning ``.ckpt`` file (``torch.load(weights_only=True)``), whose whole model and optimizer state
        are split into this rank's stage and replica by parameter name.
        """
        assert self.lightning_module is not None
        path = Path(checkpoint_path)
        self._loaded_path = self._loaded_whole = None
        if path.is_file():
            checkpoint, self._loaded_whole = ckpt.load_lightning_checkpoint(
                path, self.lightning_module, self.optimizers, self._whole_group_names
            )
            return checkpoint
        if not path.is_dir():
            raise FileNotFoundError(
                f"checkpoint_path {str(path)!r} does not exist (expected a BambooStrategy checkpoint folder "
                "or an ordinary Lightning .ckpt file)"
            )
        self._loaded_path = path
        return ckpt.load_sharded(checkpoint_path, self.lightning_module, self.optimizers)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        assert self.lightning_module is not None
        self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)
        if self.replica is not None and self._loaded_path is not None:
            ckpt.load_replica(self._loaded_path, self.replica, self._body_attr, None)
        if self.replica is not None and self._loaded_whole is not None:
            ckpt.load_replica_from_memory(self._loaded_whole, self.replica, self._body_attr, None)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        assert self.lightning_module is not None
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            ckpt.load_named_optimizer_state(self.lightning_module, optimizer, state)
        # the replica of the successor stage is in the same checkpoint: load it rather than transfer it
        if self.replica is not None and self.replica_sync is not None and self._loaded_path is not None:
            self.replica_sync.flush()  # a still-pending update must not land on top of the loaded state
            ckpt.load_replica(self._loaded_path, self.replica, self._body_attr, self.replica_sync.optimizer)
        if self.replica is not None and self.replica_sync is not None and self._loaded_whole is not None:
            self.replica_sync.flush()
            optimizer = self.replica_sync.optimizer
            ckpt.load_replica_from_memory(self._loaded_whole, self.replica, self._body_attr, optimizer)

    @override
    def teardown(self) -> None:
        """Apply the last step's in-flight replica update, so the replica is current when training ends."""
        if self.replica_sync is not None:
            try:
                self.replica_sync.flush()
            except RuntimeError as err:  # a dead peer: do not mask the error that ended training
                log.warning("Bamboo: the last replica update could not complete: %s", err)
        super().teardown()

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            ckpt.remove(filepath)

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        """Broadcast a JSON-representable value (paths, numbers) as bytes; nothing is pickled."""
        if not _distributed_is_initialized():
            return obj
        return broadcast_json(obj, src, self.root_device)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Bamboo: pipeline parallelism with redundant layers for preemptible machines",
        )


def _identity(value: Any) -> Any:
    return value


def full_forward(pl_module: pl.LightningModule, inputs: Any, pipeline_attr: str | None = None) -> Any:
    """The whole pipeline body's output for ``inputs`` under any strategy (for callbacks).

    Under Bamboo this is :meth:`BambooStrategy.full_forward` (collective: every rank of the pipeline calls
    it, as Lightning calls callback hooks on every rank); otherwise the module's body itself, so one callback
    runs under ``strategy="auto"`` and ``strategy="bamboo"``. Runs without a graph either way.
    ``pipeline_attr``: the body's attribute name, as for ``BambooStrategy`` (used off Bamboo only).
    """
    strategy = pl_module.trainer.strategy
    if isinstance(strategy, BambooStrategy):
        return strategy.full_forward(inputs)
    _, body = find_pipeline_body(pl_module, pipeline_attr)
    with torch.no_grad():
        return body(inputs)
