"""``BambooStrategy``: pipeline-parallel training that survives preemption, as a Lightning strategy.

One runtime, three ways to start it (the layout is always an
:class:`~lightning_bamboo.layout.ownership.OwnershipMap`; the first one is its generation 0)::

    import lightning_bamboo  # registers "bamboo"
    # python train.py: this process supervises 4 workers; any of them may be lost
    Trainer(strategy="bamboo", devices=4).fit(model, data)
    # python -m lightning_bamboo.launch --nproc 4 train.py (devices=1 in the script): the same, as a CLI
    # torchrun / SLURM / a single process: the same pipeline, but a lost worker ends the job

How a step runs (the *two-phase step*): the pipeline schedule runs (forwards, backwards, gradient all-reduce
over pipelines); every member sends its stages' gradients to the member holding their replica and receives its
successor's; it then *prepares* in the store; when every member has prepared, the step is *committed*
(:class:`lightning_bamboo.protocol.commit.StepCommit`) and every member applies the optimizer to its own
stages and to its replica. A failure before the commit aborts the step everywhere (nobody has changed a
parameter); after it, every survivor applies the step. Survivors therefore always agree on one state, before
or after the step; what happens next (failover, rejoin, fallback, drain) is
:mod:`lightning_bamboo.runtime.membership`.

Data: every member loads the GLOBAL batch (the sampler is not sharded; ``batch_size`` is the global batch) and
takes the share of its pipeline under the current layout, so the samples of a step do not depend on how many
pipelines exist.

The strategy is Lightning's hooks and the glue between them; it holds its parts, each an object with its own
state: the :class:`~lightning_bamboo.runtime.formation.Formation` (the body's layers, forming a generation),
the :class:`~lightning_bamboo.runtime.generation.Generation` it formed (owners, view, engine, replica), the
:class:`~lightning_bamboo.step.session.StepSession` (the step in progress), the
:class:`~lightning_bamboo.runtime.membership.Membership` (generations, the one retry loop, joins, drains),
its :class:`~lightning_bamboo.runtime.fallback.Fallback` and the
:class:`~lightning_bamboo.runtime.events.Events` bus.
"""

from __future__ import annotations

import functools
import logging
import operator
import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_bamboo import wiring
from lightning_bamboo._lightning import private as _private
from lightning_bamboo._lightning.precision import with_pipeline_clipping
from lightning_bamboo.checkpoint import sharded as ckpt
from lightning_bamboo.contract import find_pipeline_body
from lightning_bamboo.pipeline.buffers import batch_norm_split_warning, refuse_sync_batchnorm
from lightning_bamboo.protocol import crash
from lightning_bamboo.protocol import store as ms
from lightning_bamboo.runtime import generation_zero
from lightning_bamboo.runtime.lightning_side import LightningSide
from lightning_bamboo.runtime.parts import Options, assemble, resolve_recovery
from lightning_bamboo.step.broadcast import broadcast_json
from lightning_bamboo.step.reduce import is_mean, sample_weighted_mean

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_bamboo.notices.base import Notice

log = logging.getLogger(__name__)


def _part(path: str, doc: str) -> Any:
    """A read-only attribute of the strategy that is an attribute of one of its parts (``"_gen.owners"``):
    the public name stays on the strategy, the state and behaviour in the part."""
    return property(operator.attrgetter(path), doc=doc)


class BambooStrategy(ParallelStrategy):
    """Pipeline parallelism with Bamboo's redundancy that keeps training when workers are lost or join.

    The workers form ``num_stages`` stages x ``workers / num_stages`` data-parallel pipelines (generation 0:
    member ``m`` is stage ``m % num_stages`` of pipeline ``m // num_stages``). Every step runs a 1F1B schedule
    over ``num_microbatches`` micro-batches, averages gradients over the pipelines, and keeps each stage's
    replica (layers, optimizer state, buffers) on its predecessor exactly current; when a worker is lost its
    predecessor takes its stages over inside the same ``fit`` (started plainly or by
    ``python -m lightning_bamboo.launch``; under torchrun or SLURM a lost worker ends the job).

    Args:
        num_stages: pipeline length, >= 1, dividing the number of workers, <= the body's layers; 1 is plain
            data parallelism (with ``recovery="peers"``).
        num_microbatches: micro-batches per step and pipeline, >= 1, dividing each pipeline's share.
        recovery: ``"replica"`` (default), ``"replica+forward"`` (with the replica's forwards ``FR``) or
            ``"peers"`` (no replica); docs/bamboo-elastic.md. ``redundancy=True/False``: the older spelling,
            deprecated (``"replica+forward"`` / ``"peers"``).
        replica_device: ``"same"`` (default) as the stage, or ``"cpu"`` (Bamboo's lazy mode).
        pipeline_attr: the module's ``nn.Sequential`` body; ``None``: ``pipeline`` or the only one.
        layer_costs: relative cost of each layer of the body, to split it into stages; ``None``: estimated.
        timeout: of collectives and point-to-point operations, seconds or ``timedelta`` (default 30 s).
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; ``None``: NCCL on CUDA, else gloo.
        heartbeat: seconds between heartbeats written to the store; ``None``: 0.25 on one machine's store,
            1.0 on etcd (every beat is a network request there; keep it well under the launcher's
            ``--hang-timeout``, 5 s by default).
        hang_timeout: seconds without a heartbeat after which the supervisor of a plain ``python train.py``
            kills a worker as lost (``--hang-timeout`` of ``python -m lightning_bamboo.launch``).
        failure_wait: seconds a member that saw a communication error waits for the next generation before
            it raises the error as a real one.
        checkpoint_every_n_steps: an asynchronous ``torch.distributed.checkpoint`` every N steps for the
            checkpoint fallback (a loss redundancy cannot cover); ``None``: such a loss ends the job.
        checkpoint_dir: their folder (``<checkpoint_dir>/<job id>``; on several machines, a shared one).
        keep_checkpoints: complete checkpoints kept.
        drain_on_sigterm: a SIGTERM to a worker (spot agents, Kubernetes, ``docker stop``) drains it at the
            next step boundary (a :class:`~lightning_bamboo.callbacks.BambooNotices` is added when missing);
            ``False``: Lightning's own handling ends the worker.
        keyed_rng: ``True`` (default): every training forward draws dropout from generators keyed by (seed,
            step, pipeline, micro-batch, layer) (:mod:`.pipeline.keyed_rng`), so FR, a replay and a re-run
            draw what the first run drew; ``False``: each process's global generators.
        batch_norm: how buffers (BatchNorm's running statistics, ``num_batches_tracked``, any user buffer)
            stay one value across the pipelines (:mod:`.pipeline.buffers`): ``"broadcast"`` (default,
            DDP's ``broadcast_buffers=True``): after every batch each stage's buffers are pipeline 0's;
            ``"deferred"``: BatchNorm's running statistics are updated once per batch from the whole global
            batch (every micro-batch of every pipeline), as one process on the whole batch and
            ``SyncBatchNorm`` update them, and do not change when a pipeline is lost or joins.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for every
            Lightning ``ParallelStrategy`` (normally set by the Trainer).
    """

    strategy_name = "bamboo"
    is_distributed = True
    restore_checkpoint_after_setup = True  # stages and optimizers must exist before their shards load

    # the parts' public state, read-only here
    owners = _part("_gen.owners", "The current generation's ownership map (``None`` before setup).")
    view = _part("_gen.view", "This member's view of the current generation (groups, positions).")
    replica = _part("_gen.replica", "The successor stage's layers this member keeps current (or ``None``).")
    engine = _part("_gen.engine", "The engine running this member's stages' schedule.")
    replica_sync = _part("_gen.replica_sync", "What keeps ``replica`` equal to the successor's stage.")
    num_stages = _part("_formation.num_stages", "Pipeline length the job started with.")
    num_microbatches = _part("_formation.num_microbatches", "Micro-batches per step and pipeline at start.")
    redundancy = _part("_formation.redundancy", "Whether every stage holds a replica of its successor.")
    global_microbatches = _part("_formation.global_microbatches",
                                "Micro-batches per global batch, fixed for the job (:mod:`.keyed_rng`).")
    forward_redundancy = _part("_formation.forward_redundancy", "Whether steps run the replica forwards now.")
    stage_layers = _part("_formation.stage_layers", "Stage -> its layers of the body (set at setup).")
    member = _part("_gen.member", "This worker's id in the job (stable across generations).")
    pipeline_length = _part("_gen.pipeline_length", "Positions of this member's pipeline now.")
    num_pipelines = _part("_gen.num_pipelines", "Pipelines of the current generation.")
    pipeline_index = _part("_gen.pipeline_index", "This member's pipeline's position among them.")
    stage_index = _part("_gen.stage_index", "The first original stage this member holds.")
    elastic = _part("_membership.elastic", "Whether a lost worker is survived (a Bamboo supervisor runs it).")
    process_group_backend = _part("_membership.backend", "``gloo``, ``nccl``, ... (chosen at setup).")
    failovers = _part("_transitions.failovers", "(old map, new map) of every re-form in this fit.")
    session = _part("_session", "The step session (:class:`~lightning_bamboo.step.session.StepSession`).")
    full_forward = _part("_session.full_forward", "The whole body's output, collective over the pipeline.")
    set_forward_redundancy = _part("_session.set_forward_redundancy", "Switch ``FR`` at a step boundary.")
    emit = _part("_events.emit", "Fire Bamboo event ``name`` on the trainer's callbacks (:mod:`.events`).")

    def __init__(
        self,
        num_stages: int = 2,
        num_microbatches: int = 4,
        redundancy: bool | None = None,
        replica_device: Literal["same", "cpu"] = "same",
        pipeline_attr: str | None = None,
        layer_costs: Sequence[float] | None = None,
        timeout: float | timedelta | None = 30.0,
        process_group_backend: str | None = None,
        heartbeat: float | None = None,
        hang_timeout: float = 5.0,
        failure_wait: float = 30.0,
        checkpoint_every_n_steps: int | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        keep_checkpoints: int = 2,
        drain_on_sigterm: bool = True,
        keyed_rng: bool = True,
        recovery: Literal["replica", "replica+forward", "peers"] | None = None,
        batch_norm: Literal["broadcast", "deferred"] = "broadcast",
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        self._options = options = Options(  # checked here, before any process starts
            num_stages, num_microbatches, resolve_recovery(recovery, redundancy), replica_device,
            pipeline_attr, layer_costs, timeout, process_group_backend, heartbeat, hang_timeout, failure_wait,
            checkpoint_every_n_steps, checkpoint_dir, keep_checkpoints, keyed_rng, batch_norm,
        )
        self.drain_on_sigterm = drain_on_sigterm
        self.num_nodes = 1  # Lightning's connector sets it
        # a worker of a Bamboo job (its supervisor's environment), or None: an outside launcher's fixed rank
        self._env = ms.WorkerEnv.from_env()
        self._rng_at_start = torch.get_rng_state()  # set again when an entry point starts (setup_environment)
        self._entries = 0  # fit/validate/test/predict calls in this process (each its own store prefix)
        # the parts (before Lightning's __init__: its precision setter hands the session's clipping on)
        lightning = LightningSide(
            module=lambda: self.lightning_module,  # type: ignore[arg-type,return-value]
            optimizer=lambda: self.optimizers[0], schedulers=lambda: self.lr_scheduler_configs,
            device=lambda: self.root_device, ranks_changed=self.set_world_ranks,
        )
        parts = assemble(options, self._env, lightning, lambda: self.precision_plugin,
                         lambda: self.replica_device)
        self._events, self._formation, self._gen, self._checkpoints = (
            parts.events, parts.formation, parts.gen, parts.checkpoints)
        self._session, self._fallback, self._membership = parts.session, parts.fallback, parts.membership
        self._transitions = parts.transitions
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)

    # ------------------------------------------------------------------ ranks and devices
    @property
    @override
    def global_rank(self) -> int:
        return self._membership.rank

    @property
    @override
    def is_global_zero(self) -> bool:
        """Rank 0 of the current generation; never a member that drained (no rank of the job any more)."""
        return self._membership.rank == 0 and not self._membership.left

    @property
    @override
    def world_size(self) -> int:
        # a joiner's setup runs while the others are inside a step: it joins no per-batch collective there
        return 1 if self._membership.joining_setup else self._membership.world

    @property
    @override
    def local_rank(self) -> int:
        if self._env is not None or self.cluster_environment is None:
            return 0
        return self.cluster_environment.local_rank()

    @property
    @override
    def node_rank(self) -> int:
        if self._env is not None or self.cluster_environment is None:
            return 0
        return self.cluster_environment.node_rank()

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        if self._env is not None and self.parallel_devices[0].type == "cuda":
            # a Bamboo worker (Trainer(devices=1)) takes the GPU of its index among its machine's workers
            return torch.device("cuda", self._env.local_rank)
        return self.parallel_devices[min(self.local_rank, len(self.parallel_devices) - 1)]

    @property
    def replica_device(self) -> torch.device:
        return torch.device("cpu") if self._options.replica_device == "cpu" else self.root_device

    @property
    def store(self) -> dist.Store:
        """The job's store (membership, commits; the supervisor holds it)."""
        if self._membership.store is None:
            raise RuntimeError("the store is connected in setup_distributed")
        return self._membership.store

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every member loads the global batch (a failover changes the pipelines' shares, not the samples of
        a step); prediction (no failover to plan for): each pipeline its own shard, as DDP ranks do."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.predicting and self._gen.owners is not None:
            return {"num_replicas": self._gen.num_pipelines, "rank": self._gen.pipeline_index}
        return {"num_replicas": 1, "rank": 0}

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
            None if precision_plugin is None else with_pipeline_clipping(precision_plugin, self._session.clip)
        )

    # ------------------------------------------------------------------ launching
    @override
    def _configure_launcher(self) -> None:
        """Bamboo's supervisor for a plain ``python train.py`` (:func:`wiring.launcher`)."""
        processes = len(self.parallel_devices or [])
        cuda = bool(self.parallel_devices) and self.parallel_devices[0].type == "cuda"
        self._launcher = wiring.launcher(self._env, self.cluster_environment, processes, self.num_nodes,
                                         self._options, cuda)

    @override
    def set_world_ranks(self) -> None:
        """Lightning's rank-zero-only parts follow this member's rank (it changes with the generation)."""
        if self._env is None and self.cluster_environment is not None and self._gen.owners is None:
            processes = len(self.parallel_devices or [])
            wiring.fixed_ranks(self._membership, self.cluster_environment, self.node_rank * processes
                               + self.local_rank, self.num_nodes * processes, self.num_stages)
        wiring.set_rank_zero(self._membership.rank)

    @override
    def setup_environment(self) -> None:
        """Connect to the job's store and start the heartbeat (:func:`wiring.enter`)."""
        # the global generator as fit found it, before reset_seed: what "auto"'s RandomSampler draws from
        self._rng_at_start = torch.get_rng_state()
        super().setup_environment()
        reset_seed()
        self._entries += 1  # entry points of this strategy object (a later one reuses the layout)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        wiring.enter(self._membership, self._env, self.cluster_environment, self._options, trainer,
                     self.drain_on_sigterm, self.set_world_ranks, cuda=self.root_device.type == "cuda")

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        module, formation, members, gen = self.lightning_module, self._formation, self._membership, self._gen
        fitting = trainer.state.fn == TrainerFn.FITTING
        wiring.check_setup(trainer, module, self.precision_plugin, self._options.checkpoint_every_n_steps)
        fresh = formation.seam is None or module._modules.get(formation.body_attr) is not formation.seam
        if fresh:
            self._checkpoints.group_names = wiring.param_group_names(module) if fitting else None
            formation.prepare(module, self._options.pipeline_attr, self._options.layer_costs,
                              self.precision_plugin, self._checkpoints.group_names)
        assert formation.seam is not None
        formation.seam.attach(module)  # the one seam: the body and the two hooks, until teardown
        if self._env is not None and self._env.joining and members.elastic:  # a joiner: no process group yet
            members.joining_setup = True
            self._setup_model_and_optimizer(trainer, module)
            return
        if gen.owners is None:
            assert members.store is not None
            owners = generation_zero.agree(members.store, formation, members.nproc, members.member)
        else:
            owners = gen.owners
        if fresh:
            check_batch_norm(module, formation, self._layer_sync, self._options.batch_norm)
        members.begin(owners)
        optimizer = self.optimizers[0] if self.optimizers else None
        formation.form_at_setup(gen, self.store, module, fresh, optimizer, announce=self._entries == 1)
        if fitting:
            self._setup_model_and_optimizer(trainer, module)
            if members.elastic:
                formation.check_groups_fit_any_layout(module, self.optimizers[0])
            formation.build_replica_optimizer(gen, module)
            self._fallback.start(self._env.job if self._env is not None else "local", members.member)
        else:
            self.model = self.precision_plugin.convert_module(module)
            self.model_to_device()
            self.setup_precision_plugin()
        members.formed(owners.generation)
        if self._entries == 1:
            rank_zero_only(print)(f"[bamboo] generation {owners.generation}:\n{owners.format()}", flush=True)

    def _setup_model_and_optimizer(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """Lightning's model, device, optimizer and precision set-up, shared by members and joiners."""
        self.model = self.precision_plugin.convert_module(module)
        self.model_to_device()
        self.setup_optimizers(trainer)
        wiring.check_one_optimizer(self.optimizers)
        assert self._formation.seam is not None
        self._formation.regroup_ties(self.optimizers[0], self._formation.seam)
        self.setup_precision_plugin()  # its norm clipping applies the plan agreed before the commit
        _private.optimizers_to_device(self.optimizers, self.root_device)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """The training loader as the job iterates it (:func:`wiring.training_loader`)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training:
            return dataloader
        agreed_rng_state = functools.partial(wiring.agreed_rng_state, self.store, self._rng_at_start)
        return wiring.training_loader(dataloader, trainer, agreed_rng_state, self._membership)

    # ------------------------------------------------------------------ training
    @override
    def on_train_start(self) -> None:
        """A joiner joins now; a last batch the micro-batches cannot split is refused now, not at its turn."""
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        _private.restore_loader_states(trainer.fit_loop)  # mid-epoch position, also after an early estimate
        if self._env is not None and self._env.joining and self._gen.owners is None:
            members = self._membership  # the job's step count comes with the joiner's progress
            self._session.step = members.joins.join(trainer, members.begin, members.formed, members.skip)
        elif not self._events.muted:
            self._session.step = trainer.global_step  # a resumed fit goes on counting (checkpoints, keys)
        self._formation.check_train_batches(trainer.train_dataloader)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Remember the step's batches (several with accumulation): a failover mid-step runs them again."""
        members = self._membership
        if members.elastic and members.store is not None and self.lightning_module is not None:
            members.rank_zero.batch_start(self.lightning_module.trainer, members.store, self.is_global_zero)
        self._session.begin_batch(batch_idx, batch)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """This pipeline's share of the global batch through the schedule, then the user's ``training_step``
        replayed with the pipeline's loss (for logging); a lost peer: the next generation, the batch again."""
        assert self.lightning_module is not None
        return self._session.train(self.lightning_module, args, kwargs, self._fallback.record)

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        """The schedule already ran every backward; hand its gradients back and run the backward hooks."""
        assert self.lightning_module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self._session.add_stashed_grads(done=True)
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
        """A generation the last commit adopted, a checkpoint when due, then the two-phase step."""
        self._session.in_step = self._session.step
        self._session.form(self._transitions.at_boundary())
        self._fallback.maybe_checkpoint(self._membership.member, self._session.step)
        lightning_step = functools.partial(super().optimizer_step, optimizer, model=model, **kwargs)
        return self._session.two_phase(optimizer, closure, lightning_step)

    def drain(self, ranks: list[int], checkpoint_dir: str | Path | None = None,
              notices: dict[int, Notice] | None = None) -> None:
        """Take ``ranks`` out of training at this step boundary (an announced departure, :mod:`.drain`):
        under a supervisor the others re-form without them; without one, checkpoint and stop."""
        self._session.form(self._transitions.drain(self._session.step, ranks, checkpoint_dir, notices))

    # ------------------------------------------------------------------ evaluation and prediction
    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return _evaluate(self, "validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return _evaluate(self, "test_step", args, kwargs)

    @override
    def on_validation_end(self) -> None:
        self._transitions.evaluation_ended()
        super().on_validation_end()

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Forward-only pipeline over the batch, ``predict_step`` replayed with the whole body's outputs
        (broadcast over the pipeline: every rank returns its pipeline's shard's predictions, as DDP's do)."""
        assert self._gen.engine is not None and self.lightning_module is not None
        return self._session.predict(self.lightning_module, args, kwargs)

    # ------------------------------------------------------------------ Lightning checkpoints
    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer state keyed by parameter NAME, so shards of all stages merge without collisions."""
        assert self.lightning_module is not None
        return ckpt.named_optimizer_state(self.lightning_module, optimizer)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """A sharded checkpoint folder, written atomically (:class:`StageCheckpoints`)."""
        if storage_options is not None:
            raise TypeError("BambooStrategy.save_checkpoint does not take storage_options")
        self._checkpoints.save(checkpoint, filepath, self.is_global_zero, self.barrier)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """This member's stages from a Bamboo folder or a Lightning ``.ckpt`` (:class:`StageCheckpoints`)."""
        assert self.lightning_module is not None
        return self._checkpoints.load(checkpoint_path, self.lightning_module, self.optimizers)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        self._checkpoints.load_model(self.lightning_module, checkpoint, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        self._checkpoints.load_optimizers(self.lightning_module, self.optimizers, checkpoint)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            ckpt.remove(filepath)

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: str | None = None) -> None:
        if self._membership.joining_setup or not dist.is_initialized():
            return  # a joiner's setup runs while the others train: nobody to meet
        dist.barrier(device_ids=[self.root_device.index] if dist.get_backend() == "nccl" else None)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        """Broadcast a JSON-representable value (paths, numbers) as bytes; nothing is pickled."""
        if self._membership.joining_setup or not dist.is_initialized():
            return obj
        return broadcast_json(obj, src, self.root_device)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """A mean (``self.log(..., sync_dist=True)``) weights each pipeline by its samples, not its ranks
        (:mod:`.step.reduce`); other reductions are Lightning's over every rank."""
        if self._membership.joining_setup or not isinstance(tensor, Tensor):
            return tensor
        gen = self._gen
        if group is None and is_mean(reduce_op) and dist.is_initialized() and gen.owners is not None \
                and gen.view is not None:
            share = self._formation.microbatch_share(gen.owners, gen.member)
            weight = len(share) / self._formation.global_microbatches / gen.view.num_positions
            return sample_weighted_mean(tensor, weight)
        return _private.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ the end
    @override
    def on_exception(self, exception: BaseException) -> None:
        """Record ``exception`` in the store (unless a lost peer caused it): the job stops, no failover."""
        super().on_exception(exception)
        crash.record_exception(self._membership.store, self._membership.member, exception)

    @override
    def teardown(self) -> None:
        """Tell the supervisor this member is done (its heartbeat stops now), leave the process group."""
        self._fallback.finish()  # a write in flight finishes before the process exits
        self._membership.finish(self._session.step)
        wiring.destroy_process_group_at_exit()  # not now: trainer.save_checkpoint after fit is collective
        if self._formation.seam is not None and self.lightning_module is not None:
            self._formation.seam.detach(self.lightning_module)  # the user's hooks; the body keeps the stage
        ParallelStrategy.teardown(self)
        wiring.end_if_departed(self._membership, self._session.step)  # a drained member's process ends

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _private.StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Bamboo: pipeline parallelism with redundant layers for preemptible machines",
        )


ElasticBambooStrategy = BambooStrategy
"""The name the elastic runtime had before it became :class:`BambooStrategy` (kept for existing scripts)."""


def check_batch_norm(module: pl.LightningModule, formation: Any, layer_sync: object, batch_norm: str) -> None:
    """Refuse ``sync_batchnorm=True`` and SyncBatchNorm layers; warn (rank 0) when BatchNorm meets a split
    batch (:mod:`.pipeline.buffers`)."""
    body = torch.nn.ModuleDict({str(i): layer for i, layer in formation.layers.items()})
    owner = type(module).__name__
    refuse_sync_batchnorm(layer_sync, body, owner, formation.body_attr)
    pipelines = formation.global_microbatches // formation.num_microbatches
    message = batch_norm_split_warning(owner, formation.body_attr, body, formation.num_microbatches,
                                       pipelines, batch_norm)
    if message is not None:
        rank_zero_warn(message)


def _evaluate(strategy: BambooStrategy, hook: str, args: tuple, kwargs: dict[str, Any]) -> Any:
    """A validation/test step: the forward-only pipeline over the batch's micro-batches
    (:meth:`StepSession.evaluate`), then ``hook`` replayed with the loss."""
    module, plugin = strategy.lightning_module, strategy.precision_plugin
    assert module is not None
    # a factory: a batch re-run after a lost peer enters a fresh context (a used one cannot be re-entered)
    context = plugin.val_step_context if hook == "validation_step" else plugin.test_step_context
    loss, args, kwargs = strategy.session.evaluate(args, kwargs, context, hook.split("_")[0])
    seam = strategy._formation.seam
    assert seam is not None
    with seam.replaying(loss):
        return getattr(module, hook)(*args, **kwargs)


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
