"""``python -m lightning_bamboo.verify A B``: the first step where two runs' ledgers differ, or that they
agree.

The ledgers are :class:`lightning_bamboo.ledger.BambooLedger` files. Two steps agree when they trained on the
same samples (the global batch as a multiset: the order within a step follows how many pipelines shared it and
how the sampler dealt them out) and every stage's parameters are equal: the same digest, or, where the
digests differ, fingerprints (float64 sums over the stage's parameters) equal to ``--rtol`` of their absolute
sums. The second is rounding: a step whose gradients were reduced in another order (after a whole pipeline
is lost, one pipeline sums the micro-batches that two pipelines and an all-reduce summed) ends a few ulps
away; the output says which steps were equal only to rounding. A difference names the first step, the stage,
how far apart its fingerprints are, and the pipelines and generation each run committed the step under.
``--samples-only`` ignores the parameters (runs that are not meant to be equal, e.g. another precision);
a ledger of a one-process run (``strategy="auto"``) has no stage digests, and is compared by its samples.
Exit status: 0 the same, 1 they differ, 2 a file is missing or malformed (the message names the file and
line).

Only the standard library is used: it runs without importing torch or Lightning.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_FIELDS = {"step": int, "samples": dict, "digests": dict}
RTOL = 1e-9
"""Default ``--rtol``: fingerprints this close (relative to the stage's absolute sums) are rounding. Float64
runs that differ only in the order of their sums stay far below it; a float32 run needs a larger one."""


class LedgerError(ValueError):
    """A ledger file that cannot be read, naming the file and line."""


@dataclass(frozen=True)
class Entry:
    step: int
    samples: dict[str, list[int]]
    digests: dict[str, str]
    line: int
    fingerprints: dict[str, list[float]] = field(default_factory=dict)
    generation: int | None = None
    pipelines: int | None = None
    """How many pipelines trained the step (from the line's ownership map; ``None`` without one)."""

    @property
    def global_batch(self) -> list[int]:
        """The pipelines' samples joined in pipeline order (the elastic job's global batch in order)."""
        return [i for p in sorted(self.samples, key=int) for i in self.samples[p]]


def read_ledger(path: str | Path) -> dict[int, Entry]:
    """Step -> entry of a ledger file.

    Raises:
        LedgerError: the file is missing, a line is not a JSON object with the ledger's fields, or a step
            appears twice.
    """
    path = Path(path)
    if not path.is_file():
        raise LedgerError(f"{path}: no such ledger file")
    entries: dict[int, Entry] = {}
    with path.open(encoding="utf-8") as lines:
        for number, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            where = f"{path}:{number}"
            try:
                data = json.loads(text)
            except json.JSONDecodeError as err:
                raise LedgerError(f"{where}: not JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(data, dict):
                raise LedgerError(f"{where}: expected a JSON object, got {type(data).__name__}")
            for field, kind in _FIELDS.items():
                if not isinstance(data.get(field), kind) or isinstance(data.get(field), bool):
                    raise LedgerError(
                        f"{where}: field {field!r} must be a {kind.__name__}, got {data.get(field)!r}"
                    )
            samples, digests = _samples(data["samples"], where), _digests(data["digests"], where)
            owners = data.get("owners")
            pipelines = None
            if isinstance(owners, dict) and isinstance(owners.get("pipelines"), dict):
                pipelines = len(owners["pipelines"])
            fingerprints = _fingerprints(data.get("fingerprints"), where)
            generation = data.get("generation")
            entry = Entry(data["step"], samples, digests, number, fingerprints, generation, pipelines)
            if entry.step in entries:
                raise LedgerError(
                    f"{where}: step {entry.step} appears again (first at line {entries[entry.step].line})"
                )
            entries[entry.step] = entry
    return entries


def _samples(value: dict[str, Any], where: str) -> dict[str, list[int]]:
    for pipeline, indices in value.items():
        if not pipeline.isdigit() or not isinstance(indices, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in indices
        ):
            raise LedgerError(
                f"{where}: samples must map a pipeline index to a list of ints, got {pipeline!r}: {indices!r}"
            )
    return value


def _digests(value: dict[str, Any], where: str) -> dict[str, str]:
    for stage, digest in value.items():
        if not isinstance(digest, str):
            raise LedgerError(f"{where}: digests must map a stage to a hex string, got {stage!r}: {digest!r}")
    return value


def _fingerprints(value: Any, where: str) -> dict[str, list[float]]:
    """A line's fingerprints (``{}`` in a ledger written before they were recorded)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(sums, list) and len(sums) == 4 and all(isinstance(x, (int, float)) for x in sums)
        for sums in value.values()
    ):
        raise LedgerError(f"{where}: fingerprints must map a stage to four numbers, got {value!r}")
    return value


def rounding_distance(a: list[float], b: list[float]) -> float:
    """How far apart two stage fingerprints are, relative to their absolute sums (the sum of squares
    relative to itself): 0 for equal parameters, ~1e-16 for float64 parameters that differ by rounding."""
    scale = max(abs(a[1]), abs(b[1]), sys.float_info.min)
    square = max(abs(a[2]), abs(b[2]), sys.float_info.min)
    scales = (scale, scale, square, scale)
    return max(abs(x - y) / s for x, y, s in zip(a, b, scales))


def _committed_under(entry: Entry, name: str) -> str:
    if entry.pipelines is None:
        return f"{name} without an ownership map"
    return f"{name} with {entry.pipelines} pipeline(s) in generation {entry.generation}"


def _short(indices: list[int], limit: int = 12) -> str:
    shown = ", ".join(str(i) for i in indices[:limit])
    return f"[{shown}{', ...' if len(indices) > limit else ''}] ({len(indices)})"


def _minus(a: list[int], b: list[int]) -> list[int]:
    """``a`` less ``b`` as multisets, sorted (a sample trained twice in one step counts twice)."""
    rest = sorted(b)
    out = []
    for i in sorted(a):
        if i in rest:
            rest.remove(i)
        else:
            out.append(i)
    return out


@dataclass
class Rounding:
    """Steps whose parameters were equal only to rounding (digests differ, fingerprints within ``rtol``)."""

    steps: list[int] = field(default_factory=list)
    largest: float = 0.0


def difference(
    a: Entry | None,
    b: Entry | None,
    names: tuple[str, str],
    samples_only: bool,
    rtol: float = RTOL,
    rounding: Rounding | None = None,
) -> str | None:
    """What differs between two ledgers' entries of one step (``None`` where one ledger lacks it), or
    ``None`` when they agree (a stage equal only to rounding is added to ``rounding``)."""
    if a is None or b is None:
        missing, present = (names[0], names[1]) if a is None else (names[1], names[0])
        return f"the step is in {present} only ({missing} has no line for it)"
    out = []
    if sorted(a.global_batch) != sorted(b.global_batch):
        only_a = _minus(a.global_batch, b.global_batch)
        only_b = _minus(b.global_batch, a.global_batch)
        out.append(
            f"samples differ: {names[0]} trained on {_short(a.global_batch)}, {names[1]} on "
            f"{_short(b.global_batch)}; only in {names[0]}: {_short(only_a)}; "
            f"only in {names[1]}: {_short(only_b)}"
        )
    if not samples_only:
        for stage in sorted(set(a.digests) | set(b.digests), key=int):
            da, db = a.digests.get(stage), b.digests.get(stage)
            if da == db:
                continue
            fa, fb = a.fingerprints.get(stage), b.fingerprints.get(stage)
            distance = rounding_distance(fa, fb) if fa is not None and fb is not None else None
            if distance is not None and distance <= rtol:
                if rounding is not None:
                    if a.step not in rounding.steps:
                        rounding.steps.append(a.step)
                    rounding.largest = max(rounding.largest, distance)
                continue
            why = "no fingerprint to compare" if distance is None else (
                f"their fingerprints are {distance:.3g} apart, more than rounding (--rtol {rtol:g})")
            out.append(f"stage {stage} parameters differ: {names[0]} {da or 'no digest'}, "
                       f"{names[1]} {db or 'no digest'}; {why}")
        if out and (a.pipelines, a.generation) != (b.pipelines, b.generation):
            out.append(f"committed by {_committed_under(a, names[0])}, {_committed_under(b, names[1])}")
    return "\n  ".join(out) if out else None


def compare(
    a: dict[int, Entry],
    b: dict[int, Entry],
    names: tuple[str, str],
    samples_only: bool = False,
    rtol: float = RTOL,
    rounding: Rounding | None = None,
) -> tuple[int, str] | None:
    """``(step, what differs)`` of the first step where the ledgers differ, or ``None``."""
    for step in sorted(set(a) | set(b)):
        found = difference(a.get(step), b.get(step), names, samples_only, rtol, rounding)
        if found is not None:
            return step, found
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_bamboo.verify",
        description="Compare two BambooLedger files: the first step where samples or parameters differ.",
    )
    parser.add_argument("a", type=Path, help="first ledger (JSON lines)")
    parser.add_argument("b", type=Path, help="second ledger")
    parser.add_argument("--samples-only", action="store_true", help="compare the samples, not the parameters")
    parser.add_argument(
        "--rtol", type=float, default=RTOL,
        help=f"where digests differ, fingerprints this close (relative) are rounding (default {RTOL:g})",
    )
    args = parser.parse_args(argv)
    if not args.rtol >= 0:
        parser.error(f"--rtol must be a number >= 0, got {args.rtol}")
    try:
        a, b = read_ledger(args.a), read_ledger(args.b)
    except LedgerError as err:
        print(f"verify: {err}", file=sys.stderr)
        return 2
    names = (str(args.a), str(args.b))
    # a one-process run (strategy="auto") records no stage digests: its parameters are compared elsewhere
    one_process = [
        name for name, ledger in zip(names, (a, b)) if ledger and not any(e.digests for e in ledger.values())
    ]
    samples_only = args.samples_only or bool(one_process)
    rounding = Rounding()
    found = compare(a, b, names, samples_only, args.rtol, rounding)
    what = "samples" if samples_only else "samples and parameter digests"
    if one_process and not args.samples_only:
        what += f" ({', '.join(one_process)}: a one-process run, no stage digests to compare)"
    if found is None:
        steps = sorted(a)
        span = f"steps {steps[0]}..{steps[-1]}" if steps else "no steps"
        print(f"the ledgers are the same: {len(steps)} steps ({span}), {what}")
        if rounding.steps:
            print(
                f"  steps {_ranges(rounding.steps)}: parameters equal to rounding (fingerprints at most "
                f"{rounding.largest:.3g} apart), not bit for bit: their gradients were summed in another "
                "order (e.g. over another number of pipelines)"
            )
        return 0
    step, detail = found
    print(f"the ledgers differ first at step {step}:\n  {detail}")
    return 1


def _ranges(steps: list[int]) -> str:
    """``[3, 4, 5, 8]`` -> ``"3..5, 8"``."""
    out, start = [], steps[0]
    for prev, cur in zip(steps, [*steps[1:], None]):
        if cur != prev + 1:
            out.append(f"{start}..{prev}" if prev != start else str(start))
            start = cur
    return ", ".join(out)


if __name__ == "__main__":
    sys.exit(main())
