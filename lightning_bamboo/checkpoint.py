"""Sharded, atomic checkpoints of a pipelined model, with the original parameter names.

On-disk layout of one checkpoint (a directory, written by every rank)::

    epoch=0-step=3.ckpt/
        shard-00001-model-00001-of-00001.safetensors ...
                             one safetensors file per rank that holds tensors: its stage's tensors,
                             written by torch.distributed.checkpoint's HuggingFaceStorageWriter; the
                             files' own headers are the index (shapes, dtypes)
        meta.pt              trainer state (epoch, loops, callbacks, schedulers, optimizer hyper-parameters),
                             written by rank 0, loaded with weights_only=True

Nothing is unpickled on load: DCP's default ``FileSystemWriter`` would write a pickled ``.metadata`` index
(read back with ``pickle.load``); safetensors headers are JSON. Checkpoints of the older format (a
``.metadata`` file, no safetensors) are refused with an error saying so.

Tensor keys are flat and name-based, so shards of different stages never collide and a merged checkpoint
loads into a single-process model: ``model/pipeline.3.weight`` and ``optim0/pipeline.3.weight/exp_avg``.
Data-parallel pipelines write the same keys; ``torch.distributed.checkpoint`` keeps one copy.

Writes go to ``<path>.partial`` and are renamed into place only once every rank has finished, so a failure
mid-save never leaves a half-written checkpoint under the final name.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.optim import Optimizer

META_FILE = "meta.pt"
_MODEL = "model/"
_SAFETENSORS = ".safetensors"


def named_optimizer_state(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer``'s state keyed by parameter name instead of position.

    Returns:
        ``{"state": {param name: {key: tensor}}, "param_groups": [settings + "param_names"]}``.

    Raises:
        TypeError: for a non-tensor per-parameter state value (it could not be sharded).
    """
    names = {id(p): n for n, p in module.named_parameters()}
    state: dict[str, dict[str, Tensor]] = {}
    for p, values in optimizer.state.items():
        entry: dict[str, Tensor] = {}
        for key, value in values.items():
            if value is None:
                continue
            if not isinstance(value, Tensor):
                raise TypeError(
                    f"optimizer state '{key}' of {names.get(id(p), '?')} is a {type(value).__name__}; "
                    "BambooStrategy checkpoints tensor state only"
                )
            entry[key] = value
        state[names[id(p)]] = entry
    groups = []
    for group in optimizer.param_groups:
        settings = {k: v for k, v in group.items() if k != "params"}
        settings["param_names"] = [names[id(p)] for p in group["params"]]
        groups.append(settings)
    return {"state": state, "param_groups": groups}


def load_named_optimizer_state(module: nn.Module, optimizer: Optimizer, named: dict[str, Any]) -> None:
    """Inverse of :func:`named_optimizer_state` for this rank's parameters."""
    index = {
        n: i for i, n in enumerate(n for group in optimizer.param_groups for n in _group_names(module, group))
    }
    state = {index[name]: values for name, values in named["state"].items() if name in index}
    groups = []
    for group, saved in zip(optimizer.param_groups, named["param_groups"]):
        settings = {k: v for k, v in saved.items() if k != "param_names"}
        settings["params"] = [index[n] for n in _group_names(module, group)]
        groups.append(settings)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _group_names(module: nn.Module, group: dict[str, Any]) -> list[str]:
    names = {id(p): n for n, p in module.named_parameters()}
    return [names[id(p)] for p in group["params"]]


def _tensor_tree(checkpoint: dict[str, Any]) -> dict[str, Tensor]:
    """Flat name -> tensor; a tensor sharing memory with an earlier one (tied weights) is copied, since a
    safetensors file stores each name's bytes once and refuses aliases."""
    tensors = {f"{_MODEL}{k}": v for k, v in checkpoint.get("state_dict", {}).items()}
    for i, named in enumerate(checkpoint.get("optimizer_states", [])):
        for name, values in named["state"].items():
            for key, value in values.items():
                tensors[f"optim{i}/{name}/{key}"] = value
    seen: set[tuple[Any, int]] = set()
    for key, tensor in tensors.items():
        if tensor.numel() == 0:
            continue
        ident = (tensor.untyped_storage().data_ptr(), tensor.device.index or 0)
        if ident in seen:
            tensors[key] = tensor.detach().clone()
        else:
            seen.add(ident)
    return tensors


@contextmanager
def single_process_dcp() -> Iterator[None]:
    """DCP warns on every save/load without a process group ("assuming the intent is to save in a single
    process"); here that is the intent (a rank's own shard, or merging on one machine), so say nothing."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
        yield


def _writer(path: Path) -> dcp.StorageWriter:
    """Safetensors shards, one file per rank (``save_distributed``: file names carry the rank's index)."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    return HuggingFaceStorageWriter(str(path), save_distributed=True)


def _reader(path: Path) -> dcp.StorageReader:
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    return HuggingFaceStorageReader(str(path))


def save_sharded(
    checkpoint: dict[str, Any], filepath: str | Path, is_global_zero: bool, barrier: Callable[[], None]
) -> None:
    """Write this rank's shard of ``checkpoint`` (collective: every rank calls it)."""
    path = Path(filepath)
    partial = path.with_name(path.name + ".partial")
    if is_global_zero:
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
    barrier()
    with single_process_dcp():
        dcp.save(_tensor_tree(checkpoint), storage_writer=_writer(partial), no_dist=not dist.is_initialized())
    if is_global_zero:
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        meta["optimizer_param_groups"] = [
            named["param_groups"] for named in checkpoint.get("optimizer_states", [])
        ]
        torch.save(meta, partial / META_FILE)
    barrier()
    if is_global_zero:
        old = path.with_name(path.name + ".old")
        if path.exists():
            path.rename(old)
        partial.rename(path)
        if old.exists():
            _rm(old)
    barrier()


def _rm(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def remove(filepath: str | Path) -> None:
    """Delete a checkpoint directory (or file)."""
    _rm(Path(filepath))


def _metadata(path: Path) -> dict[str, Any]:
    """Every tensor's shape and dtype, from the safetensors headers (JSON: nothing unpickled)."""
    shards = [p for p in path.iterdir() if p.name.endswith(_SAFETENSORS)] if path.is_dir() else []
    if not shards:
        if (path / ".metadata").exists():
            raise ValueError(
                f"{path} is a BambooStrategy checkpoint of the older format (DCP's pickled .metadata index); "
                "it is not loaded, since loading it would unpickle a file: re-save it with this version"
            )
        raise FileNotFoundError(
            f"{path} is not a BambooStrategy checkpoint directory (no {_SAFETENSORS} shard inside)"
        )
    return _reader(path).read_metadata().state_dict_metadata


def _load_tensors(path: Path, keys: list[str], no_dist: bool) -> dict[str, Tensor]:
    """Load ``keys`` from the checkpoint into fresh CPU tensors shaped by its metadata."""
    meta = _metadata(path)
    missing = [k for k in keys if k not in meta]
    if missing:
        raise KeyError(f"checkpoint {path} has no tensors {missing[:5]}")
    out: dict[str, Tensor] = {}
    for key in keys:
        entry = meta[key]
        if not isinstance(entry, TensorStorageMetadata):
            raise TypeError(f"checkpoint entry {key} is not a tensor")
        out[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
    if out:
        with single_process_dcp():
            dcp.load(out, storage_reader=_reader(path), no_dist=no_dist)
    return out


def _optimizer_keys(meta: dict[str, Any], index: int, names: list[str]) -> dict[str, list[str]]:
    result: dict[str, list[str]] = {name: [] for name in names}
    for key in meta:
        if not key.startswith(f"optim{index}/"):
            continue
        name, _, state_key = key[len(f"optim{index}/") :].rpartition("/")
        if name in result:
            result[name].append(state_key)
    return result


def load_sharded(
    filepath: str | Path, module: LightningModule, optimizers: list[Optimizer]
) -> dict[str, Any]:
    """Load this rank's stage (model and optimizer) plus the trainer state from a sharded checkpoint.

    Returns:
        A Lightning checkpoint dict: the trainer state from ``meta.pt``, ``state_dict`` for this stage and
        ``optimizer_states`` in the name-keyed form of :func:`named_optimizer_state`.
    """
    path = Path(filepath)
    checkpoint: dict[str, Any] = torch.load(path / META_FILE, weights_only=True)
    local = module.state_dict()
    model = _load_tensors(path, [f"{_MODEL}{k}" for k in local], no_dist=not dist.is_initialized())
    checkpoint["state_dict"] = {k[len(_MODEL) :]: v for k, v in model.items()}
    meta = _metadata(path)
    groups_per_optimizer = checkpoint.pop("optimizer_param_groups", [])
    states = []
    for i, (optimizer, saved_groups) in enumerate(zip(optimizers, groups_per_optimizer)):
        names = [n for group in optimizer.param_groups for n in _group_names(module, group)]
        keys = _optimizer_keys(meta, i, names)
        flat = _load_tensors(
            path,
            [f"optim{i}/{n}/{k}" for n, ks in keys.items() for k in ks],
            no_dist=not dist.is_initialized(),
        )
        state = {n: {k: flat[f"optim{i}/{n}/{k}"] for k in ks} for n, ks in keys.items() if ks}
        groups = [
            {**saved, "param_names": _group_names(module, g)}
            for saved, g in zip(saved_groups, optimizer.param_groups)
        ]
        states.append({"state": state, "param_groups": groups})
    checkpoint["optimizer_states"] = states
    return checkpoint


def load_replica(
    filepath: str | Path, replica: nn.Module, body_attr: str, optimizer: Optimizer | None
) -> None:
    """Load the replica of the successor stage (parameters and optimizer state) from the checkpoint."""
    path = Path(filepath)
    prefix = f"{body_attr}."
    local = replica.state_dict()
    loaded = _load_tensors(path, [f"{_MODEL}{prefix}{k}" for k in local], no_dist=not dist.is_initialized())
    replica.load_state_dict({k: loaded[f"{_MODEL}{prefix}{k}"] for k in local})
    if optimizer is None:
        return
    names = {id(p): prefix + n for n, p in replica.named_parameters()}
    ordered = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    keys = _optimizer_keys(_metadata(path), 0, ordered)
    flat = _load_tensors(
        path, [f"optim0/{n}/{k}" for n, ks in keys.items() for k in ks], no_dist=not dist.is_initialized()
    )
    state = {i: {k: flat[f"optim0/{n}/{k}"] for k in keys[n]} for i, n in enumerate(ordered) if keys[n]}
    saved = optimizer.state_dict()
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


def consolidate_checkpoint(filepath: str | Path) -> dict[str, Tensor]:
    """The full model ``state_dict`` (all stages merged) of a sharded checkpoint, in one process.

    The result loads into the single-process LightningModule with ``module.load_state_dict(...)``.
    """
    path = Path(filepath)
    keys = [k for k in _metadata(path) if k.startswith(_MODEL)]
    loaded = _load_tensors(path, keys, no_dist=True)
    return {k[len(_MODEL) :]: v for k, v in loaded.items()}
