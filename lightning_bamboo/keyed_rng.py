"""Random numbers of the pipeline's training forwards, keyed by (seed, step, pipeline, micro-batch, stage).

Under Bamboo the same layers run forward in several places: stage ``s``'s own forward (``F``), its
predecessor's redundant forward of the replica (``FR``), and, after a failover, the re-run of the aborted step
on a member that runs several original stages fused as one position. Dropout drawn from each process's own
global generator would give each of them other masks: ``FR`` would not equal ``F``, and a run with a failover
would not equal the uninterrupted one.

So the engine runs each training forward inside :meth:`KeyedForward.keyed`: the global generators (CPU, and
the device's) are forked, seeded with :func:`forward_key` of the original stage before that stage's layers
run (a fused position reseeds at every original stage it holds), and restored afterwards. The same layers on
the same micro-batch of the same step draw the same numbers wherever and however often they run, and code
outside the pipeline sees a random stream that does not depend on the schedule.

The seed is ``seed_everything``'s (Lightning exports it as ``PL_GLOBAL_SEED``), else :data:`DEFAULT_SEED`.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Iterator, Sequence
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
        ValueError: ``PL_GLOBAL_SEED`` is set but is not an integer.
    """
    value = os.environ.get(SEED_ENV)
    if value is None or value == "":
        return DEFAULT_SEED
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"{SEED_ENV} must be an integer seed (as lightning.seed_everything sets it), got {value!r}"
        ) from None


def forward_key(seed: int, step: int, pipeline: int, microbatch: int, stage: int) -> int:
    """The 64-bit seed of one original stage's forward of one micro-batch: a stable hash (BLAKE2b), the same
    in every process, Python and PyTorch version, so a replica and a re-run draw what the stage drew.

    ``pipeline`` is the data-parallel pipeline (its id in the elastic ownership map), so pipelines that train
    on other samples at the same micro-batch index draw other masks.
    """
    parts = (seed, step, pipeline, microbatch, stage)
    digest = hashlib.blake2b(struct.pack("<5q", *parts), digest_size=8, person=b"bamboo-rng").digest()
    return int.from_bytes(digest, "little")


class KeyedForward:
    """A stage's (or replica's) forward split into runs of consecutive layers of one original stage each.

    Args:
        module: the layers this rank runs as one position (its stage, or its replica of the successor).
        stage_layers: the body's layers of each original stage (``StageLayout.stage_layers``); a
            :class:`StageSequential`'s children are named by their index in the body, which maps each to its
            original stage. ``None``, or a module that is not a ``StageSequential`` (standalone use): the
            whole module is one run of ``default_stage``.
        default_stage: the original stage of the whole module when it cannot be split.
        device: where the module runs: its generator is forked and seeded besides the CPU's.
        seed: the run's seed (:func:`run_seed`).
    """

    def __init__(
        self,
        module: nn.Module,
        stage_layers: Sequence[range] | None,
        default_stage: int,
        device: torch.device,
        seed: int,
    ) -> None:
        self.runs = _runs(module, stage_layers, default_stage)
        """``(original stage, forward)`` in the order the module runs them."""
        self.device = device
        self.seed = seed
        self._device_module = None if device.type == "cpu" else torch.get_device_module(device.type)
        index = device.index
        if self._device_module is not None and index is None:
            index = self._device_module.current_device()
        self._device_index = index

    @property
    def stages(self) -> list[int]:
        """The original stages the module runs, in order."""
        return [stage for stage, _ in self.runs]

    @contextmanager
    def keyed(self, step: int, pipeline: int, microbatch: int) -> Iterator[Forward]:
        """Fork the generators and seed them for the first original stage; yields the module's forward,
        which reseeds before every further original stage's layers.

        What runs in the block before the forward (stage 0's ``pipeline_inputs``) draws from the first
        stage's key, and what runs after it (the last stage's ``pipeline_loss``) continues the last stage's
        stream: on whichever rank, as ``F`` or ``FR``, in the same order.
        """
        keys = [forward_key(self.seed, step, pipeline, microbatch, stage) for stage in self.stages]
        devices = [] if self._device_module is None else [self._device_index]
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            self._seed(keys[0])

            def forward(value: Any) -> Any:
                for i, (key, (_, run)) in enumerate(zip(keys, self.runs, strict=True)):
                    if i:
                        self._seed(key)
                    value = run(value)
                return value

            yield forward

    def _seed(self, key: int) -> None:
        """Seed the CPU generator and this device's (not every device's, as ``torch.manual_seed`` would:
        only these two are forked)."""
        torch.default_generator.manual_seed(key)
        if self._device_module is not None:
            with self._device_module.device(self._device_index):
                self._device_module.manual_seed(key)


def _runs(
    module: nn.Module, stage_layers: Sequence[range] | None, default_stage: int
) -> list[tuple[int, Forward]]:
    """``module`` as ``(original stage, forward)`` runs: one run (the module itself) unless it holds layers
    of several original stages (a fused position after a failover)."""
    if stage_layers is None or not isinstance(module, StageSequential):
        return [(default_stage, module)]
    stage_of = {layer: stage for stage, layers in enumerate(stage_layers) for layer in layers}
    children = [(stage_of[int(name)], layer) for name, layer in module.named_children()]
    if len({stage for stage, _ in children}) <= 1:
        return [(children[0][0] if children else default_stage, module)]
    runs: list[tuple[int, list[nn.Module]]] = []
    for stage, layer in children:
        if runs and runs[-1][0] == stage:
            runs[-1][1].append(layer)
        else:
            runs.append((stage, [layer]))
    return [(stage, _Layers(layers)) for stage, layers in runs]


class _Layers:
    """Layers applied in order, as ``nn.Sequential.forward`` applies them (without registering them)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers = layers

    def __call__(self, value: Any) -> Any:
        for layer in self.layers:
            value = layer(value)
        return value
