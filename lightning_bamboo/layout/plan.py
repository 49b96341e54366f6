"""Which layers and ranks each pipeline stage has: the stage layout as data, re-plannable at run time.

Rank mapping: ``global rank = pipeline * num_stages + stage``. Ranks ``0..num_stages-1`` form pipeline 0,
the next ``num_stages`` ranks pipeline 1, and so on; the ranks holding the same stage (one per pipeline) form
that stage's data-parallel all-reduce group. Every stage ``s`` also keeps a replica of its successor
``(s + 1) % num_stages`` (Bamboo's redundancy ring), so after a preemption the layout is re-planned with
fewer stages instead of restarting from a checkpoint.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import torch

__all__ = ["StageLayout", "estimate_layer_costs", "partition_by_cost", "validate_microbatches"]


def partition_by_cost(costs: Sequence[float], num_stages: int) -> list[range]:
    """Split layers into ``num_stages`` contiguous, non-empty stages that minimise the largest stage cost.

    Exact dynamic programme over (layers used, stages used), O(layers^2 * stages). Among splits with the
    same largest cost it gives the last stage as many layers as it can (and so on backwards): in 1F1B rank
    ``r`` keeps up to ``num_stages - r`` micro-batches' activations alive, so early stages get the lighter
    share when it costs nothing.

    Args:
        costs: the cost of each layer of the pipeline body, in order; finite and >= 0.
        num_stages: how many stages to cut the body into; 1 <= num_stages <= len(costs).

    Raises:
        ValueError: on an empty or negative/non-finite cost, or an impossible ``num_stages``.
    """
    costs = [float(c) for c in costs]
    if not costs:
        raise ValueError("costs is empty: the pipeline body has no layers to partition")
    bad = [(i, c) for i, c in enumerate(costs) if not (c >= 0.0 and c != float("inf"))]
    if bad:
        raise ValueError(f"layer costs must be finite and >= 0, got {bad[0][1]} for layer {bad[0][0]}")
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an integer >= 1, got {num_stages!r}")
    if num_stages > len(costs):
        raise ValueError(
            f"num_stages ({num_stages}) is greater than the number of layers in the pipeline body "
            f"({len(costs)})"
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    @cache
    def best(end: int, stages: int) -> tuple[float, int]:
        """(smallest largest-stage cost, start of the last stage) for layers [0, end) in ``stages`` stages."""
        if stages == 1:
            return prefix[end], 0
        choice = (float("inf"), -1)
        for start in range(stages - 1, end):  # the last stage is [start, end), non-empty
            cost = max(best(start, stages - 1)[0], prefix[end] - prefix[start])
            if cost < choice[0]:
                choice = (cost, start)
        return choice

    bounds = [len(costs)]
    for stages in range(num_stages, 1, -1):
        bounds.append(best(bounds[-1], stages)[1])
    bounds.append(0)
    bounds.reverse()
    return [range(lo, hi) for lo, hi in itertools.pairwise(bounds)]


def estimate_layer_costs(
    layers: Sequence[torch.nn.Module], sample_input: torch.Tensor | None = None, repeats: int = 3
) -> list[float]:
    """Estimate each layer's relative cost, to feed ``partition_by_cost``.

    With ``sample_input``: run the layers in sequence under ``torch.no_grad`` (each layer gets the previous
    layer's output, so shapes are the real ones) ``repeats`` times and return each layer's median wall time in
    seconds; on CUDA the device is synchronised around each layer so the time is the kernel's, not the
    launch's. Without it: ``number of parameters + 1`` per layer (the ``+ 1`` keeps parameter-free layers
    such as activations from being free, so every stage still gets at least one layer's worth of work).

    Args:
        layers: the pipeline body's layers, in order.
        sample_input: a representative micro-batch for the first layer, on the device to time on.
        repeats: timed passes over all layers (after one untimed warm-up pass); the median is kept.
    """
    if sample_input is None:
        return [float(sum(p.numel() for p in layer.parameters()) + 1) for layer in layers]
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    sync = torch.cuda.synchronize if sample_input.is_cuda else (lambda: None)
    timings: list[list[float]] = [[] for _ in layers]
    with torch.no_grad():
        for attempt in range(repeats + 1):
            x = sample_input
            for index, layer in enumerate(layers):
                sync()
                start = time.perf_counter()
                x = layer(x)
                sync()
                if attempt > 0:  # the first pass warms up allocators and kernels
                    timings[index].append(time.perf_counter() - start)
    return [statistics.median(t) for t in timings]


def validate_microbatches(batch_size: int, num_microbatches: int) -> int:
    """Return the micro-batch size, or raise ValueError if the batch cannot be split evenly."""
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be an integer >= 1, got {num_microbatches!r}")
    if batch_size % num_microbatches:
        raise ValueError(
            f"batch size ({batch_size}) is not divisible by num_microbatches ({num_microbatches}): "
            f"{batch_size} % {num_microbatches} = {batch_size % num_microbatches}"
        )
    return batch_size // num_microbatches


@dataclass(frozen=True)
class StageLayout:
    """The plan of a job's pipelines: how many stages and data-parallel pipelines, and each stage's layers.

    Who runs which stage is the ownership map (:meth:`generation_zero` before any failover), never
    arithmetic here.

    Attributes:
        num_stages: pipeline length; stage ``s`` also holds the replica of stage ``(s + 1) % num_stages``.
        num_pipelines: data-parallel copies of the whole pipeline;
            ``world_size = num_stages * num_pipelines``.
        stage_layers: for each stage, the indices of its layers in the pipeline body (an ``nn.Sequential``);
            contiguous, non-empty, covering ``0..num_layers-1`` in order.
    """

    num_stages: int
    num_pipelines: int
    stage_layers: tuple[range, ...]

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
        if self.num_pipelines < 1:
            raise ValueError(f"num_pipelines must be >= 1, got {self.num_pipelines}")
        if len(self.stage_layers) != self.num_stages:
            raise ValueError(
                f"stage_layers has {len(self.stage_layers)} entries, "
                f"expected one per stage (num_stages = {self.num_stages})"
            )
        expected_start = 0
        for stage, layers in enumerate(self.stage_layers):
            if layers.step != 1 or len(layers) == 0 or layers.start != expected_start:
                raise ValueError(
                    f"stage {stage} has layers {layers}; stages must be non-empty, contiguous and in order "
                    f"(expected to start at layer {expected_start})"
                )
            expected_start = layers.stop

    @property
    def world_size(self) -> int:
        """Number of ranks the layout uses: ``num_stages * num_pipelines``."""
        return self.num_stages * self.num_pipelines

    @property
    def num_layers(self) -> int:
        """Layers in the pipeline body."""
        return self.stage_layers[-1].stop

    def generation_zero(self) -> dict[int, dict[int, int]]:
        """Who runs which stage before any failover, as the ownership map's data with ranks as members:
        ``{pipeline: {stage: pipeline * num_stages + stage}}`` (``OwnershipMap.pipelines`` of
        ``initial(num_stages, range(world_size))``). Every rank question (a rank's position, its pipeline's
        ranks, a stage's group) is :func:`lightning_bamboo.layout.view.view_of` of it: the one layout
        model."""
        stages = range(self.num_stages)
        return {p: {s: p * self.num_stages + s for s in stages} for p in range(self.num_pipelines)}

    def _check_stage(self, stage: int) -> None:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is outside 0..{self.num_stages - 1}")

    def successor(self, stage: int) -> int:
        """``(stage + 1) % num_stages``: the stage whose replica ``stage`` holds and runs ``FR`` for."""
        self._check_stage(stage)
        return (stage + 1) % self.num_stages

    def predecessor(self, stage: int) -> int:
        """``(stage - 1) % num_stages``: holds ``stage``'s replica and takes over when it fails."""
        self._check_stage(stage)
        return (stage - 1) % self.num_stages

    def describe(self, layer_names: Sequence[str] | None = None, costs: Sequence[float] | None = None) -> str:
        """A small table for logging: stage, ranks, layers, cost share, replica-of.

        Args:
            layer_names: optional name per layer of the body; the layers column then shows first..last name.
            costs: optional cost per layer; adds each stage's share of the total in percent.
        """
        for name, values in (("layer_names", layer_names), ("costs", costs)):
            if values is not None and len(values) != self.num_layers:
                raise ValueError(f"{name} has {len(values)} entries, the layout has {self.num_layers} layers")
        total = sum(costs) if costs is not None else 0.0
        grid = self.generation_zero()
        header = ["stage", "ranks", "layers", "cost", "replica-of"]
        rows = []
        for stage, layers in enumerate(self.stage_layers):
            span = f"{layers.start}-{layers.stop - 1}" if len(layers) > 1 else f"{layers.start}"
            if layer_names is not None:
                first, last = layer_names[layers.start], layer_names[layers.stop - 1]
                span += f" ({first}..{last})" if len(layers) > 1 else f" ({first})"
            share = "-"
            if costs is not None:
                share = f"{100 * sum(costs[i] for i in layers) / total:.1f}%" if total > 0 else "0.0%"
            replica = str(self.successor(stage)) if self.num_stages > 1 else "-"
            ranks = ",".join(str(owners[stage]) for owners in grid.values())
            rows.append([str(stage), ranks, span, share, replica])
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        return "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]
        )

    @classmethod
    def plan(cls, num_layers_costs: Sequence[float], world_size: int, num_stages: int) -> StageLayout:
        """Plan ``world_size`` ranks as ``num_stages`` cost-balanced stages x data-parallel pipelines.

        Args:
            num_layers_costs: one cost per layer of the pipeline body (see ``estimate_layer_costs``).
            world_size: number of ranks; must be a multiple of ``num_stages``.
            num_stages: pipeline length; 1 <= num_stages <= number of layers.

        Raises:
            ValueError: naming the bad value and the arithmetic that fails.
        """
        if not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"num_stages must be an integer >= 1, got {num_stages!r}")
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        if world_size % num_stages:
            raise ValueError(f"world_size ({world_size}) is not a multiple of num_stages ({num_stages})")
        stages = partition_by_cost(num_layers_costs, num_stages)
        return cls(num_stages=num_stages, num_pipelines=world_size // num_stages, stage_layers=tuple(stages))
