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
what happens next (failover, rejoin, fallback, drain) is :mod:`lightning_bamboo.elastic.runtime`.

Data: every member loads the GLOBAL batch (the sampler is not sharded; ``batch_size`` is the global batch) and
takes the share of its pipeline under the current layout, so the samples of a step do not depend on how many
pipelines exist.
"""

from __future__ import annotations

import atexit
import base64
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.callbacks import Checkpoint, StochasticWeightAveraging
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_bamboo import _private
from lightning_bamboo.broadcast import broadcast_batch, broadcast_json
from lightning_bamboo.callbacks import BambooMetrics, BambooNotices
from lightning_bamboo.checkpoint import periodic as fb
from lightning_bamboo.checkpoint import sharded as ckpt
from lightning_bamboo.clipping import ClipPlan
from lightning_bamboo.contract import (
    _STAGE_MARK,
    check_contract,
    check_stage_split,
    find_pipeline_body,
    warn_batch_statistics,
)
from lightning_bamboo.data_order import in_written_order
from lightning_bamboo.elastic import commit as commit_protocol
from lightning_bamboo.elastic import store as ms
from lightning_bamboo.elastic.cutter import GenerationCutter
from lightning_bamboo.elastic.drain import BambooDeparted, DrainTimer
from lightning_bamboo.elastic.formation import GenerationFormation
from lightning_bamboo.elastic.ownership import OwnershipMap
from lightning_bamboo.elastic.reshard import LayerState
from lightning_bamboo.elastic.runtime import ElasticRuntime
from lightning_bamboo.elastic.script_launcher import SupervisorLauncher
from lightning_bamboo.events import BambooEventsMixin
from lightning_bamboo.pipeline.engine import PipelineEngine
from lightning_bamboo.pipeline.layout import StageLayout, estimate_layer_costs
from lightning_bamboo.pipeline.microbatch import (
    batch_size_of,
    check_train_batches,
    join_microbatches,
    split_microbatches,
)
from lightning_bamboo.pipeline.view import PipelineView
from lightning_bamboo.precision import with_pipeline_clipping
from lightning_bamboo.progress import resumable, skip_first_batches
from lightning_bamboo.rank_zero import RankZeroDuties
from lightning_bamboo.replica import ReplicaSync
from lightning_bamboo.schedule import Action, ActionKind
from lightning_bamboo.seam import StageBody
from lightning_bamboo.step import PipelinedStep
from lightning_bamboo.ties import Tie, TiedGradient, aliases, find_ties, first_use_groups, untie

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

_STORES: dict[str, dist.Store] = {}
_ENTRIES: dict[int, int] = {}


def _process_store(key: str, connect: Callable[[], dist.Store]) -> dist.Store:
    """One connection per store and process: rank 0 serves the TCPStore once (a second server on the same
    port would fail), and every Trainer of the process uses it under its own prefix (:func:`_next_entry`)."""
    if key not in _STORES:
        _STORES[key] = connect()
    return _STORES[key]


def _next_entry(store: dist.Store) -> int:
    """The number of this entry point (fit, validate, ...) on ``store`` in this process: every process of a
    job runs the same sequence of Trainer calls, so they agree on it without talking."""
    _ENTRIES[id(store)] = _ENTRIES.get(id(store), 0) + 1
    return _ENTRIES[id(store)]


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
    optimizers, _ = _private.init_optimizers(module)
    if not optimizers:
        return []
    names = {id(p): n for n, p in module.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in optimizers[0].param_groups]


class BambooStrategy(ElasticRuntime, GenerationFormation, PipelinedStep, BambooEventsMixin, ParallelStrategy):
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
        fb.check_options(checkpoint_every_n_steps, checkpoint_dir, keep_checkpoints)
        if not isinstance(keyed_rng, bool):
            raise TypeError(f"keyed_rng must be True or False, got {keyed_rng!r}")
        self._keyed_rng = keyed_rng
        self._num_stages = num_stages
        self._num_microbatches = num_microbatches
        # global micro-batches per step: num_microbatches x the pipelines of generation 0, fixed for the job
        self._global_microbatches = num_microbatches
        self._redundancy = redundancy
        self._forward_redundancy = redundancy  # FR in the schedule (set_forward_redundancy switches it off)
        self._replica_device_option = replica_device
        self._pipeline_attr = pipeline_attr
        self._layer_costs = list(layer_costs) if layer_costs is not None else None
        self._timeout = timedelta(seconds=timeout) if isinstance(timeout, (int, float)) else timeout
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self._checkpoint_options = (checkpoint_every_n_steps, checkpoint_dir, keep_checkpoints)
        self._heartbeat_interval = heartbeat
        self._hang_timeout = hang_timeout
        self._failure_wait = failure_wait
        self.drain_on_sigterm = drain_on_sigterm
        # who this process is: a worker of a Bamboo job (its supervisor's environment), or a rank of a job
        # an outside launcher started (fixed membership, ``_env`` None)
        self._env = ms.WorkerEnv.from_env()
        self._member = self._env.member if self._env is not None else 0
        self._nproc = self._env.nproc if self._env is not None else 1
        self._elastic = self._env is not None  # a supervisor publishes generations (set per fit in setup)
        self._store: dist.Store | None = None
        self._rng_at_start = torch.get_rng_state()  # set again when an entry point starts (setup_environment)
        self._entries = 0  # fit/validate/test/predict calls in this process (each its own store prefix)
        self._heartbeat: ms.Heartbeat | None = None
        self._cutter: GenerationCutter | None = None
        # the layout and this member's part of it
        self.owners: OwnershipMap | None = None
        self.view: PipelineView | None = None
        self.groups: PipelineView | None = None
        self.engine: PipelineEngine | None = None
        self.replica: nn.Module | None = None
        self.replica_sync: ReplicaSync | None = None
        # a worker counts as its member id until generation 0 forms, so Lightning's rank-zero-only output
        # while the Trainer is built and fit starts (tips, device summary, warnings) comes from member 0 only
        self._rank = self._member
        self._world = 1
        self._body_attr: str = pipeline_attr or "pipeline"
        self._stage_module: StageBody | None = None  # the seam in the user's body's place (.seam)
        self._body_length = 0
        self._layers: dict[int, nn.Module] = {}
        self._ties: list[Tie] = []  # parameters used by several layers of the body (lightning_bamboo.ties)
        self._tied: list[TiedGradient] = []  # this generation's reductions of their gradients
        self._tie_groups: dict[str, int | None] = {}  # a later use's name -> its tie's param group under auto
        self._held: dict[int, LayerState] = {}
        self._stage_layers: tuple[range, ...] = ()
        self._replica_optimizer: Optimizer | None = None
        # the step in progress
        self._step = 0
        self._stashed_grads: list[Tensor | None] | None = None
        self._clip_plan: ClipPlan | None = None
        self._window: list[tuple[int, Any]] = []  # (batch_idx, batch) since the last step: accumulation
        self._window_done = 0  # of those, how many have their gradients accumulated
        self._window_buffers: list[tuple[Tensor, Tensor]] = []  # buffers as they were when the window began
        # checkpoints: Lightning's (sharded folders) and the fallback's (periodic DCP)
        self._checkpointer: fb.PeriodicCheckpointer | None = None
        # steps since the last complete checkpoint: at most 2N-1 before the step in progress (one write in
        # flight), plus the step in progress
        self._ring = fb.BatchRing(2 * checkpoint_every_n_steps + 1 if checkpoint_every_n_steps else 0)
        self._loaded_path: Path | None = None
        self._loaded_whole: dict[str, Any] | None = None  # an ordinary .ckpt's whole model, for the replica
        self._whole_group_names: list[list[str]] | None = None
        # membership changes (lightning_bamboo.elastic.runtime)
        self._in_step = 0
        self._rerunning = False
        self._created_during_eval: list[nn.Module] = []
        self.failovers: list[tuple[OwnershipMap, OwnershipMap]] = []
        self._join_adopted = False  # the last commit adopted a join: form it at the next step boundary
        self._fallback_path = ""  # the checkpoint folder the last fallback loaded (on_fallback's payload)
        self._lost_since: float | None = None  # a peer lost after a commit: when (formed at the boundary)
        self._joining_setup = False  # a joiner before its first step: no collective with the running job
        self._skip: Any = None  # a joiner's training batch sampler (progress.SkipFirstBatches)
        self.departed = False  # this member left by an announced departure (it stops after its last step)
        self._rank_zero = RankZeroDuties()  # rows and progress bar, when this member becomes rank 0
        self._left = False  # a departed member's fit has ended: it is no rank of the job any more
        self.drain_timer = DrainTimer()

    # ------------------------------------------------------------------ properties
    @property
    def num_stages(self) -> int:
        return self._num_stages

    @property
    def num_microbatches(self) -> int:
        return self._num_microbatches

    @property
    def global_microbatches(self) -> int:
        """How many micro-batches each global batch is cut into: ``num_microbatches`` x the pipelines the
        job started with, fixed for the job. Each pipeline runs a consecutive share of them (more each after
        a pipeline is lost), and their dropout masks are keyed by their index in the global batch
        (:mod:`lightning_bamboo.keyed_rng`), so they do not depend on how many pipelines share the batch."""
        return self._global_microbatches

    @property
    def redundancy(self) -> bool:
        return self._redundancy

    @property
    def forward_redundancy(self) -> bool:
        """Whether steps run the replica forwards (``FR``) now: ``redundancy`` unless
        :meth:`set_forward_redundancy` switched them off."""
        return self._forward_redundancy

    @property
    def stage_layers(self) -> tuple[range, ...]:
        """Stage -> its layers of the pipeline body (planned at setup; empty before)."""
        return self._stage_layers

    @property
    def elastic(self) -> bool:
        """Whether a lost worker is survived (a Bamboo supervisor runs the job)."""
        return self._elastic

    @property
    def store(self) -> dist.Store:
        """The job's store (membership, commits; the supervisor holds it)."""
        if self._store is None:
            raise RuntimeError("the store is connected in setup_distributed")
        return self._store

    @property
    @override
    def global_rank(self) -> int:
        return self._rank

    @property
    @override
    def is_global_zero(self) -> bool:
        """Rank 0 of the current generation; never a member that drained (it is no rank of the job any more,
        while the member that became rank 0 is)."""
        return self._rank == 0 and not self._left

    @property
    @override
    def world_size(self) -> int:
        # a joiner's setup and the start of its first batch run while the others are inside that step: it
        # joins no per-batch collective there (Lightning broadcasts a SIGTERM flag when world_size > 1)
        return 1 if self._joining_setup else self._world

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
    def member(self) -> int:
        """This worker's id in the job (stable across generations; a joiner's is >= the initial count)."""
        return self._member

    @property
    def pipeline_length(self) -> int:
        """Positions of this member's pipeline now (shorter than ``num_stages`` after a failover)."""
        return self.view.num_positions if self.view is not None else self._num_stages

    @property
    def num_pipelines(self) -> int:
        return len(self.owners.pipelines) if self.owners is not None else 1

    @property
    def pipeline_index(self) -> int:
        if self.owners is None:
            return 0
        return self.owners.pipeline_ids().index(self.owners.pipeline_of(self.member))

    @property
    def stage_index(self) -> int:
        """The first original stage this member holds."""
        if self.owners is None:
            return self._member % self._num_stages
        return self.owners.stages_of(self.member)[0]

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
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Training and evaluation: every member loads the global batch (``training_step`` takes its
        pipeline's share; a failover changes the shares, not the samples of a step). Prediction (no failover
        to plan for): each pipeline predicts its own shard, as DDP ranks do."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.predicting and self.owners is not None:
            return {"num_replicas": self.num_pipelines, "rank": self.pipeline_index}
        return {"num_replicas": 1, "rank": 0}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    # ------------------------------------------------------------------ launching
    @override
    def _configure_launcher(self) -> None:
        """A plain ``python train.py`` with ``devices=N`` becomes the supervisor of N workers
        (:mod:`lightning_bamboo.elastic.script_launcher`); a worker of a Bamboo job launches nothing; under
        an outside
        launcher (torchrun, SLURM, ...), on several nodes or in one process the ranks are fixed."""
        self._launcher = None
        if self._env is not None:
            return
        env = self.cluster_environment
        external = env is not None and env.creates_processes_externally
        if external or self.num_processes * self.num_nodes <= 1:
            return
        if self.num_nodes > 1:
            assert env is not None
            self._launcher = _private.SubprocessScriptLauncher(env, self.num_processes, self.num_nodes)
            return
        self._launcher = SupervisorLauncher(self.num_processes, self._hang_timeout, preflight=self._preflight)

    @override
    def setup_environment(self) -> None:
        # the global generator as fit found it, before reset_seed: what "auto"'s RandomSampler draws from
        self._rng_at_start = torch.get_rng_state()
        super().setup_environment()
        self.setup_distributed()

    def _agreed_rng_state(self) -> Tensor:
        """The global generator's state at the start of ``fit`` as the first member to ask had it, so every
        member (a joiner too) draws ``auto``'s shuffle from the same state (:mod:`.data_order`)."""
        assert self._store is not None
        mine = base64.b64encode(self._rng_at_start.numpy().tobytes()).decode()
        agreed = self._store.compare_set("data/rng_at_start", "", mine).decode()
        return torch.frombuffer(bytearray(base64.b64decode(agreed)), dtype=torch.uint8)

    @override
    def set_world_ranks(self) -> None:
        """Lightning's rank-zero-only parts follow this member's rank (it changes with the generation)."""
        if self._env is None and self.cluster_environment is not None and self.owners is None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
            self._rank = self._member = self.cluster_environment.global_rank()
            self._world = self._nproc = self.cluster_environment.world_size()
            if self._nproc > 1:  # devices=1 may be one worker of the launch CLI: checked at fit
                self._check_world_size()
        rank_zero_only.rank = utils_rank_zero_only.rank = self._rank  # type: ignore[attr-defined]

    def _check_world_size(self) -> None:
        if self._nproc % self._num_stages != 0:
            hint = (
                " (one process: set Trainer(devices=N), or start workers with python -m "
                "lightning_bamboo.launch --nproc N)" if self._nproc == 1 else ""
            )
            raise ValueError(
                f"num_stages ({self._num_stages}) does not divide world_size ({self._nproc}): "
                f"{self._nproc} % {self._num_stages} = {self._nproc % self._num_stages}; "
                f"world_size must be num_stages x num_pipelines{hint}"
            )

    def setup_distributed(self) -> None:
        """Connect to the job's store (the supervisor's, or one served by rank 0 under an outside launcher),
        start the heartbeat; the process group comes with the generation."""
        reset_seed()
        self._entries += 1  # entry points of this strategy object (a later one reuses the layout)
        self._process_group_backend = self._process_group_backend or (
            "nccl" if self.root_device.type == "cuda" else "gloo"
        )
        if self._env is None:
            self.set_world_ranks()
            self._check_world_size()
        base = self._connect()
        entry = _next_entry(base)
        if self._env is None and entry == 1 and self._nproc > 1:  # once per job, at its first entry point
            rank_zero_info(
                "Bamboo: the ranks were started by an outside launcher (or Lightning's, on several "
                "nodes): a lost worker ends the job. Surviving it needs Bamboo's launcher: start the "
                "script plainly (python train.py, Trainer(devices=N)) or with python -m "
                "lightning_bamboo.launch"
            )
        # the first Trainer entry point of a supervised worker is the elastic one; any later one (a test after
        # the fit, a second Trainer) runs on the layout it finds, under its own prefix of the store
        self._elastic = self._env is not None and entry == 1
        self._store = base if entry == 1 else dist.PrefixStore(f"entry{entry}", base)
        if self._elastic:
            assert self._env is not None
            self._heartbeat = ms.Heartbeat(self._env, self._heartbeat_interval)
            self._cutter = GenerationCutter(self._env)
            if not self._env.joining:
                self._open_shared_loggers()
            # generation 0's rank before it forms (members 0..N-1 in order; a joiner's id is >= N), so
            # Lightning's rank-zero-only parts (progress bar, logging) start on one member only
            self._rank = self._member
            self.set_world_ranks()
            self._watch_sigterm()

    def _connect(self) -> dist.Store:
        """The job's store: the supervisor's; else one TCPStore served by rank 0 (``MASTER_ADDR``/``PORT``,
        through torch's ``tcp://`` rendezvous, which joins torchrun's agent store when it runs one); a single
        process keeps it in memory. One connection per process, whatever the number of Trainers in it."""
        if self._env is not None:
            url, job = self._env.store_url, self._env.job
            return _process_store(f"{url}/{job}", lambda: ms.connect(url, job))
        if self._nproc == 1:
            return _process_store("local", dist.HashStore)
        env = self.cluster_environment
        assert env is not None
        url = f"tcp://{env.main_address}:{env.main_port}?rank={self._rank}&world_size={self._nproc}"

        def rendezvous() -> dist.Store:
            store, _, _ = next(dist.rendezvous(url, timeout=self._timeout))
            return dist.PrefixStore("bamboo", store)

        return _process_store(url, rendezvous)

    def _watch_sigterm(self) -> None:
        """With ``drain_on_sigterm``, make sure a :class:`BambooNotices` watches for SIGTERM (added before
        Lightning's ``setup`` hooks). It goes before ``BambooMetrics`` (a drain is counted in its step's
        metrics) and the checkpoint callbacks (Lightning keeps those last); other callbacks keep their order.
        """
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if not self.drain_on_sigterm or trainer is None:
            return
        callbacks = trainer.callbacks
        if not any(isinstance(callback, BambooNotices) for callback in callbacks):
            after = [i for i, c in enumerate(callbacks) if isinstance(c, (BambooMetrics, Checkpoint))]
            callbacks.insert(after[0] if after else len(callbacks), BambooNotices())

    def _open_shared_loggers(self) -> None:
        """Give every member of generation 0 the same logger version, opened, so whichever member is rank 0
        after a failover logs on into the run's one folder (one version per run, every step once).

        Every member reads its loggers' next free version before any creates a folder (a store barrier), then
        opens the logger (``experiment``: CSVLogger's writer, which would delete a ``metrics.csv`` it found
        if it were first opened after a failover) before anything is logged (a second barrier). Loggers open
        their experiment on rank zero only, so every member counts as rank zero while it opens its own (a
        worker otherwise counts as its member id until generation 0 forms, see ``__init__``).
        """
        assert self.lightning_module is not None and self._store is not None
        loggers = self.lightning_module.trainer.loggers
        for logger in loggers:
            _ = logger.version  # CSV/TensorBoard: the next free version; nothing is created yet
        timeout = self._timeout.total_seconds()
        ms.store_barrier(self._store, "loggers/versions_read", self._nproc, timeout)
        rank_zero_only.rank = utils_rank_zero_only.rank = 0  # type: ignore[attr-defined]
        try:
            for logger in loggers:
                _ = logger.experiment
        finally:
            rank_zero_only.rank = utils_rank_zero_only.rank = self._rank  # type: ignore[attr-defined]
        ms.store_barrier(self._store, "loggers/opened", self._nproc, timeout)

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None and self._store is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._check_setup(trainer, module)
        fresh = self._stage_module is None or module._modules.get(self._body_attr) is not self._stage_module
        if fresh:
            if fitting:
                self._whole_group_names = _param_group_names(module)
            self._prepare_body(module)
            if fitting:
                assert self._whole_group_names is not None
                self._tie_groups = first_use_groups(self._ties, self._body_attr, self._whole_group_names)
        assert self._stage_module is not None
        self._stage_module.attach(module)  # the one seam: the body and the two hooks, until teardown
        if self._env is not None and self._env.joining and self._elastic:
            self._setup_joiner(trainer)
            return
        owners = self._generation_zero() if self.owners is None else self.owners
        self._init_generation(owners)
        if fresh:  # generation 0: pipeline 0's members hold their stages as built; the others receive them
            first = owners.pipeline_ids()[0]
            self._held = {}
            if owners.pipeline_of(self.member) == first:
                self._held = {
                    layer: LayerState(self._layers[layer])
                    for s in owners.stages_of(self.member)
                    for layer in self._stage_layers[s]
                }
            self._form(owners, build_optimizers=False)
        else:  # a later fit/validate/test/predict with the same Trainer: the layers stay where they are
            self._form(owners, build_optimizers=False, held=self._current_holdings())
        if fitting:
            self._setup_model_and_optimizer(trainer, module)
            if self._elastic:
                self._check_groups_fit_any_layout()
            self._build_replica_optimizer()
            self._start_checkpointer()
        else:
            self.model = self.precision_plugin.convert_module(module)
            self.model_to_device()
            self.setup_precision_plugin()
        self._formed(owners.generation)
        if self._entries == 1:
            rank_zero_only(print)(f"[bamboo] generation {owners.generation}:\n{owners.format()}", flush=True)

    def _check_setup(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """Refuse what the pipeline cannot run, before anything is split."""
        self._check_precision()
        _refuse_whole_model_callbacks(trainer)
        if not module.automatic_optimization:
            raise TypeError(
                f"BambooStrategy runs the backward pass itself and needs automatic optimization; "
                f"{type(module).__name__}.automatic_optimization is False"
            )
        if trainer.gradient_clip_val and is_overridden("configure_gradient_clipping", module):
            raise ValueError(
                "BambooStrategy clips gradients itself (gradient_clip_val / gradient_clip_algorithm: "
                "each replica must clip exactly as the stage it mirrors); "
                f"{type(module).__name__}.configure_gradient_clipping is overridden, remove the override"
            )
        if trainer.accumulate_grad_batches != 1 and self._checkpoint_options[0] is not None:
            raise ValueError(
                "BambooStrategy's checkpoint fallback re-runs whole steps of one batch each: "
                f"accumulate_grad_batches={trainer.accumulate_grad_batches} with checkpoint_every_n_steps="
                f"{self._checkpoint_options[0]} is not supported; use one of them"
            )

    def _check_precision(self) -> None:
        plugin = self.precision_plugin
        if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
            raise ValueError(
                "BambooStrategy does not support precision='16-mixed' (its gradient scaler needs a loss "
                "scaled on every stage); use '32-true', '64-true' or 'bf16-mixed'"
            )

    def _prepare_body(self, module: pl.LightningModule) -> None:
        """Find the body, check the contract, plan which layers make each stage; every layer is converted to
        the precision's dtype now (any of them may become this member's stage or replica, and layers received
        from peers take their template's dtype)."""
        attr, body, layout = self._checked_body(module)
        self._body_attr = attr
        self._stage_layers = layout.stage_layers
        rank_zero_info(f"BambooStrategy layout:\n{layout.describe(costs=self._costs_of(body))}")
        warn_batch_statistics(module, attr, body, self._num_microbatches)
        self.precision_plugin.convert_module(body)
        self._ties = find_ties(body)
        untie(body, self._ties)  # one copy per use, on every layout (lightning_bamboo.ties)
        for found in self._ties:
            stages = sorted({s for s, layers in enumerate(self._stage_layers) for layer in found.layers
                             if layer in layers})
            rank_zero_info(f"BambooStrategy: tied {found.describe(attr)} (stages {stages}: each holds a "
                           "copy, their gradients are summed before every step)")
        self._layers = {i: body[i] for i in range(len(body))}
        self._body_length = len(body)
        self._stage_module = StageBody(type(module).__name__, attr, self._layers, self._body_length)

    def _costs_of(self, body: nn.Sequential) -> list[float]:
        return list(self._layer_costs) if self._layer_costs is not None else estimate_layer_costs(list(body))

    def _plan_stages(self, body: nn.Sequential) -> StageLayout:
        """Which layers make each stage: contiguous runs of about equal cost (``layer_costs``, estimated)."""
        if len(body) < self._num_stages:
            raise ValueError(
                f"num_stages ({self._num_stages}) is more than the {len(body)} layers of the pipeline body; "
                f"each stage needs at least one layer"
            )
        costs = self._costs_of(body)
        if len(costs) != len(body):
            raise ValueError(
                f"layer_costs has {len(costs)} entries but the pipeline body has {len(body)} layers"
            )
        return StageLayout.plan(costs, self._num_stages, self._num_stages)

    def _checked_body(self, module: pl.LightningModule) -> tuple[str, nn.Sequential, StageLayout]:
        """The body's attribute, the body and its stages' layout, once the module passed every check that
        needs the module only (the contract, enough layers, no trainable parameter outside the body, a
        trainable parameter on every stage). Changes nothing: the supervisor of a plain ``python train.py``
        runs it before any worker starts (:meth:`_preflight`), and every worker again at setup."""
        attr, body = find_pipeline_body(module, self._pipeline_attr)
        check_contract(module, attr, body)
        if getattr(body, _STAGE_MARK, False):
            raise RuntimeError(
                f"{type(module).__name__}.{attr} holds only the layers of one stage, left by an earlier "
                "BambooStrategy run; build a fresh module (e.g. load consolidate_checkpoint(path) into it)"
            )
        layout = self._plan_stages(body)
        check_stage_split(module, attr, body, layout.stage_layers)
        return attr, body, layout

    def _preflight(self, module: object) -> None:
        """The supervisor's checks of the user's module before it starts workers (one error, in the script's
        process, instead of the same traceback from every worker seconds later)."""
        from lightning.pytorch import LightningModule

        if isinstance(module, LightningModule):
            self._checked_body(module)

    def _setup_model_and_optimizer(self, trainer: pl.Trainer, module: nn.Module) -> None:
        """Lightning's model, device, optimizer and precision set-up, shared by members and joiners."""
        self.model = self.precision_plugin.convert_module(module)
        self.model_to_device()
        self.setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(
                f"BambooStrategy supports exactly one optimizer, configure_optimizers returned "
                f"{len(self.optimizers)}"
            )
        self._regroup_ties(self.optimizers[0], module._modules[self._body_attr])
        self.setup_precision_plugin()  # its norm clipping applies the plan agreed before the commit
        _private.optimizers_to_device(self.optimizers, self.root_device)

    def _start_checkpointer(self) -> None:
        every, directory, keep = self._checkpoint_options
        if every is None or directory is None:
            return
        fb.check_schedulers(self.lr_scheduler_configs)
        fb.settings(self.optimizers[0], self.lr_scheduler_configs)  # JSON-ready, or a clear error now
        job = self._env.job if self._env is not None else "local"
        self._checkpointer = fb.PeriodicCheckpointer(Path(directory) / job, every, keep, self.member)

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

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """The training loader's position in the epoch becomes checkpoint state, and a joiner's loader starts
        at the batch the job is at (:mod:`.progress`)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training:
            return dataloader
        if isinstance(dataloader, DataLoader):
            source = _private.train_loader_source(trainer)
            dataloader = in_written_order(dataloader, source, self._agreed_rng_state)
        if self._joining_setup and self._skip is None:
            # how many batches to skip is known when the joiner forms (on_train_start, before the first fetch)
            loader = skip_first_batches(dataloader, 0)  # type: ignore[arg-type]
            self._skip = loader.batch_sampler
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
        if self._env is not None and self._env.joining and self.owners is None:
            self._join(trainer)  # the job's step count comes with the joiner's progress
        elif not self._rerunning:
            self._step = trainer.global_step  # a resumed fit goes on counting (checkpoints, random keys)
        # the job's fixed split: num_microbatches x the pipelines at its start, whatever is alive now
        starting = self._global_microbatches // self._num_microbatches
        check_train_batches(trainer.train_dataloader, self._num_microbatches, starting)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Remember the batches of the step in progress (more than one with ``accumulate_grad_batches``): a
        failover mid-step runs them again on the next generation."""
        if self._elastic and self._store is not None and self.lightning_module is not None:
            self._rank_zero.batch_start(self.lightning_module.trainer, self._store, self.is_global_zero)
        if not self._window:
            self._window_buffers = self._buffer_snapshot()
        self._window.append((batch_idx, batch))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """This pipeline's share of the global batch through the schedule, then the user's ``training_step``
        replayed with the pipeline's loss (for logging). A peer lost mid-schedule: the next generation, and
        the batch again."""
        assert self.lightning_module is not None
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        while True:
            since = time.monotonic()
            try:
                batch, args, kwargs = self._agreed_batch(args, kwargs)
                if self._window:
                    self._window[-1] = (batch_idx, batch)
                if self._checkpointer is not None:
                    self._ring.put(self._step, batch_idx, batch)
                return self._run_schedule_and_replay(self._share(batch), args, kwargs)
            except Exception as err:
                if not self._generation_ended(err):
                    raise
                self._recover(since)

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
        self._add_stashed_grads()
        self._window_done += 1
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
        """The two-phase step; a lost peer leads to the next generation and a replay or a roll-forward."""
        assert self._store is not None and self.owners is not None
        self._in_step = self._step
        self._join_at_boundary()
        self._maybe_checkpoint()
        while True:
            failed = False
            attempt = time.monotonic()
            try:
                result = closure()
                self._phase("exchange")
                self._exchange_replica_gradients()
                self._plan_clipping()
                outcome = self._prepare_and_wait()
                self._phase("prepared")
            except Exception as err:
                if not self._generation_ended(err):
                    raise
                failed = True
                outcome = self._decide_abort()
            committed = outcome in (commit_protocol.COMMIT, commit_protocol.COMMIT_JOIN)
            if not committed and not failed:
                failed = True  # a peer was lost while this member waited for the outcome
            if committed:
                self._phase("commit")
                output = super().optimizer_step(optimizer, lambda result=result: result, model, **kwargs)
                self._update_replica(optimizer)
                self._phase("applied")
                self._committed(outcome, attempt if failed else None)
                return output
            # the batch in flight runs again in ``closure``; the window's earlier ones in ``_recover``
            self._window_done = max(self._window_done - 1, 0)
            self._recover(attempt)

    # ------------------------------------------------------------------ evaluation and prediction
    def _eval_step(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        """Forward-only pipeline over the batch's micro-batches; replays ``hook`` with the loss. A peer lost
        mid-batch: the next generation, and the batch again (evaluation changes no state)."""
        assert self.lightning_module is not None
        context = (
            self.precision_plugin.val_step_context()
            if hook == "validation_step"
            else self.precision_plugin.test_step_context()
        )
        while True:
            self._phase("validate")
            since = time.monotonic()
            try:
                assert self.engine is not None
                batch, args, kwargs = self._agreed_batch(args, kwargs)
                num = math.gcd(batch_size_of(batch), self._num_microbatches)
                with context:
                    loss = self.engine.run_forward(split_microbatches(batch, num))
                break
            except Exception as err:
                if not self._generation_ended(err):
                    raise
                self._stop_if_asked()
                log.warning("Bamboo: %s batch interrupted by a lost peer; re-running it", hook.split("_")[0])
                self._reform_during_evaluation(since)
        with self._stage_module.replaying(loss):
            return getattr(self.lightning_module, hook)(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", *args, **kwargs)

    @override
    def on_validation_end(self) -> None:
        for created in self._created_during_eval:
            created.training = True
        self._created_during_eval = []
        super().on_validation_end()

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Forward-only pipeline over the batch; replays ``predict_step`` with the whole body's outputs.

        The last stage's outputs are broadcast over the pipeline, so every rank returns the predictions of
        its pipeline's batches (each pipeline predicts its own shard of the data, as every DDP rank does).
        """
        assert self.engine is not None and self.lightning_module is not None
        module = self.lightning_module
        batch, args, kwargs = self._agreed_batch(args, kwargs, per_pipeline=True)
        num = math.gcd(batch_size_of(batch), self._num_microbatches)
        with self.precision_plugin.predict_step_context():
            outputs = self._pipeline_outputs(split_microbatches(batch, num), None)
            with self._stage_module.predicting(module.pipeline_inputs(batch), outputs):  # type: ignore[operator]
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
        if self.engine is None or self.view is None:
            raise RuntimeError(
                "BambooStrategy.full_forward needs the pipeline, which exists once fit/validate/test/predict "
                "has set the strategy up; call it from a LightningModule or callback hook"
            )
        if self.view.num_positions > 1:
            src = self.view.rank_of_position(0)
            inputs = broadcast_batch(inputs, src, self.root_device, group=self.view.pipeline_group)
        num = math.gcd(batch_size_of(inputs), self._num_microbatches)
        with self.precision_plugin.forward_context():
            return self._pipeline_outputs(split_microbatches(inputs, num), _identity)

    def _pipeline_outputs(self, microbatches: list[Any], inputs_fn: Callable[[Any], Any] | None) -> Any:
        """Run the body over ``microbatches`` (forward only); the joined outputs, on every pipeline rank."""
        assert self.engine is not None and self.view is not None
        outputs = self.engine.run_outputs(microbatches, inputs_fn)
        joined = join_microbatches(outputs) if outputs is not None else None
        if self.view.num_positions == 1:
            return joined
        src = self.view.last_rank
        return broadcast_batch(joined, src, self.root_device, group=self.view.pipeline_group)

    # ------------------------------------------------------------------ phases of a step
    def _phase(self, phase: str, **payload: Any) -> None:
        """Fire ``on_step_phase`` on the trainer's callbacks at a point of the two-phase step (not during a
        fallback's re-run of old steps). Tests and demos kill a member there
        (:class:`lightning_bamboo.testing.PhaseFaults`)."""
        if not self._rerunning:
            self._emit("on_step_phase", phase=phase, step=self._step, member=self.member, **payload)

    def _before_action(self, action: Action) -> None:
        if action.kind is ActionKind.FORWARD:
            self._phase("forward", microbatch=action.microbatch)

    # ------------------------------------------------------------------ Lightning checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Stages and optimizers must exist before their shards can be loaded."""
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This member's stages' tensors only, under their original names (``pipeline.3.weight``)."""
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
        # pipeline 0's members write their param groups' names; one file per member, named by its first
        # stage (a member holding several stages after a failover lists all their parameters in it)
        stage = self.stage_index if self.pipeline_index == 0 else None
        if self._ties:
            checkpoint[ckpt.TIED_KEY] = self._tie_aliases()
        ckpt.save_sharded(checkpoint, filepath, self.is_global_zero, self.barrier, stage=stage)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Read this member's stages (and their optimizer state) and the trainer state; nothing is unpickled.

        ``checkpoint_path`` is a Bamboo checkpoint (a folder, any stage and pipeline count) or an ordinary
        Lightning ``.ckpt`` file (``torch.load(weights_only=True)``), whose whole model and optimizer state
        are split into this member's stages and replica by parameter name.
        """
        assert self.lightning_module is not None
        path = Path(checkpoint_path)
        self._loaded_path = self._loaded_whole = None
        if path.is_file():
            checkpoint, self._loaded_whole = ckpt.load_lightning_checkpoint(
                path, self.lightning_module, self.optimizers, self._whole_group_names, self._tie_aliases()
            )
            return checkpoint
        if not path.is_dir():
            raise FileNotFoundError(
                f"checkpoint_path {str(path)!r} does not exist (expected a BambooStrategy checkpoint folder "
                "or an ordinary Lightning .ckpt file)"
            )
        self._loaded_path = path
        return ckpt.load_sharded(checkpoint_path, self.lightning_module, self.optimizers)

    def _tie_aliases(self) -> dict[str, str]:
        return aliases(self._ties, self._body_attr)

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
        optimizer = self._replica_optimizer
        if self.replica is not None and optimizer is not None and self._loaded_path is not None:
            ckpt.load_replica(self._loaded_path, self.replica, self._body_attr, optimizer)
        if self.replica is not None and optimizer is not None and self._loaded_whole is not None:
            ckpt.load_replica_from_memory(self._loaded_whole, self.replica, self._body_attr, optimizer)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            ckpt.remove(filepath)

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: str | None = None) -> None:
        if self._joining_setup or not dist.is_initialized():
            return  # a joiner's setup runs while the others train: nobody to meet
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        """Broadcast a JSON-representable value (paths, numbers) as bytes; nothing is pickled."""
        if self._joining_setup or not dist.is_initialized():
            return obj
        return broadcast_json(obj, src, self.root_device)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if self._joining_setup or not isinstance(tensor, Tensor):
            return tensor
        return _private.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ the end
    @override
    def teardown(self) -> None:
        """Tell the supervisor this member is done (its heartbeat stops now), leave the process group."""
        if self._checkpointer is not None:  # a write in flight finishes before the process exits
            self._checkpointer.wait(strict=False)
            fb.finalize(self._checkpointer.root)
            fb.prune(self._checkpointer.root, self._checkpointer.keep)
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if self._cutter is not None:
            self._cutter.disarm()
            self._cutter.stop()
            self._cutter = None
        if self._store is not None and self._elastic:
            self._store.set(f"done/{self.member}", "1")
        # the process group stays (trainer.save_checkpoint after fit is collective) until the next entry
        # point forms its own, or the interpreter exits (a gloo group left to shutdown can abort the process)
        global _DESTROY_AT_EXIT
        if not _DESTROY_AT_EXIT:
            atexit.register(_destroy_process_group)
            _DESTROY_AT_EXIT = True
        self._elastic = False
        if self._stage_module is not None and self.lightning_module is not None:
            self._stage_module.detach(self.lightning_module)  # the user's hooks; the body keeps the stage
        ParallelStrategy.teardown(self)
        if self.departed and not self._left:
            self._leave()

    def _leave(self) -> None:
        """A drained member's ``fit`` has ended (teardown hooks ran, loggers were finalized): end the process
        with exit code 0 instead of returning into the script (:class:`BambooDeparted` says why)."""
        self._left = True
        rank_zero_only.rank = utils_rank_zero_only.rank = -1  # type: ignore[attr-defined]
        raise BambooDeparted(self.member, self._step)

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
