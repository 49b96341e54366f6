"""The costs the replay uses, read from the live preemption benchmark's JSON (never typed in).

Schema: ``docs/bamboo-replay.md`` (written by ``benchmarks/bamboo_preemption.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_bamboo.layout.ownership import RECOVERY_MODES

DEFAULT_COSTS = Path("benchmarks/results/bamboo_preemption.json")
PRODUCER = "python benchmarks/bamboo_preemption.py --out benchmarks/results/bamboo_preemption.json"
SCHEMA = 2
"""2: checkpoint-restart's restarts priced by their measured parts (``restart_stop_s``,
``relaunch_s_by_layout``, ``relaunch_warmup_s_by_layout``) and the warm-up after Bamboo's failovers and
joins (``failover_warmup_s``, ``rejoin_warmup_s``); 1 priced every restart with one median."""


@dataclass(frozen=True)
class Costs:
    """Measured costs (seconds) and the benchmark's shape; see the schema for each field's meaning."""

    num_stages: int
    max_pipelines: int
    samples_per_step: float
    step_s: float
    step_s_by_layout: dict[str, float]
    failover_s: float
    rejoin_s: float | None
    checkpoint_s: float
    restart_s: float
    fallback_s: float | None
    cr_step_s_by_layout: dict[str, float] = field(default_factory=dict)
    step_s_by_shape: dict[str, float] = field(default_factory=dict)
    rejoin_delay_s: float = 0.0
    restart_stop_s: dict[str, float] = field(default_factory=dict)
    relaunch_s_by_layout: dict[str, float] = field(default_factory=dict)
    relaunch_warmup_s_by_layout: dict[str, float] = field(default_factory=dict)
    failover_warmup_s: float = 0.0
    rejoin_warmup_s: float = 0.0
    recovery: str = "replica+forward"
    """The recovery mode Bamboo ran in the benchmark: ``step_s_by_layout``, ``step_s_by_shape`` and
    ``failover_s`` are that mode's. A file that does not say was measured under ``"replica+forward"``
    (the default before ``"replica"``)."""
    replica_step_s_by_layout: dict[str, float] = field(default_factory=dict)
    """The failure-free step of ``recovery="replica"`` (the replica kept current, no ``FR``) per layout,
    where the benchmark's own mode is another; ``cr_step_s_by_layout`` is the step without a replica,
    ``"peers"``'s. Empty: not measured (the mode is not priced)."""
    peers_failover_s: float | None = None
    """A failover under ``recovery="peers"`` (the lost stages' state fetched from a peer pipeline); None:
    priced as ``failover_s`` (the same control path, the state moved instead of promoted)."""
    fused_slowdown: float | None = None
    """A step of a map with fused positions takes this many times the full layout's step (a projection's
    published figure, lightning_bamboo/simulate/scenarios); None: the shortest pipeline's rule (map_rate)."""
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def recovery_steps(self, recovery: str) -> dict[str, float]:
        """The failure-free step per layout of Bamboo under ``recovery`` (``{}``: not measured)."""
        if recovery not in RECOVERY_MODES:
            modes = ", ".join(map(repr, RECOVERY_MODES))
            raise ValueError(f"recovery must be one of {modes}, got {recovery!r}")
        steps = {"replica+forward": {}, "replica": self.replica_step_s_by_layout,
                 "peers": self.cr_step_s_by_layout}
        steps[self.recovery] = self.step_s_by_layout
        return steps[recovery]

    def recovery_failover_s(self, recovery: str) -> float:
        """What a failover pauses the job under ``recovery``."""
        return self.peers_failover_s if recovery == "peers" and self.peers_failover_s is not None \
            else self.failover_s

    def restart_parts(self, stop: str | None, stages: int, pipelines: int) -> tuple[float, float, float]:
        """Checkpoint-restart's pause for one restart as its three measured parts ``(stop, relaunch,
        warm-up)``: stopping the job (``stop``: ``"kill"``, ``"drain"`` = next step boundary + checkpoint +
        exit, or ``None`` when nothing runs), relaunching at ``stages x pipelines`` up to its first step
        (``nearest`` measured layout), and the excess of the steps after it over failure-free ones.

        Raises:
            KeyError: naming the cost the benchmark run did not measure.
        """
        if stop is not None and stop not in self.restart_stop_s:
            raise KeyError(
                f"no measured restart stop of kind {stop!r} (costs.restart_stop_s has "
                f"{sorted(self.restart_stop_s)}): the benchmark run saw no such restart"
            )
        return (
            self.restart_stop_s[stop] if stop is not None else 0.0,
            nearest(self.relaunch_s_by_layout, stages, pipelines, "costs.relaunch_s_by_layout"),
            nearest(self.relaunch_warmup_s_by_layout, stages, pipelines, "costs.relaunch_warmup_s_by_layout"),
        )


def _need(obj: dict[str, Any], key: str, where: str, path: Path) -> Any:
    if key not in obj:
        raise ValueError(f"{path}: missing key {where}{key!r} (schema: docs/bamboo-replay.md)")
    return obj[key]


def _seconds(value: Any, name: str, path: Path, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{path}: {name} must be a number of seconds >= 0, got {value!r}")
    return float(value)


def load_costs(path: str | Path) -> Costs:
    """Read and check the benchmark JSON.

    Raises:
        FileNotFoundError: naming the file and the command that produces it.
        ValueError: for a missing key or a value that is not a duration.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"costs file {str(path)!r} does not exist; produce it with the live benchmark: {PRODUCER}"
        )
    data = json.loads(path.read_text())
    if data.get("schema") != SCHEMA:
        raise ValueError(
            f"{path}: schema must be {SCHEMA} (per-restart costs: stop, relaunch, warm-up), got "
            f"{data.get('schema')!r}; re-measure with the live benchmark: {PRODUCER}"
        )
    costs = _need(data, "costs", "", path)
    by_layout = _need(costs, "step_s_by_layout", "costs.", path)
    if not isinstance(by_layout, dict) or not by_layout:
        raise ValueError(f"{path}: costs.step_s_by_layout must be a non-empty object, got {by_layout!r}")
    for key, value in by_layout.items():
        _layout(key, path)
        _seconds(value, f"costs.step_s_by_layout[{key!r}]", path)
    cr_layout = costs.get("checkpoint_restart_step_s_by_layout") or {}
    recovery = data.get("recovery", "replica+forward")
    if recovery not in RECOVERY_MODES:
        raise ValueError(f"{path}: recovery must be one of {', '.join(map(repr, RECOVERY_MODES))}, got "
                         f"{recovery!r}")
    return Costs(
        num_stages=int(_need(data, "num_stages", "", path)),
        max_pipelines=int(_need(data, "max_pipelines", "", path)),
        samples_per_step=float(_need(data, "samples_per_step", "", path)),
        step_s=_seconds(_need(costs, "step_s", "costs.", path), "costs.step_s", path),  # type: ignore[arg-type]
        step_s_by_layout={k: float(v) for k, v in by_layout.items()},
        failover_s=_seconds(_need(costs, "failover_s", "costs.", path), "costs.failover_s", path),  # type: ignore[arg-type]
        rejoin_s=_seconds(_need(costs, "rejoin_s", "costs.", path), "costs.rejoin_s", path, allow_none=True),
        checkpoint_s=_seconds(_need(costs, "checkpoint_s", "costs.", path), "costs.checkpoint_s", path),  # type: ignore[arg-type]
        restart_s=_seconds(_need(costs, "restart_s", "costs.", path), "costs.restart_s", path),  # type: ignore[arg-type]
        fallback_s=_seconds(costs.get("fallback_s"), "costs.fallback_s", path, allow_none=True),
        cr_step_s_by_layout={k: float(v) for k, v in cr_layout.items()},
        step_s_by_shape={k: float(v) for k, v in (costs.get("step_s_by_shape") or {}).items()},
        recovery=recovery,
        replica_step_s_by_layout=_durations(costs, "replica_step_s_by_layout", path, required=False),
        peers_failover_s=_seconds(costs.get("peers_failover_s"), "costs.peers_failover_s", path,
                                  allow_none=True),
        rejoin_delay_s=_seconds(  # type: ignore[arg-type]
            costs.get("rejoin_delay_s") or 0.0, "costs.rejoin_delay_s", path
        ),
        restart_stop_s=_durations(costs, "restart_stop_s", path, layouts=False),
        relaunch_s_by_layout=_durations(costs, "relaunch_s_by_layout", path),
        relaunch_warmup_s_by_layout=_durations(costs, "relaunch_warmup_s_by_layout", path),
        failover_warmup_s=_seconds(  # type: ignore[arg-type]
            _need(costs, "failover_warmup_s", "costs.", path), "costs.failover_warmup_s", path
        ),
        rejoin_warmup_s=_seconds(  # type: ignore[arg-type]
            costs.get("rejoin_warmup_s") or 0.0, "costs.rejoin_warmup_s", path
        ),
        raw=data,
    )


def _durations(costs: dict[str, Any], key: str, path: Path, layouts: bool = True,
               required: bool = True) -> dict[str, float]:
    """An object of durations (keyed by layout ``'SxP'`` when ``layouts``); ``{}`` when not ``required``
    and absent."""
    if not required and costs.get(key) is None:
        return {}
    value = _need(costs, key, "costs.", path)
    if not isinstance(value, dict):
        raise ValueError(f"{path}: costs.{key} must be an object of seconds, got {value!r}")
    for name, seconds in value.items():
        if layouts:
            _layout(name, path)
        _seconds(seconds, f"costs.{key}[{name!r}]", path)
    return {k: float(v) for k, v in value.items()}


def nearest(by_layout: dict[str, float], stages: int, pipelines: int, what: str) -> float:
    """The value measured for ``stages x pipelines``, else for the measured layout with ``stages`` stages
    and the nearest pipeline count (the narrower one on a tie): the benchmark measures at most its own
    width, and a wider job's relaunch is priced as its widest measured one.

    Raises:
        KeyError: naming ``what`` when no layout with ``stages`` stages was measured.
    """
    key = f"{stages}x{pipelines}"
    if key in by_layout:
        return by_layout[key]
    measured = sorted(int(k.split("x")[1]) for k in by_layout if int(k.split("x")[0]) == stages)
    if not measured:
        raise KeyError(f"{what} has no layout with {stages} stages (for {key}); measured {sorted(by_layout)}")
    return by_layout[f"{stages}x{min(measured, key=lambda p: (abs(p - pipelines), p))}"]


def _layout(key: str, path: Path) -> tuple[int, int]:
    try:
        stages, pipelines = (int(x) for x in key.split("x"))
    except ValueError:
        raise ValueError(f"{path}: layout key {key!r} must be '<stages>x<pipelines>', e.g. '2x2'") from None
    return stages, pipelines


def rate(by_layout: dict[str, float], stages: int, pipelines: int, samples_per_step: float) -> float:
    """Samples/s of ``stages x pipelines``: ``samples_per_step`` over its measured step time.

    A step trains the same global batch whatever the layout (the live runtime gives each pipeline its share),
    so a measured layout's rate is ``samples_per_step / step_s``. A layout not measured takes the per-pipeline
    rate of the nearest measured one with ``stages`` stages (``P_m`` pipelines; the narrower one on a tie):
    ``pipelines / P_m`` times its rate (weak scaling of data parallelism: the benchmark cannot measure 16
    pipelines on one machine, and may not see every narrower layout). Stated in docs/bamboo-replay.md.

    Raises:
        KeyError: when no layout with ``stages`` stages was measured.
    """
    key = f"{stages}x{pipelines}"
    if key in by_layout:
        return samples_per_step / by_layout[key]
    measured = sorted(int(k.split("x")[1]) for k in by_layout if int(k.split("x")[0]) == stages)
    if not measured:
        raise KeyError(
            f"no measured step time for a layout with {stages} stages (for {key}, stages x pipelines); "
            f"measured layouts: {sorted(by_layout)} (choose --stages among them)"
        )
    nearest = min(measured, key=lambda p: (abs(p - pipelines), p))
    return pipelines / nearest * samples_per_step / by_layout[f"{stages}x{nearest}"]
