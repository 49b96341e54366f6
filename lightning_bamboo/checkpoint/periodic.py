"""Checkpoint fallback of elastic Bamboo: periodic asynchronous checkpoints keyed by layer, and the batches to
re-run from them.

When redundancy cannot cover a loss (two adjacent stages lost at once, fewer processes than stages), the
survivors load the last complete checkpoint into whatever layout they can run and re-run the steps since it,
inside the same ``fit`` (:class:`lightning_bamboo.strategy.BambooStrategy`). This module holds what that
needs and nothing about process groups:

* :class:`PeriodicCheckpointer`: every ``N`` steps each member of the first pipeline writes the layers of its
  stages (parameters, buffers, optimizer state) with ``torch.distributed.checkpoint``, copied to host
  memory and written by a background thread (no collectives: one DCP checkpoint per member, saved as this
  process's own, so torch does not warn that it assumes a single process) into
  ``<root>/step_<c>.partial/member<m>/``, after writing
  ``member<m>.json`` (each layer's description, the writers, the LR schedulers' and optimizer groups'
  settings). The tensors go through DCP's ``HuggingFaceStorageWriter``: a safetensors file and a JSON index,
  so loading never unpickles anything (DCP's default ``FileSystemReader`` reads its ``.metadata`` with
  ``pickle``). Non-tensor values (optimizer-state scalars, group settings, scheduler states) are in the JSON.
  The writer writes its index after the data (synced), so a member's part is finished when that index parses
  and lists every tensor the member's JSON promises; a folder whose writers' parts are all finished is renamed
  to ``step_<c>`` (an atomic rename) by whichever member notices first. Readers only consider renamed
  folders, and check them again.
* :class:`BatchRing`: the global batches of the last steps (every member keeps the same ones: the data of a
  step does not depend on the layout).

Tensors are keyed ``layer<L>/<i>`` (the ``i``-th tensor of
:func:`lightning_bamboo.checkpoint.layers.describe`), so any
later layout loads the layers it needs, wherever they were written.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_bamboo._lightning import private as _private
from lightning_bamboo.checkpoint.layers import LayerState, describe, materialize, spec_of
from lightning_bamboo.step.broadcast import broadcast_batch, broadcast_json

log = logging.getLogger(__name__)

PREFIX = "step_"
PARTIAL = ".partial"
# HuggingFaceStorageWriter's JSON index (tensor name -> safetensors file), written after the data
_INDEX = "model.safetensors.index.json"


def check_options(every: Any, directory: Any, keep: Any) -> None:
    """Validate the strategy's checkpoint arguments (both or neither of ``every`` and ``directory``)."""
    if (every is None) != (directory is None):
        raise ValueError(
            "checkpoint_every_n_steps and checkpoint_dir go together (checkpoint fallback needs both), got "
            f"checkpoint_every_n_steps={every!r}, checkpoint_dir={directory!r}"
        )
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ValueError(f"checkpoint_every_n_steps must be an integer >= 1, got {every!r}")
    if directory is not None and not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"checkpoint_dir must be a path (str or os.PathLike), got {type(directory).__name__}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep_checkpoints must be an integer >= 1, got {keep!r}")


def folder(root: Path, step: int, partial: bool = False) -> Path:
    return root / f"{PREFIX}{step:08d}{PARTIAL if partial else ''}"


def _step_of(path: Path) -> int | None:
    name = path.name.removesuffix(PARTIAL)
    if not name.startswith(PREFIX) or not name[len(PREFIX) :].isdigit():
        return None
    return int(name[len(PREFIX) :])


def is_complete(path: Path) -> bool:
    """Every writer named in the folder finished its part, and their parts hold every layer.

    ``False`` for a folder another member renames or prunes while this one looks at it.
    """
    try:
        return _is_complete(path)
    except FileNotFoundError:
        return False


def _is_complete(path: Path) -> bool:
    metas = sorted(path.glob("member*.json"))
    if not metas:
        return False
    first = json.loads(metas[0].read_text())
    layers: set[int] = set()
    for writer in first["writers"]:
        meta = path / f"member{writer}.json"
        if not meta.exists():
            return False
        values = json.loads(meta.read_text())
        if not _part_written(path / f"member{writer}", values):
            return False
        layers |= set(values["layers"])
    return layers == set(range(first["num_layers"]))


def _part_written(part: Path, meta: dict[str, Any]) -> bool:
    """The writer's index exists, is whole JSON (a write cut short never parses: the closing brace comes last)
    and names every tensor of the member's layers."""
    index = part / _INDEX
    if not index.exists():
        return False
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return False
    return all(key in weight_map for key in _tensor_specs(meta, meta["layers"]))


def _tensor_specs(meta: dict[str, Any], layers: list[int]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """``layer<L>/<i>`` -> (dtype, shape) of the tensors a member's JSON describes, describe() order."""
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for layer in layers:
        desc = meta["descriptions"][str(layer)]
        entries = [*desc["params"], *desc["buffers"]]
        entries += [entry[2:] for entry in desc["state"] if entry[2] == "tensor"]
        for i, entry in enumerate(entries):
            spec = spec_of(entry)
            specs[f"layer{layer}/{i}"] = (spec.dtype, spec.shape)
    return specs


def finalize(root: Path) -> list[int]:
    """Rename every complete ``.partial`` folder into place (atomic); returns the steps now final."""
    done = []
    for path in sorted(root.glob(f"{PREFIX}*{PARTIAL}")):
        step = _step_of(path)
        if step is None or not is_complete(path):
            continue
        try:
            path.rename(folder(root, step))
        except OSError:  # another member renamed it first
            if not folder(root, step).exists():
                raise
        done.append(step)
    return done


def complete_steps(root: Path) -> list[int]:
    """Steps of the complete checkpoints under ``root``, oldest first (``.partial`` folders never count)."""
    steps = []
    for path in root.glob(f"{PREFIX}*"):
        step = _step_of(path)
        if step is not None and not path.name.endswith(PARTIAL) and is_complete(path):
            steps.append(step)
    return sorted(steps)


def latest_complete(root: Path) -> int | None:
    steps = complete_steps(root)
    return steps[-1] if steps else None


def prune(root: Path, keep: int) -> None:
    """Keep the ``keep`` newest complete checkpoints; drop older ones and ``.partial`` folders older still."""
    steps = complete_steps(root)
    if len(steps) <= keep:
        return
    oldest_kept = steps[-keep]
    for path in root.glob(f"{PREFIX}*"):
        step = _step_of(path)
        if step is not None and step < oldest_kept:
            shutil.rmtree(path, ignore_errors=True)


def settings(optimizer: Optimizer, scheduler_configs: list[Any]) -> dict[str, Any]:
    """The optimizer groups' hyper-parameters and the LR schedulers' states, as JSON-ready values.

    Raises:
        ValueError: a value is not JSON-serializable (it could not be written without pickling).
    """
    out = {
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "schedulers": [config.scheduler.state_dict() for config in scheduler_configs],
    }
    try:
        json.dumps(out)
    except TypeError as err:
        raise ValueError(
            "checkpoint fallback writes the optimizer's param-group settings and the LR schedulers' "
            f"state_dict() as JSON, and one value is not JSON-serializable: {err}"
        ) from err
    return out


def restore_settings(optimizer: Optimizer, scheduler_configs: list[Any], saved: dict[str, Any]) -> None:
    """Inverse of :func:`settings` (JSON turned tuples into lists: they are turned back)."""
    for group, values in zip(optimizer.param_groups, saved["param_groups"]):
        for key, value in values.items():
            group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
    for config, state in zip(scheduler_configs, saved["schedulers"]):
        config.scheduler.load_state_dict(state)


def check_schedulers(scheduler_configs: list[Any]) -> None:
    """Fallback re-steps ``interval="step"`` schedulers during re-runs; any other kind is refused."""
    for config in scheduler_configs:
        if config.reduce_on_plateau or config.interval != "step":
            raise ValueError(
                "checkpoint fallback (checkpoint_every_n_steps) re-steps LR schedulers with interval='step' "
                f"while it re-runs steps; got {type(config.scheduler).__name__} with interval="
                f"{config.interval!r}{' (ReduceLROnPlateau)' if config.reduce_on_plateau else ''}"
            )


def _hf_storage() -> tuple[type, type]:
    """DCP's safetensors writer and reader (torch 2.13 has them; older torch lacks them: say so)."""
    try:
        from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
    except ImportError as err:
        raise RuntimeError(
            "checkpoint fallback writes safetensors through torch.distributed.checkpoint's "
            f"HuggingFaceStorageWriter/Reader, which torch {torch.__version__} lacks: install the torch "
            "version scripts/setup.sh pins"
        ) from err
    return HuggingFaceStorageWriter, HuggingFaceStorageReader


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


class PeriodicCheckpointer:
    """Writes this member's layers every ``every`` steps, one asynchronous write in flight at a time.

    Args:
        root: the job's checkpoint folder (``<checkpoint_dir>/<job id>``, so runs never see each other's).
        every: steps between checkpoints (a checkpoint at step ``c`` holds the state before step ``c``).
        keep: complete checkpoints kept.
        member: this member's id.
    """

    def __init__(self, root: Path, every: int, keep: int, member: int) -> None:
        self.root = root
        self.every = every
        self.keep = keep
        self.member = member
        self._last: int | None = None
        self._pending: tuple[int, Future, float] | None = None
        self._written_at: dict[int, float] = {}
        self._writing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bamboo-checkpoint")
        _hf_storage()  # a torch without the safetensors writer fails at setup, not at the first checkpoint
        root.mkdir(parents=True, exist_ok=True)

    def due(self, step: int, final: bool = False) -> bool:
        """Whether a checkpoint is taken before ``step`` (once per step, on every member); ``final``: the
        job is stopping before ``step``, whatever the interval."""
        if (step % self.every != 0 and not final) or step == self._last:
            return False
        self._last = step
        return True

    def save(
        self,
        step: int,
        layers: dict[int, LayerState],
        writers: list[int],
        num_layers: int,
        extra: dict[str, Any],
    ) -> tuple[float, int]:
        """Start writing ``layers`` for ``step``; returns (seconds blocked, bytes of tensors).

        The previous write is waited for first (a failure of it raises), finished folders are renamed into
        place and old ones pruned. The tensors are copied before it returns (the blocking part), so training
        may change them right after; a background thread writes the copies.
        """
        self.wait(strict=True)
        finalize(self.root)
        prune(self.root, self.keep)
        path = folder(self.root, step, partial=True)
        path.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, Tensor] = {}
        descriptions = {}
        for layer, held in sorted(layers.items()):
            desc, values = describe(held)
            descriptions[str(layer)] = desc
            for i, tensor in enumerate(values):
                tensors[f"layer{layer}/{i}"] = tensor
        meta = {
            "step": step,
            "member": self.member,
            "writers": sorted(writers),
            "num_layers": num_layers,
            "layers": sorted(layers),
            "descriptions": descriptions,
            **extra,
        }
        _write_json(path / f"member{self.member}.json", meta)
        start = time.perf_counter()
        writer = _hf_storage()[0](str(path / f"member{self.member}"))
        staged = {key: tensor.detach().to("cpu", copy=True) for key, tensor in tensors.items()}
        future = self._writing.submit(_private.save_single_process, staged, writer)
        blocking = time.perf_counter() - start
        future.add_done_callback(lambda _f, s=step: self._written_at.__setitem__(s, time.perf_counter()))
        self._pending = (step, future, start)
        return blocking, sum(t.numel() * t.element_size() for t in tensors.values())

    def wait(self, strict: bool) -> tuple[int, float] | None:
        """Wait for the write in flight; returns (its step, seconds from start to written) or ``None``.

        Args:
            strict: raise when the write failed (``False``: log it; the checkpoint just never completes).
        """
        if self._pending is None:
            return None
        step, future, start = self._pending
        self._pending = None
        try:
            future.result()
        except Exception as err:
            if strict:
                raise RuntimeError(
                    f"the checkpoint of step {step} in {self.root} failed to write: {err}"
                ) from err
            log.warning("Bamboo: the checkpoint of step %d failed to write: %s", step, err)
            return None
        return step, self._written_at.get(step, time.perf_counter()) - start


def load_layers(
    path: Path, layers: list[int], template: Callable[[int], nn.Module], device: torch.device
) -> tuple[dict[int, LayerState], dict[str, Any]]:
    """Load ``layers`` (parameters, buffers, optimizer state) from a complete checkpoint into their templates.

    Returns:
        The layers' states and the checkpoint's settings (see :func:`settings`) and ``step``.
    """
    if not is_complete(path):
        raise FileNotFoundError(f"{path} is not a complete Bamboo fallback checkpoint")
    metas = [json.loads(p.read_text()) for p in sorted(path.glob("member*.json"))]
    writer_of = {layer: meta for meta in metas for layer in meta["layers"]}
    missing = [layer for layer in layers if layer not in writer_of]
    if missing:
        raise KeyError(f"checkpoint {path} holds no layers {missing}")
    out: dict[int, LayerState] = {}
    for meta in metas:
        wanted = [layer for layer in layers if writer_of[layer] is meta]
        if not wanted:
            continue
        specs = _tensor_specs(meta, wanted)
        loaded = {key: torch.empty(shape, dtype=dtype) for key, (dtype, shape) in specs.items()}
        if loaded:  # read through the safetensors files and their JSON index: nothing is unpickled
            reader = _hf_storage()[1](str(path / f"member{meta['member']}"))
            _private.load_single_process(loaded, reader)
        for layer in wanted:
            values = iter(loaded[key] for key in specs if key.startswith(f"layer{layer}/"))
            out[layer] = materialize(
                template(layer), meta["descriptions"][str(layer)], lambda _d, _s, v=values: next(v), device
            )
    return out, metas[0]


class BatchRing:
    """The global batches of the last ``capacity`` steps (private copies): ``step -> (batch_idx, batch)``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: dict[int, tuple[int, Any]] = {}

    def put(self, step: int, batch_idx: int, batch: Any) -> None:
        self._items[step] = (batch_idx, apply_to_collection(batch, Tensor, lambda t: t.detach().clone()))
        while len(self._items) > self.capacity:
            del self._items[min(self._items)]

    def holds(self, steps: range) -> bool:
        return all(step in self._items for step in steps)

    def get(self, step: int) -> tuple[int, Any]:
        if step not in self._items:
            raise RuntimeError(
                f"the batch of step {step} is no longer kept (the ring holds steps {list(self._items)}); "
                "the last complete checkpoint is older than the ring: raise the ring or checkpoint more often"
            )
        return self._items[step]


def share_batches(ring: BatchRing, steps: range, device: torch.device) -> None:
    """Make every rank of the default process group hold the batches of ``steps`` (collective).

    Members that started together keep the same batches; a member that joined later lacks the steps before
    it joined: the lowest rank holding them all broadcasts them (JSON header + raw bytes, nothing pickled).

    Raises:
        RuntimeError: no rank holds them all.
    """
    has = torch.tensor([int(ring.holds(steps))], dtype=torch.int64)
    flags = [torch.zeros_like(has) for _ in range(dist.get_world_size())]
    dist.all_gather(flags, has)
    holders = [rank for rank, flag in enumerate(flags) if flag.item()]
    if len(holders) == len(flags):
        return
    if not holders:
        raise RuntimeError(f"no member keeps the batches of steps {steps.start}..{steps.stop - 1} to re-run")
    src, me = holders[0], dist.get_rank()
    for step in steps:
        batch_idx, batch = ring.get(step) if me == src else (None, None)
        batch_idx = broadcast_json(batch_idx, src, device)
        batch = broadcast_batch(batch, src, device)
        if me != src:
            ring.put(step, int(batch_idx), batch)
