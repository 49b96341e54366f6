"""Elastic Bamboo end to end: workers are really SIGKILLed (or SIGSTOPped) during training, by fault injection
at a chosen phase of a chosen step, and the job must finish every step inside the same ``fit`` with final
parameters and optimizer state equal (float64) to an uninterrupted single-process run.

Every run is ``python -m lightning_bamboo.launch`` over ``scripts/train_elastic.py`` (a subprocess with a
timeout, killed by process group if it outlives it).
"""

from __future__ import annotations

import csv
import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_bamboo.protocol import store as ms
from tests.bamboo.launch_record import NAME, Record, record_env, worker_events
from tests.bamboo.module_writes import assert_no_writes
from tests.process import run_process

SCRIPT = Path(__file__).parent / "scripts" / "train_elastic.py"
TOL = {"rtol": 1e-9, "atol": 1e-11}
STEPS = 6
CLIP = 0.05  # small enough that every step of the model clips
# One re-run: a member can still die on a gloo "connection reset" raised outside the failure handling while a
# second kill is in flight (seen once, in a full-suite run of test_sigkill_middle_stage; open, see
# docs/bamboo-elastic-reference.md, "Known race").
pytestmark = pytest.mark.flaky(reruns=1)


def run_elastic(
    out: Path,
    nproc: int,
    stages: int,
    fault: str = "",
    launch_args: tuple[str, ...] = (),
    extra_env: dict[str, str] | None = None,
    extra_args: tuple[str, ...] = (),
) -> str:
    """Run the job; returns its output. The supervisor's record is then :func:`launched` ``(out)``."""
    env = {**record_env(out, fault), **(extra_env or {})}
    cmd = [
        sys.executable,
        "-m",
        "lightning_bamboo.launch",
        "--nproc",
        str(nproc),
        *launch_args,
        str(SCRIPT),
        "--out",
        str(out),
        "--stages",
        str(stages),
        "--steps",
        str(STEPS),
        *extra_args,
    ]
    return run_process(cmd, timeout=400, env=env).stdout


def check_final(out: Path, reference: dict[str, torch.Tensor]) -> set[str]:
    """Every finished member's stages equal the reference; returns the parameter names covered."""
    covered: set[str] = set()
    finals = sorted(out.glob("final_member*.safetensors"))
    assert finals, f"no member finished: {sorted(p.name for p in out.iterdir())}"
    for path in finals:
        state = load_file(str(path))
        assert int(state.pop("global_step")) == STEPS
        for key, value in state.items():
            torch.testing.assert_close(
                value, reference[key], **TOL, msg=lambda m, k=key, p=path: f"{p.name} {k}: {m}"
            )
            covered.add(key)
    expected = {k for k in reference if k != "global_step"}
    assert covered == expected, f"not covered: {sorted(expected - covered)}"
    return covered


def launched(out: Path) -> Record:
    """The supervisor's record of the job :func:`run_elastic` ran into ``out``."""
    return Record.read(out / NAME)


BACKENDS = pytest.mark.parametrize("backend", ["gloo", "nccl-like"])  # nccl-like: NCCL's failure rules on CPU


@pytest.mark.slow
@pytest.mark.multiprocess
@BACKENDS
def test_sigkill_last_stage_two_stages(
    tmp_path: Path, elastic_reference: dict[str, torch.Tensor], backend: str
) -> None:
    """The last stage dies mid-step; stage 0 holds its replica and runs the whole model. The output says it
    once: Lightning's start-up lines come from member 0 only, and the survivor's gloo error is not printed
    (the supervisor reports the failover). On ``nccl-like`` nothing raises: the survivor's operation blocks
    until its watcher aborts the generation's backends, and the failed generation is never destroyed."""
    log = run_elastic(tmp_path, nproc=2, stages=2, fault="1:2:forward", extra_args=("--backend", backend))
    if backend == "nccl-like":
        assert "superseded by a failover generation: aborting its backends" in log, log[-3000:]
        assert "NcclLikeDestroyRefused" not in log
    record = launched(tmp_path)
    assert record.summary() == [("failover", [1])] and record.grids() == [[[0, 0]]]
    assert log.count("GPU available:") == 1 and log.count("Tip:") <= 1
    assert "Connection closed by peer" not in log and "gloo" not in log
    check_final(tmp_path, elastic_reference)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigkill_middle_stage(tmp_path: Path, elastic_reference: dict[str, torch.Tensor]) -> None:
    """Stage 1 of 3 dies mid-step; stage 0 promotes its replica and runs stages 0-1 fused."""
    run_elastic(tmp_path, nproc=3, stages=3, fault="1:2:forward")
    assert launched(tmp_path).grids() == [[[0, 0, 2]]]
    check_final(tmp_path, elastic_reference)
    for member in (0, 2):  # the failover re-formed the seam's layers, never the user's module
        seen = json.loads((tmp_path / f"module_member{member}.json").read_text())
        assert_no_writes(seen, f"member {member}")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigkill_rank0(tmp_path: Path, elastic_reference: dict[str, torch.Tensor]) -> None:
    """Member 0 (rank 0 of the process group, stage 0) dies: the store is on the launcher, the job goes on."""
    run_elastic(tmp_path, nproc=2, stages=2, fault="0:3:forward")
    record = launched(tmp_path)
    assert record.summary() == [("failover", [0])] and record.grids() == [[[1, 1]]]
    check_final(tmp_path, elastic_reference)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_failures_at_two_phases_with_gradient_clipping(
    tmp_path: Path,
    elastic_reference: dict[str, torch.Tensor],
    elastic_reference_clipped: dict[str, torch.Tensor],
) -> None:
    """3 stages, ``gradient_clip_val``: member 1 dies before sending its replica gradients (step 1 aborted
    and replayed), then member 2 dies after the commit of step 3 and before applying it (survivors roll step
    3 forward with the clipping agreed before the commit: the global norm over all stages, also on the
    replicas)."""
    assert any(
        not torch.equal(value, elastic_reference[key]) for key, value in elastic_reference_clipped.items()
    ), "the clip value must change the trajectory, or this test would not see clipping"
    clip = ("--clip", str(CLIP))
    run_elastic(tmp_path, nproc=3, stages=3, fault="1:1:exchange,2:3:commit", extra_args=clip)
    record = launched(tmp_path)
    assert record.summary() == [("failover", [1]), ("failover", [2])]
    assert record.grids() == [[[0, 0, 2]], [[0, 0, 0]]]
    check_final(tmp_path, elastic_reference_clipped)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigkill_during_validation(tmp_path: Path) -> None:
    """Validation every 3 steps (after Lightning's sanity check): member 1 dies inside the first validation
    run; member 0 forms the next generation, runs the interrupted validation batch again on it and trains on.
    The logged val_loss of both validation runs and the final state equal the uninterrupted run's."""
    validate = ("--validate", "3")
    run_process([sys.executable, str(SCRIPT), "--out", str(tmp_path / "reference"), "--strategy", "auto",
                 "--steps", str(STEPS), *validate], timeout=240)
    reference = load_file(str(tmp_path / "reference" / "final_reference.safetensors"))
    assert reference["val_losses"].numel() == 2
    run_elastic(tmp_path / "run", nproc=2, stages=2, fault="1:3:validate", extra_args=(*validate, "--events"))
    reruns = [(e["loop"], e["step"]) for e in worker_events(tmp_path / "run", 0, "on_evaluation_rerun")]
    assert reruns == [("validation", 3)]
    assert launched(tmp_path / "run").summary() == [("failover", [1])]
    check_final(tmp_path / "run", reference)


@pytest.mark.slow
@pytest.mark.multiprocess
@BACKENDS
def test_two_pipelines_prepared_and_applied(
    tmp_path: Path, elastic_reference: dict[str, torch.Tensor], backend: str
) -> None:
    """2 stages x 2 pipelines: member 3 dies once prepared (the step commits: all had prepared, or aborts:
    one had not — either way the survivors agree), later member 0 dies after applying its step."""
    run_elastic(tmp_path, nproc=4, stages=2, fault="3:1:prepared,0:4:applied",
                extra_args=("--backend", backend))
    record = launched(tmp_path)
    assert record.summary() == [("failover", [3]), ("failover", [0])]
    assert record.grids() == [[[0, 1], [2, 2]], [[1, 1], [2, 2]]]
    check_final(tmp_path, elastic_reference)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["gloo", "nccl-like"])
def test_a_member_lost_while_the_next_generation_forms(
    tmp_path: Path, elastic_reference: dict[str, torch.Tensor], backend: str
) -> None:
    """2 stages x 2 pipelines: member 3 dies in step 1's forward; while the survivors form generation 1
    (its process group created, no layer moved yet) member 1 dies too. The re-form is cut like a step: the
    survivors release generation 1 as their backend needs (on ``nccl-like`` nothing raises: the watcher
    aborts) and form generation 2, each stage-0 member running its pipeline with its promoted replica; step 1
    then runs once, and the final state equals the uninterrupted run's."""
    run_elastic(tmp_path, nproc=4, stages=2, fault="3:1:forward,1:1:form", extra_args=("--backend", backend))
    record = launched(tmp_path)
    assert record.summary() == [("failover", [3]), ("failover", [1])]
    assert record.grids()[-1] == [[0, 0], [2, 2]]
    check_final(tmp_path, elastic_reference)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_hung_member_detected_by_heartbeat(
    tmp_path: Path, elastic_reference: dict[str, torch.Tensor]
) -> None:
    """A SIGSTOPped member stops its heartbeat; the launcher kills it after --hang-timeout and fails over."""
    run_elastic(tmp_path, nproc=2, stages=2, fault="1:2:forward:STOP", launch_args=("--hang-timeout", "3"))
    record = launched(tmp_path)
    assert record["hung"] == [1] and record.summary() == [("failover", [1])]
    assert record.exits[1] == -signal.SIGKILL  # fenced by PID, not exited on its own
    check_final(tmp_path, elastic_reference)


@pytest.mark.services
def test_the_etcd_store_counts_and_reads_a_counter_without_writing(etcd_endpoint: str) -> None:
    """``add(key, 0)`` is how Store users read a counter (agents read every machine's lease each tick): on
    etcd it must be a read, not a write (each write is a consensus round and a disk sync)."""
    store = ms.connect(f"etcd://{etcd_endpoint}", f"counter-{os.getpid()}")
    assert store.add("c", 0) == 0 and not store.check(["c"])
    assert (store.add("c", 2), store.add("c", 3)) == (2, 5)
    revision = store._client.get(store._key("c"), metadata=True)[0][1]["mod_revision"]
    assert store.add("c", 0) == 5
    assert store._client.get(store._key("c"), metadata=True)[0][1]["mod_revision"] == revision


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.services
@pytest.mark.parametrize(
    ("nproc", "fault", "failovers"),
    [(2, "1:2:forward", [[1]]), (4, "3:1:prepared,0:4:applied,2:5:exchange", [[3], [0], [2]])],
    ids=["one-pipeline", "2x2-after-and-before-the-all-reduce"],
)
def test_failover_through_etcd(
    tmp_path: Path, elastic_reference: dict[str, torch.Tensor], etcd_endpoint: str, nproc: int, fault: str,
    failovers: list[list[int]],
) -> None:
    """The job's membership and every generation's rendezvous live in a real etcd server, and the members
    commit each step by all-reduce (:mod:`lightning_bamboo.runtime.collective_commit`). 2 x 2: member 3 dies
    once the all-reduce of step 1 completed on it (the others applied the step or roll it forward), member 0
    after applying step 4 (rank 0, which records the outcomes), member 2 before the all-reduce of step 5
    (no one applied it: aborted and replayed). Each time the survivors agree, and the run ends equal to the
    uninterrupted one."""
    run_elastic(
        tmp_path, nproc=nproc, stages=2, fault=fault, launch_args=("--store", f"etcd://{etcd_endpoint}")
    )
    record = launched(tmp_path)
    assert record.summary() == [("failover", lost) for lost in failovers]
    check_final(tmp_path, elastic_reference)
    # the steps committed by all-reduce (no member voted in etcd), and each survivor of generation 0 said
    # how many steps it had applied there when it left it
    store = ms.connect(record.data["store"], record.data["job"])
    assert ms.get_str(store, "g0/outcome/0") == "commit"
    assert not store.check(["g0/prep/0"])
    survivors = [m for m in range(nproc) if m != failovers[0][0]]
    assert all(store.check([f"g0/applied/{m}"]) for m in survivors)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_rank_zero_lost_after_a_commit_logs_every_step_once(
    tmp_path: Path, elastic_reference: dict[str, torch.Tensor]
) -> None:
    """Member 0 (rank 0: the one whose CSVLogger writes and whose progress bar shows) is SIGKILLed after the
    commit of step 3, before Lightning logged that step's row. Member 1 rolls the step forward, becomes rank
    0, logs step 3's row (the store says the old rank 0 logged up to step 2) and shows the progress bar for
    the rest of the run: the CSV has every step once, and the final state equals the uninterrupted run."""
    run_elastic(tmp_path, nproc=2, stages=2, fault="0:3:commit", extra_args=("--csv",))
    assert launched(tmp_path).summary() == [("failover", [0])]
    check_final(tmp_path, elastic_reference)
    (version,) = (tmp_path / "logs").iterdir()
    rows = list(csv.DictReader((version / "metrics.csv").open()))
    steps = [int(row["step"]) for row in rows if row.get("train_loss")]
    assert steps == list(range(STEPS)), steps
    assert json.loads((tmp_path / "bar_member1.json").read_text()) == {"enabled": True, "n": STEPS}
