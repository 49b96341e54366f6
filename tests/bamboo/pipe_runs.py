"""The runs behind the Bamboo exactness tests (test_strategy.py, test_found_bugs.py), launched in batches.

Every case trains ``PipeMLP`` (or a variant) with ``scripts/train_pipe.py`` twice: on one process under
``strategy="auto"`` (the reference) and on 2 or 4 processes under Bamboo. What costs is not the 3 steps
but the start-up: importing torch + Lightning (~7 CPU-seconds per process) and Lightning's popen launch.
So the cases are grouped: every reference in ONE single-process launch, every 2-process Bamboo run in ONE
launch, every 4-process one in ONE launch (``train_pipe.py --cases``: a Trainer per case, one after another;
the process group and the imports are paid once). A case still has its own output folder, checked by its
own test; a failing case fails its launch, whose output names the case.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tests.bamboo.launch import run_script

STEPS = 3  # the exactness checks compare every step; 3 steps cover init, a steady step and the last one


def reference_args(optimizer: str, pipelines: int, flags: Sequence[str]) -> list[str]:
    """``strategy="auto"`` on one process, the union of the pipelines' batches per step."""
    return ["--strategy", "auto", "--optimizer", optimizer, "--pipelines", str(pipelines),
            "--steps", str(STEPS), *flags]


def bamboo_args(stages: int, pipelines: int, optimizer: str, flags: Sequence[str]) -> list[str]:
    return ["--strategy", "bamboo", "--devices", str(stages * pipelines), "--stages", str(stages),
            "--pipelines", str(pipelines), "--optimizer", optimizer, "--steps", str(STEPS), *flags]


# name -> (stages, pipelines, optimizer, Bamboo flags, reference flags or None for no reference)
CASES: dict[str, tuple[int, int, str, list[str], list[str] | None]] = {
    # test_strategy.py
    "2stages-redundant-sgd": (2, 1, "sgd", [], []),
    "2stages-plain-adam": (2, 1, "adam", ["--no-redundancy"], []),
    "4stages-redundant-adam": (4, 1, "adam", ["--microbatches", "4"], []),
    "4stages-plain-sgd": (4, 1, "sgd", ["--microbatches", "4", "--no-redundancy"], []),
    "2stages-x-2pipelines-redundant-adam": (2, 2, "adam", [], []),
    "clip-cpu-replica-validate": (
        2, 1, "adam", ["--clip", "0.05", "--validate", "--replica-device", "cpu"],
        ["--clip", "0.05", "--validate"],
    ),
    "bf16-mixed": (
        2, 1, "sgd", ["--dtype", "float32", "--precision", "bf16-mixed"],
        ["--dtype", "float32", "--precision", "bf16-mixed"],
    ),
    # test_found_bugs.py
    "accumulate": (2, 1, "sgd", ["--accumulate", "2"], ["--accumulate", "2"]),
    "per-layer-lr": (2, 1, "sgd", ["--variant", "per-layer-lr"], ["--variant", "per-layer-lr"]),
    "unused": (2, 1, "adam", ["--variant", "unused"], ["--variant", "unused"]),
    # test_found_bugs.py, sweep of user models (bsweep)
    "head-lr": (2, 1, "sgd", ["--variant", "head-lr"], ["--variant", "head-lr"]),
    "strided": (2, 1, "sgd", ["--variant", "strided"], ["--variant", "strided"]),
    "inplace": (2, 1, "sgd", ["--variant", "inplace"], ["--variant", "inplace"]),
    "rank-noise": (2, 1, "sgd", ["--data", "rank-noise"], ["--data", "rank-noise"]),
    "partial-last-batch": (2, 1, "sgd", ["--extra-samples", "2"], ["--extra-samples", "2"]),
    "per-rank-state": (2, 1, "sgd", ["--variant", "state", "--per-rank-state"], None),
    # test_keyed_rng.py: no reference (strategy="auto" draws its dropout masks from one global stream)
    "dropout": (2, 1, "sgd", ["--variant", "dropout"], None),
}


def _reference_key(name: str) -> str:
    """Cases with the same reference share its run (e.g. every plain sgd case)."""
    _, pipelines, optimizer, _, flags = CASES[name]
    assert flags is not None
    return "-".join([optimizer, f"p{pipelines}", *(f.lstrip("-") for f in flags)])


def run_batch(
    out: Path, cases: dict[str, list[str]], timeout: float, nprocs: int | None = None
) -> dict[str, Path]:
    """Runs ``cases`` (name -> train_pipe.py arguments without ``--out``) in one launch; their folders.

    ``nprocs``: the ranks are started together by the test (:func:`tests.process.run_ranks`)."""
    out.mkdir(parents=True, exist_ok=True)
    folders = {name: out / name for name in cases}
    spec = {name: ["--out", str(folders[name]), *argv] for name, argv in cases.items()}
    (out / "cases.json").write_text(json.dumps(spec, indent=1))
    run_script("train_pipe.py", ["--cases", str(out / "cases.json")], timeout=timeout, nprocs=nprocs)
    return folders


def run_references(out: Path) -> dict[str, Path]:
    """Every case's single-process reference (one process, shared references run once); by case name."""
    keys = {name: _reference_key(name) for name, case in CASES.items() if case[4] is not None}
    unique: dict[str, list[str]] = {}
    for name, key in keys.items():
        _, pipelines, optimizer, _, flags = CASES[name]
        unique[key] = reference_args(optimizer, pipelines, flags or [])
    folders = run_batch(out, unique, timeout=600)
    return {name: folders[key] for name, key in keys.items()}


def run_bamboo(out: Path, devices: int) -> dict[str, Path]:
    """Every case on ``devices`` Bamboo processes started together (an external launcher), in one launch."""
    cases = {
        name: bamboo_args(stages, pipelines, optimizer, flags)
        for name, (stages, pipelines, optimizer, flags, _) in CASES.items()
        if stages * pipelines == devices
    }
    return run_batch(out, cases, timeout=300 + 60 * len(cases), nprocs=devices)
