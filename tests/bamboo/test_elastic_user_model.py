"""Elastic Bamboo on the model a user writes (issue 17): two param groups (the head at a tenth of the learning
rate, without weight decay), a parameter that never gets a gradient, a frozen parameter, BatchNorm and another
buffer, AdamW with a per-step scheduler and norm clipping. The final parameters, buffers and optimizer state
of every surviving member equal (float64) the uninterrupted single-process run's — with no fault, and with a
real SIGKILL of the last stage or of a middle stage mid-step.

One micro-batch per step: BatchNorm's statistics over micro-batches differ from the batch's (a documented
limit of any pipeline), so exactness against ``strategy="auto"`` needs M=1 for this model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.bamboo.launch_record import NAME, Record
from tests.bamboo.test_elastic import CLIP, SCRIPT, TOL, check_final, launched, run_elastic
from tests.process import REPO, launch_env

USER_MODEL = ("--variant", "user", "--microbatches", "1", "--clip", str(CLIP))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("nproc", "stages", "fault"),
    [(2, 2, ""), (2, 2, "1:2:forward"), (3, 3, "1:2:forward")],
    ids=["no-fault", "sigkill-last-stage", "sigkill-middle-stage"],
)
def test_user_model_equals_auto(
    tmp_path: Path, user_model_reference: dict[str, torch.Tensor], nproc: int, stages: int, fault: str
) -> None:
    run_elastic(tmp_path, nproc=nproc, stages=stages, fault=fault, extra_args=USER_MODEL)
    assert launched(tmp_path).summary() == ([("failover", [1])] if fault else [])
    covered = check_final(tmp_path, user_model_reference)
    assert any(key.startswith("own_buffer/") and "running_var" in key for key in covered)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_parameter_without_gradient_two_pipelines(
    tmp_path: Path, unused_reference: dict[str, torch.Tensor]
) -> None:
    """2 stages x 2 pipelines, Adam with weight decay: the gradient-less parameter is skipped by every
    optimizer (its has-gradient flag travels with the averaged gradients and the replica update), also after
    member 3 (stage 1 of pipeline 1) is SIGKILLed."""
    run_elastic(tmp_path, nproc=4, stages=2, fault="3:2:forward", extra_args=("--variant", "unused"))
    check_final(tmp_path, unused_reference)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("fault", ["", "1:2:forward"], ids=["no-fault", "sigkill-last-stage"])
def test_double_precision_of_a_float32_model(
    tmp_path: Path, double_precision_reference: dict[str, torch.Tensor], fault: str
) -> None:
    """``precision="64-true"`` on a model built in float32: every layer is converted at setup (a replica or a
    layer received from a peer is float64 too), so the run equals "auto"'s with and without a failover."""
    args = ("--dtype", "float32", "--precision", "64-true")
    run_elastic(tmp_path, nproc=2, stages=2, fault=fault, extra_args=args)
    check_final(tmp_path, double_precision_reference)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_groups_that_depend_on_the_layers_are_refused_at_start(tmp_path: Path) -> None:
    """One param group per layer (``PerLayerLr``): a failover that fuses stages would need more groups in the
    member's optimizer than it has, so the job stops at start with the reason, not at the first failover."""
    cmd = [sys.executable, "-m", "lightning_bamboo.launch", "--nproc", "2", str(SCRIPT), "--out",
           str(tmp_path), "--stages", "2", "--steps", "2", "--variant", "per-layer-lr"]
    record = tmp_path / NAME
    proc = subprocess.run(cmd, cwd=REPO, env=launch_env({"BAMBOO_EVENTS": str(record)}), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0
    assert "configure_optimizers builds 2 param groups for this member's stage but 4 for the whole" in (
        proc.stdout + proc.stderr
    )
    assert Record.read(record)["changes"] == []  # stopped at start: no failover


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("nproc", "stages", "fault"),
    [(2, 2, ""), (2, 2, "1:2:exchange"), (3, 3, "1:2:forward")],
    ids=["no-fault", "sigkill-last-stage-after-both-batches", "sigkill-middle-stage-in-first-batch"],
)
def test_gradient_accumulation_equals_auto(
    tmp_path: Path, accumulate_reference: dict[str, torch.Tensor], nproc: int, stages: int, fault: str
) -> None:
    """``accumulate_grad_batches=2``: a step is two batches. A member lost after both ran (at the replica
    exchange) aborts the step: the survivors undo its buffer updates, form the next generation, run the
    first batch again on it and then the second (Lightning's closure); a member lost in the first batch's
    forward aborts it the same way. Either way the run equals auto's."""
    args = (*USER_MODEL, "--accumulate", "2")
    run_elastic(tmp_path, nproc=nproc, stages=stages, fault=fault, extra_args=args)
    assert launched(tmp_path).summary() == ([("failover", [1])] if fault else [])
    check_final(tmp_path, accumulate_reference)


TIED = {
    "tied": ("--variant", "tied", "--optimizer", "adam", "--clip", str(CLIP)),
    "tied-gpt": ("--variant", "tied-gpt", "--clip", str(CLIP)),
}
TIED_NAMES = {
    "tied": ("pipeline.0.weight", "pipeline.4.weight"),
    "tied-gpt": ("pipeline.0.tok.weight", "pipeline.3.lm.weight"),
}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("variant", "nproc", "stages", "fault"),
    [
        ("tied", 3, 3, "2:2:forward"),
        ("tied", 4, 2, "3:2:forward"),
        ("tied-gpt", 2, 2, ""),
        ("tied-gpt", 3, 3, "2:2:forward"),
    ],
    ids=["3-stages-sigkill-last", "2x2-sigkill-one", "gpt-2-stages", "gpt-3-stages-sigkill-last"],
)
def test_tied_weights_across_stages_equal_auto(
    tmp_path: Path, request: pytest.FixtureRequest, variant: str, nproc: int, stages: int, fault: str
) -> None:
    """One weight used by two layers: ``pipe_variants.Tied`` (layers 0 and 4; Adam, norm clipping) and a tiny
    GPT-2 whose LM head is the token embedding (``TiedGPT``; AdamW, warm-up + cosine, clipping). The uses
    sit on the first and last stage; each member holding one keeps a copy and their gradients are summed
    before the step. Equal to auto's tied run: with no fault; after the last of 3 stages dies (the use moves
    to member 1); with 2 pipelines and one member lost (member 2 then holds both uses, as two copies). A
    member holding both uses from the start of a run: ``test_checkpoint_travel.py`` (1 stage),
    ``test_elastic_rejoin.py``; bit-exactness across a failover: ``test_ledger.py``."""
    reference = request.getfixturevalue(f"{variant.replace('-', '_')}_reference")
    log = run_elastic(tmp_path, nproc=nproc, stages=stages, fault=fault, extra_args=TIED[variant])
    first, second = TIED_NAMES[variant]
    assert f"BambooStrategy: tied {first} = {second}" in log
    assert launched(tmp_path).summary() == ([("failover", [int(fault.split(":")[0])])] if fault else [])
    check_final(tmp_path, reference)
    copies = [
        value
        for path in sorted(tmp_path.glob("final_member*.safetensors"))
        for key, value in load_file(str(path)).items()
        if key in (f"own/{first}", f"own/{second}")
    ]
    assert len(copies) >= 2 and all(torch.equal(copy, copies[0]) for copy in copies), "copies drifted apart"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(("nproc", "stages"), [(2, 2), (4, 2)], ids=["2-stages", "2x2"])
def test_name_grouped_tie_takes_the_first_use_group(
    tmp_path: Path, tied_gpt_named_reference: dict[str, torch.Tensor], nproc: int, stages: int
) -> None:
    """Issue 28, item 1: the tied GPT with the usual name-based AdamW groups (no decay on ``"tok"``...). Under
    ``auto`` the tied weight is ``pipeline.0.tok.weight`` (no decay); the last stage's copy, named
    ``pipeline.3.lm.weight``, joins the same group (the one ``auto`` gives the first use), so the run equals
    auto's (grouped by its own name the run ends 2.5e-5 from auto's), the checkpoint's param-group files list
    it in that group, and ``consolidate_checkpoint`` gives one tensor for both names, equal to auto's."""
    from lightning_bamboo import consolidate_checkpoint

    saved = tmp_path / "final.ckpt"
    run_elastic(tmp_path, nproc=nproc, stages=stages,
                extra_args=("--variant", "tied-gpt-named", "--clip", str(CLIP), "--save-ckpt", str(saved)))
    check_final(tmp_path, tied_gpt_named_reference)
    first, second = TIED_NAMES["tied-gpt"]
    groups = [json.loads(p.read_text())["optimizers"][0] for p in sorted(saved.glob("param-groups-*.json"))]
    where = {name: index for stage in groups for index, names in enumerate(stage) for name in names}
    assert where[first] == where[second] == 1  # the no-decay group, as under auto
    merged = consolidate_checkpoint(saved)
    assert merged[second] is merged[first]
    torch.testing.assert_close(merged[first], tied_gpt_named_reference[f"own/{first}"], **TOL)
