"""Sharded, atomic checkpoints of a pipelined model, with the original parameter names.

On-disk layout of one checkpoint (a directory, written by every rank)::

    epoch=0-step=3.ckpt/
        shard-00001-model-00001-of-00001.safetensors ...
                             one safetensors file per rank that holds tensors: its stage's tensors,
                             written by torch.distributed.checkpoint's HuggingFaceStorageWriter; the
                             files' own headers are the index (shapes, dtypes)
        meta.pt              trainer state (epoch, loops, callbacks, schedulers, optimizer hyper-parameters),
                             written by rank 0, loaded with weights_only=True
        param-groups-stage00000.json ...
                             per stage: the parameter names of each param group (JSON), for writing the
                             whole model's positional optimizer state (consolidate_checkpoint(output=...))

Nothing is unpickled on load: DCP's default ``FileSystemWriter`` would write a pickled ``.metadata`` index
(read back with ``pickle.load``); safetensors headers are JSON. Checkpoints of the older format (a
``.metadata`` file, no safetensors) are refused with an error saying so.

Tensor keys are flat and name-based, so shards of different stages never collide and a merged checkpoint
loads into a single-process model: ``model/pipeline.3.weight`` and ``optim0/pipeline.3.weight/exp_avg``.
Data-parallel pipelines write the same keys; ``torch.distributed.checkpoint`` keeps one copy.

An ordinary Lightning ``.ckpt`` file (one process) loads into the stages too
(:func:`load_lightning_checkpoint`), and :func:`consolidate_checkpoint` writes one from a folder.

Writes go to ``<path>.partial`` and are renamed into place only once every rank has finished, so a failure
mid-save never leaves a half-written checkpoint under the final name.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.optim import Optimizer

from lightning_bamboo._lightning import private as _private
from lightning_bamboo.step.progress import drop_loader_position

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


def _writer(path: Path, shard: int | None = None) -> dcp.StorageWriter:
    """Safetensors shards, one file per rank (``save_distributed``: file names carry the rank's index).

    ``shard``: this process writes alone (no process group) as shard ``shard`` (>= 1) of the folder; DCP
    would number every lone writer 1.
    """
    import dataclasses

    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    if shard is None:
        return HuggingFaceStorageWriter(str(path), save_distributed=True)

    class _LoneShardWriter(HuggingFaceStorageWriter):
        def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
            return [
                dataclasses.replace(plan, storage_data={**plan.storage_data, "shard_index": shard})
                for plan in super().prepare_global_plan(plans)
            ]

    return _LoneShardWriter(str(path), save_distributed=True)


def _reader(path: Path) -> dcp.StorageReader:
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    return HuggingFaceStorageReader(str(path))


def save_sharded(
    checkpoint: dict[str, Any],
    filepath: str | Path,
    is_global_zero: bool,
    barrier: Callable[[], None],
    stage: int | None = None,
    shard: int | None = None,
) -> None:
    """Write this rank's shard of ``checkpoint`` (collective: every rank calls it).

    ``stage``: given by one rank per stage (pipeline 0's), which then also writes its param groups'
    parameter names (JSON), so :func:`consolidate_checkpoint` can write the whole model's optimizer state.
    ``shard``: write without the process group, as shard ``shard`` (>= 1; unique among the writers), with
    ``barrier`` meeting the others some other way (the job's store); only the ranks that hold tensors to
    write pass a ``checkpoint`` with any (each tensor written by exactly one of them).
    """
    path = Path(filepath)
    partial = path.with_name(path.name + ".partial")
    if is_global_zero:
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
    barrier()
    tree = _tensor_tree(checkpoint)
    if shard is not None:  # a lone writer among others that meet through the store (a stopping job)
        if tree:
            _private.save_single_process(tree, _writer(partial, shard))
    elif dist.is_initialized():
        dcp.save(tree, storage_writer=_writer(partial))
    else:  # one process: its own checkpoint (torch's public save would warn that it assumes so)
        _private.save_single_process(tree, _writer(partial))
    if stage is not None:
        write_group_names(partial, stage, checkpoint.get("optimizer_states", []))
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


def _not_a_fallback_snapshot(path: Path) -> None:
    """Refuse one of the fallback's periodic snapshots (``checkpoint/periodic.py``: layers only, no trainer
    state) with what to use instead.

    Raises:
        ValueError: ``path`` is such a snapshot.
    """
    if path.is_dir() and not (path / META_FILE).exists() and any(path.glob("member*.json")):
        raise ValueError(
            f"{path} is a snapshot of BambooStrategy's checkpoint fallback (layers only, for a fallback "
            "inside the same fit), not a Lightning checkpoint: resume from the stop checkpoint the job "
            f"wrote beside it ({path.parent}/stop-step=<k>.ckpt, after a SIGTERM to the supervisor) or "
            "from a ModelCheckpoint folder"
        )


def _metadata(path: Path) -> dict[str, Any]:
    """Every tensor's shape and dtype, from the safetensors headers (JSON: nothing unpickled)."""
    _not_a_fallback_snapshot(path)
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
    if out and no_dist:  # this process's own read (torch's public load would warn that it assumes so)
        _private.load_single_process(out, _reader(path))
    elif out:
        dcp.load(out, storage_reader=_reader(path))
    return out


TIED_KEY = "bamboo_tied_parameters"
"""Checkpoint entry (``meta.pt``): ``later use's name -> first use's name`` of every tied parameter
(:func:`lightning_bamboo.pipeline.ties.aliases`). Bamboo saves every use's copy (and its optimizer state)
under the use's own name; :func:`consolidate_checkpoint` keeps the first use's, as the single-process
model holds it."""


def _saved_optimizer_state(
    path: Path, index: int, names: list[str], no_dist: bool
) -> dict[str, dict[str, Tensor]]:
    """``name -> {state key: tensor}`` of optimizer ``index`` for each of ``names`` with saved state."""
    saved: dict[str, list[str]] = {name: [] for name in names}
    for key in _metadata(path):
        if key.startswith(f"optim{index}/"):
            name, _, state_key = key[len(f"optim{index}/") :].rpartition("/")
            if name in saved:
                saved[name].append(state_key)
    flat = _load_tensors(path, [f"optim{index}/{n}/{k}" for n, ks in saved.items() for k in ks], no_dist)
    return {n: {k: flat[f"optim{index}/{n}/{k}"] for k in ks} for n, ks in saved.items() if ks}


def load_sharded(
    filepath: str | Path, module: LightningModule, optimizers: list[Optimizer]
) -> dict[str, Any]:
    """Load this rank's stage (model and optimizer) plus the trainer state from a sharded checkpoint.

    Returns:
        A Lightning checkpoint dict: the trainer state from ``meta.pt``, ``state_dict`` for this stage and
        ``optimizer_states`` in the name-keyed form of :func:`named_optimizer_state`.
    """
    path = Path(filepath)
    _not_a_fallback_snapshot(path)
    checkpoint: dict[str, Any] = torch.load(path / META_FILE, weights_only=True)
    local = module.state_dict()
    model = _load_tensors(path, [f"{_MODEL}{k}" for k in local], no_dist=not dist.is_initialized())
    checkpoint["state_dict"] = {k[len(_MODEL) :]: v for k, v in model.items()}
    groups_per_optimizer = checkpoint.pop("optimizer_param_groups", [])
    checkpoint.pop(TIED_KEY, None)  # the strategy knows its model's ties
    states = []
    for i, (optimizer, saved_groups) in enumerate(zip(optimizers, groups_per_optimizer)):
        names = [n for group in optimizer.param_groups for n in _group_names(module, group)]
        state = _saved_optimizer_state(path, i, names, no_dist=not dist.is_initialized())
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
    named = _saved_optimizer_state(path, 0, ordered, no_dist=not dist.is_initialized())
    state = {i: named[n] for i, n in enumerate(ordered) if n in named}
    saved = optimizer.state_dict()
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


def consolidate_checkpoint(filepath: str | Path, output: str | Path | None = None) -> dict[str, Tensor]:
    """The full model ``state_dict`` (all stages merged) of a sharded checkpoint, in one process.

    The result loads into the single-process LightningModule with ``module.load_state_dict(...)``. With
    ``output``, also write an ordinary Lightning ``.ckpt`` file there: the merged weights, each optimizer's
    state in ``Optimizer.state_dict()`` form for the whole model, and the trainer state (epoch, global
    step, loops, schedulers, callbacks), so ``Trainer(strategy="auto").fit(ckpt_path=output)`` resumes
    and ``MyModel.load_from_checkpoint(output)`` loads. A tied parameter is one tensor under all its names
    (every stage's copy is equal; a checkpoint whose copies differ is refused). Lightning opens a
    ``ckpt_path`` itself (a folder fails there with ``IsADirectoryError`` before any strategy code runs),
    hence this converter.
    """
    path = Path(filepath)
    keys = [k for k in _metadata(path) if k.startswith(_MODEL)]
    loaded = _load_tensors(path, keys, no_dist=True)
    state_dict = {k[len(_MODEL) :]: v for k, v in loaded.items()}
    tied = torch.load(path / META_FILE, weights_only=True).get(TIED_KEY, {})
    for later, first in tied.items():  # one tensor per tied parameter, as in the single-process model
        if later in state_dict and first in state_dict:
            if not torch.equal(state_dict[later], state_dict[first]):
                difference = (state_dict[later] - state_dict[first]).abs().max().item()
                raise ValueError(
                    f"{path} holds two different values of one tied parameter: {later} differs from {first} "
                    f"by up to {difference:.3g}; each stage's copy must take the same step (a checkpoint of "
                    "an earlier version whose param groups put the copies apart): pick one, load it by hand"
                )
            state_dict[later] = state_dict[first]
    if output is not None:
        _write_lightning_checkpoint(path, Path(output), state_dict)
    return state_dict


# ---------------------------------------------------------------------------- ordinary Lightning checkpoints
# A ``.ckpt`` file of ``strategy="auto"`` (one process) holds the whole model and each optimizer's
# ``state_dict()`` with positional parameter indices. Bamboo reads it by giving every index its parameter's
# name (the param groups of the user's ``configure_optimizers`` over the whole model, recorded before the
# split), and :func:`consolidate_checkpoint` writes one from a Bamboo checkpoint by the inverse mapping.

GROUPS_FILE = "param-groups-stage{stage:05d}.json"
"""Per stage (written by pipeline 0's rank): the parameter names of each param group, in group order."""


def named_from_positional(state: dict[str, Any], group_names: list[list[str]]) -> dict[str, Any]:
    """An optimizer ``state_dict()`` of the whole model in the name-keyed form of
    :func:`named_optimizer_state`, given each param group's parameter names (whole model, group order).

    Raises:
        ValueError: when the saved groups do not have the sizes of ``group_names``.
    """
    saved_groups = state["param_groups"]
    sizes = [len(g["params"]) for g in saved_groups]
    if sizes != [len(names) for names in group_names]:
        raise ValueError(
            f"the checkpoint's optimizer has param groups of {sizes} parameters but configure_optimizers "
            f"builds groups of {[len(n) for n in group_names]} for this model; it was saved from another "
            "model or another configure_optimizers"
        )
    index_to_name = {i: n for g, names in zip(saved_groups, group_names) for i, n in zip(g["params"], names)}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "param_names": names}
        for g, names in zip(saved_groups, group_names)
    ]
    named = {index_to_name[i]: values for i, values in state["state"].items()}
    return {"state": named, "param_groups": groups}


def positional_from_named(named: dict[str, Any], group_names: list[list[str]]) -> dict[str, Any]:
    """Inverse of :func:`named_from_positional`: an optimizer ``state_dict()`` for the whole model."""
    index = {n: i for i, n in enumerate(n for names in group_names for n in names)}
    groups = []
    for settings, names in zip(named["param_groups"], group_names):
        group = {k: v for k, v in settings.items() if k != "param_names"}
        group["params"] = [index[n] for n in names]
        groups.append(group)
    state = {index[name]: values for name, values in named["state"].items()}
    return {"state": state, "param_groups": groups}


def load_lightning_checkpoint(
    filepath: str | Path,
    module: LightningModule,
    optimizers: list[Optimizer],
    group_names: list[list[str]] | None,
    aliases: dict[str, str] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read an ordinary Lightning ``.ckpt`` file (``weights_only=True``) and keep this rank's stage of it.

    Returns:
        ``(checkpoint, whole)``: the checkpoint as :func:`load_sharded` returns it (this stage's
        ``state_dict``, name-keyed ``optimizer_states``, the trainer state as saved), and the whole model's
        ``state_dict`` plus name-keyed optimizer states (for the replica).
    """
    path = Path(filepath)
    checkpoint: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    if "state_dict" not in checkpoint:
        raise ValueError(f"{path} is not a Lightning checkpoint (no 'state_dict' entry)")
    full_state = checkpoint["state_dict"]
    local = module.state_dict()
    checkpoint["state_dict"] = {k: v for k, v in full_state.items() if k in local}
    saved_optimizers = checkpoint.get("optimizer_states", [])
    named_states = []
    if optimizers and saved_optimizers:
        if group_names is None:
            raise RuntimeError("the whole model's param groups were not recorded before the split")
        named_states = [named_from_positional(saved_optimizers[0], group_names)]
        state = named_states[0]["state"]
        for later, first in (aliases or {}).items():  # every copy of a tied parameter starts from its state
            if first in state:  # its own tensors: the optimizers update them in place
                state[later] = {k: v.clone() if isinstance(v, Tensor) else v for k, v in state[first].items()}
    own = []
    for optimizer, named in zip(optimizers, named_states):
        names = {n for g in optimizer.param_groups for n in _group_names(module, g)}
        groups = [
            {**saved, "param_names": _group_names(module, g)}
            for saved, g in zip(named["param_groups"], optimizer.param_groups)
        ]
        own.append({"state": {n: v for n, v in named["state"].items() if n in names}, "param_groups": groups})
    checkpoint["optimizer_states"] = own
    return checkpoint, {"state_dict": full_state, "optimizer_states": named_states}


def load_replica_from_memory(
    whole: dict[str, Any], replica: nn.Module, body_attr: str, optimizer: Optimizer | None
) -> None:
    """:func:`load_replica` from the whole model of an ordinary checkpoint
    (:func:`load_lightning_checkpoint`)."""
    prefix = f"{body_attr}."
    replica.load_state_dict({k: whole["state_dict"][prefix + k] for k in replica.state_dict()})
    if optimizer is None or not whole["optimizer_states"]:
        return
    named = whole["optimizer_states"][0]["state"]
    names = {id(p): prefix + n for n, p in replica.named_parameters()}
    ordered = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    state = {i: dict(named[n]) for i, n in enumerate(ordered) if n in named}
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})


def write_group_names(directory: Path, stage: int, optimizer_states: list[dict[str, Any]]) -> None:
    """This stage's parameter names per param group (JSON), for :func:`consolidate_checkpoint`."""
    groups = [[g["param_names"] for g in named["param_groups"]] for named in optimizer_states]
    entry = {"stage": stage, "optimizers": groups}
    (directory / GROUPS_FILE.format(stage=stage)).write_text(json.dumps(entry))


def _whole_group_names(path: Path, optimizer: int) -> list[list[str]]:
    """Each param group's names over all stages (stage 0's, then stage 1's, ...: the module's order)."""
    files = sorted(path.glob(GROUPS_FILE.replace("{stage:05d}", "*")))
    if not files:
        raise FileNotFoundError(
            f"{path} has no {GROUPS_FILE.format(stage=0)}: it was written before checkpoints recorded their "
            "param groups; resume it with BambooStrategy and save it again to convert its optimizer state"
        )
    stages = sorted((json.loads(f.read_text()) for f in files), key=lambda entry: entry["stage"])
    groups = [list(names) for names in stages[0]["optimizers"][optimizer]]
    for entry in stages[1:]:
        for merged, names in zip(groups, entry["optimizers"][optimizer]):
            merged += names
    return groups


def _write_lightning_checkpoint(path: Path, output: Path, state_dict: dict[str, Tensor]) -> None:
    """The ordinary ``.ckpt`` of :func:`consolidate_checkpoint`: weights, optimizers, trainer state."""
    checkpoint: dict[str, Any] = torch.load(path / META_FILE, weights_only=True)
    drop_loader_position(checkpoint)  # the one-process run's plain DataLoader has no position to load
    saved_groups = checkpoint.pop("optimizer_param_groups", [])
    meta = _metadata(path)
    optimizer_states = []
    tied = checkpoint.pop(TIED_KEY, {})
    for i, groups in enumerate(saved_groups):
        # a tied parameter is one parameter of the single-process model, listed where its first use is
        group_names = [[n for n in g if n not in tied] for g in _whole_group_names(path, i)]
        names = [n for g in group_names for n in g]
        with_state = {k[len(f"optim{i}/") :].rpartition("/")[0] for k in meta if k.startswith(f"optim{i}/")}
        with_state = {tied.get(n, n) for n in with_state}
        if len(set(names)) != len(names) or not with_state <= set(names):
            raise ValueError(
                f"{path}'s param-group files ({GROUPS_FILE.format(stage=0)}, ...) do not list every "
                "parameter with optimizer state exactly once; the folder is incomplete"
            )
        named = {
            "state": _saved_optimizer_state(path, i, names, no_dist=True),
            "param_groups": groups,
        }
        optimizer_states.append(positional_from_named(named, group_names))
    checkpoint["state_dict"] = state_dict
    checkpoint["optimizer_states"] = optimizer_states
    output.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, output)
