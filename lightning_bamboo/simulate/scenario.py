"""Projection scenarios: the replay's cost model fed with published figures for a GPU-scale job instead of the
live benchmark's measurements, every parameter naming its source, and the unknown ones swept.

    python -m lightning_bamboo.simulate --scenario gpt2-p3     # or a path to a scenario YAML

A scenario is a YAML file (shipped ones in ``lightning_bamboo/simulate/scenarios/``); its schema and what a
projection is and is not: docs/bamboo-replay.md, "Projection at GPU scale".
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lightning_bamboo.simulate.costs import Costs
from lightning_bamboo.simulate.model import Prices

SCENARIOS = Path(__file__).parent / "scenarios"
REPO = Path(__file__).resolve().parents[2]
UNKNOWN = "unknown"
SOURCE_KINDS = ("measured here:", "published:", "configuration:")
"""A known parameter's source starts with one of these, then the command, the reference or the reason."""

LAYOUTS = "bamboo_step_s"
COUNTS = ("stages", "max_pipelines", "on_demand_nodes")
PARAMETERS = {
    "stages": "pipeline stages (nodes per pipeline)",
    "max_pipelines": "at most this many data-parallel pipelines",
    "samples_per_step": "samples one step trains (the global batch, whatever the layout)",
    LAYOUTS: "Bamboo's step (with redundancy) per layout '<stages>x<pipelines>', seconds",
    "redundancy_overhead": "Bamboo's step over a step without redundancy on the same layout",
    "fused_slowdown": "a step with a member running a lost neighbour's stages too, over the full layout's",
    "failover_s": "Bamboo's pause when it loses a member (detect, re-form, replay the step)",
    "failover_warmup_s": "extra time of the first steps after a failover",
    "rejoin_s": "Bamboo's pause when new nodes join the pipelines",
    "rejoin_warmup_s": "extra time of the first steps after a rejoin",
    "rejoin_delay_s": "from a node's arrival to its joining (start-up, waiting for a step boundary)",
    "checkpoint_s": "one checkpoint save of the whole model state",
    "restart_s": "checkpoint-restart's restart: stop, relaunch, restore, first steps (and Bamboo's fallback)",
    "spot_price": "dollars per spot node-hour",
    "on_demand_price": "dollars per on-demand node-hour",
    "on_demand_nodes": "on-demand nodes (a multiple of stages), never preempted",
}


class ScenarioError(ValueError):
    """A scenario file that cannot be used, naming the file and the key."""


@dataclass(frozen=True)
class Parameter:
    """One input of the projection: its value (or the values to sweep when its source is unknown)."""

    name: str
    source: str
    value: Any = None
    sweep: tuple[float, ...] = ()
    note: str = ""

    @property
    def unknown(self) -> bool:
        return self.source == UNKNOWN


@dataclass(frozen=True)
class Scenario:
    """A projection's inputs, checked: every parameter present with a source, unknowns with a sweep."""

    name: str
    title: str
    path: Path
    trace: Path
    trace_source: str
    parameters: dict[str, Parameter]
    references: dict[str, str] = field(default_factory=dict)

    def unknowns(self) -> list[Parameter]:
        return [p for p in self.parameters.values() if p.unknown]

    def combinations(self) -> list[dict[str, float]]:
        """Every combination of the unknowns' sweep values (one row of the projection table each)."""
        unknowns = self.unknowns()
        return [
            {p.name: v for p, v in zip(unknowns, values)}
            for values in itertools.product(*(p.sweep for p in unknowns))
        ]

    def values(self, chosen: dict[str, float]) -> dict[str, Any]:
        """Every parameter's value, the unknowns' from ``chosen``."""
        return {name: chosen[name] if p.unknown else p.value for name, p in self.parameters.items()}

    def costs(self, chosen: dict[str, float]) -> Costs:
        """The replay's :class:`Costs` for one combination of the unknowns.

        Checkpoint-restart steps are Bamboo's over ``redundancy_overhead``; a restart is priced whole as
        ``restart_s`` (its stop and warm-up folded in) at every layout, a drain before a grow as one
        ``checkpoint_s``; Bamboo's fallback as a restart (``fallback_s`` None: the model uses ``restart_s``).
        """
        v = self.values(chosen)
        steps = {layout: float(s) for layout, s in v[LAYOUTS].items()}
        widest = max(steps, key=lambda k: int(k.split("x")[1]))
        return Costs(
            num_stages=int(v["stages"]),
            max_pipelines=int(v["max_pipelines"]),
            samples_per_step=float(v["samples_per_step"]),
            step_s=steps[widest],
            step_s_by_layout=steps,
            failover_s=float(v["failover_s"]),
            rejoin_s=float(v["rejoin_s"]),
            checkpoint_s=float(v["checkpoint_s"]),
            restart_s=float(v["restart_s"]),
            fallback_s=None,
            cr_step_s_by_layout={k: s / float(v["redundancy_overhead"]) for k, s in steps.items()},
            rejoin_delay_s=float(v["rejoin_delay_s"]),
            restart_stop_s={"kill": 0.0, "drain": float(v["checkpoint_s"])},
            relaunch_s_by_layout=dict.fromkeys(steps, float(v["restart_s"])),
            relaunch_warmup_s_by_layout=dict.fromkeys(steps, 0.0),
            failover_warmup_s=float(v["failover_warmup_s"]),
            rejoin_warmup_s=float(v["rejoin_warmup_s"]),
            fused_slowdown=float(v["fused_slowdown"]),
            raw={"projection": self.name},
        )

    def prices(self, chosen: dict[str, float]) -> Prices:
        v = self.values(chosen)
        return Prices(spot=float(v["spot_price"]), on_demand=float(v["on_demand_price"]))


def available() -> list[str]:
    return sorted(p.stem for p in SCENARIOS.glob("*.yaml"))


def load_scenario(name_or_path: str | Path) -> Scenario:
    """A shipped scenario by name (``gpt2-p3``) or a scenario file by path, checked.

    Raises:
        ScenarioError: naming the file and the key: unknown name, not YAML, a missing or unexpected key, a
            parameter without a source, a known parameter without a value, an unknown one without a sweep.
    """
    path = Path(name_or_path)
    if not path.is_file():
        shipped = SCENARIOS / f"{name_or_path}.yaml"
        if not shipped.is_file():
            raise ScenarioError(
                f"scenario {str(name_or_path)!r} is neither a file nor a shipped scenario "
                f"({', '.join(available())})"
            )
        path = shipped
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ScenarioError(f"{path}: not valid YAML ({err})") from None
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: expected a mapping with name, title, trace, parameters")
    for key in ("name", "title", "trace", "parameters"):
        if key not in data:
            raise ScenarioError(f"{path}: missing key {key!r}")
    extra = set(data) - {"name", "title", "trace", "parameters", "references"}
    if extra:
        raise ScenarioError(f"{path}: unexpected keys {sorted(extra)}")
    trace = data["trace"]
    if not isinstance(trace, dict) or not isinstance(trace.get("path"), str):
        raise ScenarioError(f"{path}: trace must be a mapping with path and source, got {trace!r}")
    trace_source = _source(path, "trace", trace.get("source"))
    raw = data["parameters"]
    if not isinstance(raw, dict):
        raise ScenarioError(f"{path}: parameters must be a mapping of name -> {{value, source}}")
    missing = [name for name in PARAMETERS if name not in raw]
    if missing:
        raise ScenarioError(f"{path}: parameters missing {missing} (each needs a value and a source)")
    unexpected = sorted(set(raw) - set(PARAMETERS))
    if unexpected:
        raise ScenarioError(f"{path}: unexpected parameters {unexpected}; expected {sorted(PARAMETERS)}")
    parameters = {name: _parameter(path, name, raw[name]) for name in PARAMETERS}
    _check_layouts(path, parameters)
    trace_path = Path(trace["path"])
    return Scenario(
        name=str(data["name"]),
        title=str(data["title"]),
        path=path,
        trace=trace_path if trace_path.is_absolute() else REPO / trace_path,
        trace_source=trace_source,
        parameters=parameters,
        references={str(k): str(v) for k, v in (data.get("references") or {}).items()},
    )


def _source(path: Path, where: str, source: Any) -> str:
    if not isinstance(source, str) or not source.strip():
        raise ScenarioError(f"{path}: {where} has no source (expected '{UNKNOWN}' or one of {SOURCE_KINDS})")
    source = " ".join(source.split())
    if source == UNKNOWN:
        return source
    kind = next((k for k in SOURCE_KINDS if source.startswith(k)), None)
    if kind is None or not source[len(kind):].strip():
        raise ScenarioError(
            f"{path}: {where}.source must be '{UNKNOWN}' or start with one of {SOURCE_KINDS} followed by the "
            f"command, the reference or the reason, got {source!r}"
        )
    return source


def _parameter(path: Path, name: str, raw: Any) -> Parameter:
    where = f"parameters.{name}"
    if not isinstance(raw, dict):
        raise ScenarioError(f"{path}: {where} must be a mapping with value and source, got {raw!r}")
    extra = set(raw) - {"value", "source", "sweep", "note"}
    if extra:
        raise ScenarioError(f"{path}: {where} has unexpected keys {sorted(extra)}")
    source = _source(path, where, raw.get("source"))
    note = str(raw.get("note") or "")
    if source == UNKNOWN:
        if "value" in raw:
            raise ScenarioError(f"{path}: {where} is unknown: give no value, sweep the candidates instead")
        sweep = raw.get("sweep")
        if name == LAYOUTS or name in COUNTS:
            raise ScenarioError(f"{path}: {where} cannot be unknown (it shapes the job): give a value")
        if not isinstance(sweep, list) or not sweep or not all(_number(x) for x in sweep):
            raise ScenarioError(f"{path}: {where} is unknown: sweep must be a non-empty list of numbers "
                                f">= 0, got {sweep!r}")
        return Parameter(name, source, sweep=tuple(float(x) for x in sweep), note=note)
    if "sweep" in raw:
        raise ScenarioError(f"{path}: {where} has a source, so a value: only an unknown parameter is swept")
    if "value" not in raw:
        raise ScenarioError(f"{path}: {where} has no value")
    value = raw["value"]
    if name == LAYOUTS:
        if not isinstance(value, dict) or not value or not all(_number(s) and s > 0 for s in value.values()):
            raise ScenarioError(f"{path}: {where}.value must map '<stages>x<pipelines>' to seconds > 0, "
                                f"got {value!r}")
    elif name in COUNTS:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScenarioError(f"{path}: {where}.value must be an integer >= 1, got {value!r}")
    elif not _number(value):
        raise ScenarioError(f"{path}: {where}.value must be a number >= 0, got {value!r}")
    return Parameter(name, source, value=value, note=note)


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0


def _check_layouts(path: Path, parameters: dict[str, Parameter]) -> None:
    stages = parameters["stages"].value
    for layout in parameters[LAYOUTS].value:
        match = re.fullmatch(r"(\d+)x(\d+)", str(layout))
        if match is None or int(match[1]) != stages:
            raise ScenarioError(f"{path}: parameters.{LAYOUTS} layout {layout!r} must be "
                                f"'{stages}x<pipelines>' (stages = {stages})")
    nodes = parameters["on_demand_nodes"].value
    if nodes % stages:
        raise ScenarioError(
            f"{path}: parameters.on_demand_nodes ({nodes}) must be a multiple of stages ({stages})"
        )
    for name in ("redundancy_overhead", "fused_slowdown"):
        p = parameters[name]
        if any(x < 1 for x in (p.sweep if p.unknown else (p.value,))):
            raise ScenarioError(f"{path}: parameters.{name} must be >= 1 (a ratio of step times)")
