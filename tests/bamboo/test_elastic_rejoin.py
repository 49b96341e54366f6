"""Elastic Bamboo rejoin end to end: workers started while the job runs join it at a step boundary, receive
their layers and optimizer state from peers and the trainer's progress through the store, and the job ends
with final parameters and optimizer state equal (float64) to an uninterrupted single-process run, every
sample of every step consumed exactly once.

The worker script (``scripts/train_rejoin.py``) records the ids of the samples whose loss each member
computed; its ``--hold-at S`` makes the members wait at step ``S`` until a join is proposed, so the join
happens after step ``S`` whatever the machine's load (a new process takes seconds to start).
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.bamboo.launch_record import NAME, Record, record_env
from tests.process import launch_env, run_process

SCRIPTS = Path(__file__).parent / "scripts"
WORKER = SCRIPTS / "train_rejoin.py"
TOL = {"rtol": 1e-9, "atol": 1e-11}
STEPS = 7  # 4 batches per epoch: the runs cross into a second epoch (the sampler's order changes)


def joins(record: Record) -> list[tuple[list[int], int]]:
    """``(members, first step at the new size)`` of every completed join, each with its cost measured."""
    assert all(j["join_s"] > 0 and j["wait_s"] >= 0 for j in record["joins"]), record["joins"]
    return [(j["members"], j["step"]) for j in record["joins"]]


def _reference(out: Path, *extra: str) -> tuple[dict[str, torch.Tensor], list]:
    cmd = [sys.executable, str(WORKER), "--out", str(out), "--strategy", "auto", "--steps", str(STEPS)]
    cmd += extra
    run_process(cmd, timeout=240, env=launch_env())
    ids = json.loads((out / "ids_reference.json").read_text())
    return load_file(str(out / "final_reference.safetensors")), ids


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], list]:
    return _reference(tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module")
def tied_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], list]:
    return _reference(tmp_path_factory.mktemp("reference-tied"), "--tied")


def check_final(out: Path, reference: dict[str, torch.Tensor], members: set[int]) -> None:
    """Every member in ``members`` finished all steps with its stages equal to the reference; all covered."""
    finals = {int(p.stem.removeprefix("final_member")): p for p in out.glob("final_member*.safetensors")}
    assert set(finals) == members, f"finished: {sorted(finals)}, expected {sorted(members)}"
    covered: set[str] = set()
    for member, path in sorted(finals.items()):
        state = load_file(str(path))
        assert int(state.pop("global_step")) == STEPS, f"member {member}"
        for key, value in state.items():
            torch.testing.assert_close(
                value, reference[key], **TOL, msg=lambda m, k=key, n=member: f"member {n} {k}: {m}"
            )
            covered.add(key)
    assert covered == set(reference) - {"global_step"}


def consumed(out: Path) -> tuple[dict[int, list[int]], dict[int, dict[int, list[int]]]]:
    """Sample ids per step over all finished members, and per member."""
    per_step: dict[int, list[int]] = defaultdict(list)
    per_member: dict[int, dict[int, list[int]]] = {}
    for path in out.glob("ids_member*.json"):
        member = int(path.stem.removeprefix("ids_member"))
        per_member[member] = defaultdict(list)
        for step, ids in json.loads(path.read_text()):
            per_step[step] += ids
            per_member[member][step] += ids
    return per_step, per_member


@pytest.mark.slow
@pytest.mark.multiprocess
def test_rank_joining_back(tmp_path: Path, reference: tuple[dict[str, torch.Tensor], list]) -> None:
    """2 stages x 1 pipeline: member 1 is SIGKILLed in step 1 (member 0 runs both stages), the launcher's
    ``--replace`` starts member 2, which joins after step 4 (in the second epoch): the pipeline is back at
    full length, member 2 received stage 1's layers and Adam state from member 0 and reads the batches the
    reference reads from step 5 on."""
    params, ids = reference
    env = record_env(tmp_path, "1:1:forward")
    cmd = [sys.executable, "-m", "lightning_bamboo.launch", "--nproc", "2", "--replace", "1"]
    cmd += [str(WORKER), "--out", str(tmp_path), "--stages", "2", "--steps", str(STEPS), "--hold-at", "4"]
    run_process(cmd, timeout=400, env=env)
    record = Record.read(tmp_path / NAME)
    assert record.history() == [("failover", [1], []), ("rejoin", [], [2])]
    assert record.grids() == [[[0, 0]], [[0, 2]]]
    assert joins(record) == [([2], 5)]  # joined after step 4: step 5 is the first at full length
    check_final(tmp_path, params, {0, 2})
    per_step, per_member = consumed(tmp_path)
    # step 0's losses were computed by the killed member; from the replayed step 1 on, exactly the reference's
    for step, expected in ids[1:]:
        assert sorted(per_step[step]) == sorted(expected), f"step {step}"
    assert {s: sorted(v) for s, v in per_member[2].items()} == {s: sorted(i) for s, i in ids[5:]}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_rank_joining_back_splits_a_tie_again(
    tmp_path: Path, tied_reference: tuple[dict[str, torch.Tensor], list]
) -> None:
    """Layer 4's weight IS layer 0's: member 1 (stage 1, layer 4's use) is SIGKILLed, member 0 holds both
    uses as one parameter with one Adam state; member 2 joins after step 4 and receives layer 4 with its own
    copy of the weight and of its Adam state (the copy member 0 keeps is not shared with what it sent), and
    from then on their gradients are summed again. Equal to auto's tied run."""
    params, _ = tied_reference
    env = record_env(tmp_path, "1:1:forward")
    cmd = [sys.executable, "-m", "lightning_bamboo.launch", "--nproc", "2", "--replace", "1"]
    cmd += [str(WORKER), "--out", str(tmp_path), "--stages", "2", "--steps", str(STEPS), "--hold-at", "4",
            "--tied"]
    run_process(cmd, timeout=400, env=env)
    record = Record.read(tmp_path / NAME)
    assert record.history() == [("failover", [1], []), ("rejoin", [], [2])]
    assert joins(record) == [([2], 5)]
    check_final(tmp_path, params, {0, 2})
    m0, m2 = (load_file(str(tmp_path / f"final_member{m}.safetensors")) for m in (0, 2))
    assert torch.equal(m0["own/pipeline.0.weight"], m2["own/pipeline.4.weight"])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_join_adds_a_pipeline(tmp_path: Path, reference: tuple[dict[str, torch.Tensor], list]) -> None:
    """2 stages x 1 pipeline; two workers added through ``Supervisor.add_worker()`` (from another thread
    while ``run()`` runs) form a second pipeline after step 2: both receive their stage's layers and Adam
    state from pipeline 0, the global batch is split over two pipelines from step 3 on (and the joiners
    cross into epoch 2), and no sample is repeated or skipped."""
    params, ids = reference
    cmd = [sys.executable, str(SCRIPTS / "rejoin_driver.py"), "--nproc", "2", "--add", "2", "--"]
    cmd += [str(WORKER), "--out", str(tmp_path), "--stages", "2", "--steps", str(STEPS), "--hold-at", "2"]
    run_process(cmd, timeout=400, env=record_env(tmp_path))
    record = Record.read(tmp_path / NAME)
    assert [(c.kind, c.joined) for c in record.changes] == [("rejoin", [2, 3])]
    assert record.grids() == [[[0, 1], [2, 3]]]
    assert joins(record) == [([2, 3], 3)]
    check_final(tmp_path, params, {0, 1, 2, 3})
    per_step, per_member = consumed(tmp_path)
    assert sorted(per_step) == list(range(STEPS))
    for step, expected in ids:
        assert sorted(per_step[step]) == sorted(expected), f"step {step}: {per_step[step]} vs {expected}"
    # after the join each pipeline's last stage consumed half of every global batch
    assert all(len(per_member[3][s]) == 4 and len(per_member[1][s]) == 4 for s in range(3, STEPS))


def _finals(out: Path) -> dict[str, torch.Tensor]:
    """Every finished member's final state merged (stages held by several pipelines are equal)."""
    merged: dict[str, torch.Tensor] = {}
    for path in sorted(out.glob("final_member*.safetensors")):
        state = load_file(str(path))
        assert int(state.pop("global_step")) == STEPS, path.name
        merged.update(state)
    return merged


@pytest.fixture(scope="module")
def dropout_2x2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The uninterrupted elastic run with dropout, 2 stages x 2 pipelines x 2 micro-batches (4 global)."""
    out = tmp_path_factory.mktemp("dropout-2x2")
    cmd = [sys.executable, "-m", "lightning_bamboo.launch", "--nproc", "4"]
    cmd += [str(WORKER), "--out", str(out), "--stages", "2", "--steps", str(STEPS), "--dropout"]
    run_process(cmd, timeout=400, env=launch_env())
    return _finals(out)


def _assert_equal_to(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, **TOL, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["gloo", "nccl-like"])  # nccl-like: NCCL's failure rules on CPU
def test_pipeline_lost_and_grown_back_with_dropout(
    tmp_path: Path, dropout_2x2: dict[str, torch.Tensor], backend: str
) -> None:
    """2x2 with dropout: both members of pipeline 1 are SIGKILLed in step 1 (pipeline 0 replays it alone, all
    4 global micro-batches), ``--replace`` starts two workers that form pipeline 1 again after step 4: every
    step drew the uninterrupted run's masks for each sample, so the final state equals it. On ``nccl-like``
    the failed generation is released by abort and the join's planned change by destroy."""
    env = record_env(tmp_path, "2+3:1:forward")
    cmd = [sys.executable, "-m", "lightning_bamboo.launch", "--nproc", "4", "--replace", "2"]
    cmd += [str(WORKER), "--out", str(tmp_path), "--stages", "2", "--steps", str(STEPS), "--hold-at", "4",
            "--dropout", "--backend", backend]
    log = run_process(cmd, timeout=400, env=env).stdout
    record = Record.read(tmp_path / NAME)
    expected = [("failover", [2, 3], []), ("rejoin", [], [4, 5])]
    assert record.history() == expected, log[-3000:]
    assert joins(record) == [([4, 5], 5)]
    _assert_equal_to(_finals(tmp_path), dropout_2x2)


def _peers_with_a_replacement(out: Path, faults: str) -> tuple[Record, str]:
    """2x2 with dropout, ``recovery="peers"``, ``faults`` injected, one replacement started by the launcher
    whose join is proposed before step 4 (``--hold-at 4``): the supervisor's record and the output."""
    cmd = [sys.executable, "-m", "lightning_bamboo.launch", "--nproc", "4", "--replace", "1"]
    cmd += [str(WORKER), "--out", str(out), "--stages", "2", "--steps", str(STEPS), "--hold-at", "4",
            "--dropout", "--recovery", "peers"]
    log = run_process(cmd, timeout=400, env=record_env(out, faults)).stdout
    return Record.read(out / NAME), log


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_loss_during_a_join_under_peers_recovery_with_dropout(
    tmp_path: Path, dropout_2x2: dict[str, torch.Tensor]
) -> None:
    """2x2 with dropout and ``recovery="peers"`` (no replica): member 3 is SIGKILLed in step 1 (member 2
    runs pipeline 1 fused, stage 1's layers from member 1), ``--replace`` starts a worker whose join is
    proposed before step 4, and member 1 is SIGKILLed in step 4's forward, while that join is pending. Seen
    here: the failover first (generation 2: both pipelines fused, member 0's stage 1 from member 2), then
    the join (generation 3: member 4 takes stage 1 back, its layers peer to peer). The test accepts either
    order; every lost stage comes from a peer and the final state equals the uninterrupted run's."""
    record, log = _peers_with_a_replacement(tmp_path, "3:1:forward,1:4:forward")
    history = record.history()
    assert history[0] == ("failover", [3], []), log[-3000:]
    assert sorted(m for _, lost, _ in history for m in lost) == [1, 3], history
    assert [m for _, _, joined in history for m in joined] == [4], history
    _assert_equal_to(_finals(tmp_path), dropout_2x2)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_member_that_gave_layers_to_a_joiner_is_no_source_of_them_later(
    tmp_path: Path, dropout_2x2: dict[str, torch.Tensor]
) -> None:
    """2x2, ``recovery="peers"``, dropout. Member 1 is SIGKILLed in step 1, so member 0 runs pipeline 0
    fused. A replacement, member 4, joins after step 4 and takes stage 1 back from member 0, which then holds
    stage 0 only: its copy of stage 1's layers goes to the meta device. Member 3 is SIGKILLed in step 6, and
    member 2 needs stage 1 from a peer. The lowest member that lists it must really hold it (member 4, not
    member 0).

    Before the fix, member 0 still listed the released layers. It was chosen as their source: its receiver
    timed out waiting for the layer's description, or a member formed with a layer on the meta device. The
    3x2 multi-machine run of ``bamboo_nodes.py`` stopped that way."""
    record, log = _peers_with_a_replacement(tmp_path, "1:1:forward,3:6:forward")
    expected = [("failover", [1], []), ("rejoin", [], [4]), ("failover", [3], [])]
    assert record.history() == expected, log[-3000:]
    assert record.grids()[-1] == [[0, 4], [2, 2]]
    _assert_equal_to(_finals(tmp_path), dropout_2x2)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_join_adds_a_pipeline_with_dropout(tmp_path: Path, dropout_2x2: dict[str, torch.Tensor]) -> None:
    """One pipeline of 4 micro-batches, joined by a second after step 2 (each then runs 2 of the 4 global
    micro-batches): equal to the 2x2 run of 2 micro-batches each, which cuts the batch the same way."""
    cmd = [sys.executable, str(SCRIPTS / "rejoin_driver.py"), "--nproc", "2", "--add", "2", "--"]
    cmd += [str(WORKER), "--out", str(tmp_path), "--stages", "2", "--steps", str(STEPS), "--hold-at", "2",
            "--microbatches", "4", "--dropout"]
    log = run_process(cmd, timeout=400, env=record_env(tmp_path)).stdout
    record = Record.read(tmp_path / NAME)
    assert [(c.kind, c.joined) for c in record.changes] == [("rejoin", [2, 3])], log[-3000:]
    assert joins(record) == [([2, 3], 3)]
    _assert_equal_to(_finals(tmp_path), dropout_2x2)


# ---------------------------------------------------------------------- single-process pieces (fast)
def test_skip_first_batches_skips_once_and_follows_the_epoch() -> None:
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from lightning_bamboo.step.progress import skip_first_batches

    data = TensorDataset(torch.arange(12))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    plain = DataLoader(data, batch_size=3, sampler=sampler)
    sampler.set_epoch(1)
    epoch1 = [b[0].tolist() for b in plain]
    sampler.set_epoch(2)
    epoch2 = [b[0].tolist() for b in plain]
    joined = skip_first_batches(plain, 2)
    assert len(joined) == 4  # Lightning counts the skipped batches as fetched
    joined.batch_sampler.set_epoch(1)  # type: ignore[union-attr]
    assert [b[0].tolist() for b in joined] == epoch1[2:]
    joined.batch_sampler.set_epoch(2)  # type: ignore[union-attr]
    assert [b[0].tolist() for b in joined] == epoch2


def test_skip_first_batches_refuses_what_it_cannot_position() -> None:
    from torch.utils.data import DataLoader, IterableDataset

    from lightning_bamboo.step.progress import skip_first_batches

    class Stream(IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield from range(4)

    with pytest.raises(TypeError, match=re.escape("a plain torch.utils.data.DataLoader over a map-style")):
        skip_first_batches(DataLoader(Stream(), batch_size=None), 1)


def test_progress_refuses_what_json_cannot_carry() -> None:
    from lightning_bamboo.step.progress import _check_json

    _check_json({"a": [1, 2.5, "x", None, {"b": True}]}, "progress")
    with pytest.raises(TypeError, match=r"progress\.schedulers\[0\]\.t is a Tensor; .* never pickled"):
        _check_json({"schedulers": [{"t": torch.zeros(1)}]}, "progress")


def test_join_claim_and_failover_first_writer_wins() -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_bamboo.layout.ownership import initial, rejoin
    from lightning_bamboo.protocol import join as joining
    from lightning_bamboo.protocol.commit import COMMIT_JOIN, decide

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=5))
    gen0 = initial(2, [0, 1])
    assert not joining.claim(store, 0, step=3)  # nothing proposed: nothing to adopt
    joining.propose(store, 0, rejoin(gen0, [2, 3]))
    assert joining.proposal(store, 0) == rejoin(gen0, [2, 3])
    assert joining.adopted_step(store, 0) is None
    assert joining.claim(store, 0, step=3)
    assert not joining.claim(store, 0, step=4)  # decided once
    assert joining.adopted_step(store, 0) == 3
    assert decide(store, 0, 3, COMMIT_JOIN) == COMMIT_JOIN  # the claimer commits step 3
    assert joining.close(store, 0) == 3  # a later loss: the failover applies to the joined layout
    # generation 1: the launcher's failover claims first, a later commit cannot adopt the proposal
    joining.propose(store, 1, rejoin(gen0, [4, 5]))
    assert joining.close(store, 1) is None
    assert not joining.claim(store, 1, step=7)
    assert joining.adopted_step(store, 1) is None


def test_replace_delay_must_not_be_negative() -> None:
    from lightning_bamboo.control.supervisor import Supervisor

    with pytest.raises(ValueError, match=re.escape("--replace-delay must be >= 0 seconds, got -1")):
        Supervisor(["true"], 1, replace=True, replace_delay=-1)
