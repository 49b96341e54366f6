"""The private Lightning and torch names ``lightning_dorylus`` relies on (``lightning_dorylus._lightning``),
and the ``DDPStrategy`` hooks ``DorylusStrategy`` overrides, still exist and behave as it expects: a version
that changes one fails here, not as a model silently wrapped in ``DistributedDataParallel`` or a hung
collective.
"""

from __future__ import annotations

import datetime
import inspect
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_dorylus import DorylusStrategy, lost_server
from lightning_dorylus import _lightning as _private
from lightning_dorylus.data import partition_graph
from tests.dorylus.scripts.exact_run import INTERVAL_SIZE, loader, make_graph, make_model


def test_the_strategy_registry_type_registers_and_answers_membership() -> None:
    assert isinstance(StrategyRegistry, _private.StrategyRegistry)
    assert callable(getattr(_private.StrategyRegistry, "register", None))
    assert "dorylus" in StrategyRegistry and "dorylus_inline" in StrategyRegistry


def test_flat_bucket_round_trip() -> None:
    """``post_backward`` all-reduces the gradients as one flat bucket and copies them back."""
    grads = [torch.arange(6.0).reshape(2, 3), torch.tensor([7.0]), torch.ones(2, 2)]
    bucket = _private.flatten_dense_tensors(grads)
    assert bucket.shape == (11,)
    for grad, back in zip(grads, _private.unflatten_dense_tensors(bucket, grads)):
        assert back.shape == grad.shape and torch.equal(back, grad)


def test_process_group_helpers_in_a_one_process_group(tmp_path: Path) -> None:
    """``distributed_is_initialized`` tells whether a group exists; ``sync_module_states`` gives every replica
    rank 0's parameters and buffers (a no-op on one rank); ``destroy_dist_connection`` ends the group (what
    the strategy registers at exit). Also the group's store, which ``lost_server`` reads through torch's
    private ``_get_default_store``."""
    if dist.is_initialized():
        pytest.skip("a process group is already open in this process")
    assert _private.distributed_is_initialized() is False
    assert list(inspect.signature(_private.sync_module_states).parameters) == ["module"]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert _private.distributed_is_initialized() is True
        module = nn.BatchNorm1d(3)
        before = {k: v.clone() for k, v in module.state_dict().items()}
        _private.sync_module_states(module)
        assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
        # torch's private accessor lost_server reads (it falls back to the backend's error without it)
        assert lost_server.process_group_store() is not None
    finally:
        _private.destroy_dist_connection()
    assert _private.distributed_is_initialized() is False
    _private.destroy_dist_connection()  # harmless without a group (atexit may run it after teardown)


def test_ddp_constructor_takes_the_options_dorylus_passes_on() -> None:
    """``DorylusStrategy`` hands ``process_group_backend``, ``timeout`` and ``start_method`` to
    ``DDPStrategy``, whose launcher and ``setup_distributed`` read them."""
    params = inspect.signature(DDPStrategy.__init__).parameters
    assert {"process_group_backend", "timeout", "start_method"} <= set(params)
    strategy = DorylusStrategy(process_group_backend="gloo", timeout=datetime.timedelta(seconds=7))
    assert strategy.process_group_backend == "gloo"
    assert strategy._timeout == datetime.timedelta(seconds=7)
    assert strategy._start_method == "popen"
    for hook in ("setup_distributed", "set_world_ranks", "configure_ddp", "_configure_launcher", "setup"):
        assert callable(getattr(DDPStrategy, hook, None)), hook


@pytest.mark.parametrize(("start_method", "launcher"), [("popen", _SubprocessScriptLauncher),
                                                        ("spawn", _MultiProcessingLauncher),
                                                        ("fork", _MultiProcessingLauncher)])
def test_ddps_launcher_follows_start_method(start_method: str, launcher: type) -> None:
    strategy = DorylusStrategy(start_method=start_method, cluster_environment=LightningEnvironment(),  # type: ignore[arg-type]
                               parallel_devices=[torch.device("cpu")] * 2)
    strategy._configure_launcher()
    assert isinstance(strategy.launcher, launcher)
    if start_method != "popen":
        assert strategy.launcher._start_method == start_method  # type: ignore[union-attr]


def test_lightning_treats_dorylus_as_distributed() -> None:
    """``self.log(..., sync_dist=True)`` reduces over graph servers only where Lightning's connector says
    the strategy is distributed (a ``DDPStrategy`` is, without asking its deprecated property)."""
    trainer = Trainer(strategy=DorylusStrategy(executor="inline"), accelerator="cpu", devices=2, logger=False)
    assert trainer._accelerator_connector.is_distributed


class _Seen(Callback):
    def __init__(self) -> None:
        self.models: list[tuple[bool, bool, object]] = []

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        model = trainer.strategy.model
        layer_sync = getattr(trainer.strategy, "_layer_sync", "missing")
        self.models.append((isinstance(model, DistributedDataParallel), model is pl_module, layer_sync))


def test_ddp_setup_wraps_only_through_configure_ddp(tmp_path: Path) -> None:
    """``DDPStrategy.setup`` reaches ``DistributedDataParallel`` only through ``configure_ddp`` (which
    ``DorylusStrategy`` overrides: rank 0's weights, no wrapper) and applies the plugin of
    ``Trainer(sync_batchnorm=True)`` from ``_layer_sync`` (which ``DorylusStrategy`` clears: its
    GraphBatchNorm syncs already); a fit with both sees the user's module itself, unwrapped."""
    assert "_layer_sync" in inspect.getsource(DDPStrategy.setup)
    partitions = partition_graph(make_graph(), 1, partitioner="metis", interval_size=INTERVAL_SIZE)
    seen = _Seen()
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                      sync_batchnorm=True, callbacks=[seen],
                      strategy=DorylusStrategy(executor="inline", timeout=datetime.timedelta(seconds=30)))
    try:
        trainer.fit(make_model("gcn"), train_dataloaders=loader(partitions[0]),
                    val_dataloaders=loader(partitions[0]))
    finally:  # a 1-process group was created in this (pytest) process; leave nothing behind
        if dist.is_initialized():
            dist.destroy_process_group()
    assert trainer._accelerator_connector._layer_sync is not None  # the plugin was given to the strategy
    assert seen.models == [(False, True, None)]
