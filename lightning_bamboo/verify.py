"""``python -m lightning_bamboo.verify A B``: the first step where two runs' ledgers differ, or that they
agree.

The ledgers are :class:`lightning_bamboo.ledger.BambooLedger` files. Two steps agree when they trained on the
same samples (the global batch as a multiset: the order within a step follows how many pipelines shared it and
how the sampler dealt them out) and every stage's parameter digest is equal. ``--samples-only`` ignores the
digests (runs that are not meant to be bit-exact, e.g. another precision); a ledger of a one-process run
(``strategy="auto"``) has no stage digests, and is compared by its samples. Exit status: 0 the same, 1 they
differ, 2 a file is missing or malformed (the message names the file and line).

Only the standard library is used: it runs without importing torch or Lightning.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_FIELDS = {"step": int, "samples": dict, "digests": dict}


class LedgerError(ValueError):
    """A ledger file that cannot be read, naming the file and line."""


@dataclass(frozen=True)
class Entry:
    step: int
    samples: dict[str, list[int]]
    digests: dict[str, str]
    line: int

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
            entry = Entry(data["step"], samples, digests, number)
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


def difference(a: Entry | None, b: Entry | None, names: tuple[str, str], samples_only: bool) -> str | None:
    """What differs between two ledgers' entries of one step (``None`` where one ledger lacks it), or
    ``None`` when they agree."""
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
            if da != db:
                out.append(f"stage {stage} parameters differ: {names[0]} {da or 'no digest'}, "
                           f"{names[1]} {db or 'no digest'}")
    return "\n  ".join(out) if out else None


def compare(a: dict[int, Entry], b: dict[int, Entry], names: tuple[str, str], samples_only: bool = False
            ) -> tuple[int, str] | None:
    """``(step, what differs)`` of the first step where the ledgers differ, or ``None``."""
    for step in sorted(set(a) | set(b)):
        found = difference(a.get(step), b.get(step), names, samples_only)
        if found is not None:
            return step, found
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_bamboo.verify",
        description="Compare two BambooLedger files: the first step where samples or digests differ.",
    )
    parser.add_argument("a", type=Path, help="first ledger (JSON lines)")
    parser.add_argument("b", type=Path, help="second ledger")
    parser.add_argument("--samples-only", action="store_true", help="compare the samples, not the digests")
    args = parser.parse_args(argv)
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
    found = compare(a, b, names, samples_only)
    what = "samples" if samples_only else "samples and parameter digests"
    if one_process and not args.samples_only:
        what += f" ({', '.join(one_process)}: a one-process run, no stage digests to compare)"
    if found is None:
        steps = sorted(a)
        span = f"steps {steps[0]}..{steps[-1]}" if steps else "no steps"
        print(f"the ledgers are the same: {len(steps)} steps ({span}), {what}")
        return 0
    step, detail = found
    print(f"the ledgers differ first at step {step}:\n  {detail}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
