"""``BambooStrategy``: pipeline-parallel training that survives preemption, as a Lightning strategy.

One runtime, three ways to start it (the layout is always an
:class:`~lightning_bamboo.elastic.ownership.OwnershipMap`; the first one is its generation 0)::

    import lightning_bamboo  # registers "bamboo"
    # python train.py: this process supervises 4 workers; any of them may be lost
    Trainer(strategy="bamboo", devices=4).fit(model, data)
    # python -m lightning_bamboo.launch --nproc 4 train.py (devices=1 in the script): the same, as a CLI
    # torchrun / SLURM / a single process: the same pipeline, but a lost worker ends the job

How a step runs (the *two-phase step*): the pipeline schedule runs (forwards, backwards, gradient all-reduce
over pipelines); every member sends its stages' gradients to the member holding their replica and receives its
successor's; it then *prepares* in the store; when every member has prepared, the step is *committed*
(:class:`lightning_bamboo.elastic.commit.StepCommit`) and every member applies the optimizer to its own stages
and
to its replica. A failure before the commit aborts the step everywhere (nobody has changed a parameter); after
it, every survivor applies the step. Survivors therefore always agree on one state, before or after the step;
what happens next (failover, rejoin, fallback, drain) is :mod:`lightning_bamboo.elastic.membership`.

Data: every member loads the GLOBAL batch (the sampler is not sharded; ``batch_size`` is the global batch) and
takes the share of its pipeline under the current layout, so the samples of a step do not depend on how many
pipelines exist.

The strategy is Lightning's hooks and the glue between them; it holds its parts, each an object with its own
state: the :class:`~lightning_bamboo.elastic.formation.Formation` (the body's layers, forming a generation),
the :class:`~lightning_bamboo.elastic.generation.Generation` it formed (owners, view, engine, replica), the
:class:`~lightning_bamboo.step_session.StepSession` (the step in progress), the
:class:`~lightning_bamboo.elastic.membership.Membership` (generations, the one retry loop, joins, drains),
its :class:`~lightning_bamboo.elastic.fallback.Fallback` and the :class:`~lightning_bamboo.events.Events` bus.
"""

from __future__ import annotations

import atexit
import functools
import logging
import operator
import os
from collections.abc import Callable, Sequence
from datetime import timedelta
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
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_bamboo import _private, wiring
from lightning_bamboo.broadcast import broadcast_json
from lightning_bamboo.checkpoint import periodic as fb
from lightning_bamboo.checkpoint import sharded as ckpt
from lightning_bamboo.checkpoint.loading import CheckpointLoad
from lightning_bamboo.contract import find_pipeline_body
from lightning_bamboo.data_order import in_written_order
from lightning_bamboo.elastic import store as ms
from lightning_bamboo.elastic.drain import BambooDeparted
from lightning_bamboo.elastic.fallback import Fallback
from lightning_bamboo.elastic.formation import Formation, checked_module
from lightning_bamboo.elastic.generation import Generation
from lightning_bamboo.elastic.membership import LightningSide, Membership, record_exception
from lightning_bamboo.elastic.script_launcher import SupervisorLauncher
from lightning_bamboo.events import Events
from lightning_bamboo.pipeline.microbatch import (
    check_train_batches,
)
from lightning_bamboo.precision import with_pipeline_clipping
from lightning_bamboo.progress import resumable, skip_first_batches
from lightning_bamboo.step_session import StepSession
from lightning_bamboo.ties import aliases

if TYPE_CHECKING:
    import lightning.pytorch as pl

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
        num_stages: pipeline length, >= 1; must divide the number of workers and be <= the number of layers
            of the pipeline body. 1 means plain data parallelism (and requires ``redundancy=False``).
        num_microbatches: micro-batches per training step and pipeline, >= 1; must divide each pipeline's
            share of the batch.
        redundancy: ``True`` (default): every stage holds a replica of its successor and runs the eager
            redundant forwards (``FR``) of the Bamboo schedule; ``False``: the plain 1F1B pipeline (no
            replica: a lost worker needs the checkpoint fallback).
        replica_device: ``"same"`` (default): the replica lives on the stage's device; ``"cpu"``: in host
            memory, as Bamboo's lazy mode, saving accelerator memory.
        pipeline_attr: attribute name of the module's ``nn.Sequential`` body; ``None`` (default): ``pipeline``
            or else the module's only ``nn.Sequential`` child.
        layer_costs: relative cost of each layer of the body, used to split layers into stages; ``None``
            (default): estimated by ``estimate_layer_costs`` from the layers.
        timeout: timeout of the process group's collectives and point-to-point operations, in seconds or as a
            ``timedelta`` (default 30 s: a hung peer is noticed fast; the supervisor's heartbeat usually
            notices it sooner).
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; ``None`` (default): NCCL on CUDA, else gloo.
        heartbeat: seconds between heartbeats written to the store (the supervisor's ``hang_timeout`` decides
            when a silent worker is lost).
        hang_timeout: under a plain ``python train.py`` (this process supervises ``devices`` workers): seconds
            without a heartbeat after which a worker is killed and lost (``--hang-timeout`` of the CLI).
        failure_wait: seconds a member that saw a communication error waits for the supervisor to publish
            the next generation before it treats the error as a real one and raises it.
        checkpoint_every_n_steps: take an asynchronous ``torch.distributed.checkpoint`` every N steps, for the
            checkpoint fallback (a loss redundancy cannot cover); ``None`` (default): no checkpoints, and
            such a loss ends the job. Needs ``checkpoint_dir``.
        checkpoint_dir: folder of those checkpoints (each job writes under ``<checkpoint_dir>/<job id>``);
            on several machines, a filesystem every worker sees.
        keep_checkpoints: complete checkpoints kept (older ones are deleted).
        drain_on_sigterm: a SIGTERM to a worker (what spot agents, Kubernetes and ``docker stop`` send)
            drains it one step boundary later, an announced departure: a
            :class:`~lightning_bamboo.callbacks.BambooNotices` is added when the trainer has none. ``False``:
            Lightning's own SIGTERM handling, which ends the worker (the job then fails over, or stops).
        keyed_rng: ``True`` (default): every training forward (F, FR, a replayed or re-run step) draws its
            random numbers (dropout) from generators keyed by (seed, step, pipeline, micro-batch, layer),
            restored afterwards (:mod:`lightning_bamboo.keyed_rng`); ``False``: from each process's global
            generators (FR then differs from F under dropout, and a replay from the first run).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for every
            Lightning ``ParallelStrategy`` (normally set by the Trainer).
    """

    strategy_name = "bamboo"
    is_distributed = True
    restore_checkpoint_after_setup = True  # stages and optimizers must exist before their shards load

    # the parts' public state, read-only here
    owners = _part("_gen.owners", "The current generation's ownership map (``None`` before setup).")
    view = _part("_gen.view", "This member's view of the current generation (groups, positions).")
    groups = _part("_gen.view", "The same object as ``view`` (its process groups).")
    engine = _part("_gen.engine", "The engine running this member's stages' schedule.")
    replica = _part("_gen.replica", "The successor stage's layers this member keeps current (or ``None``).")
    replica_sync = _part("_gen.replica_sync", "What keeps ``replica`` equal to the successor's stage.")
    num_stages = _part("_formation.num_stages", "Pipeline length the job started with.")
    num_microbatches = _part("_formation.num_microbatches", "Micro-batches per step and pipeline at start.")
    redundancy = _part("_formation.redundancy", "Whether every stage holds a replica of its successor.")
    global_microbatches = _part(
        "_formation.global_microbatches",
        "How many micro-batches each global batch is cut into: ``num_microbatches`` x the pipelines the job "
        "started with, fixed for the job (each pipeline runs a consecutive share; dropout masks are keyed by "
        "the index in the global batch, :mod:`lightning_bamboo.keyed_rng`).",
    )
    forward_redundancy = _part(
        "_formation.forward_redundancy",
        "Whether steps run the replica forwards (``FR``) now: ``redundancy`` unless "
        ":meth:`set_forward_redundancy` switched them off.",
    )
    stage_layers = _part("_formation.stage_layers", "Stage -> its layers of the body (set at setup).")
    member = _part("_gen.member", "This worker's id in the job (stable across generations).")
    pipeline_length = _part("_gen.pipeline_length", "Positions of this member's pipeline now.")
    num_pipelines = _part("_gen.num_pipelines", "Pipelines of the current generation.")
    pipeline_index = _part("_gen.pipeline_index", "This member's pipeline's position among them.")
    stage_index = _part("_gen.stage_index", "The first original stage this member holds.")
    elastic = _part("_membership.elastic", "Whether a lost worker is survived (a Bamboo supervisor runs it).")
    process_group_backend = _part("_membership.backend", "``gloo``, ``nccl``, ... (chosen at setup).")
    failovers = _part("_membership.failovers", "(old map, new map) of every re-form in this fit.")
    departed = _part("_membership.departed", "This member left by an announced departure.")
    drain_timer = _part("_membership.drain_timer", "Timings of the drains seen here.")
    session = _part("_session", "The step session (:class:`~lightning_bamboo.step_session.StepSession`).")
    full_forward = _part("_session.full_forward", "The whole body's output, collective over the pipeline.")
    set_forward_redundancy = _part("_session.set_forward_redundancy", "Switch ``FR`` at a step boundary.")
    emit = _part("_events.emit", "Fire Bamboo event ``name`` on the trainer's callbacks (:mod:`.events`).")
    drain = _part(
        "_membership.drain",
        "Take ``ranks`` out of training at this step boundary (called on every rank with the same ranks by "
        ":class:`~lightning_bamboo.callbacks.BambooNotices`): an announced departure under a supervisor, "
        "else checkpoint and stop (:func:`lightning_bamboo.events.drain_with_checkpoint`).",
    )

    def __init__(
        self,
        num_stages: int = 2,
        num_microbatches: int = 4,
        redundancy: bool = True,
        replica_device: Literal["same", "cpu"] = "same",
        pipeline_attr: str | None = None,
        layer_costs: Sequence[float] | None = None,
        timeout: float | timedelta | None = 30.0,
        process_group_backend: str | None = None,
        heartbeat: float = 0.25,
        hang_timeout: float = 5.0,
        failure_wait: float = 30.0,
        checkpoint_every_n_steps: int | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        keep_checkpoints: int = 2,
        drain_on_sigterm: bool = True,
        keyed_rng: bool = True,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        wiring.check_options(num_stages, num_microbatches, redundancy, replica_device, keyed_rng)
        fb.check_options(checkpoint_every_n_steps, checkpoint_dir, keep_checkpoints)
        self._replica_device_option = replica_device
        self._pipeline_attr = pipeline_attr
        self._layer_costs = list(layer_costs) if layer_costs is not None else None
        self._timeout = timedelta(seconds=timeout) if isinstance(timeout, (int, float)) else timeout
        self._checkpoint_every = checkpoint_every_n_steps
        self._heartbeat_interval = heartbeat
        self._hang_timeout = hang_timeout
        self.drain_on_sigterm = drain_on_sigterm
        self.num_nodes = 1  # Lightning's connector sets it
        # who this process is: a worker of a Bamboo job (its supervisor's environment), or a rank of a job
        # an outside launcher started (fixed membership, ``_env`` None)
        self._env = ms.WorkerEnv.from_env()
        self._rng_at_start = torch.get_rng_state()  # set again when an entry point starts (setup_environment)
        self._entries = 0  # fit/validate/test/predict calls in this process (each its own store prefix)
        self._loaded = CheckpointLoad()
        # the parts (before Lightning's __init__: its precision setter hands the session's clipping on)
        self._events = Events(lambda: self.lightning_module and self.lightning_module.trainer)
        self._formation = Formation(
            num_stages, num_microbatches, redundancy, keyed_rng, self._timeout,
            device=lambda: self.root_device, replica_device=lambda: self.replica_device,
        )
        self._gen = Generation(num_stages=num_stages)
        lightning = LightningSide(
            module=lambda: self.lightning_module,  # type: ignore[arg-type,return-value]
            optimizer=lambda: self.optimizers[0],
            schedulers=lambda: self.lr_scheduler_configs,
            device=lambda: self.root_device,
            ranks_changed=self.set_world_ranks,
        )
        self._session = StepSession(
            self._gen, self._formation, self._events,
            trainer=lambda: self.lightning_module.trainer,  # type: ignore[union-attr]
            precision=lambda: self.precision_plugin, device=lambda: self.root_device,
        )
        self._formation.before_action = self._session.before_action
        self._fallback = Fallback(checkpoint_every_n_steps, checkpoint_dir, keep_checkpoints, self._formation,
                                  self._gen, self._session, self._events, lightning)
        self._membership = Membership(self._env, self._formation, self._gen, self._session, self._fallback,
                                      self._events, lightning, failure_wait, self._timeout)
        self._membership.backend = process_group_backend
        self._session.runtime = self._membership
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
        """Rank 0 of the current generation; never a member that drained (it is no rank of the job any more,
        while the member that became rank 0 is)."""
        return self._membership.rank == 0 and not self._membership.left

    @property
    @override
    def world_size(self) -> int:
        # a joiner's setup and the start of its first batch run while the others are inside that step: it
        # joins no per-batch collective there (Lightning broadcasts a SIGTERM flag when world_size > 1)
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
        return torch.device("cpu") if self._replica_device_option == "cpu" else self.root_device

    @property
    def store(self) -> dist.Store:
        """The job's store (membership, commits; the supervisor holds it)."""
        if self._membership.store is None:
            raise RuntimeError("the store is connected in setup_distributed")
        return self._membership.store

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Training and evaluation: every member loads the global batch (``training_step`` takes its
        pipeline's share; a failover changes the shares, not the samples of a step). Prediction (no failover
        to plan for): each pipeline predicts its own shard, as DDP ranks do."""
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
        """A plain ``python train.py`` with ``devices=N`` becomes the supervisor of N workers
        (:mod:`lightning_bamboo.elastic.script_launcher`); a worker of a Bamboo job launches nothing; under
        an outside launcher (torchrun, SLURM, ...), on several nodes or in one process the ranks are fixed."""
        self._launcher = None
        env = self.cluster_environment
        processes = len(self.parallel_devices or [])
        if self._env is not None or (env is not None and env.creates_processes_externally):
            return
        if processes * self.num_nodes <= 1:
            return
        if self.num_nodes > 1:
            assert env is not None
            self._launcher = _private.SubprocessScriptLauncher(env, processes, self.num_nodes)
            return
        preflight = functools.partial(
            checked_module, pipeline_attr=self._pipeline_attr, num_stages=self.num_stages,
            costs=self._layer_costs,
        )
        self._launcher = SupervisorLauncher(processes, self._hang_timeout, preflight=preflight)

    @override
    def set_world_ranks(self) -> None:
        """Lightning's rank-zero-only parts follow this member's rank (it changes with the generation)."""
        members = self._membership
        if self._env is None and self.cluster_environment is not None and self._gen.owners is None:
            processes = len(self.parallel_devices or [])
            self.cluster_environment.set_global_rank(self.node_rank * processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * processes)
            members.rank = members.member = self.cluster_environment.global_rank()
            members.world = members.nproc = self.cluster_environment.world_size()
            if members.nproc > 1:  # devices=1 may be one worker of the launch CLI: checked at fit
                wiring.check_world_size(members.nproc, self._formation.num_stages)
        wiring.set_rank_zero(members.rank)

    @override
    def setup_environment(self) -> None:
        """Connect to the job's store (the supervisor's, or one served by rank 0 under an outside launcher),
        start the heartbeat; the process group comes with the generation."""
        # the global generator as fit found it, before reset_seed: what "auto"'s RandomSampler draws from
        self._rng_at_start = torch.get_rng_state()
        super().setup_environment()
        reset_seed()
        members = self._membership
        self._entries += 1  # entry points of this strategy object (a later one reuses the layout)
        members.backend = members.backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
        if self._env is None:
            self.set_world_ranks()
            wiring.check_world_size(members.nproc, self._formation.num_stages)
        base = wiring.connect(self._env, self.cluster_environment, members.rank, members.nproc, self._timeout)
        entry = wiring.next_entry(base)
        if self._env is None and entry == 1 and members.nproc > 1:  # once per job, at its first entry point
            rank_zero_info(
                "Bamboo: the ranks were started by an outside launcher (or Lightning's, on several "
                "nodes): a lost worker ends the job. Surviving it needs Bamboo's launcher: start the "
                "script plainly (python train.py, Trainer(devices=N)) or with python -m "
                "lightning_bamboo.launch"
            )
        # the first Trainer entry point of a supervised worker is the elastic one; any later one (a test after
        # the fit, a second Trainer) runs on the layout it finds, under its own prefix of the store
        elastic = self._env is not None and entry == 1
        members.start(base if entry == 1 else dist.PrefixStore(f"entry{entry}", base), elastic,
                      self._heartbeat_interval)
        if elastic:
            assert self._env is not None and self.lightning_module is not None
            trainer = self.lightning_module.trainer
            if not self._env.joining:
                timeout = self._timeout.total_seconds() if self._timeout is not None else 30.0
                wiring.open_shared_loggers(trainer, self.store, members.nproc, members.rank, timeout)
            # generation 0's rank before it forms (members 0..N-1 in order; a joiner's id is >= N), so
            # Lightning's rank-zero-only parts (progress bar, logging) start on one member only
            members.rank = members.member
            self.set_world_ranks()
            wiring.watch_sigterm(trainer, self.drain_on_sigterm)

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        module, formation, members, gen = self.lightning_module, self._formation, self._membership, self._gen
        fitting = trainer.state.fn == TrainerFn.FITTING
        wiring.check_setup(trainer, module, self.precision_plugin, self._checkpoint_every)
        fresh = formation.seam is None or module._modules.get(formation.body_attr) is not formation.seam
        if fresh:
            self._loaded.group_names = wiring.param_group_names(module) if fitting else None
            formation.prepare(module, self._pipeline_attr, self._layer_costs, self.precision_plugin,
                              self._loaded.group_names)
        assert formation.seam is not None
        formation.seam.attach(module)  # the one seam: the body and the two hooks, until teardown
        if self._env is not None and self._env.joining and members.elastic:  # a joiner: no process group yet
            members.joining_setup = True
            self._setup_model_and_optimizer(trainer, module)
            return
        owners = members.generation_zero() if gen.owners is None else gen.owners
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
        if len(self.optimizers) != 1:
            raise ValueError(
                f"BambooStrategy supports exactly one optimizer, configure_optimizers returned "
                f"{len(self.optimizers)}"
            )
        assert self._formation.seam is not None
        self._formation.regroup_ties(self.optimizers[0], self._formation.seam)
        self.setup_precision_plugin()  # its norm clipping applies the plan agreed before the commit
        _private.optimizers_to_device(self.optimizers, self.root_device)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """The training loader's position in the epoch becomes checkpoint state, and a joiner's loader starts
        at the batch the job is at (:mod:`.progress`)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training:
            return dataloader
        if isinstance(dataloader, DataLoader):
            source = _private.train_loader_source(trainer)
            agreed_rng_state = functools.partial(wiring.agreed_rng_state, self.store, self._rng_at_start)
            dataloader = in_written_order(dataloader, source, agreed_rng_state)
        members = self._membership
        if members.joining_setup and members.skip is None:
            # how many batches to skip is known when the joiner forms (on_train_start, before the first fetch)
            loader = skip_first_batches(dataloader, 0)  # type: ignore[arg-type]
            members.skip = loader.batch_sampler
            return loader
        return resumable(dataloader)

    # ------------------------------------------------------------------ training
    @override
    def on_train_start(self) -> None:
        """A joiner joins now; a last batch the micro-batches cannot split evenly is refused now, not at the
        epoch's end."""
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        _private.restore_loader_states(trainer.fit_loop)  # mid-epoch position, also after an early estimate
        if self._env is not None and self._env.joining and self._gen.owners is None:
            members = self._membership  # the job's step count comes with the joiner's progress
            members.joins.join(trainer, members.begin, members.formed, members.skip)
        elif not self._events.muted:
            self._session.step = trainer.global_step  # a resumed fit goes on counting (checkpoints, keys)
        # the job's fixed split: num_microbatches x the pipelines at its start, whatever is alive now
        formation = self._formation
        starting = formation.global_microbatches // formation.num_microbatches
        check_train_batches(trainer.train_dataloader, formation.num_microbatches, starting)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Remember the batches of the step in progress (more than one with ``accumulate_grad_batches``): a
        failover mid-step runs them again on the next generation."""
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
        self._session.add_stashed_grads()
        self._session.window_done += 1
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
        """The two-phase step (:meth:`StepSession.two_phase`), after forming a generation the last commit
        adopted (a join, or a peer lost after it) and taking a periodic checkpoint when one is due."""
        session, members = self._session, self._membership
        session.in_step = session.step
        members.join_at_boundary()
        self._fallback.maybe_checkpoint(members.member)

        def lightning_step(closure: Callable[[], Any]) -> Any:
            return super(BambooStrategy, self).optimizer_step(optimizer, closure, model, **kwargs)

        return session.two_phase(optimizer, closure, lightning_step)

    # ------------------------------------------------------------------ evaluation and prediction
    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return _evaluate(self, "validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return _evaluate(self, "test_step", args, kwargs)

    @override
    def on_validation_end(self) -> None:
        for created in self._membership.created_during_eval:
            created.training = True
        self._membership.created_during_eval = []
        super().on_validation_end()

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Forward-only pipeline over the batch; replays ``predict_step`` with the whole body's outputs.

        The last stage's outputs are broadcast over the pipeline, so every rank returns the predictions of
        its pipeline's batches (each pipeline predicts its own shard of the data, as every DDP rank does).
        """
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
        """Write a sharded checkpoint directory atomically (temporary directory, then rename)."""
        if storage_options is not None:
            raise TypeError("BambooStrategy.save_checkpoint does not take storage_options")
        # pipeline 0's members write their param groups' names; one file per member, named by its first
        # stage (a member holding several stages after a failover lists all their parameters in it)
        stage = self.stage_index if self.pipeline_index == 0 else None
        if self._formation.ties:
            checkpoint[ckpt.TIED_KEY] = aliases(self._formation.ties, self._formation.body_attr)
        ckpt.save_sharded(checkpoint, filepath, self.is_global_zero, self.barrier, stage=stage)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """This member's stages, their optimizer state and the trainer state, from a Bamboo checkpoint folder
        or an ordinary Lightning ``.ckpt`` (:mod:`lightning_bamboo.checkpoint.loading`)."""
        assert self.lightning_module is not None
        tied = aliases(self._formation.ties, self._formation.body_attr)
        return self._loaded.load(checkpoint_path, self.lightning_module, self.optimizers, tied)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        assert self.lightning_module is not None
        self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)
        self._loaded.load_replica(self._gen.replica, self._formation.body_attr, None)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        assert self.lightning_module is not None
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            ckpt.load_named_optimizer_state(self.lightning_module, optimizer, state)
        # the replica of the successor stage is in the same checkpoint: load it rather than transfer it
        if self._gen.replica_optimizer is not None:
            gen = self._gen
            self._loaded.load_replica(gen.replica, self._formation.body_attr, gen.replica_optimizer)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            ckpt.remove(filepath)

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: str | None = None) -> None:
        if self._membership.joining_setup or not dist.is_initialized():
            return  # a joiner's setup runs while the others train: nobody to meet
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        """Broadcast a JSON-representable value (paths, numbers) as bytes; nothing is pickled."""
        if self._membership.joining_setup or not dist.is_initialized():
            return obj
        return broadcast_json(obj, src, self.root_device)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if self._membership.joining_setup or not isinstance(tensor, Tensor):
            return tensor
        return _private.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ the end
    @override
    def on_exception(self, exception: BaseException) -> None:
        """``fit`` ends with ``exception``: unless a lost peer caused it, record it in the job's store, so the
        supervisor stops the job with it instead of failing over (:mod:`lightning_bamboo.elastic.crash`)."""
        super().on_exception(exception)
        record_exception(self._membership.store, self._membership.member, exception)

    @override
    def teardown(self) -> None:
        """Tell the supervisor this member is done (its heartbeat stops now), leave the process group."""
        self._fallback.finish()  # a write in flight finishes before the process exits
        self._membership.finish()
        # the process group stays (trainer.save_checkpoint after fit is collective) until the next entry
        # point forms its own, or the interpreter exits (a gloo group left to shutdown can abort the process)
        global _DESTROY_AT_EXIT
        if not _DESTROY_AT_EXIT:
            atexit.register(_destroy_process_group)
            _DESTROY_AT_EXIT = True
        if self._formation.seam is not None and self.lightning_module is not None:
            self._formation.seam.detach(self.lightning_module)  # the user's hooks; the body keeps the stage
        ParallelStrategy.teardown(self)
        members = self._membership
        if members.departed and not members.left:
            # a drained member's ``fit`` has ended (teardown hooks ran, loggers were finalized): end the
            # process with exit code 0 instead of returning into the script (BambooDeparted says why)
            members.left = True
            wiring.set_rank_zero(-1)
            raise BambooDeparted(members.member, self._session.step)

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


_DESTROY_AT_EXIT = False  # _destroy_process_group is registered with atexit (once per process)


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _evaluate(strategy: BambooStrategy, hook: str, args: tuple, kwargs: dict[str, Any]) -> Any:
    """A validation/test step: the forward-only pipeline over the batch's micro-batches
    (:meth:`StepSession.evaluate`), then ``hook`` replayed with the loss."""
    module, plugin = strategy.lightning_module, strategy.precision_plugin
    assert module is not None
    context = plugin.val_step_context() if hook == "validation_step" else plugin.test_step_context()
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
