"""Dropout that survives failover (lightning_bamboo.pipeline.keyed_rng): keys, keyed forwards, the engine.

In one process: the key is stable and depends on each of its parts; a replica's keyed forward draws its
stage's masks; a fused position (several original stages, as after a failover) and any other split of the
body into stages draw the same masks; the global generators come back as they were; the stage's own hooks
still run; a single-stage engine keys its steps; one pipeline over all global micro-batches, or two or
three over their shares, draw the same masks and gradient. The multi-process checks (FR equals F with
dropout under ``strategy="bamboo"``; elastic runs with a SIGKILLed stage, or two and a checkpoint fallback,
equal the uninterrupted one bit for bit; a 2x2 run that loses a whole pipeline equals it to rounding and
``verify`` says the same) start processes and are marked so.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from lightning.fabric.utilities.seed import seed_everything
from safetensors.torch import load_file
from torch import Tensor, nn

from lightning_bamboo.contract import sub_sequential
from lightning_bamboo.layout.ownership import failover, initial
from lightning_bamboo.layout.view import PipelineView
from lightning_bamboo.pipeline.engine import PipelineEngine
from lightning_bamboo.pipeline.keyed_rng import DEFAULT_SEED, SEED_ENV, KeyedForward, forward_key, run_seed
from lightning_bamboo.pipeline.microbatch import microbatch_shares, split_microbatches
from lightning_bamboo.schedule import build_1f1b
from tests.bamboo.launch import snapshot
from tests.bamboo.launch_record import worker_events
from tests.bamboo.pipe_mlp import make_data
from tests.bamboo.pipe_runs import STEPS
from tests.bamboo.pipe_variants import WithDropout
from tests.process import run_process

CPU = torch.device("cpu")
STAGES = (range(0, 3), range(3, 6), range(6, 10))
"""The 3-stage split of ``WithDropout``'s body: L T D | L T D | L T D L."""


def dropout_body() -> nn.Sequential:
    torch.manual_seed(0)
    return WithDropout(pairs=3).pipeline


def keyed_output(module: nn.Module, x: Tensor, step: int = 3, mb: int = 1, seed: int = 7) -> Tensor:
    with KeyedForward(module, 0, CPU, seed).keyed(step, mb) as forward:
        return forward(x)


def test_key_is_stable_and_depends_on_every_part() -> None:
    # a fixed value: every process, Python and PyTorch version must derive the same key
    assert forward_key(0, 0, 0, 0) == forward_key(0, 0, 0, 0) == 0x6BD24FE08C694106
    parts = [(0,) * 4] + [tuple(int(i == j) for j in range(4)) for i in range(4)]  # each part changed alone
    assert len({forward_key(*p) for p in parts}) == 5
    assert 0 <= forward_key(2**32 - 1, 10**6, 255, 63) < 2**64  # torch.manual_seed takes any 64-bit key


def test_run_seed_is_seed_everythings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SEED_ENV, raising=False)
    assert run_seed() == DEFAULT_SEED
    monkeypatch.setenv(SEED_ENV, "0")  # restored after the test, whatever seed_everything sets
    seed_everything(1234)
    assert run_seed() == 1234
    for bad in ("abc", str(2**64)):
        monkeypatch.setenv(SEED_ENV, bad)
        with pytest.raises(ValueError, match=rf"PL_GLOBAL_SEED must be an integer seed .* got '{bad}'"):
            run_seed()


def test_replica_draws_the_masks_of_its_stage() -> None:
    """Stage 1 and an independent copy of its layers (a replica on another rank) give the same output for the
    same (seed, step, pipeline, micro-batch); any other key draws other masks."""
    body = dropout_body()
    stage = sub_sequential(body, STAGES[1])
    replica = sub_sequential(copy.deepcopy(body), STAGES[1])
    x = torch.randn(4, 8, dtype=torch.float64)
    torch.manual_seed(1)  # the global generators' state must not matter
    expected = keyed_output(stage, x)
    torch.manual_seed(2)
    got = keyed_output(replica, x.clone())
    assert torch.equal(got, expected)
    assert 0 < int((expected == 0).sum()) < expected.numel()  # Dropout(0.5) dropped some, not all
    for other in ({"step": 4}, {"mb": 2}, {"seed": 8}):
        masks = keyed_output(stage, x, **other) == 0
        assert not torch.equal(masks, expected == 0), other


def test_fused_position_and_any_split_draw_the_same_masks() -> None:
    """Stages 0 and 1 run fused by one member (after stage 1's member was lost) draw exactly what stage 0 and
    stage 1 draw on their own members, and so does a 2-stage split of the same body: each layer reseeds with
    its own key just before it runs."""
    body = dropout_body()
    x = torch.randn(4, 8, dtype=torch.float64)
    hidden = keyed_output(sub_sequential(body, STAGES[0]), x)
    expected = keyed_output(sub_sequential(body, STAGES[1]), hidden)
    assert torch.equal(keyed_output(sub_sequential(body, range(0, 6)), x), expected)
    three = keyed_output(sub_sequential(body, STAGES[2]), expected)
    two = keyed_output(sub_sequential(body, range(4, 10)), keyed_output(sub_sequential(body, range(0, 4)), x))
    assert torch.equal(two, three)
    # one key for the whole fused position (a module whose layers the engine cannot see) draws other masks
    assert not torch.equal(keyed_output(nn.Sequential(*body[:6]), x), expected)


def test_the_stages_hooks_run_and_nothing_stays_behind() -> None:
    stage = sub_sequential(dropout_body(), range(0, 6))
    seen: list[Tensor] = []
    stage.register_forward_hook(lambda module, args, out: seen.append(out))
    out = keyed_output(stage, torch.randn(4, 8, dtype=torch.float64))
    assert len(seen) == 1 and seen[0] is out
    assert stage.before_layer is None


def test_the_global_generator_is_restored() -> None:
    """What the pipeline's forwards draw does not shift the random stream of the user's code around them."""
    stage = sub_sequential(dropout_body(), STAGES[0])
    x = torch.randn(4, 8, dtype=torch.float64)
    torch.manual_seed(11)
    expected = torch.rand(5)
    torch.manual_seed(11)
    keyed_output(stage, x)
    assert torch.equal(torch.rand(5), expected)


class Checkpointed(nn.Module):
    """``inner`` under activation checkpointing: its forward runs again in the backward, outside the block."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def test_activation_checkpointing_recomputes_the_keyed_masks() -> None:
    """The backward of a checkpointed Tanh + Dropout runs after the keyed block has put the generators back;
    torch.utils.checkpoint restores the state it saved in the forward (the keyed one), so the gradients are
    those of the same layers without checkpointing."""
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), nn.Sequential(nn.Tanh(), nn.Dropout(0.5)), nn.Linear(8, 1)]
    plain = sub_sequential(nn.Sequential(*layers).double(), range(3))
    checkpointed = copy.deepcopy(plain)
    checkpointed._modules["1"] = Checkpointed(checkpointed._modules["1"])
    x = torch.randn(4, 8, dtype=torch.float64)
    for stage in (plain, checkpointed):
        keyed_output(stage, x).sum().backward()
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name
    with torch.no_grad():  # dropout is on: another step's masks give another output
        assert not torch.equal(keyed_output(plain, x, step=4), keyed_output(plain, x))


def one_stage_engine(keyed_rng: bool, microbatches: int = 2, **kwargs: float) -> PipelineEngine:
    """The whole dropout body as one stage: an engine that runs without a process group."""
    body = dropout_body()
    return PipelineEngine(
        sub_sequential(body, range(len(body))),
        PipelineView(position=0, ranks=(0,), stages=((0,),)),  # one position, one pipeline
        build_1f1b(1, microbatches),
        inputs_fn=lambda mb: mb[0],
        loss_fn=lambda out, mb: F.mse_loss(out, mb[1]),
        device=CPU,
        keyed_rng=keyed_rng,
        seed=5,
        **kwargs,
    )


def test_shares_of_the_global_microbatches() -> None:
    assert microbatch_shares(4, 2) == [range(0, 2), range(2, 4)]
    assert microbatch_shares(4, 1) == [range(0, 4)]
    assert microbatch_shares(4, 3) == [range(0, 2), range(2, 3), range(3, 4)]  # unequal: the first runs more
    with pytest.raises(ValueError, match="5 pipelines cannot share 4 global micro-batches"):
        microbatch_shares(4, 5)


def test_a_pipeline_running_stages_fused_runs_fewer_microbatches() -> None:
    """Equal pipelines split evenly, as before shapes existed; a pipeline whose survivor runs two stages fused
    (one position two stages wide, after a failover) gets fewer, so it does not hold the job back."""
    fused = failover(initial(2, range(6)), [3])  # pipeline 1: m2 runs stages 0-1
    assert fused.shapes() == [(2, 1), (1, 2), (2, 1)]
    assert microbatch_shares(6, 3, initial(2, range(6)).shapes()) == microbatch_shares(6, 3)
    shares = microbatch_shares(12, 3, fused.shapes())
    assert shares == [range(0, 5), range(5, 8), range(8, 12)]

    def step(counts: list[int]) -> int:  # stage-times of the slowest pipeline's 1F1B step
        return max((m + n - 1) * w for m, (n, w) in zip(counts, fused.shapes()))

    assert step([len(r) for r in shares]) == 6 < step([4, 4, 4]) == 8
    with pytest.raises(ValueError, match=r"shapes must give \(positions >= 1, widest >= 1\) for each of 3"):
        microbatch_shares(6, 3, [(1, 1)] * 2)


@pytest.mark.parametrize("pipelines", [1, 2, 4])
def test_any_number_of_pipelines_draws_the_masks_and_gradient_of_one(pipelines: int) -> None:
    """The global batch cut into 4 micro-batches: one pipeline running all 4, or ``pipelines`` pipelines
    each running its share (3: unequal, 2 + 1 + 1, each loss divided by 4/3) with their gradients averaged as
    the stage groups average them, give the same gradient and loss terms: the masks follow the global
    micro-batch, not the pipeline. (Keyed by pipeline and local micro-batch, they differ.)"""
    batch = make_data(8)
    whole = one_stage_engine(True, 4)
    whole.run_step(split_microbatches(batch, 4), step=3)
    expected = [p.grad for p in whole.stage.parameters()]
    parts = split_microbatches(batch, 4)
    summed = [torch.zeros_like(g) for g in expected]
    for share in microbatch_shares(4, pipelines):
        engine = one_stage_engine(True, len(share), first_microbatch=share.start, loss_divisor=4 / pipelines)
        engine.run_step(parts[share.start : share.stop], step=3)
        for total, p in zip(summed, engine.stage.parameters(), strict=True):
            total += p.grad
    torch.testing.assert_close([g / pipelines for g in summed], expected, rtol=1e-13, atol=1e-15)
    # the old key (pipeline, its own micro-batch index): pipeline 1's first micro-batch drew pipeline 0's
    engine = one_stage_engine(True, 2, first_microbatch=0, loss_divisor=2)
    engine.run_step(parts[2:], step=3)
    second = one_stage_engine(True, 2, first_microbatch=2, loss_divisor=2)
    second.run_step(parts[2:], step=3)
    assert not torch.equal(next(engine.stage.parameters()).grad, next(second.stage.parameters()).grad)


def test_engine_keys_each_step_and_leaves_the_global_stream_alone() -> None:
    engine = one_stage_engine(keyed_rng=True)
    microbatches = split_microbatches(make_data(8), 2)
    torch.manual_seed(3)
    expected_draw = torch.rand(3)
    torch.manual_seed(3)
    first = engine.run_step(microbatches)  # step 0
    grads = [p.grad.clone() for p in engine.stage.parameters()]
    assert engine.rng_step == 0
    assert torch.equal(torch.rand(3), expected_draw)
    torch.manual_seed(99)
    engine.stage.zero_grad(set_to_none=True)
    assert torch.equal(engine.run_step(microbatches, step=0), first)  # the same step again: the same masks
    assert all(torch.equal(p.grad, g) for p, g in zip(engine.stage.parameters(), grads, strict=True))
    assert not torch.equal(engine.run_step(microbatches), first)  # step 1: other masks
    assert engine.rng_step == 1


def test_engine_without_keys_draws_from_the_global_generator() -> None:
    engine = one_stage_engine(keyed_rng=False)
    assert engine.keyed_stage is None
    microbatches = split_microbatches(make_data(8), 2)
    torch.manual_seed(3)
    first = engine.run_step(microbatches)
    torch.manual_seed(3)
    assert torch.equal(engine.run_step(microbatches, step=5), first)  # the step plays no part
    torch.manual_seed(4)
    assert not torch.equal(engine.run_step(microbatches), first)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fr_equals_f_with_dropout(pipe_bamboo_2: dict[str, Path]) -> None:
    """2 stages, Dropout(0.5) on both: every FR equals its successor's F bit for bit, every step; and
    dropout is on (the losses differ from the same model without it)."""
    run = pipe_bamboo_2["dropout"]
    for step in range(1, STEPS + 1):
        ranks = [snapshot(run, step, rank) for rank in range(2)]
        for rank, got in enumerate(ranks):
            twin = ranks[(rank + 1) % 2]
            fr = {k: v for k, v in got.items() if k.startswith("fr/")}
            assert len(fr) == 2
            for key, value in fr.items():
                assert torch.equal(value, twin["fwd/" + key[3:]]), f"step {step} rank {rank} {key}"
        plain = snapshot(pipe_bamboo_2["2stages-redundant-sgd"], step, 0)  # the same model, no dropout
        assert not torch.equal(ranks[0]["loss"], plain["loss"]), f"step {step}: dropout drew nothing"


def elastic_finals(out: Path) -> dict[str, Tensor]:
    """The finished members' stages (parameters and optimizer state) of a ``train_elastic.py`` run, merged."""
    from tests.bamboo.test_elastic import STEPS as ELASTIC_STEPS

    merged: dict[str, Tensor] = {}
    paths = sorted(out.glob("final_member*.safetensors"))
    assert paths, f"no member finished: {sorted(p.name for p in out.iterdir())}"
    for path in paths:
        state = load_file(str(path))
        assert int(state.pop("global_step")) == ELASTIC_STEPS
        merged.update(state)
    return merged


def assert_bitwise_equal(got: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert set(got) == set(expected)
    differ = [key for key in expected if not torch.equal(got[key], expected[key])]
    assert not differ, f"differ from the uninterrupted run: {differ}"


@pytest.fixture(scope="module")
def uninterrupted_dropout(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tensor]:
    """The uninterrupted elastic run of ``WithDropout`` on 3 members (3 stages), seed 0."""
    from tests.bamboo.test_elastic import run_elastic

    out = tmp_path_factory.mktemp("elastic-dropout")
    run_elastic(out, nproc=3, stages=3, extra_args=("--variant", "dropout"))
    return elastic_finals(out)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_failover_with_dropout_equals_the_uninterrupted_run(
    tmp_path: Path, uninterrupted_dropout: dict[str, Tensor], elastic_reference: dict[str, Tensor]
) -> None:
    """Member 1 (stage 1 of 3) is SIGKILLed in step 2's forward; member 0 replays the step with stages 0-1
    fused (each layer still keyed by its index in the body) and trains on: every parameter and optimizer
    state ends bit for bit where the uninterrupted run ends. (With one key for the fused position, it does
    not.)"""
    from tests.bamboo.test_elastic import launched, run_elastic

    run_elastic(tmp_path, nproc=3, stages=3, fault="1:2:forward", extra_args=("--variant", "dropout"))
    record = launched(tmp_path)
    assert record.summary() == [("failover", [1])] and record.grids() == [[[0, 0, 2]]]
    assert_bitwise_equal(elastic_finals(tmp_path), uninterrupted_dropout)
    # dropout was on: the same model without it (strategy="auto") ends elsewhere
    first = "own/pipeline.0.weight"
    assert (uninterrupted_dropout[first] - elastic_reference[first]).abs().max() > 1e-3


@pytest.mark.multiprocess
@pytest.mark.slow
def test_checkpoint_fallback_with_dropout_equals_the_uninterrupted_run(
    tmp_path: Path, uninterrupted_dropout: dict[str, Tensor]
) -> None:
    """Members 1 and 2 die together in step 5: member 0 alone loads the last checkpoint, re-runs the steps
    since it (keyed by their own step numbers) with all three stages fused, replays step 5: bit for bit the
    uninterrupted run."""
    from tests.bamboo.test_elastic import launched, run_elastic
    from tests.bamboo.test_elastic_fallback import loaded_step

    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    args = ("--variant", "dropout", "--checkpoint-every", "2", "--checkpoint-dir", str(ckpt), "--events")
    run_elastic(out, nproc=3, stages=3, fault="1+2:5:exchange", extra_args=args)
    record = launched(out)
    assert record.summary() == [("fallback", [1, 2])] and record.grids() == [[[0, 0, 0]]]
    (fallback,) = worker_events(out, 0, "on_fallback")
    assert loaded_step(fallback) in (2, 4) and fallback["step"] == 5
    assert_bitwise_equal(elastic_finals(out), uninterrupted_dropout)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_another_layout_draws_the_same_masks(
    tmp_path: Path, uninterrupted_dropout: dict[str, Tensor]
) -> None:
    """The same run on 2 members as 2 stages (L T D L | T D L T D L) ends bit for bit where the 3-stage run
    ends: the masks depend on the layers, not on how the body is cut into stages."""
    from tests.bamboo.test_elastic import run_elastic

    run_elastic(tmp_path, nproc=2, stages=2, extra_args=("--variant", "dropout"))
    assert_bitwise_equal(elastic_finals(tmp_path), uninterrupted_dropout)


def test_a_device_without_per_device_generators_is_refused() -> None:
    expected = r"per-device generators \(cpu, cuda, xpu\), got 'mps'; turn them off \(keyed_rng=False\)"
    with pytest.raises(ValueError, match=expected):
        KeyedForward(nn.Linear(2, 2), 0, torch.device("mps"), 0)



def _two_by_two_dropout(out: Path, fault: str = "") -> tuple[dict[str, Tensor], str]:
    """2 stages x 2 pipelines of ``WithDropout`` (2 micro-batches each: 4 global micro-batches), a ledger."""
    from tests.bamboo.test_elastic import run_elastic

    args = ("--variant", "dropout", "--ledger", str(out / "ledger.jsonl"))
    log = run_elastic(out, nproc=4, stages=2, fault=fault, extra_args=args)
    return elastic_finals(out), log


@pytest.fixture(scope="module")
def uninterrupted_2x2(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Tensor], Path]:
    """The uninterrupted 2x2 run with dropout: its final state and its ledger."""
    out = tmp_path_factory.mktemp("uninterrupted-2x2")
    return _two_by_two_dropout(out)[0], out / "ledger.jsonl"


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("fault", ["2+3:3:applied", "2+3:2:forward"])
def test_losing_a_whole_pipeline_with_dropout_equals_the_uninterrupted_run(
    tmp_path: Path, uninterrupted_2x2: tuple[dict[str, Tensor], Path], fault: str
) -> None:
    """Both members of pipeline 1 are SIGKILLed together (two machines of one pipeline reclaimed): after
    step 3 applied (the step committed; pipeline 1's ledger reports of it never come), or in step 2's forward
    (the step aborts and pipeline 0 replays it alone on the whole global batch: 4 micro-batches). The
    survivor runs the same global micro-batches, keyed as before, so the final parameters and optimizer state
    equal the uninterrupted 2x2 run's (to rounding: one pipeline sums the micro-batches' gradients in another
    order than two pipelines and an all-reduce; with pipeline-keyed masks they were 1e-2 apart, issue 28),
    and the ledger keeps pipeline 1's samples of every step: ``verify`` calls the runs the same."""
    from tests.bamboo.test_elastic import TOL

    reference, reference_ledger = uninterrupted_2x2
    from tests.bamboo.test_elastic import launched

    got, log = _two_by_two_dropout(tmp_path, fault)
    assert launched(tmp_path).summary() == [("failover", [2, 3])], log[-3000:]
    assert set(got) == set(reference)
    for key, value in reference.items():
        torch.testing.assert_close(got[key], value, **TOL, msg=lambda m, k=key: f"{k}: {m}")
    ledger = tmp_path / "ledger.jsonl"
    lines = [json.loads(line) for line in ledger.read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(6))
    assert all(sorted(line["samples"]) == ["0", "1"] for line in lines if line["generation"] == 0)
    assert len(lines[-1]["owners"]["pipelines"]) == 1
    cmd = [sys.executable, "-m", "lightning_bamboo.verify", str(reference_ledger), str(ledger)]
    result = run_process(cmd, timeout=60)
    assert "the ledgers are the same: 6 steps" in result.stdout, result.stdout
