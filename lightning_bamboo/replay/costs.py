"""The costs the replay uses, read from the live preemption benchmark's JSON (never typed in).

Schema: ``docs/bamboo-replay.md`` (written by ``benchmarks/bamboo_preemption.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_COSTS = Path("benchmarks/results/bamboo_preemption.json")
PRODUCER = "python benchmarks/bamboo_preemption.py --out benchmarks/results/bamboo_preemption.json"


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
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


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
    if data.get("schema") != 1:
        raise ValueError(f"{path}: schema must be 1, got {data.get('schema')!r}")
    costs = _need(data, "costs", "", path)
    by_layout = _need(costs, "step_s_by_layout", "costs.", path)
    if not isinstance(by_layout, dict) or not by_layout:
        raise ValueError(f"{path}: costs.step_s_by_layout must be a non-empty object, got {by_layout!r}")
    for key, value in by_layout.items():
        _layout(key, path)
        _seconds(value, f"costs.step_s_by_layout[{key!r}]", path)
    cr_layout = costs.get("checkpoint_restart_step_s_by_layout") or {}
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
        rejoin_delay_s=_seconds(  # type: ignore[arg-type]
            costs.get("rejoin_delay_s") or 0.0, "costs.rejoin_delay_s", path
        ),
        raw=data,
    )


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
