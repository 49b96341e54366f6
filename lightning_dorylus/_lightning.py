"""Every private name of Lightning (and torch) that ``lightning_dorylus`` relies on, in one place.

``DorylusStrategy`` is a ``DDPStrategy`` that never wraps the model: it reduces the weight gradients itself
(one flat bucket, :meth:`~lightning_dorylus.strategy.DorylusStrategy.post_backward`) and so needs the few
helpers DDP's own wrapper and Lightning's strategies use internally: whether a process group exists, rank 0's
weights to every replica, the process-group teardown, the strategy registry's type and torch's flat gradient
bucket. ``tests/dorylus/test_private_api.py`` imports and exercises each (and the ``DDPStrategy`` hooks the
strategy overrides), so a Lightning or torch version that changes one fails there, loudly, instead of as a
wrapped model or a hung collective.
"""

from __future__ import annotations

from lightning.fabric.strategies import _StrategyRegistry as StrategyRegistry
from lightning.fabric.utilities.distributed import _destroy_dist_connection as destroy_dist_connection
from lightning.fabric.utilities.distributed import _distributed_is_initialized as distributed_is_initialized
from lightning.pytorch.overrides.distributed import _sync_module_states as sync_module_states
from torch._utils import _flatten_dense_tensors as flatten_dense_tensors
from torch._utils import _unflatten_dense_tensors as unflatten_dense_tensors

__all__ = [
    "StrategyRegistry",
    "destroy_dist_connection",
    "distributed_is_initialized",
    "flatten_dense_tensors",
    "sync_module_states",
    "unflatten_dense_tensors",
]
