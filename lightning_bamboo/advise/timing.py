"""What one rank measures of its own steps: the engine's per-action times split into compute, replica forward
and waiting, its state's bytes, and when the OS started the process."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.optim import Optimizer


@dataclass
class StepParts:
    """Seconds of one step on one rank, from :attr:`lightning_bamboo.pipeline.engine.PipelineEngine.trace`.

    ``compute_s``: its own stage's forwards and backwards, less the receive waits inside them; ``fr_s``: the
    redundant forwards of the successor's replica (Bamboo's ``FR``); ``wait_s``: blocked on a neighbour
    (receive waits, then waiting for its sends at the end of the schedule) — the pipeline bubble as this rank
    sees it; ``allreduce_s``: the data-parallel gradient average and the loss broadcast.
    """

    compute_s: float = 0.0
    fr_s: float = 0.0
    wait_s: float = 0.0
    allreduce_s: float = 0.0

    def add(self, other: StepParts) -> None:
        self.compute_s += other.compute_s
        self.fr_s += other.fr_s
        self.wait_s += other.wait_s
        self.allreduce_s += other.allreduce_s


GROUPS = 5
"""Runs of consecutive steps a set of step times is cut into for :func:`median_of_means`."""


def median_of_means(values: Sequence[float], groups: int = GROUPS) -> float:
    """The median of the means of ``groups`` runs of consecutive ``values`` (sizes differ by at most one;
    fewer runs when there are fewer values).

    Why: a throughput pays every slow step, so a step time is a mean; but on a shared machine one scheduler
    stall of a few hundred ms moves the mean of 20 steps of 50 ms by 20-30 %. Whatever slows every run of
    steps (a collector, a slow step every few steps) is in every run's mean and stays; a one-off stall moves
    one run's mean and the median drops it.

    Raises:
        ValueError: for no values.
    """
    if not values:
        raise ValueError("median_of_means: no values")
    count = min(groups, len(values))
    size, extra = divmod(len(values), count)
    means, start = [], 0
    for group in range(count):
        end = start + size + (1 if group < extra else 0)
        means.append(statistics.fmean(values[start:end]))
        start = end
    return statistics.median(means)


def step_parts(trace: Iterable[tuple[str, float, float]]) -> StepParts:
    """Split one step's engine trace (``(event, start, end)``; event names as the engine writes them:
    ``F0,1``, ``B0,1``, ``FR1,0``, ``wait A1``, ``finish``, ``allreduce+loss``) into :class:`StepParts`.

    An action that takes a received tensor includes the wait for it (``wait ...`` events, recorded inside it),
    so the waits are taken off the compute and counted as waiting.
    """
    parts = StepParts()
    actions = waits = 0.0
    for name, start, end in trace:
        seconds = max(end - start, 0.0)
        if name.startswith("FR"):
            parts.fr_s += seconds
        elif name.startswith(("F", "B")):
            actions += seconds
        elif name.startswith("wait"):
            waits += seconds
        elif name == "finish":
            parts.wait_s += seconds
        elif name.startswith("allreduce"):
            parts.allreduce_s += seconds
    parts.compute_s = max(actions - waits, 0.0)
    parts.wait_s += waits
    return parts


def tensor_bytes(tensors: Iterable[object]) -> int:
    """Bytes of the distinct tensors among ``tensors`` (others ignored)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def optimizer_state_bytes(optimizers: Iterable[Optimizer]) -> tuple[int, int, int]:
    """``(parameters, parameter bytes, optimizer state bytes)`` of what ``optimizers`` train on this rank:
    the stage's trained state, what a checkpoint of it holds (the replica is a copy of the successor's)."""
    params: list[torch.Tensor] = []
    state: list[object] = []
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            params.extend(group["params"])
        for per_param in optimizer.state.values():
            state.extend(per_param.values())
    distinct = {id(p): p for p in params}.values()
    return sum(p.numel() for p in distinct), tensor_bytes(distinct), tensor_bytes(state)


def module_bytes(module: nn.Module | None) -> int:
    """Bytes of ``module``'s parameters (0 for ``None``)."""
    return 0 if module is None else tensor_bytes(module.parameters())


def process_start_time() -> float | None:
    """Wall time at which the OS created this process (``/proc/self/stat``, 10 ms ticks), before the
    interpreter imported anything; ``None`` where there is no ``/proc`` (then start-up is not measured)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    except (OSError, IndexError, ValueError, AttributeError):
        return None
    return time.time() - (boot - ticks / os.sysconf("SC_CLK_TCK"))
