"""How a member forms a generation of the ownership map: the layers it needs moved to it from peers (or
loaded), its stage and replica, the user's optimizer over them, the process groups of the pipelines and
stages, and the engine. Generation 0 (at setup) and every later one (a failover, a join, a fallback) go
through :meth:`Formation.form`, which fills a :class:`~lightning_bamboo.runtime.generation.Generation`.

:class:`Formation` holds what does not change between generations: the pipeline body's layers (each one the
module this member holds, or a template on the meta device), which layers make each original stage, the
tied parameters, and the schedule settings. The body is planned and checked by :func:`checked_body`, a
function of the module alone (the supervisor runs it before any worker starts).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_bamboo._lightning import private as _private
from lightning_bamboo._lightning.seam import StageBody
from lightning_bamboo.contract import (
    _STAGE_MARK,
    check_contract,
    check_stage_split,
    find_pipeline_body,
    sub_sequential,
)
from lightning_bamboo.layout.ownership import OwnershipMap
from lightning_bamboo.layout.plan import StageLayout, estimate_layer_costs
from lightning_bamboo.layout.view import create_groups, view_of
from lightning_bamboo.pipeline.engine import PipelineEngine
from lightning_bamboo.pipeline.microbatch import check_train_batches, microbatch_shares
from lightning_bamboo.pipeline.replica import ReplicaSync
from lightning_bamboo.pipeline.ties import (
    Tie,
    find_ties,
    first_use_groups,
    regroup_tied_copies,
    tied_gradients,
    untie,
)
from lightning_bamboo.runtime.generation import Generation
from lightning_bamboo.runtime.reshard import LayerState, Resharder, gather, install
from lightning_bamboo.schedule import (
    Action,
    Schedule,
    add_forward_redundancy,
    build_1f1b,
    format_grid,
    rank_program,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import Precision


class Formation:
    """Forming generations of one pipeline body (see the module docstring).

    ``device``/``replica_device`` return where this member's stages and replica live (known once Lightning
    has set the strategy's devices); ``before_action`` is the engine's hook before each schedule action.
    """

    def __init__(
        self,
        num_stages: int,
        num_microbatches: int,
        redundancy: bool,
        keyed_rng: bool,
        timeout: timedelta | None,
        device: Callable[[], torch.device],
        replica_device: Callable[[], torch.device],
        forward_redundancy: bool | None = None,
    ) -> None:
        self.num_stages = num_stages
        self.num_microbatches = num_microbatches
        # global micro-batches per step: num_microbatches x the pipelines of generation 0, fixed for the job
        self.global_microbatches = num_microbatches
        self.redundancy = redundancy
        # FR in the schedule: the mode's (recovery="replica+forward"); set_forward_redundancy switches it
        self.default_forward_redundancy = redundancy if forward_redundancy is None else forward_redundancy
        self.forward_redundancy = self.default_forward_redundancy
        self.keyed_rng = keyed_rng
        self.timeout = timeout
        self._device, self._replica_device = device, replica_device
        self.before_action: Callable[[Action], None] | None = None  # the engine's hook before each action
        self.body_attr = "pipeline"
        self.body_length = 0
        self.layers: dict[int, nn.Module] = {}
        self.stage_layers: tuple[range, ...] = ()
        self.ties: list[Tie] = []  # parameters used by several layers of the body (pipeline/ties.py)
        self.tie_groups: dict[str, int | None] = {}  # a later use's name -> its tie's param group under auto
        self.seam: StageBody | None = None  # in the user's body's place from setup on (_lightning/seam.py)

    # ------------------------------------------------------------------ the body
    def prepare(self, module: pl.LightningModule, pipeline_attr: str | None, costs: Sequence[float] | None,
                precision: Precision, group_names: list[list[str]] | None) -> None:
        """Take the module's body once it passed :func:`checked_body`: every layer is converted to the
        precision's dtype now (any of them may become this member's stage or replica, and layers received
        from peers take their template's dtype), tied parameters are untied into one copy per use, and, when
        fitting (``group_names``: the whole model's param groups, read before the split), each tie's later
        uses go in its first use's param group."""
        attr, body, layout = checked_body(module, pipeline_attr, self.num_stages, costs)
        self.body_attr = attr
        self.stage_layers = layout.stage_layers
        rank_zero_info(f"BambooStrategy layout:\n{layout.describe(costs=layer_costs(body, costs))}")
        precision.convert_module(body)
        self.ties = find_ties(body)
        untie(body, self.ties)  # one copy per use, on every layout (lightning_bamboo.pipeline.ties)
        for found in self.ties:
            stages = sorted({s for s, layers in enumerate(self.stage_layers) for layer in found.layers
                             if layer in layers})
            rank_zero_info(f"BambooStrategy: tied {found.describe(attr)} (stages {stages}: each holds a "
                           "copy, their gradients are summed before every step)")
        self.layers = {i: body[i] for i in range(len(body))}
        self.body_length = len(body)
        self.seam = StageBody(type(module).__name__, attr, self.layers, self.body_length)
        if group_names is not None:
            self.tie_groups = first_use_groups(self.ties, self.body_attr, group_names)

    def check_train_batches(self, loader: object) -> None:
        """Refuse at the start of training a last batch the job's fixed split cannot cut evenly
        (``num_microbatches`` x the pipelines at its start, whatever is alive now), not at the epoch's end."""
        starting = self.global_microbatches // self.num_microbatches
        check_train_batches(loader, self.num_microbatches, starting)

    def replica_stages(self, owners: OwnershipMap, member: int) -> list[int]:
        """The stages ``member`` holds a replica of (none without ``redundancy``: a loss then needs the
        checkpoint fallback)."""
        return owners.replica_stages_of(member) if self.redundancy else []

    def needs(self, owners: OwnershipMap) -> dict[int, list[int]]:
        """Member -> the layers it holds in ``owners`` (its stages' and its replica's)."""
        return {
            m: self.layers_of(owners.stages_of(m) + self.replica_stages(owners, m)) for m in owners.members()
        }

    def layers_of(self, stages: list[int]) -> list[int]:
        return [layer for s in stages for layer in self.stage_layers[s]]

    def template(self, layer: int) -> nn.Module:
        return self.layers[layer]

    # ------------------------------------------------------------------ a generation
    def form_at_setup(self, gen: Generation, store: dist.Store, module: pl.LightningModule, fresh: bool,
                      optimizer: Optimizer | None, announce: bool) -> None:
        """Form ``gen.owners`` at setup: a ``fresh`` body (generation 0) is held as built by pipeline 0's
        members and sent to the others; a later fit/validate/test/predict with the same Trainer keeps the
        layers where they are. ``announce``: the first entry point logs generation 0's schedule."""
        owners, member = gen.owners, gen.member
        assert owners is not None
        announce = announce and owners.generation == 0
        if not fresh:
            self.form(gen, member, store, module, None, held=self.holdings(gen, optimizer), announce=announce)
            return
        gen.held = {}
        if owners.pipeline_of(member) == owners.pipeline_ids()[0]:
            own = self.layers_of(owners.stages_of(member))
            gen.held = {layer: LayerState(self.layers[layer]) for layer in own}
        self.form(gen, member, store, module, None, holdings=self.holdings(gen, optimizer), announce=announce)

    def form(
        self,
        gen: Generation,
        member: int,
        store: dist.Store,
        module: pl.LightningModule,
        optimizer: Optimizer | None,
        holdings: dict[int, LayerState] | None = None,
        held: dict[int, LayerState] | None = None,
        announce: bool = False,
    ) -> None:
        """Move layers to where ``gen.owners`` needs them (or take ``held``, loaded from a checkpoint) and
        rebuild stage, replica, groups and engine in ``gen``.

        ``holdings``: the layers this member can give (default: all it holds now; a joiner gives none).
        ``optimizer``: the member's optimizer, refilled with its stages' layers (``None``: not built yet).
        ``announce``: log the schedule's grid (generation 0 of the first entry point).
        """
        owners, me, device = gen.owners, member, self._device()
        assert owners is not None
        if held is None:
            resharder = Resharder(store, owners.generation, me, owners.rank_of, self.template, device)
            current = self.holdings(gen, optimizer) if holdings is None else holdings
            held = resharder.run(current, self.needs(owners))
        own_layers = self.layers_of(owners.stages_of(me))
        replica_layers = self.layers_of(self.replica_stages(owners, me))
        # what it holds from now on: the layers it gave up go to the meta device below, and a member that
        # still listed them would be chosen as their source (or take its meta copy) in a later generation
        gen.held = {layer: held[layer] for layer in own_layers + replica_layers}
        for layer in own_layers + replica_layers:
            self.layers[layer] = gen.held[layer].module
        for layer in replica_layers:
            self.layers[layer].to(self._replica_device())
        for layer in own_layers:
            self.layers[layer].to(device)
        self._release_templates(set(own_layers) | set(replica_layers))
        assert self.seam is not None
        stage = self.seam.hold({layer: self.layers[layer] for layer in own_layers})  # the seam's children
        gen.stage = stage
        gen.replica = sub_sequential(self.layers, replica_layers) if replica_layers else None
        if optimizer is not None:
            grouping = self.user_optimizer(module, stage)
            install(optimizer, [(layer, gen.held[layer]) for layer in own_layers], grouping)
        # groups: one per pipeline (loss broadcast) and one per stage (gradient all-reduce), same order
        # on every member
        pipeline_groups, stage_groups = create_groups(owners.pipelines, owners.rank_of, self.timeout)
        holders = [
            (owners.rank_of(m), owners.pipeline_of(m), set(self.layers_of(owners.stages_of(m))))
            for m in owners.members()
        ]
        own_modules = {layer: self.layers[layer] for layer in own_layers}
        gen.tied = tied_gradients(self.ties, own_modules, holders, owners.rank_of(me), self.timeout)
        gen.view = view_of(owners.pipelines, me, owners.rank_of, pipeline_groups, stage_groups)
        if optimizer is not None:
            self.build_replica_optimizer(gen, module)
        positions = gen.view.num_positions
        share = self.microbatch_share(owners, me)
        schedule = self.schedule(positions, len(share))
        if announce:
            rank_zero_info(f"BambooStrategy schedule (rank x step):\n{format_grid(schedule)}")
        stage_params = {
            s: [p for layer in self.stage_layers[s] for p in self.layers[layer].parameters()]
            for s in owners.stages_of(me)
        }
        gen.engine = PipelineEngine(
            stage,
            gen.view,
            schedule,  # type: ignore[arg-type]
            inputs_fn=module.pipeline_inputs,  # type: ignore[arg-type]
            loss_fn=module.pipeline_loss,  # type: ignore[arg-type]
            device=device,
            replica=gen.replica if positions > 1 and self.redundancy else None,
            replica_device=self._replica_device(),
            stage_params=stage_params,
            tied=gen.tied,
            keyed_rng=self.keyed_rng,
            first_microbatch=share.start,
            loss_divisor=self.global_microbatches / len(owners.pipelines),
        )
        gen.engine.before_action = self.before_action

    def schedule(self, positions: int, num_microbatches: int) -> Schedule:
        """1F1B over ``positions``, with the replica forwards (``FR``) in its bubbles when the job has
        redundancy and they are not switched off (:meth:`set_forward_redundancy`)."""
        return pipeline_schedule(positions, num_microbatches, self.redundancy and self.forward_redundancy)

    def microbatch_share(self, owners: OwnershipMap, member: int) -> range:
        """The job's global micro-batches ``member``'s pipeline runs in ``owners`` (its consecutive share of
        the fixed split, :func:`~lightning_bamboo.pipeline.microbatch.microbatch_shares`):
        ``num_microbatches`` each while the pipelines are those of the start, more each after a pipeline is
        lost, fewer after one joins, and fewer for a pipeline running stages fused than for full ones."""
        shares = microbatch_shares(self.global_microbatches, len(owners.pipelines), owners.shapes())
        return shares[owners.pipeline_ids().index(owners.pipeline_of(member))]

    def warn_if_unrecoverable(self, owners: OwnershipMap) -> None:
        """Say at start what ``recovery="peers"`` with one pipeline means: no peer holds a lost stage."""
        if not self.redundancy and len(owners.pipelines) == 1:
            rank_zero_warn(
                "Bamboo recovery='peers' with one pipeline: no data-parallel peer holds "
                "a copy of a lost stage, so a lost worker resumes from the last checkpoint "
                "(checkpoint_every_n_steps) or ends the job; use recovery='replica' or more pipelines"
            )

    def set_forward_redundancy(self, enabled: bool, gen: Generation, member: int) -> None:
        """Switch ``FR`` for the following steps (see ``BambooStrategy.set_forward_redundancy``)."""
        if not isinstance(enabled, bool):
            raise TypeError(f"set_forward_redundancy(enabled=...) must be True or False, got {enabled!r}")
        if enabled and not self.redundancy:
            raise ValueError("set_forward_redundancy(True) needs BambooStrategy(redundancy=True): without "
                             "redundancy no member holds a replica to run forward")
        self.forward_redundancy = enabled
        engine, view = gen.engine, gen.view
        if engine is not None and view is not None and gen.owners is not None:
            share = self.microbatch_share(gen.owners, member)
            engine.schedule = self.schedule(view.num_positions, len(share))
            engine.program = rank_program(engine.schedule, view.position)
            engine.lowered(engine.schedule)  # lowered now, not in the next step

    def _release_templates(self, held: set[int]) -> None:
        """Layers this member does not hold stay only as templates on the meta device (a layer received
        later is materialized from its template), so a member's memory is its stages and replica, not the
        whole model."""
        for layer, module in self.layers.items():
            if layer not in held and any(t.device.type != "meta" for t in _tensors_of(module)):
                module.to("meta")

    def holdings(self, gen: Generation, optimizer: Optimizer | None) -> dict[int, LayerState]:
        """Every layer this member holds in ``gen``, with its optimizer state as of now."""
        held = dict(gen.held)
        if optimizer is not None and gen.stage is not None:
            own = {int(n): m for n, m in gen.stage._modules.items()}
            held.update(gather(own, optimizer))
        if gen.replica is not None and gen.replica_optimizer is not None:
            held.update(gather({int(n): m for n, m in gen.replica._modules.items()}, gen.replica_optimizer))
        return held

    def build_replica_optimizer(self, gen: Generation, module: pl.LightningModule) -> None:
        """The user's optimizer over the replica (``configure_optimizers`` with the body swapped for it) and
        the :class:`ReplicaSync` that keeps both equal to the successor's (when the pipeline has two or more
        positions; a member running the whole pipeline has no successor)."""
        if gen.replica_sync is not None:
            gen.replica_sync.close()
            gen.replica_sync = None
        if gen.replica is None:
            gen.replica_optimizer = None
            return
        gen.replica_optimizer = self.user_optimizer(module, gen.replica)
        layers = [(layer, gen.held[layer]) for layer in (int(name) for name in gen.replica._modules)]
        install(gen.replica_optimizer, layers, gen.replica_optimizer)
        if gen.view is not None and gen.view.num_positions > 1:
            assert gen.stage is not None
            gen.replica_sync = ReplicaSync(
                gen.stage, gen.replica, gen.replica_optimizer, gen.view, self._device()
            )

    def check_groups_fit_any_layout(self, module: pl.LightningModule, optimizer: Optimizer) -> None:
        """A failover gives a member several stages, whose parameters join the param groups the user's
        ``configure_optimizers`` gives them, in the member's optimizer (the object Lightning and the
        schedulers hold): so that code must build as many groups for the whole body as for one stage (a group
        may be empty). Checked at start, not at the first failover."""
        whole = self.user_optimizer(module, sub_sequential(self.layers, sorted(self.layers)))
        if len(whole.param_groups) != len(optimizer.param_groups):
            raise ValueError(
                f"configure_optimizers builds {len(optimizer.param_groups)} param groups for this member's "
                f"stage but {len(whole.param_groups)} for the whole pipeline body; BambooStrategy needs the "
                "same number for any set of layers (a failover gives a member several stages): build the "
                "groups from fixed parts (e.g. the head and the rest), leaving a group empty where the "
                "stage has none of its layers"
            )

    def user_optimizer(self, module: pl.LightningModule, body: nn.Module) -> Optimizer:
        """The user's optimizer over ``body`` (``configure_optimizers`` while the seam presents ``body``'s
        layers, :meth:`~lightning_bamboo._lightning.seam.StageBody.presenting`): its param groups,
        hyper-parameters and which parameter goes in which group are the user's own."""
        assert self.seam is not None
        with self.seam.presenting(body):
            optimizers, _ = _private.init_optimizers(module)
        if len(optimizers) != 1:
            raise ValueError(f"BambooStrategy supports exactly one optimizer, got {len(optimizers)}")
        self.regroup_ties(optimizers[0], body)
        return optimizers[0]

    def regroup_ties(self, optimizer: Optimizer, body: nn.Module) -> None:
        """Every copy of a tied parameter into the param group ``strategy="auto"`` gives the parameter (its
        first use's), whatever its own name makes the user's grouping choose (:mod:`..ties`)."""
        if self.tie_groups:
            named = ((f"{self.body_attr}.{name}", p) for name, p in body.named_parameters())
            regroup_tied_copies(optimizer, named, self.tie_groups)


def plan_stages(body: nn.Sequential, num_stages: int, costs: list[float]) -> StageLayout:
    """Which layers make each stage: contiguous runs of about equal cost (``layer_costs``, estimated)."""
    if len(body) < num_stages:
        raise ValueError(
            f"num_stages ({num_stages}) is more than the {len(body)} layers of the pipeline body; "
            f"each stage needs at least one layer"
        )
    if len(costs) != len(body):
        raise ValueError(f"layer_costs has {len(costs)} entries but the pipeline body has {len(body)} layers")
    return StageLayout.plan(costs, num_stages, num_stages)


def layer_costs(body: nn.Sequential, given: Sequence[float] | None) -> list[float]:
    """The given ``layer_costs``, or the estimate from the layers."""
    return list(given) if given is not None else estimate_layer_costs(list(body))


def checked_body(
    module: pl.LightningModule, pipeline_attr: str | None, num_stages: int, costs: Sequence[float] | None
) -> tuple[str, nn.Sequential, StageLayout]:
    """The body's attribute, the body and its stages' layout, once the module passed every check that
    needs the module only (the contract, enough layers, no trainable parameter outside the body, a
    trainable parameter on every stage). Changes nothing: the supervisor of a plain ``python train.py``
    runs it before any worker starts, and every worker again at setup."""
    attr, body = find_pipeline_body(module, pipeline_attr)
    check_contract(module, attr, body)
    if getattr(body, _STAGE_MARK, False):
        raise RuntimeError(
            f"{type(module).__name__}.{attr} holds only the layers of one stage, left by an earlier "
            "BambooStrategy run; build a fresh module (e.g. load consolidate_checkpoint(path) into it)"
        )
    layout = plan_stages(body, num_stages, layer_costs(body, costs))
    check_stage_split(module, attr, body, layout.stage_layers)
    return attr, body, layout


def checked_module(
    module: object, pipeline_attr: str | None, num_stages: int, costs: Sequence[float] | None
) -> None:
    """The supervisor's checks of the user's module before it starts workers (one error, in the script's
    process, instead of the same traceback from every worker seconds later): :func:`checked_body`."""
    from lightning.pytorch import LightningModule

    if isinstance(module, LightningModule):
        checked_body(module, pipeline_attr, num_stages, costs)


@functools.lru_cache(maxsize=16)
def pipeline_schedule(positions: int, num_microbatches: int, forward_redundancy: bool) -> Schedule:
    """1F1B, with ``FR`` in its bubbles when ``forward_redundancy`` and ``positions > 1``; one object per
    argument tuple (the engine lowers a schedule once per object: switching back and forth lowers nothing
    again). Never mutated."""
    schedule = build_1f1b(positions, num_microbatches)
    if forward_redundancy and positions > 1:
        schedule = add_forward_redundancy(schedule, positions, num_microbatches)
    return schedule


def _tensors_of(module: nn.Module) -> list[Tensor]:
    return [*module.parameters(), *module.buffers()]
