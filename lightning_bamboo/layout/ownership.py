"""Who runs which stage of which pipeline: the ownership map of one generation of an elastic Bamboo job.

The map is plain data, ``{pipeline: {stage: member}}`` plus the generation number and the spare members,
and every membership change is a pure function of it: :func:`failover` (members lost) and :func:`rejoin`
(members added). ``member`` is a stable id given by the launcher (it never changes while the process
lives); the process-group rank of a generation is the member's index in :meth:`OwnershipMap.members`.

Rules (Bamboo's): stage ``s`` of a pipeline has its replica on the owner of the position before it in the
ring (stage 0's on the last position). A lost position is covered when its ring predecessor is alive (it
holds the lost layers and their optimizer state). The lost stages then go to the previous position in
data-flow order, which runs them fused with its own (the pipeline gets one position shorter); the first
position's go to the second one. Usually the heir is the replica holder itself (a promotion, no transfer);
when the first position is lost, the second position receives the layers peer to peer from the replica
holder (the last position), so every member's stages stay one contiguous run.
Without a replica (``recovery="peers"``), or with two consecutive positions lost, the lost stages can still
come from another pipeline, whose members own the same stages (data-parallel copies, exactly current): a
pipeline that keeps a survivor is kept when every stage it lost is owned by a survivor elsewhere; the
layers then move peer to peer (``runtime/reshard.py``) and the pipeline, shorter and wider, runs fewer
micro-batches (``pipeline/microbatch.py``). A pipeline with no survivor, or whose lost stages no survivor
holds, is dropped (its survivors become spares); when no pipeline is left, :class:`FallbackNeeded` says the
job must resume from a checkpoint.

A pipeline that lost positions is then *rebalanced* when that shortens its widest position (Oobleck's
templates, at the grain of stages): its surviving positions, in their order, take the pipeline's stages in
contiguous runs of at most ``ceil(stages / survivors)``, chosen to keep as many stages where they already
are as possible (the fewest layers moved). A step takes about ``(micro-batches + positions - 1) x widest``
stage-times, so e.g. 4 stages whose first two positions are lost run as 2 + 2 on the survivors, not 3 + 1.
When fusing already gives the shortest widest position (one loss in a pipeline of one stage per member),
the map is the fused one: a replica holder's promotion moves nothing, and rebalancing would.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from lightning_bamboo.layout.view import fused_positions

#: How a lost worker's stages are recovered (``BambooStrategy(recovery=...)``): from the replica its
#: predecessor keeps current, the same with the replica's eager forwards in the bubbles (Bamboo's paper
#: schedule), or from a data-parallel peer pipeline's copy of the stage (no redundancy at all).
RECOVERY_MODES = ("replica", "replica+forward", "peers")


class FallbackNeeded(RuntimeError):
    """Redundancy cannot cover the loss: the survivors must resume from the last checkpoint."""


@dataclass(frozen=True)
class OwnershipMap:
    """Attributes:
    generation: incremented by every membership change.
    num_stages: pipeline length of the full layout (stages keep their layers across generations).
    pipelines: ``pipeline id -> (stage -> member)``; every pipeline lists every stage.
    spares: live members that own nothing now (they wait for a :func:`rejoin`).
    """

    generation: int
    num_stages: int
    pipelines: dict[int, dict[int, int]]
    spares: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
        for pipeline, owners in self.pipelines.items():
            if sorted(owners) != list(range(self.num_stages)):
                raise ValueError(
                    f"pipeline {pipeline} lists stages {sorted(owners)}, expected 0..{self.num_stages - 1}"
                )
            # a member's stages must be one run of consecutive stages (a fused stage)
            members = [owners[s] for s in range(self.num_stages)]
            runs = [m for i, m in enumerate(members) if i == 0 or members[i - 1] != m]
            if len(runs) != len(set(runs)):
                raise ValueError(
                    f"pipeline {pipeline}: a member owns stages that are not adjacent: {members}"
                )

    # ------------------------------------------------------------------ views
    def members(self) -> list[int]:
        """Members that own a stage, sorted; a member's process-group rank is its index here."""
        return sorted({m for owners in self.pipelines.values() for m in owners.values()})

    def rank_of(self, member: int) -> int:
        return self.members().index(member)

    def pipeline_ids(self) -> list[int]:
        return sorted(self.pipelines)

    def pipeline_of(self, member: int) -> int:
        for pipeline, owners in self.pipelines.items():
            if member in owners.values():
                return pipeline
        raise KeyError(f"member {member} owns no stage in generation {self.generation}")

    def positions(self, pipeline: int) -> list[tuple[int, list[int]]]:
        """The pipeline's positions in order: ``(member, its consecutive stages)``
        (:func:`~lightning_bamboo.layout.view.fused_positions`, which the engine's view reads too)."""
        return fused_positions(self.pipelines[pipeline])

    def stages_of(self, member: int) -> list[int]:
        owners = self.pipelines[self.pipeline_of(member)]
        return [s for s in range(self.num_stages) if owners[s] == member]

    def replica_stages_of(self, member: int) -> list[int]:
        """Stages whose replica ``member`` holds: those of the next position in its pipeline's ring."""
        positions = self.positions(self.pipeline_of(member))
        if len(positions) < 2:
            return []
        index = next(i for i, (m, _) in enumerate(positions) if m == member)
        return positions[(index + 1) % len(positions)][1]

    def shapes(self) -> list[tuple[int, int]]:
        """Per pipeline, by id: ``(positions, widest)``, its positions and the most stages one of them runs:
        what its step takes (:func:`~lightning_bamboo.pipeline.microbatch.microbatch_shares`)."""
        return [(len(self.positions(p)), max(len(stages) for _, stages in self.positions(p)))
                for p in self.pipeline_ids()]

    def stage_holders(self, stage: int) -> list[int]:
        """Owner of ``stage`` in every pipeline, by pipeline id (its gradient all-reduce group)."""
        return [self.pipelines[p][stage] for p in self.pipeline_ids()]

    def format(self) -> str:
        """A grid for logs: one row per pipeline, one column per stage, ``m<id>`` per cell."""
        header = [f"gen {self.generation}"] + [f"stage{s}" for s in range(self.num_stages)]
        rows = [
            [f"pipe{p}"] + [f"m{self.pipelines[p][s]}" for s in range(self.num_stages)]
            for p in self.pipeline_ids()
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
        if self.spares:
            lines.append("spares " + " ".join(f"m{m}" for m in self.spares))
        return "\n".join(lines)

    # ------------------------------------------------------------------ (de)serialisation
    def to_json(self) -> str:
        return json.dumps(
            {
                "generation": self.generation,
                "num_stages": self.num_stages,
                "pipelines": {str(p): {str(s): m for s, m in o.items()} for p, o in self.pipelines.items()},
                "spares": list(self.spares),
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> OwnershipMap:
        data = json.loads(text)
        return cls(
            generation=int(data["generation"]),
            num_stages=int(data["num_stages"]),
            pipelines={int(p): {int(s): int(m) for s, m in o.items()} for p, o in data["pipelines"].items()},
            spares=tuple(int(m) for m in data["spares"]),
        )


def initial(num_stages: int, members: Iterable[int]) -> OwnershipMap:
    """Generation 0: members in order fill pipeline 0's stages, then pipeline 1's...; the rest are spares."""
    ordered = sorted(members)
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an integer >= 1, got {num_stages!r}")
    if len(ordered) < num_stages:
        raise ValueError(f"{len(ordered)} members cannot fill one pipeline of num_stages ({num_stages})")
    count = len(ordered) // num_stages
    pipelines = {p: {s: ordered[p * num_stages + s] for s in range(num_stages)} for p in range(count)}
    return OwnershipMap(0, num_stages, pipelines, tuple(ordered[count * num_stages :]))


def failover(old: OwnershipMap, lost: Iterable[int], replicas: bool = True) -> OwnershipMap:
    """The next generation after ``lost`` members disappeared (see the module docstring for the rules).
    ``replicas=False`` (``recovery="peers"``: no member holds a replica) keeps only the pipelines that peers
    cover; the runtime reaches the same outcome either way (a stage no survivor owns is held by nobody, and
    then no pipeline is kept); the replay (:mod:`lightning_bamboo.simulate`) decides it here, up front.

    Raises:
        FallbackNeeded: no pipeline can be kept.
    """
    lost_set = set(lost)
    pipelines: dict[int, dict[int, int]] = {}
    spares = [m for m in old.spares if m not in lost_set]
    held_by_peers = {  # stages a surviving member of some pipeline owns: a data-parallel copy survives
        stage for owners in old.pipelines.values() for stage, m in owners.items() if m not in lost_set
    }
    for pipeline in old.pipeline_ids():
        positions = old.positions(pipeline)
        alive = [m not in lost_set for m, _ in positions]
        if all(alive):
            pipelines[pipeline] = dict(old.pipelines[pipeline])
            continue
        n = len(positions)
        by_replicas = replicas and n > 1 and all(alive[i] or alive[(i - 1) % n] for i in range(n))
        by_peers = any(alive) and all(
            alive[i] or set(stages) <= held_by_peers for i, (_, stages) in enumerate(positions)
        )
        if not (by_replicas or by_peers):
            spares += [m for m, _ in positions if m not in lost_set]
            continue
        owners = dict(old.pipelines[pipeline])
        for i, (_, stages) in enumerate(positions):
            if not alive[i]:
                # the nearest surviving position before it in data-flow order runs the stages fused (its
                # replica holder when the ring predecessor lives); a lost run at the start goes to the first
                # survivor after it (the first position's to the second, whose layers follow them)
                before = [j for j in range(i - 1, -1, -1) if alive[j]]
                heir_index = before[0] if before else next(j for j in range(i + 1, n) if alive[j])
                for stage in stages:
                    owners[stage] = positions[heir_index][0]
        pipelines[pipeline] = rebalanced(owners)
    if not pipelines:
        raise FallbackNeeded(
            f"generation {old.generation}: losing members {sorted(lost_set)} leaves no pipeline whose "
            f"redundancy covers it:\n{old.format()}"
        )
    return OwnershipMap(old.generation + 1, old.num_stages, pipelines, tuple(sorted(spares)))


def rebalanced(owners: dict[int, int]) -> dict[int, int]:
    """One pipeline's ``stage -> member`` with its positions' runs of stages evened out (see the module
    docstring): unchanged when its widest position is already as short as its member count allows; else
    every position, in order, takes a run of at most ``ceil(stages / positions)`` stages, the cut keeping
    the most stages with the member that owns them now (a dynamic programme over the cuts)."""
    positions = fused_positions(owners)
    count, members = len(owners), [m for m, _ in positions]
    width = math.ceil(count / len(members))
    if max(len(stages) for _, stages in positions) <= width:
        return owners
    # kept[i][j]: the most stages kept in place when members[:i] take stages[:j] (None: impossible)
    kept: list[list[int | None]] = [[None] * (count + 1) for _ in range(len(members) + 1)]
    cut: dict[tuple[int, int], int] = {}
    kept[0][0] = 0
    for i, member in enumerate(members):
        for j in range(count):
            base = kept[i][j]
            if base is None:
                continue
            stays = 0
            for end in range(j + 1, min(j + width, count) + 1):
                stays += owners[end - 1] == member
                if kept[i + 1][end] is None or base + stays > kept[i + 1][end]:  # type: ignore[operator]
                    kept[i + 1][end] = base + stays
                    cut[(i + 1, end)] = j
    out: dict[int, int] = {}
    end = count
    for i in range(len(members), 0, -1):
        start = cut[(i, end)]
        out.update({stage: members[i - 1] for stage in range(start, end)})
        end = start
    return dict(sorted(out.items()))


def rejoin(old: OwnershipMap, new: Iterable[int], max_pipelines: int | None = None) -> OwnershipMap:
    """The next generation with ``new`` members (and the old spares) placed.

    Fused positions are split first (the newcomer takes the last stage of the longest run, pipeline by
    pipeline), then whole new pipelines are formed from ``num_stages`` members at a time, up to
    ``max_pipelines`` pipelines in all (the job's global micro-batches: each pipeline runs at least one); the
    rest stay spare.
    """
    waiting = sorted(set(old.spares) | set(new))
    pipelines = {p: dict(o) for p, o in old.pipelines.items()}
    changed = True
    while waiting and changed:
        changed = False
        for pipeline in sorted(pipelines):
            owners = pipelines[pipeline]
            runs: dict[int, list[int]] = {}
            for stage in range(old.num_stages):
                runs.setdefault(owners[stage], []).append(stage)
            longest = max(runs.values(), key=len)
            if len(longest) > 1 and waiting:
                owners[longest[-1]] = waiting.pop(0)
                changed = True
    next_id = max(pipelines, default=-1) + 1
    while len(waiting) >= old.num_stages and (max_pipelines is None or len(pipelines) < max_pipelines):
        pipelines[next_id] = {s: waiting.pop(0) for s in range(old.num_stages)}
        next_id += 1
    return OwnershipMap(old.generation + 1, old.num_stages, pipelines, tuple(waiting))


def fallback(old: OwnershipMap, survivors: list[int]) -> OwnershipMap:
    """One layout over the survivors after a loss redundancy cannot cover (they reload a checkpoint).

    As many full pipelines as fit; with fewer survivors than stages, one pipeline whose members own
    consecutive runs of stages (a member runs its run fused).
    """
    members = sorted(survivors)
    if len(members) >= old.num_stages:
        fresh = initial(old.num_stages, members)
        return OwnershipMap(old.generation + 1, old.num_stages, fresh.pipelines, fresh.spares)
    owners: dict[int, int] = {}
    for stage in range(old.num_stages):
        owners[stage] = members[stage * len(members) // old.num_stages]
    return OwnershipMap(old.generation + 1, old.num_stages, {0: owners}, ())
