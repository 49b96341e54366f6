"""Launch and store wiring of :class:`~lightning_bamboo.strategy.BambooStrategy`, as functions of what they
need: the job's store (one connection per process, a prefix per Trainer entry point), the loggers every
member of generation 0 opens alike, the notices callback added for SIGTERM, and the checks of a trainer and
module made before anything is split.
"""

from __future__ import annotations

import atexit
import base64
import functools
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch.callbacks import Checkpoint, ModelSummary, StochasticWeightAveraging
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from lightning_bamboo._lightning import private as _private
from lightning_bamboo.callbacks import BambooMetrics, BambooNotices
from lightning_bamboo.protocol import nccl_env
from lightning_bamboo.protocol import store as ms
from lightning_bamboo.protocol.drain import BambooDeparted
from lightning_bamboo.runtime.data_order import in_written_order
from lightning_bamboo.runtime.formation import checked_module
from lightning_bamboo.runtime.launcher import SupervisorLauncher
from lightning_bamboo.step.progress import resumable, skip_first_batches

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies.launchers.launcher import _Launcher

    from lightning_bamboo.runtime.membership import Membership
    from lightning_bamboo.runtime.parts import Options

_STORES: dict[str, dist.Store] = {}
_ENTRIES: dict[int, int] = {}


def _process_store(key: str, connect: Callable[[], dist.Store]) -> dist.Store:
    """One connection per store and process: rank 0 serves the TCPStore once (a second server on the same
    port would fail), and every Trainer of the process uses it under its own prefix (:func:`next_entry`)."""
    if key not in _STORES:
        _STORES[key] = connect()
    return _STORES[key]


def next_entry(store: dist.Store) -> int:
    """The number of this entry point (fit, validate, ...) on ``store`` in this process: every process of a
    job runs the same sequence of Trainer calls, so they agree on it without talking."""
    _ENTRIES[id(store)] = _ENTRIES.get(id(store), 0) + 1
    return _ENTRIES[id(store)]


def connect(
    env: ms.WorkerEnv | None,
    cluster: ClusterEnvironment | None,
    rank: int,
    nproc: int,
    timeout: timedelta | None,
) -> dist.Store:
    """The job's store: the supervisor's; else one TCPStore served by rank 0 (``MASTER_ADDR``/``PORT``,
    through torch's ``tcp://`` rendezvous, which joins torchrun's agent store when it runs one); a single
    process keeps it in memory. One connection per process, whatever the number of Trainers in it."""
    if env is not None:
        url, job = env.store_url, env.job
        return _process_store(f"{url}/{job}", lambda: ms.connect(url, job))
    if nproc == 1:
        return _process_store("local", dist.HashStore)
    assert cluster is not None
    url = f"tcp://{cluster.main_address}:{cluster.main_port}?rank={rank}&world_size={nproc}"

    def rendezvous() -> dist.Store:
        store, _, _ = next(dist.rendezvous(url, timeout=timeout))  # type: ignore[arg-type]
        return dist.PrefixStore("bamboo", store)

    return _process_store(url, rendezvous)


def launcher(
    env: ms.WorkerEnv | None,
    cluster: ClusterEnvironment | None,
    processes: int,
    num_nodes: int,
    options: Options,
    cuda: bool = False,
) -> _Launcher | None:
    """What starts the processes: a plain ``python train.py`` with ``devices=N`` becomes the supervisor of
    N workers (:mod:`lightning_bamboo.runtime.launcher`); a worker of a Bamboo job launches nothing;
    under an outside launcher (torchrun, SLURM, ...) or in one process nothing either; on several nodes
    Lightning's script launcher (the ranks are then fixed)."""
    if env is not None or (cluster is not None and cluster.creates_processes_externally):
        return None
    if processes * num_nodes <= 1:
        return None
    if num_nodes > 1:
        assert cluster is not None
        return _private.SubprocessScriptLauncher(cluster, processes, num_nodes)
    preflight = functools.partial(checked_module, pipeline_attr=options.pipeline_attr,
                                  num_stages=options.num_stages, costs=options.layer_costs)
    backend = options.process_group_backend or ("nccl" if cuda else "gloo")  # what enter() will choose
    return SupervisorLauncher(processes, options.hang_timeout, preflight=preflight, backend=backend)


def enter(
    members: Membership,
    env: ms.WorkerEnv | None,
    cluster: ClusterEnvironment | None,
    options: Options,
    trainer: pl.Trainer | None,
    drain_on_sigterm: bool,
    set_world_ranks: Callable[[], None],
    cuda: bool,
) -> None:
    """Connect a Trainer entry point (fit, validate, ...) to the job's store (the supervisor's, or one served
    by rank 0 under an outside launcher) and start its membership (heartbeat); the process group comes with
    the generation. The first entry point of a supervised worker is the elastic one; any later one (a test
    after the fit, a second Trainer) runs on the layout it finds, under its own prefix of the store."""
    timeout = options.timeout
    members.backend = members.backend or ("nccl" if cuda else "gloo")
    if env is None:
        set_world_ranks()
        check_world_size(members.nproc, options.num_stages)
        warn_nccl_env(members.backend)
    base = connect(env, cluster, members.rank, members.nproc, timeout)
    entry = next_entry(base)
    if env is None and entry == 1 and members.nproc > 1:  # once per job, at its first entry point
        rank_zero_info(
            "Bamboo: the ranks were started by an outside launcher (or Lightning's, on several nodes): a "
            "lost worker ends the job. Surviving it needs Bamboo's launcher: start the script plainly "
            "(python train.py, Trainer(devices=N)) or with python -m lightning_bamboo.launch"
        )
    elastic = env is not None and entry == 1
    members.start(base if entry == 1 else dist.PrefixStore(f"entry{entry}", base), elastic, options.heartbeat)
    if not elastic:
        return
    assert env is not None and trainer is not None and members.store is not None
    if not env.joining:
        seconds = timeout.total_seconds() if timeout is not None else 30.0
        open_shared_loggers(trainer, members.store, members.nproc, members.rank, seconds)
    # generation 0's rank before it forms (members 0..N-1 in order; a joiner's id is >= N), so Lightning's
    # rank-zero-only parts (progress bar, logging) start on one member only
    members.rank = members.member
    set_world_ranks()
    warn_nccl_env(members.backend)
    watch_sigterm(trainer, drain_on_sigterm)


def warn_nccl_env(backend: str | None) -> None:
    """On NCCL, warn (rank zero) naming the variables of :data:`~.protocol.nccl_env.NCCL_ENV` this worker
    lacks: another launcher (torchrun, SLURM), or Bamboo's with ``BAMBOO_NCCL_ENV=0``."""
    if nccl_env.uses_nccl(backend) and (names := nccl_env.missing()):
        rank_zero_warn(nccl_env.warning(names))


def set_rank_zero(rank: int) -> None:
    """Lightning's rank-zero-only parts follow ``rank`` (-1: none of them runs here)."""
    rank_zero_only.rank = utils_rank_zero_only.rank = rank  # type: ignore[attr-defined]


def open_shared_loggers(
    trainer: pl.Trainer, store: dist.Store, nproc: int, rank: int, timeout: float
) -> None:
    """Give every member of generation 0 the same logger version, opened, so whichever member is rank 0
    after a failover logs on into the run's one folder (one version per run, every step once).

    Every member reads its loggers' next free version before any creates a folder (a store barrier), then
    opens the logger (``experiment``: CSVLogger's writer, which would delete a ``metrics.csv`` it found
    if it were first opened after a failover) before anything is logged (a second barrier). Loggers open
    their experiment on rank zero only, so every member counts as rank zero while it opens its own (a
    worker otherwise counts as its member id until generation 0 forms).
    """
    loggers = trainer.loggers
    for logger in loggers:
        _ = logger.version  # CSV/TensorBoard: the next free version; nothing is created yet
    ms.store_barrier(store, "loggers/versions_read", nproc, timeout)
    set_rank_zero(0)
    try:
        for logger in loggers:
            _ = logger.experiment
    finally:
        set_rank_zero(rank)
    ms.store_barrier(store, "loggers/opened", nproc, timeout)


def watch_sigterm(trainer: pl.Trainer | None, drain_on_sigterm: bool) -> None:
    """With ``drain_on_sigterm``, make sure a :class:`BambooNotices` watches for SIGTERM (added before
    Lightning's ``setup`` hooks). It goes before ``BambooMetrics`` (a drain is counted in its step's
    metrics) and the checkpoint callbacks (Lightning keeps those last); other callbacks keep their order.
    """
    if not drain_on_sigterm or trainer is None:
        return
    callbacks = trainer.callbacks
    if not any(isinstance(callback, BambooNotices) for callback in callbacks):
        after = [i for i, c in enumerate(callbacks) if isinstance(c, (BambooMetrics, Checkpoint))]
        callbacks.insert(after[0] if after else len(callbacks), BambooNotices())


def agreed_rng_state(store: dist.Store, state: torch.Tensor) -> torch.Tensor:
    """The global generator's state at the start of ``fit`` as the first member to ask had it, so every
    member (a joiner too) draws ``auto``'s shuffle from the same state (:mod:`.data_order`)."""
    mine = base64.b64encode(state.numpy().tobytes()).decode()
    agreed = store.compare_set("data/rng_at_start", "", mine).decode()
    return torch.frombuffer(bytearray(base64.b64decode(agreed)), dtype=torch.uint8)


def check_world_size(nproc: int, num_stages: int) -> None:
    if nproc % num_stages != 0:
        hint = (
            " (one process: set Trainer(devices=N), or start workers with python -m "
            "lightning_bamboo.launch --nproc N)" if nproc == 1 else ""
        )
        raise ValueError(
            f"num_stages ({num_stages}) does not divide world_size ({nproc}): "
            f"{nproc} % {num_stages} = {nproc % num_stages}; "
            f"world_size must be num_stages x num_pipelines{hint}"
        )


def check_precision(plugin: Precision) -> None:
    if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
        raise ValueError(
            "BambooStrategy does not support precision='16-mixed' (its gradient scaler needs a loss "
            "scaled on every stage); use '32-true', '64-true' or 'bf16-mixed'"
        )


def check_setup(
    trainer: pl.Trainer, module: pl.LightningModule, plugin: Precision, checkpoint_every: int | None
) -> None:
    """Refuse what the pipeline cannot run, before anything is split."""
    check_precision(plugin)
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, StochasticWeightAveraging):
            raise ValueError(
                "BambooStrategy does not support StochasticWeightAveraging: the callback copies the whole "
                "model in its setup hook, before BambooStrategy splits it into stages, and later copies the "
                "stage's parameters into that copy by position (it would fail with 'shape [32] doesn't "
                "match [96, 32]' when averaging starts). Train without it, or average consolidated "
                "checkpoints (lightning_bamboo.consolidate_checkpoint) after training"
            )
        if isinstance(callback, ModelSummary) and module.example_input_array is not None:
            raise ValueError(
                f"{type(module).__name__}.example_input_array with Lightning's model summary: the summary "
                "runs it through the whole module on rank 0 alone, but under BambooStrategy each process "
                "holds one pipeline stage (its layers' parameters are summarized without an example input). "
                "Pass Trainer(enable_model_summary=False), or set example_input_array = None when training "
                "with BambooStrategy"
            )
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
    if trainer.accumulate_grad_batches != 1 and checkpoint_every is not None:
        raise ValueError(
            "BambooStrategy's checkpoint fallback re-runs whole steps of one batch each: "
            f"accumulate_grad_batches={trainer.accumulate_grad_batches} with checkpoint_every_n_steps="
            f"{checkpoint_every} is not supported; use one of them"
        )


def param_group_names(module: pl.LightningModule) -> list[list[str]]:
    """The parameter names of each param group ``configure_optimizers`` builds over the whole model (read
    before the split): an ordinary checkpoint's optimizer state is positional over exactly these groups."""
    optimizers, _ = _private.init_optimizers(module)
    if not optimizers:
        return []
    names = {id(p): n for n, p in module.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in optimizers[0].param_groups]


def fixed_ranks(
    members: Membership, cluster: ClusterEnvironment, rank: int, world: int, num_stages: int
) -> None:
    """The ranks of a job an outside launcher started (torchrun, SLURM, Lightning's on several nodes): fixed
    for the job, from the cluster environment."""
    cluster.set_global_rank(rank)
    cluster.set_world_size(world)
    members.rank = members.member = cluster.global_rank()
    members.world = members.nproc = cluster.world_size()
    if members.nproc > 1:  # devices=1 may be one worker of the launch CLI: checked at fit
        check_world_size(members.nproc, num_stages)


def check_one_optimizer(optimizers: list[Optimizer]) -> None:
    if len(optimizers) != 1:
        raise ValueError(
            f"BambooStrategy supports exactly one optimizer, configure_optimizers returned {len(optimizers)}"
        )


def training_loader(
    dataloader: object, trainer: pl.Trainer, agreed_rng_state: Callable[[], torch.Tensor], members: Membership
) -> object:
    """The training loader as the strategy iterates it: an ordinary ``DataLoader`` in the order the sampler
    wrote (:mod:`lightning_bamboo.runtime.data_order`, one order agreed by every member), its position in the
    epoch checkpoint state (:mod:`lightning_bamboo.step.progress`), and a joiner's loader starting at the
    batch the job is at (how many to skip is known when the joiner forms, on_train_start, before the first
    fetch)."""
    if isinstance(dataloader, DataLoader):
        dataloader = in_written_order(dataloader, _private.train_loader_source(trainer), agreed_rng_state)
    if members.joining_setup and members.skip is None:
        loader = skip_first_batches(dataloader, 0)  # type: ignore[arg-type]
        members.skip = loader.batch_sampler
        return loader
    return resumable(dataloader)


_DESTROY_AT_EXIT = False  # _destroy_process_group is registered with atexit (once per process)


def destroy_process_group_at_exit() -> None:
    """The process group stays after ``fit`` (``trainer.save_checkpoint`` afterwards is collective) until the
    next entry point forms its own, or the interpreter exits (a gloo group left to interpreter shutdown can
    abort the process)."""
    global _DESTROY_AT_EXIT
    if not _DESTROY_AT_EXIT:
        atexit.register(_destroy_process_group)
        _DESTROY_AT_EXIT = True


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def end_if_departed(members: Membership, step: int) -> None:
    """A drained member's ``fit`` has ended (teardown hooks ran, loggers were finalized): end the process with
    exit code 0 instead of returning into the script (:class:`BambooDeparted` says why)."""
    if members.departed and not members.left:
        members.left = True
        set_rank_zero(-1)
        raise BambooDeparted(members.member, step)
