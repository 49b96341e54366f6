"""Launch and store wiring of :class:`~lightning_bamboo.strategy.BambooStrategy`, as functions of what they
need: the job's store (one connection per process, a prefix per Trainer entry point), the loggers every
member of generation 0 opens alike, the notices callback added for SIGTERM, and the checks of a trainer and
module made before anything is split.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch.callbacks import Checkpoint, StochasticWeightAveraging
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from lightning_bamboo import _private
from lightning_bamboo.callbacks import BambooMetrics, BambooNotices
from lightning_bamboo.elastic import store as ms

if TYPE_CHECKING:
    import lightning.pytorch as pl

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


def check_options(num_stages: int, num_microbatches: int, redundancy: bool, replica_device: str,
                  keyed_rng: bool) -> None:
    """The strategy's constructor arguments, each with what was expected."""
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
    if not isinstance(keyed_rng, bool):
        raise TypeError(f"keyed_rng must be True or False, got {keyed_rng!r}")


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
