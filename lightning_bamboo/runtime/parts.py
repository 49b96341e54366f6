"""The parts :class:`~lightning_bamboo.strategy.BambooStrategy` holds, built and linked in one place.

Each part is an object with its own state and a small interface (see the strategy's module docstring); the
strategy's hooks call them. They never hold the strategy: what they need of Lightning comes as callables
(:class:`~lightning_bamboo.runtime.lightning_side.LightningSide`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_deprecation

from lightning_bamboo.checkpoint import periodic
from lightning_bamboo.checkpoint.stages import StageCheckpoints
from lightning_bamboo.layout.ownership import RECOVERY_MODES
from lightning_bamboo.pipeline.buffers import check_batch_norm_mode
from lightning_bamboo.protocol import store as ms
from lightning_bamboo.runtime.events import Events
from lightning_bamboo.runtime.fallback import Fallback
from lightning_bamboo.runtime.formation import Formation
from lightning_bamboo.runtime.generation import Generation
from lightning_bamboo.runtime.lightning_side import LightningSide
from lightning_bamboo.runtime.membership import Membership
from lightning_bamboo.runtime.transitions import Transitions
from lightning_bamboo.step.session import StepSession


@dataclass(frozen=True)
class Parts:
    events: Events  # Bamboo's events on the trainer's callbacks
    formation: Formation  # the body's layers and how a generation forms
    gen: Generation  # the generation formed now: owners, view, engine, replica
    checkpoints: StageCheckpoints  # Lightning's checkpoint hooks for this member's stages
    session: StepSession  # the step in progress: two-phase step, exchange, commit, the one retry loop
    fallback: Fallback  # periodic checkpoints and the fallback to them
    membership: Membership  # generations: process groups, commits, what an error means
    transitions: Transitions  # failover, rejoin, fallback, drain, stop: the re-forms the retry loop runs


@dataclass(frozen=True)
class Options:
    """The strategy's constructor arguments (documented on the strategy), checked when built: each bad one
    is named with what was expected before any process starts."""

    num_stages: int
    num_microbatches: int
    recovery: str  # resolved from the constructor's recovery and redundancy (resolve_recovery)
    replica_device: str
    pipeline_attr: str | None
    layer_costs: Sequence[float] | None
    timeout: float | timedelta | None
    process_group_backend: str | None
    heartbeat: float | None
    hang_timeout: float
    failure_wait: float
    checkpoint_every_n_steps: int | None
    checkpoint_dir: str | os.PathLike | None
    keep_checkpoints: int
    keyed_rng: bool
    batch_norm: str = "broadcast"

    def __post_init__(self) -> None:
        check_batch_norm_mode(self.batch_norm)
        check_options(self.num_stages, self.num_microbatches, self.recovery, self.replica_device,
                      self.keyed_rng)
        periodic.check_options(self.checkpoint_every_n_steps, self.checkpoint_dir, self.keep_checkpoints)
        if self.layer_costs is not None:
            object.__setattr__(self, "layer_costs", list(self.layer_costs))
        if self.heartbeat is not None and (isinstance(self.heartbeat, bool) or not self.heartbeat > 0):
            raise ValueError(f"heartbeat={self.heartbeat!r}: expected seconds > 0, or None for the default")
        if isinstance(self.timeout, (int, float)):
            object.__setattr__(self, "timeout", timedelta(seconds=self.timeout))


def resolve_recovery(recovery: str | None, redundancy: bool | None) -> str:
    """The recovery mode of the constructor's ``recovery``; default ``"replica"``. ``redundancy``, its older
    spelling (``True``: ``"replica+forward"``, what it always meant; ``False``: ``"peers"``), is still
    accepted with a deprecation warning naming the replacement: one option, one spelling in the docs.

    Why "replica" by default: the replica's eager forwards are not used at a failover (the interrupted step
    is replayed), so they cost 9% of a step for nothing (docs/bamboo-benchmark.md, part (e)).
    """
    if recovery is not None and recovery not in RECOVERY_MODES:
        raise ValueError(f"recovery must be one of {', '.join(map(repr, RECOVERY_MODES))}, got {recovery!r}")
    if redundancy is None:
        return "replica" if recovery is None else recovery
    if not isinstance(redundancy, bool):
        raise TypeError(f"redundancy must be True or False, got {redundancy!r}; it is deprecated: pass "
                        "recovery='replica', 'replica+forward' or 'peers'")
    meant = "replica+forward" if redundancy else "peers"
    if recovery is not None and redundancy != (recovery != "peers"):
        why = "peers hold no replica" if recovery == "peers" else "this mode holds a replica"
        raise ValueError(f"recovery={recovery!r} and redundancy={redundancy!r} disagree: {why}; "
                         "pass recovery alone")
    rank_zero_deprecation(
        f"BambooStrategy(redundancy={redundancy}) is deprecated: pass recovery={recovery or meant!r} instead "
        "(the default, recovery='replica', keeps the replica without its forwards; docs/bamboo-elastic.md)",
        stacklevel=7,  # the user's BambooStrategy(...) line
    )
    return recovery or meant


def check_options(num_stages: int, num_microbatches: int, recovery: str, replica_device: str,
                  keyed_rng: bool) -> None:
    """The strategy's constructor arguments, each with what was expected."""
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an integer >= 1, got {num_stages!r}")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be an integer >= 1, got {num_microbatches!r}")
    if replica_device not in ("same", "cpu"):
        raise ValueError(f"replica_device must be 'same' or 'cpu', got {replica_device!r}")
    if recovery != "peers" and num_stages < 2:
        raise ValueError(
            f"recovery={recovery!r} needs num_stages >= 2 (a stage replicates its successor), got "
            f"num_stages ({num_stages}); pass recovery='peers'"
        )
    if not isinstance(keyed_rng, bool):
        raise TypeError(f"keyed_rng must be True or False, got {keyed_rng!r}")


def assemble(
    options: Options,
    env: ms.WorkerEnv | None,
    lightning: LightningSide,
    precision: Callable[[], Precision],
    replica_device: Callable[[], torch.device],
) -> Parts:
    """Build the parts and link them: the formation asks the session before each schedule action; the
    session's retry loop asks the membership and its transitions, which return (they hold no session)."""
    o = options
    events = Events(lambda: lightning.module() and lightning.module().trainer)
    formation = Formation(o.num_stages, o.num_microbatches, o.recovery != "peers", o.keyed_rng, o.timeout,
                          device=lightning.device, replica_device=replica_device,
                          forward_redundancy=o.recovery == "replica+forward")
    gen = Generation(num_stages=o.num_stages)
    session = StepSession(gen, formation, events, trainer=lambda: lightning.module().trainer,
                          precision=precision, device=lightning.device, batch_norm=o.batch_norm)
    formation.before_action = session.before_action
    fallback = Fallback(o.checkpoint_every_n_steps, o.checkpoint_dir, o.keep_checkpoints, formation, gen,
                        events, lightning)
    membership = Membership(env, formation, gen, lightning, o.failure_wait, o.timeout)
    membership.backend = o.process_group_backend
    transitions = Transitions(membership, formation, gen, fallback, events, lightning)
    session.members, session.transitions = membership, transitions
    return Parts(events, formation, gen, StageCheckpoints(formation, gen), session, fallback, membership,
                 transitions)
