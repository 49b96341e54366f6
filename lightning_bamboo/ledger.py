"""``BambooLedger``: a JSON-lines record of what every committed step trained on and what it produced.

Why: a fault-tolerant run claims that failovers and resumes change nothing, that every sample is trained on
exactly once and the global batch stays the same. The ledger makes that checkable after the fact: two runs'
ledgers are compared step by step with ``python -m lightning_bamboo.verify A B``.

One line per committed optimizer step, written by global rank 0 (the rank 0 of the current generation in an
elastic job)::

    {"step": 3, "epoch": 0, "samples": {"0": [17, 4, ...], "1": [...]}, "generation": 1,
     "owners": {...} | null, "digests": {"0": "<sha256 hex>", "1": "..."},
     "fingerprints": {"0": [sum, abs_sum, square_sum, signed_sum], "1": [...]}}

* ``step``: the step's index from 0 (``trainer.global_step - 1`` after it; the ``step`` of Bamboo's events).
* ``samples``: pipeline index -> the dataset indices that pipeline trained on in this step, in batch order
  (with ``accumulate_grad_batches`` > 1, those of every batch of the step). Every member loads the global
  batch and knows how the job's fixed split shares it, so every member reports every pipeline's samples: a
  pipeline lost after the commit, members and replicas together, still has its samples in the line.
* ``generation``/``owners``: the elastic job's generation and ownership map the step committed under
  (``OwnershipMap.to_json``); ``null`` without one.
* ``digests``: stage -> sha256 over the raw bytes of that stage's parameters (layer by layer, each
  parameter's name, dtype and shape, then its bytes). Every pipeline holds the same stage; a stage whose
  holders disagree is also listed under ``"mismatch"`` with every digest seen.
* ``fingerprints``: stage -> four float64 sums over that stage's parameters (their values, absolute values,
  squares, and values times a fixed pseudo-random sign per element): what ``verify`` compares when two
  runs' digests differ, to tell rounding (the gradients of a step reduced in another order, e.g. over
  another number of pipelines after one was lost) from a different model.

A one-process run (``strategy="auto"`` on one device) is recorded too, as one pipeline: its samples are
worked out from the loader's sampler as ``fit`` draws them
(:class:`~lightning_bamboo.runtime.data_order.AutoBatches`;
a ``DataLoader`` with a ``batch_size``), and it has no stage digests (``verify`` then compares samples only),
so a Bamboo run can be checked against the same script run in one process.

Nothing is pickled on the way to rank 0: the static strategy's ranks all-gather JSON bytes as ``uint8``
tensors; an elastic job's members put JSON in the job's store (each also reports the digests of the
replica it holds, so a member lost after a commit still has its stage reported, and a new writer writes a
step whose writer was lost from what the store still holds). Each line is one ``write`` on a file opened for
appending; a run resumed from a checkpoint drops the lines at or after the step it resumes at (written
after that checkpoint) and appends from there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_bamboo._lightning import private as _private
from lightning_bamboo.contract import StageSequential
from lightning_bamboo.pipeline.microbatch import microbatch_shares, split_microbatches
from lightning_bamboo.runtime.data_order import AutoBatches
from lightning_bamboo.step.broadcast import all_gather_json
from lightning_bamboo.step.progress import ResumableDataLoader

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

_KEY = "ledger/{step}/{member}"
_FALLBACK_KEY = "ledger/{step}/fallback/{member}"


class BambooLedger(Callback):
    """Append one JSON line per committed step to ``path`` (see the module docstring for the format).

    Args:
        path: the ledger file (created with its folder; a resumed run appends to it).
        wait: seconds rank 0 of an elastic job waits for every member's report of a step before it writes
            the line with what it has (a member lost after the commit reports nothing; its stage comes from
            the replica holder's report).
    """

    def __init__(self, path: str | Path, wait: float = 60.0) -> None:
        self.path = Path(path)
        self.wait = wait
        self._samples: dict[int, list[int]] = {}  # pipeline -> indices of the step being accumulated
        self._step_before = -1  # trainer.global_step when the current batch started
        self._trimmed = False  # this process has dropped stale lines (it writes from now on)
        # (step, epoch, reports) of a line written without some stage's digest because the members holding
        # it were lost after its commit: completed by the fallback that re-runs the step (on_fallback)
        self._pending: tuple[int, int, list[dict[str, Any]]] | None = None
        self._one_process: tuple[Tensor, Tensor | None] | None = None  # generators' states at fit's start
        self._auto: AutoBatches | None = None
        self._batch_idx = 0

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """A one-process run (``strategy="auto"``, one device): keep the generators' states before ``fit``
        draws its first permutation, to work out which samples each batch holds (:class:`AutoBatches`)."""
        if stage != "fit" or _is_bamboo(trainer.strategy) or trainer.world_size != 1:
            return
        source = _private.train_loader_source(trainer)
        generator = source.generator if isinstance(source, DataLoader) else None
        self._one_process = (torch.get_rng_state(), generator.get_state() if generator is not None else None)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_before = trainer.global_step
        self._batch_idx = batch_idx

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        one = self._one_process is not None
        pipeline, shares = self._one_process_samples(trainer) if one else _pipeline_samples(trainer)
        for index, indices in shares.items():
            self._samples.setdefault(index, []).extend(indices)
        if trainer.global_step == self._step_before:
            return  # no optimizer step yet (accumulate_grad_batches): its samples are the batches' together
        step = trainer.global_step - 1
        strategy = trainer.strategy
        owners = getattr(strategy, "owners", None)
        store = _store_of(strategy)
        elastic = store is not None and owners is not None and bool(getattr(strategy, "elastic", False))
        report = {
            "pipeline": pipeline,
            "samples": {str(index): indices for index, indices in sorted(self._samples.items())},
            **_digests(trainer, pl_module),
        }
        self._samples.clear()
        if owners is not None:
            report["owners"] = json.loads(owners.to_json())  # the generation the step committed under
        if elastic:
            store.set(_KEY.format(step=step, member=strategy.member), json.dumps(report))  # type: ignore[attr-defined]
            if trainer.global_rank == 0:
                self._write_pending()
                self._write_from_store(trainer, store, owners, step)
            return
        one_process = not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1
        reports = [report] if one_process else all_gather_json(report, strategy.root_device)
        if trainer.global_rank == 0:
            self._trim(step)
            self._append(_line(step, trainer.current_epoch, reports))

    def _one_process_samples(self, trainer: pl.Trainer) -> tuple[int, dict[int, list[int]]]:
        """``(0, {0: indices of this batch})`` of a one-process run, from its loader's sampler."""
        assert self._one_process is not None
        loader = trainer.train_dataloader
        if not isinstance(loader, DataLoader) or isinstance(loader, ResumableDataLoader):
            return _pipeline_samples(trainer)
        if self._auto is None or self._auto.loader is not loader:
            self._auto = AutoBatches(loader, *self._one_process)
        return 0, {0: self._auto.batch(trainer.current_epoch, self._batch_idx)}

    # ------------------------------------------------------------------ writing
    def _write_from_store(self, trainer: pl.Trainer, store: Any, owners: Any, step: int) -> None:
        """Rank 0 of an elastic job: this step's line (and a step before it whose writer was lost)."""
        first = self._trim(step)
        for missing in range(first, step):  # reports the lost writer left in the store
            keys = [_KEY.format(step=missing, member=m) for m in _members_ever(owners)]
            found = [k for k in keys if store.check([k])]
            if found:
                log.warning("BambooLedger: writing step %d, whose writer was lost, from the store", missing)
                reports = [json.loads(store.get(k)) for k in found]
                self._append(_line(missing, trainer.current_epoch, reports))
                for key in found:
                    store.delete_key(key)
        members = owners.members()
        keys = [_KEY.format(step=step, member=m) for m in members]
        deadline = time.monotonic() + self.wait
        generation = owners.generation
        while not store.check(keys) and time.monotonic() < deadline:
            if _current_generation(store) > generation:  # a member was lost: its report may never come
                deadline = min(deadline, time.monotonic() + 2.0)
            time.sleep(0.005)
        found = [k for k in keys if store.check([k])]
        if len(found) < len(keys):
            log.warning("BambooLedger: step %d: %d of %d members reported", step, len(found), len(keys))
        reports = [json.loads(store.get(k)) for k in found]
        for key in found:
            store.delete_key(key)
        if _stages_reported(reports) < len(_stage_layers(trainer.strategy)):
            # every holder of a stage was lost after this step's commit: the fallback that follows re-runs
            # the step and reports the digest (on_fallback); written then, or before the next line
            self._pending = (step, trainer.current_epoch, reports)
            return
        self._append(_line(step, trainer.current_epoch, reports))

    def on_fallback(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint_path: str, **info: Any
    ) -> None:
        """After a fallback's re-run (the members hold the parameters of step ``info["step"] - 1`` again),
        every member reports its stages' digests of that step; rank 0 completes the line it holds back."""
        strategy = trainer.strategy
        store, owners = _store_of(strategy), getattr(strategy, "owners", None)
        if store is None or owners is None or "step" not in info:
            return
        step = int(info["step"]) - 1
        key = _FALLBACK_KEY.format(step=step, member=strategy.member)  # type: ignore[attr-defined]
        store.set(key, json.dumps(_digests(trainer, pl_module)))
        if trainer.global_rank != 0 or self._pending is None or self._pending[0] != step:
            return
        keys = [_FALLBACK_KEY.format(step=step, member=m) for m in owners.members()]
        deadline = time.monotonic() + self.wait
        while not store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.005)
        found = [k for k in keys if store.check([k])]
        step, epoch, reports = self._pending
        self._pending = None
        self._append(_line(step, epoch, reports, [json.loads(store.get(k)) for k in found]))
        for key in found:
            store.delete_key(key)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write_pending()

    def _write_pending(self) -> None:
        """A line held back for a fallback that did not come (no member could report the stage): as it is."""
        if self._pending is not None:
            step, epoch, reports = self._pending
            self._pending = None
            self._append(_line(step, epoch, reports))

    def _trim(self, step: int) -> int:
        """Before this process's first line: drop lines at or after ``step`` (a resumed run re-trains them);
        returns the step after the last line kept (``step`` from then on)."""
        if self._trimmed:
            return step
        self._trimmed = True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.path.exists():
            return step
        kept, dropped, last = [], 0, -1
        for text in self.path.read_text().splitlines():
            try:
                entry_step = json.loads(text)["step"]
            except (ValueError, KeyError, TypeError):  # a writer killed inside its write
                log.warning("BambooLedger: dropping an unreadable line of %s: %r", self.path, text[:80])
                dropped += 1
                continue
            if entry_step < step:
                kept.append(text)
                last = max(last, entry_step)
            else:
                dropped += 1
        if dropped:
            log.warning("BambooLedger: dropped %d lines at or after step %d (a resumed run)", dropped, step)
            partial = self.path.with_name(self.path.name + ".partial")
            partial.write_text("".join(f"{t}\n" for t in kept))
            os.replace(partial, self.path)
        return last + 1 if last >= 0 else step

    def _append(self, line: dict[str, Any]) -> None:
        data = (json.dumps(line, sort_keys=True) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)  # one write on an O_APPEND file: the line lands whole
            os.fsync(fd)
        finally:
            os.close(fd)


# ---------------------------------------------------------------------- what each rank reports
def _pipeline_samples(trainer: pl.Trainer) -> tuple[int, dict[int, list[int]]]:
    """``(this rank's pipeline index, pipeline index -> the indices it trained on in this batch)``: every
    pipeline's when every member loads the global batch (elastic Bamboo), else this rank's own."""
    loader = trainer.train_dataloader
    if not isinstance(loader, ResumableDataLoader):
        raise TypeError(
            "BambooLedger records the sample indices of each step, which needs one plain "
            "torch.utils.data.DataLoader over a map-style dataset under the Bamboo strategy (it makes the "
            f"loader a ResumableDataLoader); the training loader is a {type(loader).__name__}"
        )
    strategy = trainer.strategy
    pipelines = int(getattr(strategy, "num_pipelines", 1))
    pipeline = int(getattr(strategy, "pipeline_index", 0))
    indices = list(loader.last_indices)
    if pipelines > 1 and strategy.distributed_sampler_kwargs.get("num_replicas", 1) == 1:
        # every member loads the global batch; each pipeline trains on its share of the job's fixed split
        total = int(strategy.global_microbatches)
        parts = split_microbatches(torch.tensor(indices), total)
        owners = getattr(strategy, "owners", None)
        shares = microbatch_shares(total, pipelines, owners.shapes() if owners is not None else None)
        return pipeline, {p: torch.cat(parts[s.start : s.stop]).tolist() for p, s in enumerate(shares)}
    return pipeline, {pipeline: indices}


def _is_bamboo(strategy: Any) -> bool:
    return getattr(strategy, "stage_layers", None) is not None


def _digests(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, dict[str, Any]]:
    """``{"own": stage -> digest, "replica": stage -> digest}`` of the stages this rank holds whole (the
    replica has taken the step when the step's batch ends), and their fingerprints under ``"own_fp"`` and
    ``"replica_fp"``. A one-process run has no stages: none (its parameters are not bit-equal to a
    pipeline's, whose sums run in another order; ``verify`` compares its samples only)."""
    if not _is_bamboo(trainer.strategy) and trainer.world_size == 1:
        return {"own": {}, "replica": {}, "own_fp": {}, "replica_fp": {}}
    stages = _stage_layers(trainer.strategy)
    own = next((m for m in pl_module.children() if isinstance(m, StageSequential)), None)
    replica = getattr(trainer.strategy, "replica", None)
    modules = {"own": own, "replica": replica if isinstance(replica, StageSequential) else None}
    report: dict[str, dict[str, Any]] = {}
    for kind, module in modules.items():
        report[kind] = _held_stages(module, stages, stage_digest) if module is not None else {}
        report[f"{kind}_fp"] = _held_stages(module, stages, stage_fingerprint) if module is not None else {}
    return report


def _stage_layers(strategy: Any) -> list[range]:
    """Stage -> its layers of the pipeline body."""
    stages = getattr(strategy, "stage_layers", None)
    if stages is None:
        raise TypeError(
            f"BambooLedger runs under the Bamboo strategies (it digests each pipeline stage); the trainer's "
            f"strategy is {type(strategy).__name__}"
        )
    return list(stages)


def _held_stages(module: StageSequential, stages: list[range], summary: Any) -> dict[str, Any]:
    """Stage -> ``summary`` of its layers, for the stages ``module`` holds whole."""
    held = {int(name): layer for name, layer in module.named_children()}
    return {
        str(s): summary([(i, held[i]) for i in layers])
        for s, layers in enumerate(stages)
        if all(i in held for i in layers)
    }


def stage_digest(layers: list[tuple[int, nn.Module]]) -> str:
    """sha256 over ``(layer index, parameter name, dtype, shape)`` and the raw bytes of every parameter."""
    digest = hashlib.sha256()
    for index, layer in layers:
        for name, param in layer.named_parameters():
            tensor = param.detach().to("cpu").contiguous().reshape(-1)
            digest.update(f"{index}.{name}:{tensor.dtype}:{tuple(param.shape)}\n".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def stage_fingerprint(layers: list[tuple[int, nn.Module]]) -> list[float]:
    """Four float64 sums over every parameter's elements: values, absolute values, squares, and values
    times a pseudo-random sign fixed by the layer index and parameter name (the same in every run). Equal
    parameters give equal sums; parameters that differ by rounding give sums within a few ulps of the
    absolute sum; a different model moves them far more (``verify`` compares them)."""
    sums = torch.zeros(4, dtype=torch.float64)
    for index, layer in layers:
        for name, param in layer.named_parameters():
            values = param.detach().to("cpu", torch.float64).reshape(-1)
            key = hashlib.blake2b(f"{index}.{name}".encode(), digest_size=7).digest()
            generator = torch.Generator().manual_seed(int.from_bytes(key, "little"))
            signs = torch.randint(0, 2, values.shape, generator=generator, dtype=torch.float64) * 2 - 1
            parts = [values.sum(), values.abs().sum(), values.square().sum(), (values * signs).sum()]
            sums += torch.stack(parts)
    return sums.tolist()


# ---------------------------------------------------------------------- the elastic job's store
def _store_of(strategy: Any) -> Any:
    if not isinstance(getattr(type(strategy), "store", None), property):
        return None
    try:
        return strategy.store
    except RuntimeError:  # not connected (no job)
        return None


def _current_generation(store: Any) -> int:
    return int(store.get("gen").decode()) if store.check(["gen"]) else -1


def _members_ever(owners: Any) -> list[int]:
    """Members that may have reported an earlier step: this generation's and every lower-numbered one."""
    return list(range(max(owners.members()) + 1))


def _stages_reported(reports: list[dict[str, Any]]) -> int:
    """How many stages some report gives a digest of (its own stages or its replica)."""
    return len({stage for report in reports for kind in ("own", "replica") for stage in report[kind]})


def _line(
    step: int, epoch: int, reports: list[dict[str, Any]], refilled: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Merge the ranks' reports of one step into its ledger line (an elastic member's report carries the
    ownership map of the generation the step committed under). ``refilled``: digests (``own``/``replica``)
    the members of a fallback reported for this step after re-running it, used for stages no report has."""
    samples: dict[str, list[int]] = {}
    seen: dict[str, set[str]] = {}
    digests: dict[str, str] = {}
    fingerprints: dict[str, list[float]] = {}
    ordered = sorted(reports, key=lambda r: r["pipeline"])
    owners = next((r["owners"] for r in ordered if r.get("owners")), None)  # every member's is the same
    for report in ordered:  # each report holds every pipeline's samples (a lost pipeline's too)
        for pipeline, indices in report["samples"].items():
            samples.setdefault(pipeline, indices)
    for kind in ("own", "replica"):  # a stage whose holders were all lost: its replica holder's digest
        for report in [*ordered, *(refilled or [])]:
            for stage, value in report[kind].items():
                seen.setdefault(stage, set()).add(value)
                digests.setdefault(stage, value)
            for stage, value in report.get(f"{kind}_fp", {}).items():
                fingerprints.setdefault(stage, value)
    line: dict[str, Any] = {
        "step": step,
        "epoch": epoch,
        "samples": dict(sorted(samples.items(), key=lambda kv: int(kv[0]))),
        "generation": owners["generation"] if owners is not None else None,
        "owners": owners,
        "digests": dict(sorted(digests.items(), key=lambda kv: int(kv[0]))),
        "fingerprints": dict(sorted(fingerprints.items(), key=lambda kv: int(kv[0]))),
    }
    mismatch = {s: sorted(v) for s, v in seen.items() if len(v) > 1}
    if mismatch:
        line["mismatch"] = mismatch
    return line
