"""``ElasticBambooStrategy``: Bamboo that keeps training inside the same ``fit`` when workers die or join.

Start the script with the supervisor (which is not a training rank and keeps the store)::

    # train.py: Trainer(strategy=ElasticBambooStrategy(num_stages=2), devices=1).fit(...)
    python -m lightning_bamboo.launch --nproc 4 train.py

How a step runs (the *two-phase step*): the pipeline schedule runs (forwards, backwards, gradient
all-reduce over pipelines); every member sends its stages' gradients to the member holding their replica
and receives its successor's (blocking); it then *prepares* in the store; when every member has prepared,
the step is *committed* (:class:`lightning_bamboo.membership.StepCommit`) and every member applies the
optimizer to its own stages and to its replica. A failure before the commit aborts the step everywhere
(nobody has changed a parameter); after it, every survivor applies the step (every replica holds its
gradients). Survivors therefore always agree on one state, before or after the step.

On a failure (a gloo error, or the generation changing while waiting) a member waits for the launcher's next
generation, destroys the old process group and forms the new one: ``init_process_group`` on
``PrefixStore("gen{g}")``, layers moved peer to peer where the new ownership map needs them
(:mod:`lightning_bamboo.reshard`; a promoted replica moves nothing), new groups, engine and replica, and
Lightning's ``global_rank``/``world_size``/``rank_zero_only.rank`` follow. An aborted step is then *replayed*
on the new layout with the same batch, so the run's trajectory is the uninterrupted one. With replay, the
eager redundant forwards (FR) are pure cost for failover: they are kept so the schedule is Bamboo's, and
``redundancy=False`` measures the run without them.

Data: every member loads the GLOBAL batch (the sampler is not sharded) and takes the share of its
pipeline under the current layout, so the samples of a step do not depend on how many pipelines exist.

Joins: a worker the launcher starts while the job runs registers in ``on_train_start``; the members adopt
the launcher's proposal at a step's commit and form it at the next step boundary with the joiner, which
receives its layers and optimizer state from peers and the trainer's progress as JSON
(:mod:`lightning_bamboo.joining`, :mod:`lightning_bamboo.progress`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException, _TunerExitException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_bamboo import crash, departure, joining
from lightning_bamboo import fallback as fb
from lightning_bamboo import membership as ms
from lightning_bamboo import progress as trainer_progress
from lightning_bamboo.callbacks import BambooMetrics, BambooNotices
from lightning_bamboo.clipping import ClipPlan, apply_clipping, plan_clipping
from lightning_bamboo.contract import check_contract, check_stage_split, find_pipeline_body, sub_sequential
from lightning_bamboo.cutter import GenerationCutter
from lightning_bamboo.engine import PipelineEngine
from lightning_bamboo.layout import StageLayout, estimate_layer_costs
from lightning_bamboo.microbatch import split_microbatches
from lightning_bamboo.ownership import FallbackNeeded, OwnershipMap, initial
from lightning_bamboo.replica import ReplicaSync
from lightning_bamboo.reshard import LayerState, Resharder, gather, install
from lightning_bamboo.schedule import Action, ActionKind, add_forward_redundancy, build_1f1b
from lightning_bamboo.script_launcher import SupervisorLauncher
from lightning_bamboo.strategy import _STAGE_MARK, BambooStrategy

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_bamboo.notices.base import Notice

log = logging.getLogger(__name__)

class _Spare(RuntimeError):
    """This member has no stage in the new generation: it leaves (not an error of the training code)."""


class PipelineView:
    """This member's place in its pipeline, shaped like :class:`BambooGroups` for the engine.

    A *position* is one member's run of consecutive stages (fused); the engine runs positions as stages.
    """

    def __init__(
        self,
        owners: OwnershipMap,
        member: int,
        rank_of: Callable[[int], int],
        pipeline_groups: dict[int, Any],
        stage_groups: dict[int, Any],
    ) -> None:
        self.map = owners
        self.member = member
        self.pipeline = owners.pipeline_of(member)
        self.positions = owners.positions(self.pipeline)
        self.stage = next(i for i, (m, _) in enumerate(self.positions) if m == member)
        self._rank_of = rank_of
        self.pipeline_group = pipeline_groups.get(self.pipeline)
        self.stage_groups = stage_groups
        self.layout = self  # the engine reads layout.num_pipelines

    @property
    def num_stages(self) -> int:
        return len(self.positions)

    @property
    def num_pipelines(self) -> int:
        return len(self.map.pipelines)

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == len(self.positions) - 1

    def rank_of_stage(self, position: int) -> int:
        return self._rank_of(self.positions[position][0])

    @property
    def last_stage_rank(self) -> int:
        return self.rank_of_stage(len(self.positions) - 1)

    @property
    def predecessor_rank(self) -> int:
        return self.rank_of_stage((self.stage - 1) % len(self.positions))

    @property
    def successor_rank(self) -> int:
        return self.rank_of_stage((self.stage + 1) % len(self.positions))


class ElasticEngine(PipelineEngine):
    """The pipeline engine over a :class:`PipelineView`: gradients are averaged per original stage.

    ``stage_params[s]`` are this member's parameters of stage ``s``; each is all-reduced over the members
    holding ``s`` in every pipeline, stages in increasing order on every member (no cycle between groups).
    """

    def __init__(
        self,
        *args: Any,
        stage_params: dict[int, list[nn.Parameter]],
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.stage_params = stage_params

    @override
    def _averaging_groups(self) -> list[tuple[list[nn.Parameter], Any]]:
        view: PipelineView = self.groups  # type: ignore[assignment]
        return [(self.stage_params[s], view.stage_groups[s]) for s in sorted(self.stage_params)]


class ElasticBambooStrategy(BambooStrategy):
    """Bamboo under ``python -m lightning_bamboo.launch``: failover, rejoin and fallback inside one ``fit``.

    Takes every argument of :class:`BambooStrategy` (``timeout`` is the process group's, in seconds), plus:

    Args:
        heartbeat: seconds between heartbeats written to the store (the launcher's ``--hang-timeout``
            decides when a silent worker is lost).
        hang_timeout: under a plain ``python train.py`` (this process supervises ``devices`` workers): seconds
            without a heartbeat after which a worker is killed and lost (``--hang-timeout`` of the CLI).
        failure_wait: seconds a member that saw a communication error waits for the launcher to publish
            the next generation before it treats the error as a real one and raises it.
        checkpoint_every_n_steps: take an asynchronous ``torch.distributed.checkpoint`` every N steps, for the
            checkpoint fallback (a loss redundancy cannot cover); ``None`` (default): no checkpoints, and
            such a loss ends the job. Needs ``checkpoint_dir``.
        checkpoint_dir: folder of those checkpoints (each job writes under ``<checkpoint_dir>/<job id>``);
            on several machines, a filesystem every worker sees.
        keep_checkpoints: complete checkpoints kept (older ones are deleted).
        drain_on_sigterm: a SIGTERM to a worker (what spot agents, Kubernetes and ``docker stop`` send)
            drains it one step boundary later, an announced departure: a
            :class:`~lightning_bamboo.callbacks.BambooNotices` is added when the trainer has none (a
            ``BambooNotices`` given without ``sigterm`` follows this too). ``False``: Lightning's own
            SIGTERM handling, which ends the worker (the job then fails over, or stops).
    """

    strategy_name = "bamboo_elastic"

    def __init__(
        self,
        *args: Any,
        heartbeat: float = 0.25,
        hang_timeout: float = 5.0,
        failure_wait: float = 30.0,
        checkpoint_every_n_steps: int | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        keep_checkpoints: int = 2,
        drain_on_sigterm: bool = True,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("timeout", 30.0)
        super().__init__(*args, **kwargs)
        fb.check_options(checkpoint_every_n_steps, checkpoint_dir, keep_checkpoints)
        self._checkpoint_options = (checkpoint_every_n_steps, checkpoint_dir, keep_checkpoints)
        self._checkpointer: fb.PeriodicCheckpointer | None = None
        # steps since the last complete checkpoint: at most 2N-1 before the step in progress (one write in
        # flight), plus the step in progress
        self._ring = fb.BatchRing(2 * checkpoint_every_n_steps + 1 if checkpoint_every_n_steps else 0)
        self._in_step = 0
        self._rerunning = False
        self._clip_plan: ClipPlan | None = None
        self._created_during_eval: list[nn.Module] = []
        self._heartbeat_interval = heartbeat
        self._hang_timeout = hang_timeout
        self._failure_wait = failure_wait
        self.drain_on_sigterm = drain_on_sigterm
        self._env = ms.WorkerEnv.from_env()
        self._store: dist.Store | None = None
        self._heartbeat: ms.Heartbeat | None = None
        self._cutter: GenerationCutter | None = None
        self.owners: OwnershipMap | None = None
        self.view: PipelineView | None = None
        self._rank = 0
        self._world = 1
        self._layers: dict[int, nn.Module] = {}
        self._held: dict[int, LayerState] = {}
        self._stage_layers: tuple[range, ...] = ()
        self._replica_optimizer: Optimizer | None = None
        self._step = 0
        self.failovers: list[tuple[OwnershipMap, OwnershipMap]] = []
        self._join_adopted = False  # the last commit adopted a join: form it at the next step boundary
        self._fallback_path = ""  # the checkpoint folder the last fallback loaded (on_fallback's payload)
        self._lost_since: float | None = None  # a peer lost after a commit: when (formed at the boundary)
        self._joining_setup = False  # a joiner before its first step: no collective with the running job
        self._skip: trainer_progress.SkipFirstBatches | None = None  # a joiner's training batch sampler
        self.departed = False  # this member left by an announced departure (it stops after its last step)
        self.drain_timer = departure.DrainTimer()

    @property
    def store(self) -> dist.Store:
        """The job's store (membership, commits; the launcher holds it)."""
        if self._store is None:
            raise RuntimeError("the store is connected in setup_distributed")
        return self._store

    # ------------------------------------------------------------------ ranks follow the generation
    @property
    @override
    def global_rank(self) -> int:
        return self._rank

    @property
    @override
    def world_size(self) -> int:
        # a joiner's setup and the start of its first batch run while the others are inside that step: it
        # joins no per-batch collective there (Lightning broadcasts a SIGTERM flag when world_size > 1)
        return 1 if self._joining_setup else self._world

    @property
    @override
    def local_rank(self) -> int:
        return 0

    @property
    @override
    def node_rank(self) -> int:
        return 0

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[0]

    @property
    def member(self) -> int:
        assert self._env is not None
        return self._env.member

    @property
    def pipeline_length(self) -> int:
        """Positions of this member's pipeline now (shorter than ``num_stages`` after a failover)."""
        return self.view.num_stages if self.view is not None else self._num_stages

    @property
    def num_pipelines(self) -> int:
        return len(self.owners.pipelines) if self.owners is not None else 1

    @property
    def pipeline_index(self) -> int:
        assert self.owners is not None
        return self.owners.pipeline_ids().index(self.owners.pipeline_of(self.member))

    @property
    def stage_index(self) -> int:
        assert self.owners is not None
        return self.owners.stages_of(self.member)[0]

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every member loads the global batch; ``training_step`` takes its pipeline's share."""
        return {"num_replicas": 1, "rank": 0}

    @override
    def _configure_launcher(self) -> None:
        """A worker (started by a supervisor) launches nothing; a plain ``python train.py`` becomes the
        supervisor of ``devices`` workers (:mod:`lightning_bamboo.script_launcher`)."""
        if self._env is not None:
            self._launcher = None
            return
        env = self.cluster_environment
        # torchrun, SLURM, LSF, ... (Lightning's own environment reads LOCAL_RANK, which its launcher and
        # earlier fits in the same interpreter leave behind: not a sign of an outside launcher)
        if env is not None and not isinstance(env, LightningEnvironment) and env.creates_processes_externally:
            raise RuntimeError(
                f"ElasticBambooStrategy was started by an outside launcher ({type(env).__name__}: torchrun, "
                "SLURM, ...), which restarts or ends the whole job when a process is lost. Start the script "
                "plainly (python train.py, Trainer(devices=N)) or with python -m lightning_bamboo.launch "
                "--nproc N train.py; or use BambooStrategy for the pipeline without failover"
            )
        self._launcher = SupervisorLauncher(self.num_processes, self._hang_timeout)

    @override
    def set_world_ranks(self) -> None:
        rank_zero_only.rank = utils_rank_zero_only.rank = self._rank  # type: ignore[attr-defined]

    @override
    def _check_world_size(self) -> None:
        pass  # any number of workers: the ownership map decides

    @override
    def setup_distributed(self) -> None:
        """Connect to the job's store, start the heartbeat; the process group comes with generation 0."""
        if self._env is None:
            raise RuntimeError(
                "ElasticBambooStrategy runs under its supervisor: start the script with "
                "python -m lightning_bamboo.launch --nproc N script.py"
            )
        self._store = ms.connect(self._env.store_url, self._env.job)
        self._heartbeat = ms.Heartbeat(self._env, self._heartbeat_interval)
        self._cutter = GenerationCutter(self._env)
        self._process_group_backend = self._process_group_backend or "gloo"
        if not self._env.joining:
            self._open_shared_loggers()
        # generation 0's rank before it forms (members 0..N-1 in order; a joiner's id is >= N), so Lightning's
        # rank-zero-only parts (progress bar, logging) start on one member only
        self._rank = self._env.member
        self.set_world_ranks()
        self._watch_sigterm()

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
        if it were first opened after a failover) before anything is logged (a second barrier). Until
        :meth:`set_world_ranks` runs, every process counts as rank zero, so every member opens its own.
        """
        assert self.lightning_module is not None
        loggers = self.lightning_module.trainer.loggers
        for logger in loggers:
            _ = logger.version  # CSV/TensorBoard: the next free version; nothing is created yet
        assert self._store is not None and self._env is not None
        timeout = self._timeout.total_seconds()
        ms.store_barrier(self._store, "loggers/versions_read", self._env.nproc, timeout)
        for logger in loggers:
            _ = logger.experiment
        ms.store_barrier(self._store, "loggers/opened", self._env.nproc, timeout)

    def _init_generation(self, owners: OwnershipMap) -> None:
        assert self._store is not None and self._cutter is not None
        self._cutter.disarm()
        if dist.is_initialized():
            dist.destroy_process_group()
        self._cutter.before_init()
        self.owners = owners
        self._rank, self._world = owners.rank_of(self.member), len(owners.members())
        dist.init_process_group(
            self._process_group_backend,
            store=dist.PrefixStore(f"gen{owners.generation}", self._store),
            rank=self._rank,
            world_size=self._world,
            timeout=self._timeout,
        )
        self.set_world_ranks()

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None and self._store is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        self._check_precision()
        if not module.automatic_optimization:
            raise TypeError(
                f"ElasticBambooStrategy needs automatic optimization; "
                f"{type(module).__name__}.automatic_optimization is False"
            )
        if trainer.state.fn != TrainerFn.FITTING:
            raise NotImplementedError("ElasticBambooStrategy only runs fit")
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                "ElasticBambooStrategy needs accumulate_grad_batches=1 (a step is its unit of commit), "
                f"got {trainer.accumulate_grad_batches}"
            )
        if trainer.gradient_clip_val and is_overridden("configure_gradient_clipping", module):
            raise ValueError(
                "ElasticBambooStrategy clips gradients itself (gradient_clip_val / gradient_clip_algorithm: "
                "each replica must clip exactly as the stage it mirrors); "
                f"{type(module).__name__}.configure_gradient_clipping is overridden, remove the override"
            )
        attr, body = find_pipeline_body(module, self._pipeline_attr)
        check_contract(module, attr, body)
        self._body_attr = attr
        costs = self._layer_costs if self._layer_costs is not None else estimate_layer_costs(list(body))
        self._stage_layers = StageLayout.plan(costs, self._num_stages, self._num_stages).stage_layers
        check_stage_split(module, attr, body, self._stage_layers)
        # every layer in the precision's dtype now (64-true, bf16-true, ...): any of them may become this
        # member's stage or replica, and layers received from peers take their template's dtype
        self.precision_plugin.convert_module(body)
        self._layers = {i: body[i] for i in range(len(body))}
        if self._env is not None and self._env.joining:
            self._setup_joiner(trainer)
            return
        owners = self._generation_zero()
        self._init_generation(owners)
        # generation 0: pipeline 0's members hold their stages as built; everyone else receives them
        first = owners.pipeline_ids()[0]
        held = {}
        if owners.pipeline_of(self.member) == first:
            held = {
                layer: LayerState(self._layers[layer])
                for s in owners.stages_of(self.member)
                for layer in self._stage_layers[s]
            }
        self._held = held
        self._form(owners, build_optimizers=False)
        self._setup_model_and_optimizer(trainer, module)
        self._check_groups_fit_any_layout()
        self._build_replica_optimizer()
        every, directory, keep = self._checkpoint_options
        if every is not None and directory is not None:
            fb.check_schedulers(self.lr_scheduler_configs)
            fb.settings(self.optimizers[0], self.lr_scheduler_configs)  # JSON-ready, or a clear error now
            assert self._env is not None
            root = Path(directory) / self._env.job
            self._checkpointer = fb.PeriodicCheckpointer(root, every, keep, self.member)
        self._cutter.arm(owners.generation)  # type: ignore[union-attr]
        self._store.add(f"gen{owners.generation}/formed", 1)
        rank_zero_only(print)(f"[bamboo] generation {owners.generation}:\n{owners.format()}", flush=True)

    def _generation_zero(self) -> OwnershipMap:
        assert self._store is not None and self._env is not None
        owners = initial(self._num_stages, range(self._env.nproc))
        text = owners.to_json()
        stored = self._store.compare_set("gen0/map", "", text).decode()
        if stored != text:
            raise ValueError(
                f"this worker was started with num_stages={self._num_stages}, but the job's "
                f"generation 0 is {OwnershipMap.from_json(stored).format()}"
            )
        self._store.compare_set("config/num_stages", "", str(self._num_stages))
        if self.member not in owners.members():
            raise RuntimeError(
                f"member {self.member} has no stage in generation 0 (spare workers are not "
                "supported at start: use a multiple of num_stages)"
            )
        return owners

    def _needs(self, owners: OwnershipMap) -> dict[int, list[int]]:
        return {
            m: [
                layer
                for s in owners.stages_of(m) + owners.replica_stages_of(m)
                for layer in self._stage_layers[s]
            ]
            for m in owners.members()
        }

    def _template(self, layer: int) -> nn.Module:
        return self._layers[layer]

    def _form(
        self,
        owners: OwnershipMap,
        build_optimizers: bool = True,
        holdings: dict[int, LayerState] | None = None,
        held: dict[int, LayerState] | None = None,
    ) -> None:
        """Move layers to where ``owners`` needs them (or take ``held``, loaded from a checkpoint) and rebuild
        stage, replica, groups and engine.

        ``holdings``: the layers this member can give (default: all it holds now; a joiner gives none).
        """
        assert self._store is not None and self.lightning_module is not None
        me = self.member
        if held is None:
            resharder = Resharder(
                self._store, owners.generation, me, owners.rank_of, self._template, self.root_device
            )
            current = self._current_holdings() if holdings is None else holdings
            held = resharder.run(current, self._needs(owners))
        self._held = held
        own_layers = [layer for s in owners.stages_of(me) for layer in self._stage_layers[s]]
        replica_layers = [layer for s in owners.replica_stages_of(me) for layer in self._stage_layers[s]]
        for layer in own_layers + replica_layers:
            self._layers[layer] = self._held[layer].module
        stage = sub_sequential(self._layers, own_layers)
        setattr(stage, _STAGE_MARK, True)
        self._stage_module = stage
        self.lightning_module._modules[self._body_attr] = stage
        self.replica = (
            sub_sequential(self._layers, replica_layers)
            if replica_layers
            else None
        )
        if build_optimizers:
            grouping = self._user_optimizer(stage)
            install(self.optimizers[0], [(layer, self._held[layer]) for layer in own_layers], grouping)
        # groups: one per pipeline (loss broadcast) and one per stage (gradient all-reduce), same order
        # on every member
        pipeline_groups: dict[int, Any] = {}
        stage_groups: dict[int, Any] = {}
        kwargs = {"timeout": self._timeout}
        for pipeline in owners.pipeline_ids():
            ranks = [owners.rank_of(m) for m, _ in owners.positions(pipeline)]
            pipeline_groups[pipeline] = dist.new_group(ranks, **kwargs)
        if len(owners.pipelines) > 1:
            for s in range(owners.num_stages):
                stage_groups[s] = dist.new_group(
                    sorted(owners.rank_of(m) for m in owners.stage_holders(s)), **kwargs
                )
        self.view = PipelineView(owners, me, owners.rank_of, pipeline_groups, stage_groups)
        self.groups = self.view  # type: ignore[assignment]
        if build_optimizers:
            self._build_replica_optimizer()
        positions = self.view.num_stages
        schedule = build_1f1b(positions, self._num_microbatches)
        if self._redundancy and positions > 1:
            schedule = add_forward_redundancy(schedule, positions, self._num_microbatches)
        module = self.lightning_module
        stage_params = {
            s: [p for layer in self._stage_layers[s] for p in self._layers[layer].parameters()]
            for s in owners.stages_of(me)
        }
        self.engine = ElasticEngine(
            stage,
            self.view,
            schedule,  # type: ignore[arg-type]
            inputs_fn=module.pipeline_inputs,  # type: ignore[arg-type]
            loss_fn=module.pipeline_loss,  # type: ignore[arg-type]
            device=self.root_device,
            replica=self.replica if positions > 1 and self._redundancy else None,
            replica_device=self.root_device,
            stage_params=stage_params,
        )
        self.engine.before_action = self._before_action

    def _current_holdings(self) -> dict[int, LayerState]:
        """Every layer this member holds, with its optimizer state as of now."""
        held = dict(self._held)
        if self.optimizers:
            held.update(
                gather(
                    {int(n): m for n, m in self._stage_module._modules.items()},  # type: ignore[union-attr]
                    self.optimizers[0],
                )
            )
        if self.replica is not None and self._replica_optimizer is not None:
            held.update(
                gather({int(n): m for n, m in self.replica._modules.items()}, self._replica_optimizer)
            )
        return held

    def _build_replica_optimizer(self) -> None:
        """The user's optimizer over the replica (``configure_optimizers`` with the body swapped for it) and
        the :class:`ReplicaSync` that keeps both equal to the successor's (when the pipeline has two or more
        positions; a member running the whole pipeline has no successor)."""
        if self.replica_sync is not None:
            self.replica_sync.close()
            self.replica_sync = None
        if self.replica is None:
            self._replica_optimizer = None
            return
        self._replica_optimizer = self._user_optimizer(self.replica)
        replica_layers = [int(name) for name in self.replica._modules]
        layers = [(layer, self._held[layer]) for layer in replica_layers]
        install(self._replica_optimizer, layers, self._replica_optimizer)
        if self.view is not None and self.view.num_stages > 1:
            self.replica_sync = ReplicaSync(
                self._stage_module, self.replica, self._replica_optimizer, self.view, self.root_device
            )

    def _check_groups_fit_any_layout(self) -> None:
        """A failover gives a member several stages, whose parameters join the param groups the user's
        ``configure_optimizers`` gives them, in the member's optimizer (the object Lightning and the
        schedulers hold): so that code must build as many groups for the whole body as for one stage (a group
        may be empty). Checked at start, not at the first failover."""
        whole = self._user_optimizer(sub_sequential(self._layers, sorted(self._layers)))
        stage = self.optimizers[0]
        if len(whole.param_groups) != len(stage.param_groups):
            raise ValueError(
                f"configure_optimizers builds {len(stage.param_groups)} param groups for this member's stage "
                f"but {len(whole.param_groups)} for the whole pipeline body; ElasticBambooStrategy needs the "
                "same number for any set of layers (a failover gives a member several stages): build the "
                "groups from fixed parts (e.g. the head and the rest), leaving a group empty where the "
                "stage has none of its layers"
            )

    def _user_optimizer(self, body: nn.Module) -> Optimizer:
        """The user's optimizer over ``body`` (``configure_optimizers`` with the pipeline body swapped for
        it): its param groups, hyper-parameters and which parameter goes in which group are the user's own."""
        module = self.lightning_module
        assert module is not None
        stage = module._modules[self._body_attr]
        module._modules[self._body_attr] = body
        try:
            optimizers, _ = _init_optimizers_and_lr_schedulers(module)
        finally:
            module._modules[self._body_attr] = stage
        return optimizers[0]

    # ------------------------------------------------------------------ training
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """This pipeline's share of the global batch through the schedule (see :class:`BambooStrategy`)."""
        assert self.engine is not None and self.lightning_module is not None
        batch = args[0] if args else kwargs["batch"]
        if self._checkpointer is not None:
            self._ring.put(self._step, args[1] if len(args) > 1 else kwargs.get("batch_idx", 0), batch)
        share = split_microbatches(batch, self.num_pipelines)[self.pipeline_index]
        return self._run_schedule_and_replay(split_microbatches(share, self._num_microbatches), args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Forward-only on the current layout. A peer lost mid-batch: form the next generation and run the
        batch again on it (evaluation changes no state, so the re-run gives the uninterrupted result)."""
        while True:
            self._phase("validate")
            since = time.monotonic()
            try:
                return super().validation_step(*args, **kwargs)
            except Exception as err:
                if not self._generation_ended(err):
                    raise
                self._stop_if_asked()
                log.warning("Bamboo: validation batch interrupted by a lost peer; re-running it")
                self._reform_during_evaluation(since)

    def _reform_during_evaluation(self, since: float) -> None:
        """Form the next generation in training mode (a fallback re-runs training steps), then put every
        module back in evaluation mode. Modules the re-form created were never seen by Lightning's capture
        of the modes, so Lightning would not restore them: :meth:`on_validation_end` puts them back in
        training mode."""
        assert self.lightning_module is not None
        module = self.lightning_module
        before = {id(m) for m in module.modules()}
        module.train()
        try:
            self._next_generation(since=since)
        finally:
            module.eval()
        self._created_during_eval += [m for m in module.modules() if id(m) not in before]

    @override
    def on_validation_end(self) -> None:
        for created in self._created_during_eval:
            created.training = True
        self._created_during_eval = []
        super().on_validation_end()

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
            commit = ms.StepCommit(self._store, self.owners.generation, len(self.owners.members()))
            buffers = self._buffer_snapshot()
            try:
                result = closure()
                self._phase("exchange")
                self._exchange_replica_gradients()
                self._plan_clipping()
                outcome = commit.prepare_and_wait(self._step, self._claim_join)
                self._phase("prepared")
            except Exception as err:
                if not self._generation_ended(err):
                    raise
                failed = True
                outcome = commit.decide(self._step, ms.ABORT)
            committed = outcome in (ms.COMMIT, ms.COMMIT_JOIN)
            if not committed and not failed:
                failed = True  # a peer was lost while this member waited for the outcome
            if committed:
                self._phase("commit")
                output = super().optimizer_step(optimizer, lambda result=result: result, model, **kwargs)
                self._phase("applied")
                self._step += 1
                report = self.drain_timer.committed()
                if report is not None:
                    rank_zero_only(print)(report, flush=True)
                if failed:
                    self._lost_since = attempt  # seconds_lost of the failover formed at the next boundary
                # a lost peer after the commit (rolled forward) or an adopted join: the next generation is
                # formed at the next step boundary (_join_at_boundary), where a joiner can be positioned
                self._join_adopted = outcome == ms.COMMIT_JOIN
                return output
            self._undo_step(buffers)
            self._stop_if_asked()
            log.warning(
                "Bamboo: step %d aborted by a lost peer; replaying it on the next generation", self._step
            )
            self._next_generation(since=attempt)

    @override
    def _forward_key_step(self) -> int:
        """The committed step count: a replayed or re-run step draws the random numbers it drew first."""
        return self._step

    def _exchange_replica_gradients(self) -> None:
        """Send this member's stage gradients to its replica holder and receive its successor's (blocking,
        before the commit: after it, no communication may be needed to apply the step)."""
        if self.replica_sync is not None:
            self.replica_sync.exchange(self.optimizers[0])

    def _buffer_snapshot(self) -> list[tuple[Tensor, Tensor]]:
        """``(buffer, copy)`` of every buffer this member holds (stages and replica) at the step's start."""
        modules = [m for m in (self._stage_module, self.replica) if m is not None]
        unique = {id(b): b for m in modules for b in m.buffers()}
        return [(b, b.detach().clone()) for b in unique.values()]

    def _undo_step(self, buffers: list[tuple[Tensor, Tensor]]) -> None:
        """Leave no trace of an aborted step: its forwards' buffer updates (BatchNorm statistics, on the
        stages and in the replica's FR) are undone and the successor's update received for it is dropped, so
        the re-run on the next generation starts from the state the survivors agree on."""
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        if self.replica_sync is not None:
            self.replica_sync.discard()

    def _plan_clipping(self) -> None:
        """Agree on the step's gradient clipping before the commit (the norm is a collective)."""
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        view = self.view
        group = view.pipeline_group if view is not None and view.num_stages > 1 else None
        grads = [p.grad for p in self._stage_params()]
        clip_val, algorithm = trainer.gradient_clip_val, trainer.gradient_clip_algorithm
        self._clip_plan = plan_clipping(grads, clip_val, algorithm, group, self.root_device)

    @override
    def _clip_grad_by_global_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        """Lightning's norm clipping, after the commit: the coefficient agreed before it (no collective)."""
        apply_clipping(self._clip_plan, [p.grad for g in optimizer.param_groups for p in g["params"]])

    @override
    def _update_replica(self, optimizer: Optimizer) -> None:
        """Apply the successor's step, received before the commit, to the replica (clipped by the step's
        plan)."""
        if self.replica_sync is None:
            return
        self.replica_sync.flush(before_step=lambda grads: apply_clipping(self._clip_plan, grads))
        self.replica_sync.optimizer.zero_grad(set_to_none=True)  # its gradients are views of a receive buffer

    # ------------------------------------------------------------------ membership changes
    def _generation_ended(self, err: BaseException) -> bool:
        """Whether ``err`` came from a lost peer: the launcher publishes a new generation soon after."""
        assert self._store is not None and self.owners is not None
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            return False
        if not crash.is_communication_error(err) and (
            ms.current_generation(self._store) <= self.owners.generation
        ):
            # an error of the training code: a failover would raise it again on the member taking the
            # stage over. Raised, it stops the job (on_exception records it for the supervisor).
            return False
        log.warning(
            "Bamboo member %d: %s: %s",
            self.member,
            type(err).__name__,
            str(err).splitlines()[0] if str(err) else "",
        )
        self._abort_groups()
        deadline = time.monotonic() + self._failure_wait
        while time.monotonic() < deadline:
            if ms.current_generation(self._store) > self.owners.generation:
                return True
            time.sleep(0.01)
        return False

    def _abort_groups(self) -> None:
        """Abort this member's process groups: peers blocked on it fail now instead of at their timeout."""
        if not dist.is_initialized():
            return
        if self._cutter is not None:
            self._cutter.disarm()
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception as err:  # the groups are being thrown away either way
            log.warning(
                "Bamboo: aborting the process group failed (%s); peers may wait for their timeout", err
            )
        self.engine = None
        self.view = None
        self.groups = None
        if dist.is_initialized():
            dist.destroy_process_group()

    def _next_generation(self, since: float | None = None) -> None:
        """Wait for the generation after this one and form it (or wait as a spare).

        ``since`` (``time.monotonic()``) is when training stopped counting: the event's ``seconds_lost``.
        """
        assert self._store is not None and self.owners is not None
        since = time.monotonic() if since is None else since
        old = self.owners
        while True:
            generation = ms.current_generation(self._store)
            if generation > old.generation:
                break
            time.sleep(0.01)
        kind = ms.get_str(self._store, f"gen{generation}/kind")
        if kind == "stop":
            self._stop()
        new = ms.read_map(self._store, generation)
        if self.member not in new.members():
            raise _Spare(f"Bamboo member {self.member} is a spare in generation {generation}")
        start = time.monotonic()
        self._send_progress(old, new)
        self._init_generation(new)
        if kind == "fallback":
            self._fall_back(new)
        else:
            try:
                self._form(new)
            except FallbackNeeded as err:  # every member plans the same moves, so all of them get here
                log.warning("Bamboo: %s", err)
                kind = "fallback"
                self._fall_back(new)
        self._cutter.arm(generation)  # type: ignore[union-attr]
        self._store.add(f"gen{generation}/formed", 1)
        self.failovers.append((old, new))
        info = {
            "step": self._step,
            "seconds_lost": time.monotonic() - since,
            "pipeline_length": self.pipeline_length,
        }
        if kind == "fallback":
            self._emit("on_fallback", checkpoint_path=self._fallback_path, **info)
        elif kind == "rejoin":
            joined = sorted(set(new.members()) - set(old.members()))
            self._emit("on_rejoin", old_map=old, new_map=new, members=joined, **info)
        else:
            gone = sorted(set(old.members()) - set(new.members()) - set(new.spares))
            cause = "drain" if kind == "drain" else "lost"
            self._emit("on_failover", old_map=old, new_map=new, cause=cause, members=gone, **info)
        rank_zero_only(print)(
            f"[bamboo] {kind} at step {self._step}: generation {old.generation} -> {generation} "
            f"({time.monotonic() - start:.2f}s to re-form)\n{old.format()}\n->\n{new.format()}",
            flush=True,
        )

    def _stop_if_asked(self) -> None:
        """Stop here (:meth:`_stop`) when the generation that ended this one is a ``stop``: no replay."""
        assert self._store is not None and self.owners is not None
        generation = ms.current_generation(self._store)
        if generation > self.owners.generation and ms.get_str(self._store, f"gen{generation}/kind") == "stop":
            self._stop()

    def _stop(self) -> None:
        """The supervisor stops the job (it got SIGTERM, or a worker failed) with a ``stop`` generation.

        Every member is at the same committed step here: a step in flight was aborted or rolled forward as
        in a failover (the cutter ends the old generation's collectives). The final checkpoint, when
        ``checkpoint_every_n_steps`` is set, is therefore one consistent step (written by the first
        pipeline; ``teardown`` waits for the write). ``fit`` then ends as Lightning ends it on SIGTERM
        (``SIGTERMException``: teardown runs; the process exits with 143 unless the script catches it).
        """
        assert self.owners is not None
        self._maybe_checkpoint(final=True)
        print(
            f"[bamboo] member {self.member}: the job is stopping; leaving after step {self._step} "
            f"(generation {self.owners.generation})",
            flush=True,
        )
        raise SIGTERMException(128 + signal.SIGTERM)

    def _join_at_boundary(self) -> None:
        """Form the next generation before the step when the last commit adopted a join (every member read
        the same outcome, so all switch here) or when a generation came without a failure seen here."""
        assert self._store is not None and self.owners is not None
        self._joining_setup = False
        if self._join_adopted or ms.current_generation(self._store) > self.owners.generation:
            self._join_adopted = False
            since, self._lost_since = self._lost_since, None
            self._next_generation(since=since)

    # ------------------------------------------------------------------ joining (lightning_bamboo.joining)
    def _claim_join(self, step: int) -> bool:
        """Called by the member committing ``step``: adopt the launcher's join proposal after it, unless the
        next step starts an epoch (no mid-epoch position to give a joiner) or there is no next step."""
        assert self._store is not None and self.owners is not None and self.lightning_module is not None
        trainer = self.lightning_module.trainer
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            return False
        if trainer.max_steps != -1 and trainer.global_step + 1 >= trainer.max_steps:
            return False
        return joining.claim(self._store, self.owners.generation, step)

    def _send_progress(self, old: OwnershipMap, new: OwnershipMap) -> None:
        """The lowest continuing member writes the trainer's progress for the members joining in ``new``."""
        assert self._store is not None and self.lightning_module is not None
        joiners = set(new.members()) - set(old.members())
        staying = sorted(set(old.members()) & set(new.members()))
        if not joiners or not staying or self.member != staying[0]:
            return
        snap = trainer_progress.snapshot(self.lightning_module.trainer, self.optimizers[0], self._step)
        self._store.set(f"gen{new.generation}/progress", trainer_progress.to_json(snap))

    def _setup_model_and_optimizer(self, trainer: pl.Trainer, module: nn.Module) -> None:
        """Lightning's model, device, optimizer and precision set-up, shared by members and joiners."""
        self.model = self.precision_plugin.convert_module(module)
        self.model_to_device()
        self.setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(
                f"ElasticBambooStrategy supports exactly one optimizer, got {len(self.optimizers)}"
            )
        self.setup_precision_plugin()  # its norm clipping applies the plan agreed before the commit

    def _setup_joiner(self, trainer: pl.Trainer) -> None:
        """A joiner's ``setup``: its optimizer over the whole body, no process group yet.

        It joins the job in :meth:`on_train_start`, once Lightning's own start (logger, data, callbacks) is
        done, so the members wait for nothing but the re-form; the optimizer's param groups are then refilled
        with its stages' layers and their state (:func:`lightning_bamboo.reshard.install`).
        """
        self._joining_setup = True
        self._setup_model_and_optimizer(trainer, self.lightning_module)

    @override
    def on_train_start(self) -> None:
        """A joiner registers now and, once the members adopted the join, forms the generation with them."""
        if self._env is not None and self._env.joining and self.owners is None:
            self._join(self.lightning_module.trainer)  # type: ignore[union-attr]
        super().on_train_start()

    def _join(self, trainer: pl.Trainer) -> None:
        """Register, wait for a generation listing this member, form it, position the trainer."""
        assert self._store is not None
        joining.register(self._store, self.member)
        owners = joining.wait_for_membership(self._store, self.member)
        start = time.monotonic()
        self._init_generation(owners)
        self._form(owners, holdings={})
        progress = json.loads(self._store.get(f"gen{owners.generation}/progress"))
        trainer_progress.restore_optimizer(trainer, self.optimizers[0], progress)
        trainer_progress.restore_loop(trainer, progress)
        self._step = int(progress["step"])
        if self._skip is None:
            raise RuntimeError("Bamboo: the joiner's training DataLoader was not prepared to skip batches")
        self._skip.skip = int(progress["skip"])
        self._cutter.arm(owners.generation)  # type: ignore[union-attr]
        self._store.add(f"gen{owners.generation}/formed", 1)
        print(
            f"[bamboo] member {self.member} joined generation {owners.generation} at step {self._step} "
            f"(global step {progress['global_step']}, epoch {progress['epoch']}, batch {self._skip.skip}; "
            f"{time.monotonic() - start:.2f}s to form)\n{owners.format()}",
            flush=True,
        )

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """A joiner's training ``DataLoader`` starts at the batch the job is at (see :mod:`.progress`)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self._joining_setup and self._skip is None and trainer is not None and trainer.training:
            # how many batches to skip is known when the joiner forms (on_train_start, before the first fetch)
            loader = trainer_progress.skip_first_batches(dataloader, 0)  # type: ignore[arg-type]
            self._skip = loader.batch_sampler  # type: ignore[assignment]
            return loader
        return dataloader

    @override
    def barrier(self, name: str | None = None) -> None:
        if not self._joining_setup:  # a joiner's setup runs while the others train: nobody to meet
            super().barrier(name)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj if self._joining_setup else super().broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        return tensor if self._joining_setup else super().reduce(tensor, group, reduce_op)

    @override
    def _drain_all(
        self,
        ranks: list[int],
        checkpoint_dir: str | Path | None = None,
        notices: dict[int, Notice] | None = None,
    ) -> None:
        """Announced departure of ``ranks`` after the step just committed (:mod:`lightning_bamboo.departure`).

        Called on every member at the same boundary. A leaver ends its ``fit`` (teardown hooks run, not
        ``on_train_end``) once the launcher published the generation without it; the survivors form that
        generation now and replay nothing. ``checkpoint_dir`` is not used: nothing is checkpointed.
        """
        assert self._store is not None and self.owners is not None and self.lightning_module is not None
        start = time.monotonic()
        old = self.owners
        leaving = departure.announce(self._store, old, ranks, self._step)
        for member in leaving:
            self._emit("on_drain", member=member, rank=old.rank_of(member), step=self._step)
        self.drain_timer.begin(leaving, self._step, [n.received_at for n in (notices or {}).values()])
        departure.wait_without(self._store, old.generation, leaving, self._failure_wait)
        if self.member in leaving:
            log.warning(
                "Bamboo member %d: leaving after step %d (announced departure)", self.member, self._step
            )
            self.departed = True
            # leave ``fit`` now, the way Lightning's own tuner callbacks end it early: teardown hooks run,
            # nothing else. Whatever ran after this boundary (ModelCheckpoint's collective decisions and save,
            # on_train_end) would run against a world the survivors have already left.
            raise _TunerExitException
        self._next_generation(since=start)
        self.drain_timer.reformed()

    # ------------------------------------------------------------------ checkpoint fallback
    def _maybe_checkpoint(self, final: bool = False) -> None:
        """Before a step that is a multiple of N (``final``: before the step the job stops at): the first
        pipeline's members write their stages' layers."""
        checkpointer, owners = self._checkpointer, self.owners
        if checkpointer is None or owners is None or not checkpointer.due(self._step, final):
            return
        writers = sorted({m for m, _ in owners.positions(owners.pipeline_ids()[0])})
        if self.member not in writers:
            return
        layers = [layer for s in owners.stages_of(self.member) for layer in self._stage_layers[s]]
        held = gather({layer: self._layers[layer] for layer in layers}, self.optimizers[0])
        written = checkpointer.wait(strict=True)
        if written is not None:
            print(
                f"[bamboo] checkpoint_written step={written[0]} member={self.member} "
                f"write_s={written[1]:.4f}",
                flush=True,
            )
        blocking, size = checkpointer.save(
            self._step,
            held,
            writers,
            len(self._layers),
            fb.settings(self.optimizers[0], self.lr_scheduler_configs),
        )
        print(
            f"[bamboo] checkpoint step={self._step} member={self.member} blocking_s={blocking:.4f} "
            f"bytes={size}",
            flush=True,
        )

    def _fall_back(self, new: OwnershipMap) -> None:
        """Load the last complete checkpoint into ``new`` (whose process group is formed) and re-run the
        steps since it, so the members are where they were before the loss."""
        assert self._store is not None
        if self._checkpointer is None:
            raise RuntimeError(
                f"Bamboo: redundancy cannot cover the loss (generation {new.generation}):\n{new.format()}\n"
                "and there is no checkpoint to fall back to: pass checkpoint_every_n_steps and "
                "checkpoint_dir to ElasticBambooStrategy"
            )
        start = time.monotonic()
        target = self._step
        root = self._checkpointer.root
        self._checkpointer.wait(strict=False)  # this member's part of the last checkpoint, if it was writing
        fb.finalize(root)
        dist.barrier()  # every survivor has finished its writes: the set of complete checkpoints is settled
        key = f"gen{new.generation}/fallback_from"
        if self._rank == 0:
            latest = fb.latest_complete(root)
            self._store.set(key, str(-1 if latest is None else latest))
        step = int(ms.get_str(self._store, key))
        if step < 0:
            raise RuntimeError(
                f"Bamboo: redundancy cannot cover the loss and {root} holds no complete checkpoint"
            )
        fb.share_batches(self._ring, range(step, target), self.root_device)  # for members that joined later
        held, saved = fb.load_layers(
            fb.folder(root, step), self._needs(new)[self.member], self._template, self.root_device
        )
        self._form(new, held=held)
        fb.restore_settings(self.optimizers[0], self.lr_scheduler_configs, saved)
        self._step = step
        self._rerunning = True
        try:
            while self._step < target:
                batch_idx, batch = self._ring.get(self._step)
                # Lightning steps the schedulers after the step in progress returns; earlier ones are ours
                self._rerun_step(batch, batch_idx, step_schedulers=self._step < self._in_step)
        finally:
            self._rerunning = False
        self._fallback_path = str(fb.folder(root, step))
        rank_zero_only(print)(
            f"[bamboo] fallback: loaded checkpoint step={step} from {fb.folder(root, step)}, re-ran steps "
            f"{step}..{target - 1} ({target - step} steps) in {time.monotonic() - start:.2f}s",
            flush=True,
        )

    def _rerun_step(self, batch: Any, batch_idx: int, step_schedulers: bool) -> None:
        """One step of the fallback's re-run: schedule, replica exchange, commit, optimizer and scheduler.

        Lightning's hooks around a step (``training_step``, ``on_before_optimizer_step``, logging) are not
        called again: they ran when the step first ran.
        """
        assert self.engine is not None and self._store is not None and self.owners is not None
        optimizer = self.optimizers[0]
        share = split_microbatches(batch, self.num_pipelines)[self.pipeline_index]
        for p in self._stage_params():
            p.grad = None
        with self.precision_plugin.train_step_context():
            self.engine.run_step(split_microbatches(share, self._num_microbatches), step=self._step)
        self._exchange_replica_gradients()
        self._plan_clipping()
        commit = ms.StepCommit(self._store, self.owners.generation, len(self.owners.members()))
        if commit.prepare_and_wait(self._step) != ms.COMMIT:
            raise RuntimeError(
                f"Bamboo: a member was lost while re-running step {self._step} after a fallback"
            )
        apply_clipping(self._clip_plan, [p.grad for p in self._stage_params()])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self._update_replica(optimizer)
        if step_schedulers:
            assert self.lightning_module is not None
            for config in self.lr_scheduler_configs:
                if config.interval == "step" and (batch_idx + 1) % config.frequency == 0:
                    self.lightning_module.lr_scheduler_step(config.scheduler, None)
        self._step += 1

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

    @override
    def on_exception(self, exception: BaseException) -> None:
        """``fit`` ends with ``exception``: unless a lost peer caused it, record it in the job's store, so the
        supervisor stops the job with it instead of failing over (:mod:`lightning_bamboo.crash`)."""
        super().on_exception(exception)
        if self._store is None or isinstance(exception, (SystemExit, KeyboardInterrupt, _Spare)):
            return
        if crash.is_communication_error(exception):
            return
        try:
            crash.record(self._store, self.member, exception)
        except Exception as err:  # the supervisor is gone: nobody to tell
            log.warning("Bamboo member %d: could not record its error in the store: %s", self.member, err)

    @override
    def teardown(self) -> None:
        """Tell the launcher this member is done (its heartbeat stops now), leave the process group."""
        if self._checkpointer is not None:  # a write in flight finishes before the process exits
            self._checkpointer.wait(strict=False)
            fb.finalize(self._checkpointer.root)
            fb.prune(self._checkpointer.root, self._checkpointer.keep)
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self._cutter is not None:
            self._cutter.disarm()
            self._cutter.stop()
        if self._store is not None:
            self._store.set(f"done/{self.member}", "1")
        if dist.is_initialized():
            dist.destroy_process_group()
        ParallelStrategy.teardown(self)
