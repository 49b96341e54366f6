"""Bamboo's redundant copy of the successor stage: its layers AND its optimizer state, kept exactly current.

Every rank holds a replica of stage ``(s + 1) % num_stages``. After each optimizer step, the successor sends
the (averaged, clipped) gradients it just applied to its predecessor (one flat buffer per dtype), with its
buffers (BatchNorm statistics), which parameters had a gradient (the others are skipped, as the
successor's optimizer skipped them) and its optimizer's numeric hyper-parameters (as a scheduler set them
for this step; a float64 vector, no pickling: the first message is preceded by a small header with its
sizes, every message ends with the sizes of the next, and the hyper-parameter keys travel as JSON when
they change, so the replica's optimizer gains and drops keys as the successor's does), and the
predecessor applies them with the user's own optimizer built over the replica (same class and param
groups). At setup every parameter, frozen ones
included, and every buffer of the successor is copied to the replica. Starting from the same parameters,
the same gradients through the same optimizer code give the same parameters and the same optimizer state
bit for bit (on the same kind of device), so a takeover needs no transfer at all.

The update overlaps the next step: :meth:`ReplicaSync.step` only *posts* the exchange (non-blocking send
to the predecessor, receive from the successor) and records the hyper-parameters of this step; the
transfer runs while the rank starts its next step, and the received gradients are applied when the replica
is next needed. The replica is exactly current (parameters and optimizer state equal the successor's after
its latest optimizer step):

* before any forward of the replica (a forward pre-hook applies a pending update: the first ``FR`` of the
  next step, or a takeover),
* whenever it is read through :attr:`ReplicaSync.replica` or :attr:`ReplicaSync.optimizer`,
* after :meth:`ReplicaSync.flush`, and before the next :meth:`ReplicaSync.step` posts a new exchange.

Only the module object held elsewhere (``BambooStrategy.replica``), read directly between an optimizer
step and the next replica forward, can be one update behind; call :meth:`flush` first.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lbd_common import codec
from lightning_bamboo.layout.view import PipelineView
from lightning_bamboo.pipeline import p2p

_MAGIC = 7301.0
"""First value of every replica header (a message of another kind is refused, not misread)."""
_HEADER = 4
_TAIL = 2
_SCHEMA = "replica hyper-parameter schema"
"""Values at the end of every message: the sizes of the next (hyper-parameter values, schema bytes)."""


class ReplicaSync:
    """Keeps ``replica`` (a copy of the successor stage) and ``optimizer`` equal to the successor's.

    Args:
        stage: this rank's own stage, whose gradients are sent to the predecessor.
        replica: this rank's copy of the successor stage (same parameter order as the successor's stage).
        optimizer: the optimizer over ``replica``'s parameters, same class and param-group settings as the
            successor's.
        groups: this rank's place in the layout (gives the predecessor and successor ranks).
        device: the device gradients travel on (the strategy's ``root_device``).
    """

    def __init__(
        self,
        stage: nn.Module,
        replica: nn.Module,
        optimizer: Optimizer,
        groups: PipelineView,
        device: torch.device,
    ) -> None:
        self.stage = stage
        self._replica = replica
        self._optimizer = optimizer
        self.groups = groups
        self.device = device
        self._pending: _PendingUpdate | None = None
        # Kept from step to step, made at the first exchange: the flat buffers (one per dtype), views of the
        # send buffers shaped like this stage's trainable parameters then buffers (gradients are copied into
        # them), views of the receive buffers shaped like the replica's (they become its ``.grad``), and the
        # receive buffer of the float64 values. Building the views costs about as much as copying the
        # gradients, so they are built once.
        self._send_flats: list[Tensor] | None = None
        self._send_views: list[Tensor] = []
        self._receive_flats: list[Tensor] | None = None
        self._receive_views: list[Tensor] = []
        self._meta_in: Tensor | None = None
        # the hyper-parameter layout of the next message sent (None: not agreed yet, the first message
        # exchanges a header) and its keys (JSON) when the predecessor has not had them yet; the values last
        # sent (for keys the stage optimizer has dropped since the layout was announced); the sizes of the
        # next message received, as the successor announced them
        self._layout: list[list[list[Any]]] | None = None
        self._schema_due = b""
        self._sent_values: list[float] = []
        self._expected = (0, 0)
        self._header_out: Tensor | None = None
        # any forward of the replica (FR, a takeover) first applies the update still in flight
        self._hook = replica.register_forward_pre_hook(lambda module, args: self.flush())

    @property
    def replica(self) -> nn.Module:
        """The replica, with any update in flight applied first."""
        self.flush()
        return self._replica

    @property
    def optimizer(self) -> Optimizer:
        """The replica's optimizer, with any update in flight applied first."""
        self.flush()
        return self._optimizer

    @property
    def pending(self) -> bool:
        """Whether an exchange has been posted whose gradients are not applied yet."""
        return self._pending is not None

    def _own_params(self) -> list[nn.Parameter]:
        return [p for p in self.stage.parameters() if p.requires_grad]

    def _replica_params(self) -> list[nn.Parameter]:
        return [p for p in self._replica.parameters() if p.requires_grad]

    def sync_parameters(self) -> None:
        """Make the replica's parameters (frozen ones too) and buffers equal to the successor's (blocking).

        Called at setup: a rank's own copy of its successor's layers may have been initialised differently
        (no common seed), and frozen parameters and buffers (BatchNorm statistics) never travel with the
        gradients.
        """
        self.flush()
        with torch.no_grad():
            own = _flatten(_state_tensors(self.stage), self.device)
            targets = _state_tensors(self._replica)
            incoming = _empty_flats(targets, self.device)
            works = self._post(own, incoming, p2p.Tag.REPLICA_PARAM)
            for work in works:
                work.wait()
            _unflatten(incoming, targets)

    def step(self, main_optimizer: Optimizer) -> None:
        """Post this stage's gradients to the predecessor and the receive of the successor's (non-blocking).

        Call right after ``main_optimizer.step()`` (gradients are still in ``.grad``; they are copied into a
        flat send buffer here, so they may be zeroed right after). The param-group hyper-parameters of
        ``main_optimizer`` (learning rate set by a scheduler, ...) are recorded now, as they were for this
        step, sent with the gradients and given to the predecessor's replica optimizer when they are
        applied, so schedulers need no replica of their own. The gradients are applied by :meth:`flush`
        (see the module docstring for when that happens).
        """
        self.flush()  # exchanges are applied in order: the previous one first
        own_params = self._own_params()
        # with the gradients go: the stage's buffers (BatchNorm statistics), which gradient a parameter has,
        # and this stage's optimizer hyper-parameters, which are the ones the replica must step with
        buffers = list(self.stage.buffers())
        flags = [float(p.grad is not None) for p in own_params]
        schema, current_values = schema_and_values(main_optimizer)  # one pass over the param groups
        header: tuple[list[Any], Tensor] | None = None
        if self._layout is None:  # the first message: agree on its sizes (blocking, once per ReplicaSync)
            self._layout, self._schema_due = schema, codec.json_bytes(schema, _SCHEMA)
            size, schema_length = _layout_size(schema), len(self._schema_due)
            header = self._post_header(len(flags), size, schema_length)
        # the flat buffers are kept from step to step (no fresh 2 x model-size allocation per step): the
        # previous exchange is applied (flush above), so neither is in use any more
        if self._send_flats is None:
            self._send_flats = _empty_flats([*own_params, *buffers], self.device)
            self._send_views = _views(self._send_flats, [*own_params, *buffers])
        with torch.no_grad():
            for view, source in zip(self._send_views, [*(p.grad for p in own_params), *buffers], strict=True):
                if source is None:
                    view.zero_()  # no gradient: its flag says so, the values are not used
                else:
                    view.copy_(source)
        if header is not None:
            for work in header[0]:  # the gradient copy above ran while the headers travelled
                work.wait()
            self._expected = self._check_header(header[1])
        # this message has the layout announced by the previous one; it announces the next one's (this
        # step's keys), with the keys themselves when they changed
        if schema == self._layout:  # the usual step: the keys are those announced
            values = current_values
        else:
            values = encode_in_layout(main_optimizer, self._layout, self._sent_values)
        self._sent_values = values
        next_schema = b"" if schema == self._layout else codec.json_bytes(schema, _SCHEMA)
        tail = [float(len(current_values)), float(len(next_schema))]
        meta_out = torch.tensor([*flags, *values, *tail], dtype=torch.float64, device=self.device)
        own = [*self._send_flats, meta_out]
        if self._schema_due:
            own.append(codec.bytes_tensor(self._schema_due, self.device))
        self._layout, self._schema_due = schema, next_schema
        if self._receive_flats is None:
            replica_tensors = [*self._replica_params(), *self._replica.buffers()]
            self._receive_flats = _empty_flats(replica_tensors, self.device)
            self._receive_views = _views(self._receive_flats, replica_tensors)
        num_values, schema_length = self._expected
        meta_length = len(self._receive_views) - len(list(self._replica.buffers())) + num_values + _TAIL
        if self._meta_in is None or self._meta_in.numel() != meta_length:
            self._meta_in = torch.empty(meta_length, dtype=torch.float64, device=self.device)
        incoming = [*self._receive_flats, self._meta_in]
        schema_in = None
        if schema_length:
            schema_in = torch.empty(codec.check_header_length(schema_length, _SCHEMA), dtype=torch.uint8,
                                    device=self.device)
        receives = incoming if schema_in is None else [*incoming, schema_in]
        works = self._post(own, receives, p2p.Tag.REPLICA_GRAD)
        self._pending = _PendingUpdate(works, incoming, sent=own, schema=schema_in)

    def _post_header(self, num_flags: int, num_values: int, schema_length: int) -> tuple[list[Any], Tensor]:
        """Post the exchange of the first message's sizes with the predecessor and successor; return the
        works (wait on them before posting the message) and the successor's header, once they are done.

        Four float64 values, so the first receive is posted with the size the sender will send; every
        later message announces the sizes of the next (:meth:`step`). A size guessed from the receiver's
        own optimizer made gloo abort the process on a mismatch (``304 vs 296``, under ``lr_find``) before
        any readable error could run.
        """
        header_out = torch.tensor(
            [_MAGIC, num_flags, num_values, schema_length], dtype=torch.float64, device=self.device
        )
        header_in = torch.empty(_HEADER, dtype=torch.float64, device=self.device)
        self._header_out = header_out  # alive until the works are waited on
        return self._post([header_out], [header_in], p2p.Tag.REPLICA_GRAD), header_in

    def _check_header(self, header: Tensor) -> tuple[int, int]:
        """``(hyper-parameter values, schema bytes)`` of the successor's first message, as it announced.

        Raises:
            RuntimeError: the header is not one of ours, or the successor's stage has a different number
                of trainable parameters than the replica.
        """
        magic, num_flags, num_values, schema_length = header.tolist()
        expected_flags = len(self._replica_params())
        if magic != _MAGIC or num_values < 0 or schema_length < 0:
            raise RuntimeError(
                f"malformed replica header from rank {self.groups.successor_rank}: {header.tolist()} "
                f"(expected [{_MAGIC}, parameter count, hyper-parameter count, schema length]); the "
                "successor runs a different version of lightning_bamboo or another message was mistaken "
                "for this one"
            )
        if int(num_flags) != expected_flags:
            raise RuntimeError(
                f"the successor (rank {self.groups.successor_rank}) sends gradients of {int(num_flags)} "
                f"trainable parameters but the replica has {expected_flags}; every rank must build the same "
                "model and freeze the same parameters"
            )
        return int(num_values), int(schema_length)

    def exchange(self, main_optimizer: Optimizer) -> None:
        """The blocking form of :meth:`step`, for a step that commits in two phases (elastic Bamboo).

        Call *before* ``main_optimizer.step()``, once the step's gradients are final but before clipping: the
        gradients, has-gradient flags, buffers and hyper-parameters (as they will be for this step) go to the
        predecessor, and this returns when the successor's have arrived. Nothing is applied yet:
        :meth:`flush` applies them once the step is committed, :meth:`discard` drops them if it aborts.
        """
        self.step(main_optimizer)
        assert self._pending is not None
        for work in self._pending.works:
            work.wait()
        self._pending.works = []
        self._take_schema(self._pending)  # kept even if the step is discarded: the sender will not resend it

    def _take_schema(self, pending: _PendingUpdate) -> None:
        """Take what the message says about the hyper-parameters, whether or not its gradients are applied:
        the keys of its layout (when they changed; the replica optimizer gains and drops keys to match) and
        the sizes of the next message."""
        if pending.taken:
            return
        pending.taken = True
        if pending.schema is not None:
            follow_schema(self._optimizer, codec.parse_json(pending.schema, _SCHEMA))
        num_values, schema_length = pending.incoming[-1][-_TAIL:].tolist()
        if not (num_values >= 0 and schema_length >= 0 and num_values == int(num_values)):
            raise RuntimeError(
                f"malformed replica message from rank {self.groups.successor_rank}: it announces "
                f"{num_values} hyper-parameter values and {schema_length} schema bytes for the next one"
            )
        self._expected = (int(num_values), int(schema_length))

    def discard(self) -> None:
        """Drop the received update without applying it (the step it belongs to was aborted)."""
        self._pending = None

    def close(self) -> None:
        """Detach from the replica module (a new layout builds a new :class:`ReplicaSync`)."""
        self._pending = None
        self._hook.remove()

    def flush(self, before_step: Callable[[list[Tensor | None]], None] | None = None) -> None:
        """Wait for the exchange in flight (if any) and apply the successor's gradients to the replica.

        ``before_step`` gets the replica's gradients, installed, right before its optimizer steps (elastic
        Bamboo clips them there with the plan the step agreed on).
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        # the forward pre-hook runs this inside the engine's FR (inference mode): the optimizer's state must
        # be created and updated as normal tensors, usable outside inference mode (a takeover trains it)
        with torch.inference_mode(False):
            self._apply(pending, before_step)

    def _apply(
        self, pending: _PendingUpdate, before_step: Callable[[list[Tensor | None]], None] | None
    ) -> None:
        for work in pending.works:
            work.wait()
        replica_params = self._replica_params()
        meta = pending.incoming[-1]  # has-gradient flags, then hyper-parameters
        with torch.no_grad():
            # the gradients are used where they were received: ``.grad`` becomes a view of the flat buffer
            # (a copy only if the replica lives on another device); buffers are copied
            buffers = list(self._replica.buffers())
            views = self._receive_views  # of the flat buffers in ``pending.incoming``
            for p, view in zip(replica_params, views):
                if view.device == p.device:
                    p.grad = view
                else:
                    p.grad = view.to(p.device, copy=True)
            for buffer, view in zip(buffers, views[len(replica_params) :]):
                buffer.copy_(view)
        self._take_schema(pending)
        values = meta[:-_TAIL].tolist()
        has_grad, hyperparameters = values[: len(replica_params)], values[len(replica_params) :]
        for p, flag in zip(replica_params, has_grad):
            # no gradient: the successor's optimizer skipped it (no weight decay, no momentum); so does this
            if not flag:
                p.grad = None
        decode_hyperparameters(self._optimizer, hyperparameters)
        if before_step is not None:
            before_step([p.grad for p in replica_params])
        device_type = replica_params[0].device.type if replica_params else "cpu"
        with torch.autocast(device_type, enabled=False):  # the successor stepped outside autocast too
            self._optimizer.step()
        # no zero_grad: the next exchange overwrites every gradient (set to views of its buffer again)

    def _post(self, outgoing: list[Tensor], incoming: list[Tensor], tag: p2p.Tag) -> list[Any]:
        """Post the send of ``outgoing`` (flat buckets) to the predecessor and the receive of the
        successor's into ``incoming``; return the works.

        Both are posted in one batch (:func:`p2p.post_batch`) on every rank, so the ring (two ranks: each
        other's predecessor and successor) cannot deadlock, on gloo or NCCL.
        """
        ops = [p2p.isend_op(flat, self.groups.predecessor_rank, tag) for flat in outgoing]
        ops += [p2p.irecv_op(flat, self.groups.successor_rank, tag) for flat in incoming]
        return p2p.post_batch(ops)


@dataclass
class _PendingUpdate:
    """A posted gradient exchange whose gradients are not applied to the replica yet."""

    works: list[Any]
    incoming: list[Tensor]
    """Flat gradient-and-buffer buckets, then the float64 values (has-gradient flags, hyper-parameters)."""
    sent: list[Tensor]
    """The send buffers, alive until the exchange is waited on."""
    schema: Tensor | None = None
    """The keys of this message's hyper-parameter layout (JSON bytes), when they changed."""
    taken: bool = False
    """Whether :meth:`ReplicaSync._take_schema` has read the keys and the next message's sizes."""


def set_hyperparameters(target: Optimizer, hyperparameters: list[dict[str, Any]]) -> None:
    """Give ``target``'s param groups the recorded settings (one dict per group, ``params`` excluded)."""
    if len(hyperparameters) != len(target.param_groups):
        raise RuntimeError(
            f"replica optimizer has {len(target.param_groups)} param groups but the stage's optimizer has "
            f"{len(hyperparameters)}; configure_optimizers must build the same groups for every stage"
        )
    for values, group in zip(hyperparameters, target.param_groups):
        group.update(values)


def _numeric_settings(optimizer: Optimizer) -> list[tuple[dict[str, Any], str, Any]]:
    """``(group, key, value)`` of every numeric hyper-parameter, in a fixed order (groups, sorted keys).

    Numbers, booleans, tuples of numbers (Adam's ``betas``) and tensors (a tensor learning rate) count;
    ``None`` and strings are left alone (they are the same on both sides: same ``configure_optimizers``).
    """
    settings = []
    for group in optimizer.param_groups:
        for key in sorted(k for k in group if k != "params"):
            value = group[key]
            if isinstance(value, (bool, int, float, Tensor)) or (
                isinstance(value, (tuple, list)) and all(isinstance(v, (bool, int, float)) for v in value)
            ):
                settings.append((group, key, value))
    return settings


def encode_hyperparameters(optimizer: Optimizer) -> list[float]:
    """The optimizer's numeric hyper-parameters as floats (exact: a Python float is a float64)."""
    return [v for _, _, value in _numeric_settings(optimizer) for v in _as_floats(value)]


def _kind(value: Any) -> list[Any]:
    """``[kind, size or shape(, dtype)]`` of a numeric setting, as JSON."""
    if isinstance(value, Tensor):
        return ["tensor", list(value.shape), codec.dtype_name(value.dtype, "as a replica hyper-parameter")]
    if isinstance(value, (tuple, list)):
        return [type(value).__name__, [type(v).__name__ for v in value]]
    return [type(value).__name__, 1]


def hyperparameter_schema(optimizer: Optimizer) -> list[list[list[Any]]]:
    """Per param group, ``[key, kind, size]`` of each numeric setting (the layout of
    :func:`encode_hyperparameters`), JSON-representable."""
    return schema_and_values(optimizer)[0]


def schema_and_values(optimizer: Optimizer) -> tuple[list[list[list[Any]]], list[float]]:
    """:func:`hyperparameter_schema` and :func:`encode_hyperparameters` in one pass (once per step)."""
    schema: list[list[list[Any]]] = []
    values: list[float] = []
    for group in optimizer.param_groups:
        entries = []
        for key in sorted(group):
            if key == "params":
                continue
            value = group[key]
            if isinstance(value, (bool, int, float, Tensor)) or (
                isinstance(value, (tuple, list)) and all(isinstance(v, (bool, int, float)) for v in value)
            ):
                entries.append([key, *_kind(value)])
                values += _as_floats(value)
        schema.append(entries)
    return schema, values


def _placeholder(kind: list[Any]) -> Any:
    """A value of ``kind`` (:func:`_kind`); its number is set by :func:`decode_hyperparameters` next."""
    types = {"bool": bool, "int": int, "float": float}
    name, shape = kind[0], kind[1]
    if name == "tensor":
        return torch.zeros(codec.checked_shape(shape, _SCHEMA), dtype=codec.dtype_of(kind[2], _SCHEMA))
    if name in ("tuple", "list"):
        return (tuple if name == "tuple" else list)(types[t](0) for t in shape)
    return types[name](0)


def follow_schema(optimizer: Optimizer, schema: list[list[list[Any]]]) -> None:
    """Give ``optimizer``'s param groups exactly the numeric keys of ``schema`` (:func:`hyperparameter_schema`
    of the successor's optimizer): keys it gained are added, keys it dropped are removed.

    Raises:
        RuntimeError: when the number of param groups differs, or a schema entry is not understood.
    """
    if len(schema) != len(optimizer.param_groups):
        raise RuntimeError(
            f"the successor's optimizer has {len(schema)} param groups but the replica's has "
            f"{len(optimizer.param_groups)}; configure_optimizers must build the same param groups for a "
            "stage and its replica"
        )
    current = hyperparameter_schema(optimizer)
    for group, wanted, have in zip(optimizer.param_groups, schema, current):
        wanted_keys = {entry[0]: entry[1:] for entry in wanted}
        for key, *_ in have:
            if key not in wanted_keys:
                del group[key]
        for key, kind in wanted_keys.items():
            if [key, *kind] not in have:
                try:
                    group[key] = _placeholder(kind)
                except (KeyError, AttributeError, TypeError, IndexError) as err:
                    raise RuntimeError(
                        f"the successor sent hyper-parameter {key!r} of a kind the replica cannot hold: "
                        f"{kind}"
                    ) from err


def _entry_size(entry: list[Any]) -> int:
    """Values of one :func:`hyperparameter_schema` entry ``[key, kind, size or shape(, dtype)]``."""
    if entry[1] == "tensor":
        return math.prod(entry[2])
    if entry[1] in ("tuple", "list"):
        return len(entry[2])
    return 1


def _layout_size(schema: list[list[list[Any]]]) -> int:
    return sum(_entry_size(entry) for group in schema for entry in group)


def encode_in_layout(
    optimizer: Optimizer, layout: list[list[list[Any]]], previous: list[float]
) -> list[float]:
    """:func:`encode_hyperparameters` in the layout announced earlier (``layout``, a
    :func:`hyperparameter_schema`): a key that is gone (or changed its size) since sends its ``previous``
    value (or 0), and keys gained since wait for the next message, which carries them and its layout."""
    if hyperparameter_schema(optimizer) == layout:
        return encode_hyperparameters(optimizer)
    index = {id(group): i for i, group in enumerate(optimizer.param_groups)}
    current: list[dict[str, Any]] = [{} for _ in optimizer.param_groups]
    for group, key, value in _numeric_settings(optimizer):
        current[index[id(group)]][key] = value
    values: list[float] = []
    for i, entries in enumerate(layout):
        for entry in entries:
            size = _entry_size(entry)
            value = current[i].get(entry[0]) if i < len(current) else None
            floats = _as_floats(value) if value is not None else []
            if len(floats) != size:
                floats = previous[len(values) : len(values) + size] or [0.0] * size
            values += floats
    return values


def _as_floats(value: Any) -> list[float]:
    if isinstance(value, Tensor):
        return [float(v) for v in value.detach().reshape(-1).tolist()]
    if isinstance(value, (tuple, list)):
        return [float(v) for v in value]
    return [float(value)]


def decode_hyperparameters(optimizer: Optimizer, values: list[float]) -> None:
    """Set ``optimizer``'s numeric hyper-parameters from :func:`encode_hyperparameters` of another one.

    Raises:
        RuntimeError: when the count does not match this optimizer's settings.
    """
    settings = _numeric_settings(optimizer)
    sizes = [
        v.numel() if isinstance(v, Tensor) else len(v) if isinstance(v, (tuple, list)) else 1
        for _, _, v in settings
    ]
    if sum(sizes) != len(values):
        raise RuntimeError(
            f"the successor's optimizer has {len(values)} hyper-parameter values but the replica's has "
            f"{sum(sizes)}; configure_optimizers must build the same param groups for a stage and its replica"
        )
    offset = 0
    for (group, key, old), size in zip(settings, sizes):
        chunk = values[offset : offset + size]
        offset += size
        if isinstance(old, Tensor):
            group[key] = torch.tensor(chunk, dtype=old.dtype, device=old.device).reshape(old.shape)
        elif isinstance(old, (tuple, list)):
            group[key] = type(old)(type(o)(v) for o, v in zip(old, chunk))
        else:
            group[key] = type(old)(chunk[0])


def _state_tensors(module: nn.Module) -> list[Tensor]:
    """Every parameter (trainable or frozen) and every buffer, in registration order."""
    return [p.data for p in module.parameters()] + list(module.buffers())


def _flatten(tensors: list[Tensor], device: torch.device) -> list[Tensor]:
    """One flat tensor per dtype (:func:`lbd_common.codec.by_dtype` order)."""
    return [torch.cat([t.reshape(-1).to(device) for t in bucket]) for bucket in codec.by_dtype(tensors)]


def _empty_flats(tensors: list[Tensor], device: torch.device) -> list[Tensor]:
    """Uninitialised flat buffers (one per dtype) the size of :func:`_flatten` of ``tensors``."""
    return [
        torch.empty(sum(t.numel() for t in bucket), dtype=bucket[0].dtype, device=device)
        for bucket in codec.by_dtype(tensors)
    ]


def _views(flats: list[Tensor], targets: list[Tensor]) -> list[Tensor]:
    """Views of ``flats`` (one per dtype, :func:`lbd_common.codec.by_dtype` order) shaped like each of
    ``targets``, in the order of ``targets``."""
    offsets: dict[torch.dtype, int] = {}
    by_dtype = {bucket[0].dtype: flat for bucket, flat in zip(codec.by_dtype(targets), flats, strict=True)}
    views = []
    for target in targets:
        start = offsets.get(target.dtype, 0)
        views.append(by_dtype[target.dtype][start : start + target.numel()].view_as(target))
        offsets[target.dtype] = start + target.numel()
    return views


def _unflatten(flats: list[Tensor], targets: list[Tensor]) -> None:
    """Copy flat buckets (one per dtype, in :func:`lbd_common.codec.by_dtype` order) back into ``targets``."""
    for bucket, flat in zip(codec.by_dtype(targets), flats):
        offset = 0
        for target in bucket:
            target.copy_(flat[offset : offset + target.numel()].view_as(target))
            offset += target.numel()
