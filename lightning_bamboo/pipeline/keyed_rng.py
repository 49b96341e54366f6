"""Random numbers of the pipeline's training forwards, keyed by (seed, step, global micro-batch, layer).

Under Bamboo the same layers run forward in several places: stage ``s``'s own forward (``F``), its
predecessor's redundant forward of the replica (``FR``), and, after a failover, the re-run of the aborted step
on a member that runs several original stages fused as one position. Dropout drawn from each process's own
global generator would give each of them other masks: ``FR`` would not equal ``F``, and a run with a failover
would not equal the uninterrupted one.

So the engine runs each training forward inside :meth:`KeyedForward.keyed`: the global generators (CPU, and
the device's) are forked, seeded with :func:`forward_key` of each layer of the body just before that layer
runs, and restored afterwards. A layer draws the same numbers for the same micro-batch of the same step
wherever it runs: on its stage, in its replica, on a member that runs several original stages fused, in any
layout of the body into stages. Code outside the pipeline sees a random stream that does not depend on the
schedule.

The micro-batch in the key is the *global* micro-batch: the job cuts each global batch into a fixed number
of micro-batches (``num_microbatches`` x its pipelines at the start,
:func:`~lightning_bamboo.pipeline.microbatch.microbatch_shares`) and each pipeline runs a consecutive share of
them. No pipeline id is in the key, so a sample meets the same masks whichever pipeline runs it and however
many pipelines survive: losing a whole pipeline, a join or growing back leaves the masks as they were.

The seed is ``seed_everything``'s (Lightning exports it as ``PL_GLOBAL_SEED``), else :data:`DEFAULT_SEED`.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_bamboo.contract import StageSequential

SEED_ENV = "PL_GLOBAL_SEED"
"""Where ``lightning.seed_everything`` leaves its seed (inherited by the processes Lightning launches)."""
DEFAULT_SEED = 0
"""The seed of the keys when ``seed_everything`` was not called: every such run draws the same masks."""

Forward = Callable[[Any], Any]


def run_seed() -> int:
    """The run's seed: ``PL_GLOBAL_SEED`` (set by ``seed_everything``), else :data:`DEFAULT_SEED`.

    Raises:
        ValueError: ``PL_GLOBAL_SEED`` is set but is not an integer that fits in 64 bits (signed).
    """
    value = os.environ.get(SEED_ENV)
    if value is None or value == "":
        return DEFAULT_SEED
    try:
        seed = int(value)
    except ValueError:
        seed = None
    if seed is None or not -(2**63) <= seed < 2**63:
        raise ValueError(
            f"{SEED_ENV} must be an integer seed in [-2**63, 2**63) (as lightning.seed_everything sets it), "
            f"got {value!r}"
        )
    return seed


def forward_key(seed: int, step: int, microbatch: int, layer: int) -> int:
    """The 64-bit seed of one layer's forward of one micro-batch: a stable hash (BLAKE2b), the same in every
    process, Python and PyTorch version, so a replica and a re-run draw what the stage drew.

    ``microbatch`` is the global micro-batch's index in the step's global batch (the job's fixed split,
    :func:`~lightning_bamboo.pipeline.microbatch.microbatch_shares`): pipelines train other micro-batches,
    so they draw other masks, and no pipeline id is needed (it would change the masks when the pipelines
    change). ``layer`` is the layer's index in the whole body (a module the engine cannot see the layers of
    is keyed by its stage index instead).
    """
    parts = (seed, step, microbatch, layer)
    digest = hashlib.blake2b(struct.pack("<4q", *parts), digest_size=8, person=b"bamboo-rng").digest()
    return int.from_bytes(digest, "little")


_PER_DEVICE = ("current_device", "device", "manual_seed", "get_rng_state", "set_rng_state")
"""What a device module needs here: fork and seed one device's generator (``torch.cuda``, ``torch.xpu``)."""
INPUTS = -1
"""The key's ``layer`` of what runs before the first layer of a ``StageSequential`` (stage 0's
``pipeline_inputs``, in ``F`` and in the last rank's ``FR``)."""


class KeyedForward:
    """Runs a stage's (or replica's) forward with each layer's random numbers keyed by its index in the body.

    Args:
        module: the layers this rank runs as one position (its stage, or its replica of the successor). A
            :class:`StageSequential` (children named by their index in the body) reseeds before each layer
            (its ``before_layer``). Any other module (standalone use with a plain ``nn.Sequential``) is one
            unit keyed by ``default_unit``.
        default_unit: the key's ``layer`` for a module that is not a ``StageSequential`` (its stage index).
        device: where the module runs: its generator is forked and seeded besides the CPU's.
        seed: the run's seed (:func:`run_seed`).
    """

    def __init__(self, module: nn.Module, default_unit: int, device: torch.device, seed: int) -> None:
        self.module = module
        self.default_unit = default_unit
        self.device = device
        self.seed = seed
        backend = None if device.type == "cpu" else torch.get_device_module(device.type)
        if backend is not None and not all(hasattr(backend, name) for name in _PER_DEVICE):
            raise ValueError(
                f"keyed random numbers need a device with per-device generators (cpu, cuda, xpu), got "
                f"{device.type!r}; turn them off (keyed_rng=False) to train on it"
            )
        self._device_module = backend
        index = device.index
        if backend is not None and index is None:
            index = backend.current_device()
        self._device_index = index

    @contextmanager
    def keyed(self, step: int, microbatch: int) -> Iterator[Forward]:
        """Fork the generators and seed them for global micro-batch ``microbatch`` of ``step``; yields the
        module, whose every layer reseeds with its own key just before it runs (for the block only).

        What runs in the block before the forward (stage 0's ``pipeline_inputs``) draws from the
        :data:`INPUTS` key, and what runs after it (the last stage's ``pipeline_loss``) continues the last
        layer's stream: on whichever rank, as ``F`` or ``FR``, in the same order. The module is called as a
        whole, so its own hooks run (the replica's pending update, a user's forward hook).
        """
        devices = [] if self._device_module is None else [self._device_index]
        stage = self.module if isinstance(self.module, StageSequential) else None

        def reseed(layer: int) -> None:
            self._seed(forward_key(self.seed, step, microbatch, layer))

        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            reseed(INPUTS if stage is not None else self.default_unit)
            if stage is None:
                yield self.module
                return
            stage.before_layer = reseed
            try:
                yield stage
            finally:
                stage.before_layer = None

    def _seed(self, key: int) -> None:
        """Seed the CPU generator and this device's (not every device's, as ``torch.manual_seed`` would:
        only these two are forked)."""
        torch.default_generator.manual_seed(key)
        if self._device_module is not None:
            with self._device_module.device(self._device_index):
                self._device_module.manual_seed(key)
