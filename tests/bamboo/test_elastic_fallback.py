"""Checkpoint fallback of elastic Bamboo: a loss the replicas cannot cover resumes from the last complete
asynchronous checkpoint inside the same ``fit``, re-running the steps since it.

The multi-process test really SIGKILLs two adjacent stages of a 3-stage pipeline at once (fault injection
``1+2:step:exchange``) and checks the survivor's final parameters and optimizer state (float64) against the
uninterrupted single-process run. The unit tests check that an incomplete checkpoint is never loaded.
"""

from __future__ import annotations

import json
import pickle
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from lightning_bamboo.checkpoint import periodic as fb
from lightning_bamboo.runtime.reshard import gather
from lightning_bamboo.strategy import BambooStrategy
from tests.bamboo.launch_record import NAME, Record, record_env, worker_events
from tests.bamboo.test_elastic import SCRIPT, STEPS, check_final
from tests.process import run_process


def loaded_step(fallback: dict[str, object]) -> int:
    """The checkpoint step a fallback event's ``checkpoint_path`` (the folder it loaded) is of."""
    name = Path(str(fallback["checkpoint_path"])).name
    assert name.startswith(fb.PREFIX), fallback
    return int(name.removeprefix(fb.PREFIX))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_adjacent_stages_lost_falls_back_to_checkpoint(
    tmp_path: Path, elastic_reference: dict[str, torch.Tensor]
) -> None:
    """3 stages x 1 pipeline, a checkpoint every 2 steps; members 1 and 2 die together in step 5 (before
    the replica exchange, so the step aborts). Nobody holds stages 1-2 any more: the launcher publishes a
    fallback, member 0 alone (fewer processes than stages) loads the last complete checkpoint (step 4, or 2
    if a dead member's part of step 4 never finished), re-runs the steps since it, replays step 5 and
    finishes: equal to the uninterrupted run."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "lightning_bamboo.launch", "--nproc", "3", str(SCRIPT), "--out", str(out)]
    cmd += ["--stages", "3", "--steps", str(STEPS), "--checkpoint-every", "2", "--checkpoint-dir", str(ckpt)]
    run_process([*cmd, "--events"], timeout=400, env=record_env(out, "1+2:5:exchange"))
    record = Record.read(out / NAME)
    assert record.summary() == [("fallback", [1, 2])] and record.grids() == [[[0, 0, 0]]]
    (job,) = list(ckpt.iterdir())
    (fallback,) = worker_events(out, 0, "on_fallback")
    step = loaded_step(fallback)
    assert step in (2, 4) and fallback["step"] == 5  # re-ran steps step..4, goes on with step 5
    check_final(out, elastic_reference)
    assert fb.complete_steps(job) == [2, 4]  # keep_checkpoints=2: step 2's was written, then step 4's


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fewer_processes_than_stages_after_a_loss_after_the_commit(
    tmp_path: Path, elastic_reference: dict[str, torch.Tensor]
) -> None:
    """4 stages x 1 pipeline; members 1 and 2 die together after reading the commit of step 4 (the survivors
    apply it). Two survivors for four stages: members 0 and 3 run stages 0-1 and 2-3 fused, each with the
    other's replica, all loaded from the checkpoint, and re-run the steps since it with replica exchange.

    Both runs keep a ``BambooLedger``: step 3's line (the step before the fallback, whose stage 2 no survivor
    held: its owner and its replica holder were lost before reporting it) gets stage 2's digest from the
    fallback's re-run, and ``verify`` finds the run the same as the uninterrupted one."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"

    def launch(to: Path, fault: str, *args: str) -> str:
        cmd = [sys.executable, "-m", "lightning_bamboo.launch", "--nproc", "4", str(SCRIPT), "--out", str(to)]
        cmd += ["--stages", "4", "--steps", str(STEPS), "--ledger", str(to / "ledger.jsonl"), "--events"]
        cmd += args
        return run_process(cmd, timeout=400, env=record_env(to, fault)).stdout

    with ThreadPoolExecutor(2) as pool:
        plain = pool.submit(launch, tmp_path / "plain", "")
        launch(out, "1+2:4:commit", "--checkpoint-every", "2", "--checkpoint-dir", str(ckpt))
        plain.result()
    record = Record.read(out / NAME)
    assert record.summary() == [("fallback", [1, 2])] and record.grids() == [[[0, 0, 3, 3]]]
    for member in (0, 3):  # re-ran steps 4..4 or 2..4 from the checkpoint, go on with step 5
        (fallback,) = worker_events(out, member, "on_fallback")
        assert loaded_step(fallback) in (4, 2) and fallback["step"] == 5
    check_final(out, elastic_reference)
    lines = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(STEPS))
    assert all(sorted(line["digests"]) == ["0", "1", "2", "3"] for line in lines), lines
    assert not any("mismatch" in line for line in lines)
    verify = [sys.executable, "-m", "lightning_bamboo.verify", str(tmp_path / "plain" / "ledger.jsonl"),
              str(out / "ledger.jsonl")]
    assert f"the ledgers are the same: {STEPS} steps" in run_process(verify, timeout=60).stdout


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fallback_keeps_a_tie(tmp_path: Path, tied_reference: dict[str, torch.Tensor]) -> None:
    """``pipe_variants.Tied`` on 3 stages (the uses on stages 0 and 2, a copy each, checkpointed per layer
    with its own Adam state); members 1 and 2 die together: member 0 alone loads the checkpoint, both uses
    become one parameter in its module, and the run equals auto's tied run."""
    from tests.bamboo.test_elastic import CLIP

    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "lightning_bamboo.launch", "--nproc", "3", str(SCRIPT), "--out", str(out)]
    cmd += ["--stages", "3", "--steps", str(STEPS), "--checkpoint-every", "2", "--checkpoint-dir", str(ckpt)]
    cmd += ["--variant", "tied", "--optimizer", "adam", "--clip", str(CLIP)]
    run_process(cmd, timeout=400, env=record_env(out, "1+2:5:exchange"))
    record = Record.read(out / NAME)
    assert record.summary() == [("fallback", [1, 2])] and record.grids() == [[[0, 0, 0]]]
    check_final(out, tied_reference)


def _write(root: Path, step: int, layers: dict[int, nn.Module], optimizer: torch.optim.Optimizer) -> None:
    checkpointer = fb.PeriodicCheckpointer(root, every=2, keep=5, member=0)
    assert checkpointer.due(step)
    checkpointer.save(
        step, gather(layers, optimizer), [0], len(layers), {"param_groups": [], "schedulers": []}
    )
    assert checkpointer.wait(strict=True) is not None
    fb.finalize(root)


@pytest.mark.filterwarnings("error:torch.distributed is disabled")
def test_an_incomplete_checkpoint_is_never_loaded(tmp_path: Path) -> None:
    """The loader takes the newest COMPLETE checkpoint: a ``.partial`` folder (a writer still writing, or
    dead) and a renamed folder missing a writer's part are skipped; the complete one loads exactly. Writing
    and loading say nothing (torch's "torch.distributed is disabled ... single process" warning is an error
    here, in the writer's thread too: the write would fail)."""
    torch.manual_seed(0)
    layers = {0: nn.Linear(3, 3).double(), 1: nn.Tanh()}
    optimizer = torch.optim.Adam(layers[0].parameters(), lr=0.1)
    layers[0](torch.randn(2, 3, dtype=torch.float64)).sum().backward()
    optimizer.step()
    _write(tmp_path, 2, layers, optimizer)
    expected = {k: v.clone() for k, v in layers[0].state_dict().items()}
    expected_avg = optimizer.state[layers[0].weight]["exp_avg"].clone()
    with torch.no_grad():
        layers[0].weight.add_(1.0)
    _write(tmp_path, 4, layers, optimizer)
    # step 4's index is cut short (writer killed while writing it): as a .partial folder, and renamed too
    shutil.move(fb.folder(tmp_path, 4), fb.folder(tmp_path, 4, partial=True))
    index = fb.folder(tmp_path, 4, partial=True) / "member0" / "model.safetensors.index.json"
    index.write_text(index.read_text()[: len(index.read_text()) // 2])
    shutil.copytree(fb.folder(tmp_path, 4, partial=True), fb.folder(tmp_path, 6))
    # step 8: complete data, but it names a second writer whose part never came
    shutil.copytree(fb.folder(tmp_path, 2), fb.folder(tmp_path, 8, partial=True))
    meta = fb.folder(tmp_path, 8, partial=True) / "member0.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "writers": [0, 1]}))

    assert fb.finalize(tmp_path) == []
    assert fb.complete_steps(tmp_path) == [2]
    assert fb.latest_complete(tmp_path) == 2
    with pytest.raises(FileNotFoundError, match="not a complete Bamboo fallback checkpoint"):
        fb.load_layers(fb.folder(tmp_path, 6), [0], layers.__getitem__, torch.device("cpu"))
    fresh = {0: nn.Linear(3, 3).double(), 1: nn.Tanh()}
    held, saved = fb.load_layers(fb.folder(tmp_path, 2), [0, 1], fresh.__getitem__, torch.device("cpu"))
    assert saved["step"] == 2 and held[0].module is fresh[0]
    for key, value in expected.items():
        torch.testing.assert_close(fresh[0].state_dict()[key], value, rtol=0, atol=0)
    torch.testing.assert_close(held[0].state["weight"]["exp_avg"], expected_avg, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_loading_a_checkpoint_never_unpickles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fallback checkpoints are safetensors + JSON: loading one works with every pickle entry point raising,
    bit-exact (float64 parameters and Adam state). Control: DCP's default format cannot be read that way."""
    torch.manual_seed(0)
    layers = {0: nn.Linear(3, 3).double()}
    optimizer = torch.optim.Adam(layers[0].parameters(), lr=0.1)
    layers[0](torch.randn(2, 3, dtype=torch.float64)).sum().backward()
    optimizer.step()
    _write(tmp_path, 2, layers, optimizer)
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "default"), no_dist=True)

    def unpickle(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a fallback checkpoint load unpickled something")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, unpickle)
    # the patch does catch DCP's default format (its .metadata is unpickled)
    with pytest.raises(dcp.CheckpointException, match="read failed: a fallback checkpoint load unpickled"):
        dcp.load({"w": torch.empty(2)}, checkpoint_id=str(tmp_path / "default"), no_dist=True)
    fresh = {0: nn.Linear(3, 3).double()}
    held, _ = fb.load_layers(fb.folder(tmp_path, 2), [0], fresh.__getitem__, torch.device("cpu"))
    monkeypatch.undo()
    for key, value in layers[0].state_dict().items():
        torch.testing.assert_close(fresh[0].state_dict()[key], value, rtol=0, atol=0)
    for key, value in optimizer.state[layers[0].weight].items():
        torch.testing.assert_close(held[0].state["weight"][key], value, rtol=0, atol=0)


def test_checkpoint_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="checkpoint_every_n_steps and checkpoint_dir go together"):
        BambooStrategy(num_stages=2, checkpoint_every_n_steps=2)
    with pytest.raises(ValueError, match="checkpoint_every_n_steps must be an integer >= 1, got 0"):
        BambooStrategy(num_stages=2, checkpoint_every_n_steps=0, checkpoint_dir="x")
    with pytest.raises(ValueError, match="keep_checkpoints must be an integer >= 1, got 0"):
        BambooStrategy(
            num_stages=2, checkpoint_every_n_steps=2, checkpoint_dir="x", keep_checkpoints=0
        )
    with pytest.raises(TypeError, match="checkpoint_dir must be a path"):
        BambooStrategy(num_stages=2, checkpoint_every_n_steps=2, checkpoint_dir=3)


def test_only_step_schedulers_are_re_stepped_and_the_ring_says_what_it_lacks() -> None:
    """Fallback re-steps interval="step" schedulers; epoch and plateau schedulers are refused at setup."""
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    step_lr = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    fb.check_schedulers([SimpleNamespace(scheduler=step_lr, interval="step", reduce_on_plateau=False)])
    with pytest.raises(ValueError, match=r"interval='step' .* got StepLR with interval='epoch'"):
        fb.check_schedulers([SimpleNamespace(scheduler=step_lr, interval="epoch", reduce_on_plateau=False)])
    saved = fb.settings(optimizer, [SimpleNamespace(scheduler=step_lr)])
    optimizer.step()
    step_lr.step()
    fb.restore_settings(optimizer, [SimpleNamespace(scheduler=step_lr)], json.loads(json.dumps(saved)))
    assert optimizer.param_groups[0]["lr"] == 0.1 and step_lr.last_epoch == 0
    ring = fb.BatchRing(capacity=2)
    for step in range(3):
        ring.put(step, step, torch.full((1,), float(step)))
    assert ring.get(2)[1].item() == 2.0
    with pytest.raises(
        RuntimeError, match=r"the batch of step 0 is no longer kept \(the ring holds steps \[1, 2\]\)"
    ):
        ring.get(0)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_member_lacking_the_batches_gets_them_from_a_peer() -> None:
    """A member that joined later lacks the batches to re-run: the lowest rank keeping them broadcasts them
    (2 real gloo processes, bit-equal batches; steps nobody keeps are refused on every rank)."""
    out = run_process(
        [sys.executable, str(Path(__file__).parent / "scripts" / "share_batches.py")], timeout=450
    )
    assert "rank 0 ok" in out.stdout and "rank 1 ok" in out.stdout
