"""A Callback that measures a job's own first steps under ``strategy="bamboo"`` and writes its costs file.

    Trainer(strategy="bamboo", callbacks=[AdvisorProbe("bamboo_costs.json", checkpoint_every=10)], ...)
    python -m lightning_bamboo.advise --costs bamboo_costs.json --trace data/spot-traces/aws-p3-trace.csv

After ``warmup_steps`` steps it measures ``steps`` steps (the step time, and per stage, from the engine's
per-action times, compute, replica forward and bubble), ``steps`` more with the replica forwards switched off
(``BambooStrategy.set_forward_redundancy``: the step without redundancy, measured in the same run) and timed
checkpoint saves of the state, then gathers every rank's figures (one float64 row per rank,
``torch.distributed.all_gather``) and rank 0 writes the costs file. The steps it does not measure are the
*validation window* (after the measured ones, or alternating with them in ``block_steps``): the advisor's
projection of this very configuration must predict their throughput (``sim_error``). docs/bamboo-advise.md.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_bamboo.advise import costs_file
from lightning_bamboo.advise.timing import (
    StepParts,
    median_of_means,
    module_bytes,
    optimizer_state_bytes,
    process_start_time,
    step_parts,
)
from lightning_bamboo.simulate.costs import DEFAULT_COSTS, PRODUCER, load_costs

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[2]


def default_reference() -> Path:
    """The live preemption benchmark's committed costs of this checkout, else ``DEFAULT_COSTS`` under the
    working directory."""
    packaged = REPO / DEFAULT_COSTS
    return packaged if packaged.is_file() else DEFAULT_COSTS


def batch_size(batch: Any) -> int:
    """Samples in ``batch``: the first dimension of its first tensor (a tensor, or a tuple/list/dict)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        try:
            return batch_size(item)
        except ValueError:
            continue
    raise ValueError(f"cannot tell the number of samples of a batch of type {type(batch).__name__}; "
                     "pass AdvisorProbe(samples_per_step=...)")


@dataclass
class Window:
    """The validation window as rank 0 saw it: each step's time, each checkpoint's save."""

    step_s: list[float] = field(default_factory=list)
    checkpoint_s: list[float] = field(default_factory=list)

    @property
    def total_s(self) -> float:
        """The window's wall time as it ran, every stall in it."""
        return sum(self.step_s) + sum(self.checkpoint_s)

    @property
    def wall_s(self) -> float:
        """The window's wall time with the step and the save each taken as the measured costs are (median of
        means, median): a one-off stall of the machine moves neither the costs nor the window they are checked
        against."""
        saves = len(self.checkpoint_s) * statistics.median(self.checkpoint_s) if self.checkpoint_s else 0.0
        return len(self.step_s) * median_of_means(self.step_s) + saves


class AdvisorProbe(Callback):
    """Measures this job's costs for the preflight advisor (``python -m lightning_bamboo.advise``).

    Args:
        path: the costs file (rank 0 writes it; a file of the same job measured at another layout or with
            redundancy off is merged, so runs at several configurations fill one file).
        steps: steps measured, after ``warmup_steps`` unmeasured ones.
        measure_without_fr: in a run with redundancy, also measure ``steps`` steps with the replica forwards
            (``FR``) switched off, in their own blocks between the measured and the validation ones (the
            replica is still exchanged and stepped, so a failover is covered as before and training is
            unchanged): the step without redundancy is then measured, not estimated from the ``FR`` time.
        warmup_steps: steps left out (the first steps build caches and allocate).
        checkpoint_every: save a checkpoint every this many measured steps (``checkpoint_s`` is their mean
            save) and every this many validation steps (the window then holds what checkpointing costs);
            each is timed, then removed. ``None``: one save, after the measured steps.
        block_steps: blocks of this many measured steps, steps without ``FR`` (``measure_without_fr``) and
            validation steps follow one another in turn until both sets are measured, and the validation
            window is the validation blocks (default ``steps``: the measured steps first, then those without
            ``FR``, then every later step is the window). Small blocks make the measurement robust to a
            machine whose load changes (every set sees the same load).
        reference: costs file of the live preemption benchmark (``benchmarks/bamboo_preemption.py``), for
            the costs the first steps cannot show (failover, rejoin, killing a job); default: this
            checkout's ``benchmarks/results/bamboo_preemption.json``.
        modes_reference: results of the recovery modes benchmark (``benchmarks/bamboo_modes.py``), which
            price a failover under ``recovery="peers"`` against the reference's (the ratio of the two modes'
            failover medians on the same machines); default: this checkout's
            ``benchmarks/results/bamboo_modes.json`` if present, else the advisor prices a peers failover
            as the reference's and says so.
        samples_per_step: samples of one global step; default: the batch's first dimension times the
            data-parallel shards of the sampler.
        model: how the costs file names the job (default: the LightningModule's class and the parameters its
            stages train); runs merge into one file only for the same name and global batch.
        checkpoint_dir: where the timed checkpoints go (default: ``<default_root_dir>/advisor-probe``).
    """

    def __init__(
        self,
        path: str | Path = "bamboo_costs.json",
        steps: int = 20,
        warmup_steps: int = 5,
        checkpoint_every: int | None = None,
        measure_without_fr: bool = True,
        block_steps: int | None = None,
        reference: str | Path | None = None,
        modes_reference: str | Path | None = None,
        samples_per_step: float | None = None,
        model: str | None = None,
        checkpoint_dir: str | Path | None = None,
    ) -> None:
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"AdvisorProbe(steps=...) must be an integer >= 1, got {steps!r}")
        if not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"AdvisorProbe(warmup_steps=...) must be an integer >= 1, got {warmup_steps!r}")
        if block_steps is not None and (not isinstance(block_steps, int) or block_steps < 1):
            raise ValueError(f"AdvisorProbe(block_steps=...) must be None or an integer >= 1, got "
                             f"{block_steps!r}")
        if checkpoint_every is not None and (not isinstance(checkpoint_every, int) or checkpoint_every < 1):
            raise ValueError(f"AdvisorProbe(checkpoint_every=...) must be None or an integer >= 1, got "
                             f"{checkpoint_every!r}")
        if not isinstance(measure_without_fr, bool):
            raise ValueError(f"AdvisorProbe(measure_without_fr=...) must be True or False, got "
                             f"{measure_without_fr!r}")
        self.path = Path(path)
        self.steps = steps
        self.warmup_steps = warmup_steps
        self.checkpoint_every = checkpoint_every
        self.block_steps = block_steps or steps
        self.measure_without_fr = measure_without_fr
        # the blocks' roles, in turn (without_fr dropped at setup for a run without redundancy)
        self._cycle = ("measure", "without_fr", "validate") if measure_without_fr else ("measure", "validate")
        self._interleaved = self.block_steps < steps
        self.reference_path = Path(reference) if reference is not None else default_reference()
        self.modes_path = Path(modes_reference) if modes_reference is not None else None
        self._modes: dict[str, Any] | None = None
        self.samples_per_step = samples_per_step
        self.model = model
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self._created = process_start_time()
        self._train_start = 0.0
        self._done = 0  # completed optimizer steps in this fit
        self._last_step = -1
        self._last_end = 0.0  # when the probe's own work at the previous step boundary ended
        self._first_step_s = 0.0
        self._intervals: list[float] = []
        self._without_fr: list[float] = []  # the intervals of the steps with FR switched off
        self._parts = StepParts()
        self._traced = 0
        self._saves: list[tuple[float, int]] = []  # (seconds, bytes) of the measured checkpoint saves
        self._batch_samples = 0
        self._world: Any = None
        self._active = False  # measuring or validating; off for good after a Bamboo event or in a joiner
        self._finished = False
        self._window = Window()
        self._window_open = True
        self.written: dict[str, Any] | None = None
        """The costs file's content, as rank 0 wrote it (``None`` on the other ranks)."""
    # ------------------------------------------------------------------ set-up
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        if not hasattr(strategy, "num_stages") or not hasattr(strategy, "redundancy"):
            raise ValueError(f"AdvisorProbe measures a Bamboo pipeline: Trainer(strategy='bamboo'), got "
                             f"{type(strategy).__name__}")
        if not self.reference_path.is_file():
            raise FileNotFoundError(
                f"AdvisorProbe(reference=...): {str(self.reference_path)!r} does not exist; it prices what a "
                f"run's first steps cannot show (failover, rejoin, killing a job); measure it with: "
                f"{PRODUCER}")
        self._reference = load_costs(self.reference_path)
        self._modes, self.modes_path = costs_file.load_modes_reference(self.modes_path,
                                                                      "AdvisorProbe(modes_reference=...)")
        if not strategy.redundancy:  # nothing to switch off: the measured steps are already without it
            self._cycle = ("measure", "validate")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Measure a fit from its start only: a resumed fit or a member that joined a running job (its
        steps would not line up with the others' for the probe's collective checkpoints) stays inert."""
        self._train_start = time.time()
        self._last_end = time.perf_counter()
        self._world = _world()
        self._active = trainer.global_step == 0
        if not self._active:
            rank_zero_warn(f"AdvisorProbe: the fit starts at step {trainer.global_step}, not 0: not measured")

    def _role(self, done: int) -> str:
        """``warmup``, ``measure``, ``without_fr`` or ``validate`` for step number ``done`` (1-based) of this
        fit: after the warm-up, blocks of ``block_steps`` steps take the roles of the cycle in turn until
        ``steps`` steps are measured (with FR, and without); every step after that validates."""
        k = done - self.warmup_steps - 1
        if k < 0:
            return "warmup"
        block, within = divmod(k, self.block_steps)
        role = self._cycle[block % len(self._cycle)]
        if role != "validate" and (block // len(self._cycle)) * self.block_steps + within < self.steps:
            return role
        return "validate"

    @property
    def _measured(self) -> bool:
        """Every measured step taken (with FR, and without where the cycle has them)."""
        return len(self._intervals) == self.steps and (
            "without_fr" not in self._cycle or len(self._without_fr) == self.steps)

    def _switch_forward_redundancy(self, trainer: pl.Trainer, enabled: bool) -> None:
        """Set the replica forwards of the next steps (every rank at this same step boundary: the schedule is
        collective); nothing in a run without them."""
        strategy: Any = trainer.strategy
        if "without_fr" in self._cycle and strategy.forward_redundancy != enabled:
            strategy.set_forward_redundancy(enabled)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if self._active and self._role(self._done + 1) == "measure" and hasattr(engine, "trace"):
            engine.trace = []  # type: ignore[union-attr]
        if not self._batch_samples:
            self._batch_samples = batch_size(batch)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._last_step:  # accumulating gradients: not a step boundary
            return
        now = time.perf_counter()
        self._last_step = trainer.global_step
        self._done += 1
        if self._done == 1:
            self._first_step_s = time.time() - self._train_start
        if trainer.global_step != self._done or _world() is not self._world:
            self._stop("the job re-formed or resumed", trainer)  # its steps no longer line up
        if not self._active:
            return
        role = self._role(self._done)
        if role == "measure":
            self._intervals.append(now - self._last_end)
            engine = getattr(trainer.strategy, "engine", None)
            trace = getattr(engine, "trace", None)
            if trace:
                self._parts.add(step_parts(trace))
                self._traced += 1
            if hasattr(engine, "trace"):
                engine.trace = None  # type: ignore[union-attr]
            if self.checkpoint_every and len(self._intervals) % self.checkpoint_every == 0:
                self._saves.append(self._timed_checkpoint(trainer))  # as the validation window takes them
            if self._measured:
                self._finish_measurement(trainer, pl_module)
        elif role == "without_fr":
            self._without_fr.append(now - self._last_end)
            if self._measured:
                self._finish_measurement(trainer, pl_module)
        elif role == "validate" and self._window_open and not (self._finished and self._interleaved):
            window = self._window
            window.step_s.append(now - self._last_end)
            if self.checkpoint_every and len(window.step_s) % self.checkpoint_every == 0:
                window.checkpoint_s.append(self._timed_checkpoint(trainer)[0])
        # the next step's replica forwards, switched here so that the switch is in no measured step
        self._switch_forward_redundancy(trainer, self._role(self._done + 1) != "without_fr")
        self._last_end = time.perf_counter()

    def _stop(self, why: str, trainer: pl.Trainer) -> None:
        """End measuring and validating for good (the steps before stay valid), with the replica forwards on
        again (every rank stops at the same event or step boundary)."""
        if self._active and not self._finished:
            rank_zero_warn(f"AdvisorProbe: {why} before the measurement ended: nothing written")
        self._active = False
        self._window_open = False
        self._switch_forward_redundancy(trainer, True)

    # ------------------------------------------------------------------ the measurement
    def _timed_checkpoint(self, trainer: pl.Trainer) -> tuple[float, int]:
        """Save one checkpoint of the whole state (every rank), time it, measure its bytes, remove it."""
        base = self.checkpoint_dir or Path(trainer.default_root_dir) / "advisor-probe"
        path = base / f"probe-step{trainer.global_step}.ckpt"
        start = time.perf_counter()
        trainer.save_checkpoint(path, weights_only=False)
        trainer.strategy.barrier("advisor-probe-checkpoint")
        seconds = time.perf_counter() - start
        size = 0
        if trainer.is_global_zero:
            files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
            size = sum(p.stat().st_size for p in files)
            trainer.strategy.remove_checkpoint(path)
            if base.is_dir() and not any(base.iterdir()):
                base.rmdir()
        trainer.strategy.barrier("advisor-probe-removed")
        return seconds, size

    def _finish_measurement(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finished = True
        strategy: Any = trainer.strategy
        if not self._saves:
            self._saves.append(self._timed_checkpoint(trainer))
        checkpoint_s = statistics.median(seconds for seconds, _ in self._saves)
        checkpoint_bytes = self._saves[0][1]
        params, param_bytes, optim_bytes = optimizer_state_bytes(trainer.optimizers)
        per_step = 1.0 / self._traced if self._traced else 0.0
        mine = costs_file.RankReport(
            stage=strategy.stage_index, pipeline=strategy.pipeline_index,
            step_s=median_of_means(self._intervals),
            compute_s=self._parts.compute_s * per_step, fr_s=self._parts.fr_s * per_step,
            wait_s=self._parts.wait_s * per_step, allreduce_s=self._parts.allreduce_s * per_step,
            parameters=params, parameter_bytes=param_bytes, optimizer_bytes=optim_bytes,
            replica_bytes=module_bytes(getattr(strategy, "replica", None)),
            startup_s=self._train_start - self._created if self._created is not None else 0.0,
            first_step_s=self._first_step_s, checkpoint_s=checkpoint_s,
            without_fr_s=median_of_means(self._without_fr) if self._without_fr else 0.0,
        )
        ranks = gather_rows(mine.row(), strategy.root_device)
        if not trainer.is_global_zero:
            return
        reports = [costs_file.RankReport.from_row(r) for r in ranks]
        num_stages = int(strategy.num_stages)
        replicas = strategy.distributed_sampler_kwargs.get("num_replicas", 1) \
            if hasattr(strategy, "distributed_sampler_kwargs") else 1
        trained = sum(int(r.parameters) for r in reports if int(r.pipeline) == 0)  # every stage, once
        run = costs_file.Run(
            model=self.model or f"{type(pl_module).__name__} ({trained} parameters)",
            num_stages=num_stages, pipelines=max(trainer.world_size // num_stages, 1),
            num_microbatches=int(strategy.num_microbatches), redundancy=bool(strategy.redundancy),
            samples_per_step=float(self.samples_per_step or self._batch_samples * replicas),
            warmup_steps=self.warmup_steps, steps=self.steps, checkpoint_bytes=checkpoint_bytes,
            block_steps=self.block_steps, without_fr_steps=len(self._without_fr),
        )
        data = costs_file.build(run, reports, self._reference, str(self.reference_path), self._modes,
                                str(self.modes_path))
        data["probe"][run.layout]["step_s_each_rank0"] = self._intervals
        if self._without_fr:
            data["probe"][run.layout]["without_fr_step_s_each_rank0"] = self._without_fr
        if self.path.is_file():
            data = costs_file.merge(json.loads(self.path.read_text()), data)
        self._run = run
        self._step_s = data["costs"]["step_s"]
        self.written = data
        costs_file.write(self.path, data)
        log.info("AdvisorProbe: wrote %s (%s, step %.4f s)", self.path, run.layout, self._step_s)

    # ------------------------------------------------------------------ the validation window
    def on_failover(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any,
                    **info: Any) -> None:
        """A Bamboo event ends the probe: it does not measure what failovers, rejoins, fallbacks and drains
        cost (the reference does), and the layout changes; the validation window is the steps before."""
        self._stop("a failover", trainer)

    def on_rejoin(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any,
                  **info: Any) -> None:
        self._stop("a rejoin", trainer)

    def on_fallback(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any,
                    **info: Any) -> None:
        self._stop("a fallback", trainer)

    def on_drain(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any,
                 **info: Any) -> None:
        self._stop("a drain", trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Rank 0 adds the validation window (the steps after the warm-up that were not measured; with
        alternating blocks, those up to the end of the measurement) to the costs file."""
        if self._active:  # the replica forwards on again for whatever runs next (no step runs in between)
            self._switch_forward_redundancy(trainer, True)
        if not self._finished:
            if self._active:
                rank_zero_warn(f"AdvisorProbe: training ended after {self._done} steps, before the "
                               f"measurement ({self.warmup_steps} warm-up + {self.steps} measured steps"
                               f"{f' + {self.steps} without FR' if 'without_fr' in self._cycle else ''}, "
                               f"in blocks of {self.block_steps} between validation ones): {self.path} not "
                               "written")
            return
        window = self._window
        if self.written is None or not trainer.is_global_zero or not window.step_s:
            return
        run = self._run
        system = "bamboo" if run.redundancy else "checkpoint_restart"
        steps, wall = len(window.step_s), window.wall_s
        samples = steps * run.samples_per_step
        entry: dict[str, Any] = {
            "layout": run.layout, "wall_s": wall, "steps": steps, "samples": samples,
            "samples_per_s": samples / wall, "wall_s_total": window.total_s,
            "samples_per_s_total": samples / window.total_s, "events": [],
            "initial_nodes": [f"rank{i}" for i in range(run.num_stages * run.pipelines)],
            "checkpoints": len(window.checkpoint_s), "checkpoint_s_each": window.checkpoint_s,
            "step_s_each_rank0": window.step_s, "block_steps": self.block_steps,
        }
        if self.checkpoint_every:
            entry["checkpoint_every_steps"] = self.checkpoint_every
            # training seconds between checkpoints, as the replay counts them: this many measured steps
            entry["checkpoint_interval_s"] = self.checkpoint_every * self._step_s
        data = json.loads(self.path.read_text()) if self.path.is_file() else self.written
        data.setdefault("live", {})[system] = entry
        self.written = data
        costs_file.write(self.path, data)


def _world() -> Any:
    """The current default process group (the elastic runtime makes a new one per generation)."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def gather_rows(row: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's ``row`` (same length on every rank), in rank order; ``[row]`` without a process group."""
    mine = torch.tensor(row, dtype=torch.float64, device=device)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [row]
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return [r.cpu().tolist() for r in rows]
