"""How a member forms a generation of the ownership map: its process group, the layers it needs moved to
it from peers (or loaded), its stage and replica, the user's optimizer over them, the process groups of the
pipelines and stages, and the engine. Generation 0 (at setup) and every later one (a failover, a join, a
fallback) go through :meth:`GenerationFormation._form`.

A mixin of :class:`~lightning_bamboo.strategy.BambooStrategy` over its state; not used on its own.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_bamboo import _private
from lightning_bamboo.contract import sub_sequential
from lightning_bamboo.elastic.ownership import OwnershipMap, initial
from lightning_bamboo.elastic.reshard import LayerState, Resharder, gather, install
from lightning_bamboo.elastic.store import GLOBAL_MICROBATCHES
from lightning_bamboo.pipeline.engine import PipelineEngine
from lightning_bamboo.pipeline.microbatch import microbatch_shares
from lightning_bamboo.pipeline.view import create_groups, view_of
from lightning_bamboo.replica import ReplicaSync
from lightning_bamboo.schedule import Schedule, add_forward_redundancy, build_1f1b, format_grid, rank_program
from lightning_bamboo.ties import regroup_tied_copies, tied_gradients

if TYPE_CHECKING:
    pass


class GenerationFormation:
    """Forming a generation (see the module docstring)."""

    def _init_generation(self, owners: OwnershipMap) -> None:
        """Destroy the last generation's process group and create ``owners``' (ranks follow it)."""
        assert self._store is not None
        if self._cutter is not None:
            self._cutter.disarm()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._cutter is not None:
            self._cutter.before_init()
        self.owners = owners
        self._rank, self._world = owners.rank_of(self.member), len(owners.members())
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type == "cuda":
            kwargs["device_id"] = self.root_device
        dist.init_process_group(
            self._process_group_backend,
            store=dist.PrefixStore(f"gen{owners.generation}", self._store),
            rank=self._rank,
            world_size=self._world,
            **kwargs,
        )
        self.set_world_ranks()

    def _formed(self, generation: int) -> None:
        """Tell the supervisor this member formed ``generation`` (and arm the cutter on its sockets)."""
        if self._cutter is not None:
            self._cutter.arm(generation)
        assert self._store is not None
        self._store.add(f"gen{generation}/formed", 1)

    def _generation_zero(self) -> OwnershipMap:
        assert self._store is not None
        owners = initial(self._num_stages, range(self._nproc))
        text = owners.to_json()
        stored = self._store.compare_set("gen0/map", "", text).decode()
        if stored != text:
            raise ValueError(
                f"this worker was started with num_stages={self._num_stages}, but the job's "
                f"generation 0 is {OwnershipMap.from_json(stored).format()}"
            )
        self._store.compare_set("config/num_stages", "", str(self._num_stages))
        total = str(self._num_microbatches * len(owners.pipelines))
        self._global_microbatches = int(self._store.compare_set(GLOBAL_MICROBATCHES, "", total).decode())
        if self.member not in owners.members():
            raise RuntimeError(
                f"member {self.member} has no stage in generation 0 (spare workers are not "
                "supported at start: use a multiple of num_stages)"
            )
        return owners

    def _replica_stages(self, owners: OwnershipMap, member: int) -> list[int]:
        """The stages ``member`` holds a replica of (none without ``redundancy``: a loss then needs the
        checkpoint fallback)."""
        return owners.replica_stages_of(member) if self._redundancy else []

    def _needs(self, owners: OwnershipMap) -> dict[int, list[int]]:
        return {
            m: [
                layer
                for s in owners.stages_of(m) + self._replica_stages(owners, m)
                for layer in self._stage_layers[s]
            ]
            for m in owners.members()
        }

    def _layers_of(self, stages: list[int]) -> list[int]:
        return [layer for s in stages for layer in self._stage_layers[s]]

    def _template(self, layer: int) -> nn.Module:
        return self._layers[layer]

    def _form(
        self,
        owners: OwnershipMap,
        build_optimizers: bool = True,
        holdings: dict[int, LayerState] | None = None,
        held: dict[int, LayerState] | None = None,
    ) -> None:
        """Move layers to where ``owners`` needs them (or take ``held``, loaded from a checkpoint) and rebuild
        stage, replica, groups and engine.

        ``holdings``: the layers this member can give (default: all it holds now; a joiner gives none).
        """
        assert self._store is not None and self.lightning_module is not None
        me = self.member
        if held is None:
            resharder = Resharder(
                self._store, owners.generation, me, owners.rank_of, self._template, self.root_device
            )
            current = self._current_holdings() if holdings is None else holdings
            held = resharder.run(current, self._needs(owners))
        self._held = held
        own_layers = [layer for s in owners.stages_of(me) for layer in self._stage_layers[s]]
        replica_layers = [layer for s in self._replica_stages(owners, me) for layer in self._stage_layers[s]]
        for layer in own_layers + replica_layers:
            self._layers[layer] = self._held[layer].module
        for layer in replica_layers:
            self._layers[layer].to(self.replica_device)
        for layer in own_layers:
            self._layers[layer].to(self.root_device)
        self._release_templates(set(own_layers) | set(replica_layers))
        stage = self._stage_module.hold({layer: self._layers[layer] for layer in own_layers})  # the seam
        self.replica = sub_sequential(self._layers, replica_layers) if replica_layers else None
        if build_optimizers:
            grouping = self._user_optimizer(stage)
            install(self.optimizers[0], [(layer, self._held[layer]) for layer in own_layers], grouping)
        # groups: one per pipeline (loss broadcast) and one per stage (gradient all-reduce), same order
        # on every member
        pipeline_groups, stage_groups = create_groups(owners.pipelines, owners.rank_of, self._timeout)
        holders = [
            (owners.rank_of(m), owners.pipeline_of(m), set(self._layers_of(owners.stages_of(m))))
            for m in owners.members()
        ]
        own_modules = {layer: self._layers[layer] for layer in own_layers}
        self._tied = tied_gradients(self._ties, own_modules, holders, owners.rank_of(me), self._timeout)
        self.view = view_of(owners.pipelines, me, owners.rank_of, pipeline_groups, stage_groups)
        self.groups = self.view
        if build_optimizers:
            self._build_replica_optimizer()
        positions = self.view.num_positions
        share = self._microbatch_share()
        schedule = self._schedule(positions)
        if owners.generation == 0 and self._entries == 1:
            rank_zero_info(f"BambooStrategy schedule (rank x step):\n{format_grid(schedule)}")
        module = self.lightning_module
        stage_params = {
            s: [p for layer in self._stage_layers[s] for p in self._layers[layer].parameters()]
            for s in owners.stages_of(me)
        }
        self.engine = PipelineEngine(
            stage,
            self.view,
            schedule,  # type: ignore[arg-type]
            inputs_fn=module.pipeline_inputs,  # type: ignore[arg-type]
            loss_fn=module.pipeline_loss,  # type: ignore[arg-type]
            device=self.root_device,
            replica=self.replica if positions > 1 and self._redundancy else None,
            replica_device=self.replica_device,
            stage_params=stage_params,
            tied=self._tied,
            keyed_rng=self._keyed_rng,
            first_microbatch=share.start,
            loss_divisor=self._global_microbatches / len(owners.pipelines),
        )
        self.engine.before_action = self._before_action

    def _schedule(self, positions: int) -> Schedule:
        """1F1B over ``positions``, with the replica forwards (``FR``) in its bubbles when the job has
        redundancy and they are not switched off (:meth:`set_forward_redundancy`)."""
        return pipeline_schedule(positions, len(self._microbatch_share()),
                                 self._redundancy and self._forward_redundancy)

    def _microbatch_share(self) -> range:
        """The job's global micro-batches this member's pipeline runs in the current generation (its
        consecutive share of the fixed split,
        :func:`~lightning_bamboo.pipeline.microbatch.microbatch_shares`): ``num_microbatches`` each while
        the pipelines are those of the start, more each after a pipeline is lost, fewer after one joins."""
        assert self.owners is not None
        shares = microbatch_shares(self._global_microbatches, len(self.owners.pipelines))
        return shares[self.pipeline_index]

    def set_forward_redundancy(self, enabled: bool) -> None:
        """Run the following steps with (``True``, the default) or without (``False``) the eager redundant
        forwards (``FR``), e.g. to measure what they cost (``AdvisorProbe``); remembered across re-forms.

        Only the engine's schedule changes: the replica is still held, stepped and exchanged with its
        successor after every step, so a failover recovers as before, and ``FR`` outputs never enter a
        gradient, so training is exactly the same. The schedule is collective: call this on every rank of
        the job at the same step boundary (e.g. in a Callback's ``on_train_batch_start`` of the same step),
        never during a step.

        Raises:
            TypeError: ``enabled`` is not a bool.
            ValueError: ``enabled=True`` on a job without redundancy (it holds no replica to run).
        """
        if not isinstance(enabled, bool):
            raise TypeError(f"set_forward_redundancy(enabled=...) must be True or False, got {enabled!r}")
        if enabled and not self._redundancy:
            raise ValueError("set_forward_redundancy(True) needs BambooStrategy(redundancy=True): without "
                             "redundancy no member holds a replica to run forward")
        self._forward_redundancy = enabled
        if self.engine is not None and self.view is not None:
            self.engine.schedule = self._schedule(self.view.num_positions)
            self.engine.program = rank_program(self.engine.schedule, self.view.position)
            self.engine.lowered(self.engine.schedule)  # lowered now, not in the next step

    def _release_templates(self, held: set[int]) -> None:
        """Layers this member does not hold stay only as templates on the meta device (a layer received
        later is materialized from its template), so a member's memory is its stages and replica, not the
        whole model."""
        for layer, module in self._layers.items():
            if layer not in held and any(t.device.type != "meta" for t in _tensors_of(module)):
                module.to("meta")

    def _current_holdings(self) -> dict[int, LayerState]:
        """Every layer this member holds, with its optimizer state as of now."""
        held = dict(self._held)
        if self.optimizers and self._stage_module is not None:
            own = {int(n): m for n, m in self._stage_module._modules.items()}
            held.update(gather(own, self.optimizers[0]))
        if self.replica is not None and self._replica_optimizer is not None:
            held.update(
                gather({int(n): m for n, m in self.replica._modules.items()}, self._replica_optimizer)
            )
        return held

    def _build_replica_optimizer(self) -> None:
        """The user's optimizer over the replica (``configure_optimizers`` with the body swapped for it) and
        the :class:`ReplicaSync` that keeps both equal to the successor's (when the pipeline has two or more
        positions; a member running the whole pipeline has no successor)."""
        if self.replica_sync is not None:
            self.replica_sync.close()
            self.replica_sync = None
        if self.replica is None:
            self._replica_optimizer = None
            return
        self._replica_optimizer = self._user_optimizer(self.replica)
        replica_layers = [int(name) for name in self.replica._modules]
        layers = [(layer, self._held[layer]) for layer in replica_layers]
        install(self._replica_optimizer, layers, self._replica_optimizer)
        if self.view is not None and self.view.num_positions > 1:
            assert self._stage_module is not None
            self.replica_sync = ReplicaSync(
                self._stage_module, self.replica, self._replica_optimizer, self.view, self.root_device
            )

    def _check_groups_fit_any_layout(self) -> None:
        """A failover gives a member several stages, whose parameters join the param groups the user's
        ``configure_optimizers`` gives them, in the member's optimizer (the object Lightning and the
        schedulers hold): so that code must build as many groups for the whole body as for one stage (a group
        may be empty). Checked at start, not at the first failover."""
        whole = self._user_optimizer(sub_sequential(self._layers, sorted(self._layers)))
        stage = self.optimizers[0]
        if len(whole.param_groups) != len(stage.param_groups):
            raise ValueError(
                f"configure_optimizers builds {len(stage.param_groups)} param groups for this member's stage "
                f"but {len(whole.param_groups)} for the whole pipeline body; BambooStrategy needs the "
                "same number for any set of layers (a failover gives a member several stages): build the "
                "groups from fixed parts (e.g. the head and the rest), leaving a group empty where the "
                "stage has none of its layers"
            )

    def _user_optimizer(self, body: nn.Module) -> Optimizer:
        """The user's optimizer over ``body`` (``configure_optimizers`` while the seam presents ``body``'s
        layers, :meth:`~lightning_bamboo.seam.StageBody.presenting`):
        its param groups, hyper-parameters and which parameter goes in which group are the user's own."""
        module = self.lightning_module
        assert module is not None
        with self._stage_module.presenting(body):
            optimizers, _ = _private.init_optimizers(module)
        if len(optimizers) != 1:
            raise ValueError(f"BambooStrategy supports exactly one optimizer, got {len(optimizers)}")
        self._regroup_ties(optimizers[0], body)
        return optimizers[0]

    def _regroup_ties(self, optimizer: Optimizer, body: nn.Module) -> None:
        """Every copy of a tied parameter into the param group ``strategy="auto"`` gives the parameter (its
        first use's), whatever its own name makes the user's grouping choose (:mod:`..ties`)."""
        if self._tie_groups:
            named = ((f"{self._body_attr}.{name}", p) for name, p in body.named_parameters())
            regroup_tied_copies(optimizer, named, self._tie_groups)


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
