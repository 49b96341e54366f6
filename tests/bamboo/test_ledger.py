"""Exactly-once data: ``BambooLedger`` records every committed step, ``python -m lightning_bamboo.verify``
compares two runs. Multi-process runs (float64): a mid-epoch resume consumes every sample once and is
bit-exact against the uninterrupted run; a parameter perturbed at step K is named at step K; an elastic
run with a SIGKILLed member equals the uninterrupted one in samples and parameter digests."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lightning_bamboo.verify import main as verify
from lightning_bamboo.verify import rounding_distance
from tests.bamboo.launch import run_script
from tests.process import run_process

EPOCHS, SAMPLES, BATCH = 3, 20, 4  # 5 steps an epoch


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_mid_epoch_resume_consumes_every_sample_once_and_is_exact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One launch of 2 ranks, eight Trainers: the uninterrupted 3 epochs (2 stages); a run stopped at step 9
    with a checkpoint at step 7 (epoch 1, batch 2); a resume from that checkpoint appending to the same
    ledger (its lines 7 and 8 re-trained); the same stop and resume with a configure_optimizers that reads
    estimated_stepping_batches; a run perturbed before step 5; and the stop/resume again from 2 pipelines
    of 1 stage to 1 pipeline of 2 stages (the position carried over in samples)."""
    ckpt = tmp_path / "ckpt"
    cases = {
        "reference": ["--ledger", str(tmp_path / "reference.jsonl")],
        "first": ["--ledger", str(tmp_path / "resumed.jsonl"), "--max-steps", "9", "--checkpoint-every", "7",
                  "--checkpoint-dir", str(ckpt)],
        "resume": ["--ledger", str(tmp_path / "resumed.jsonl"), "--resume", str(ckpt / "step=7.ckpt")],
        "perturbed": ["--ledger", str(tmp_path / "perturbed.jsonl"), "--perturb-at", "5"],
        # the same stop and resume with configure_optimizers reading estimated_stepping_batches
        "estimate-first": ["--ledger", str(tmp_path / "estimate.jsonl"), "--max-steps", "9", "--estimate",
                           "--checkpoint-every", "7", "--checkpoint-dir", str(tmp_path / "ckpt3")],
        "estimate-resume": ["--ledger", str(tmp_path / "estimate.jsonl"), "--estimate",
                            "--resume", str(tmp_path / "ckpt3" / "step=7.ckpt")],
        # 2 pipelines x 2 samples (each its DistributedSampler shard), resumed as 1 pipeline x 4 samples
        "pipelines": ["--ledger", str(tmp_path / "pipelines.jsonl"), "--stages", "1", "--batch-size", "2",
                      "--max-steps", "9", "--checkpoint-every", "7",
                      "--checkpoint-dir", str(tmp_path / "ckpt2")],
        "one-pipeline": ["--ledger", str(tmp_path / "pipelines.jsonl"),
                         "--resume", str(tmp_path / "ckpt2" / "step=7.ckpt")],
    }
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    run_script("train_ledger.py", ["--cases", str(tmp_path / "cases.json")], timeout=240, nprocs=2)

    resumed = _lines(tmp_path / "resumed.jsonl")
    assert [line["step"] for line in resumed] == list(range(EPOCHS * SAMPLES // BATCH))
    for epoch in range(EPOCHS):  # every sample exactly once in every epoch, across the resume
        seen = [i for line in resumed if line["epoch"] == epoch for i in line["samples"]["0"]]
        assert sorted(seen) == list(range(SAMPLES)), f"epoch {epoch}: {seen}"
    reference = _lines(tmp_path / "reference.jsonl")
    assert [line["samples"] for line in reference[5:]] != [line["samples"] for line in reference[:-5]]

    assert verify([str(tmp_path / "reference.jsonl"), str(tmp_path / "resumed.jsonl")]) == 0
    assert "the ledgers are the same: 15 steps (steps 0..14), samples and parameter digests" in (
        capsys.readouterr().out
    )
    # Lightning alone would start epoch 1 again here (its loaders were built before the restore, #20550)
    assert verify([str(tmp_path / "reference.jsonl"), str(tmp_path / "estimate.jsonl")]) == 0
    capsys.readouterr()
    assert verify([str(tmp_path / "reference.jsonl"), str(tmp_path / "perturbed.jsonl")]) == 1
    out = capsys.readouterr().out
    assert "the ledgers differ first at step 5:" in out and "stage 1 parameters differ" in out
    assert "samples differ" not in out

    pipelines = _lines(tmp_path / "pipelines.jsonl")
    assert [sorted(line["samples"]) for line in pipelines] == [["0", "1"]] * 7 + [["0"]] * 8
    assert all(len(samples) == 2 for line in pipelines[:7] for samples in line["samples"].values())
    assert not any("mismatch" in line for line in pipelines)  # both pipelines held the same bytes
    # the same global batches as the one-pipeline reference, across the change of pipelines
    reference_and_pipelines = [str(tmp_path / "reference.jsonl"), str(tmp_path / "pipelines.jsonl")]
    assert verify([*reference_and_pipelines, "--samples-only"]) == 0


def _elastic(out: Path, fault: str, nproc: int = 2, extra: tuple[str, ...] = (), stages: int = 2) -> Path:
    from tests.bamboo.test_elastic import run_elastic

    ledger = out / "ledger.jsonl"
    run_elastic(out, nproc=nproc, stages=stages, fault=fault, extra_args=("--ledger", str(ledger), *extra))
    return ledger


@pytest.mark.multiprocess
@pytest.mark.slow
def test_elastic_failovers_keep_samples_and_parameters(tmp_path: Path) -> None:
    """Three elastic jobs at once (2 members, 2 stages, 6 steps): uninterrupted; member 1 SIGKILLed in the
    forward of step 2 (the step is aborted and replayed on member 0 alone); member 0, the ledger's writer,
    SIGKILLed after the commit of step 3 (member 1 rolls the step forward, becomes rank 0 and writes step 3
    from the reports left in the store). All three ledgers are the same, samples and digests."""
    runs = {"plain": "", "lost-stage1": "1:2:forward", "lost-writer": "0:3:commit"}
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = {name: pool.submit(_elastic, tmp_path / name, fault) for name, fault in runs.items()}
        ledgers = {name: future.result() for name, future in futures.items()}
    generations = {name: [line["generation"] for line in _lines(path)] for name, path in ledgers.items()}
    assert generations == {
        "plain": [0] * 6, "lost-stage1": [0, 0, 1, 1, 1, 1], "lost-writer": [0, 0, 0, 0, 1, 1]
    }
    assert _lines(ledgers["lost-stage1"])[2]["owners"]["pipelines"] == {"0": {"0": 0, "1": 0}}
    for name in ("lost-stage1", "lost-writer"):
        cmd = [sys.executable, "-m", "lightning_bamboo.verify", str(ledgers["plain"]), str(ledgers[name])]
        assert "the ledgers are the same: 6 steps" in run_process(cmd, timeout=60).stdout


# ---------------------------------------------------------------------- verify alone (no processes)
def _write(path: Path, steps: list[dict]) -> Path:
    path.write_text("".join(json.dumps(s) + "\n" for s in steps))
    return path


def _step(step: int, samples: list[int], digest: str = "aa") -> dict:
    return {"step": step, "epoch": 0, "samples": {"0": samples[:2], "1": samples[2:]},
            "generation": None, "owners": None, "digests": {"0": digest, "1": "bb"}}


def test_verify_names_the_first_differing_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = _step(0, [1, 2, 3, 4])
    a = _write(tmp_path / "a.jsonl", [first, _step(1, [5, 6, 7, 8]), _step(2, [9, 10, 11, 0])])
    b = _write(tmp_path / "b.jsonl", [first, _step(1, [5, 6, 7, 12]), _step(2, [9, 10, 11, 8])])
    assert verify([str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "differ first at step 1:" in out and "only in " in out and "[8] (1)" in out and "[12] (1)" in out
    # the same global batch, split otherwise between pipelines and in another order, is the same step
    regrouped = _step(0, [1, 2, 3, 4])
    regrouped["samples"] = {"0": [3, 1, 4, 2]}
    c = _write(tmp_path / "c.jsonl", [regrouped])
    d = _write(tmp_path / "d.jsonl", [_step(0, [1, 2, 3, 4], digest="cc")])
    assert verify([str(c), str(d)]) == 1
    assert "stage 0 parameters differ: " in capsys.readouterr().out
    assert verify([str(c), str(d), "--samples-only"]) == 0
    assert "the ledgers are the same: 1 steps (steps 0..0), samples" in capsys.readouterr().out
    twice = _write(tmp_path / "twice.jsonl", [_step(0, [1, 2, 3, 3])])
    assert verify([str(c), str(twice)]) == 1
    assert "only in " in (out := capsys.readouterr().out) and "[4] (1)" in out and "[3] (1)" in out
    e = _write(tmp_path / "e.jsonl", [_step(0, [1, 2, 3, 4])])
    assert verify([str(e), str(a)]) == 1
    assert "differ first at step 1:\n  the step is in " in capsys.readouterr().out


def _fingerprinted(step: int, digest: str, sums: list[float], pipelines: int, generation: int) -> dict:
    line = _step(step, [1, 2, 3, 4], digest)
    line["digests"] = {"0": digest}
    line["fingerprints"] = {"0": sums}
    line["generation"] = generation
    line["owners"] = {"generation": generation, "pipelines": {str(p): {"0": p} for p in range(pipelines)}}
    return line


def test_verify_tells_rounding_from_a_different_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Digests that differ where the fingerprints are a few ulps apart (one pipeline summed what two summed
    after a pipeline was lost) are the same parameters, said so with the steps; fingerprints further apart
    than ``--rtol`` are a different model, named with the stage, the distance and each run's pipelines."""
    sums = [1.5, 40.0, 30.0, -2.25]
    ulps = [1.5 + 4e-15, 40.0, 30.0 + 1e-14, -2.25 - 4e-15]
    far = [1.5 + 4e-4, 40.0, 30.0, -2.25]
    a = _write(tmp_path / "a.jsonl", [_fingerprinted(s, "aa", sums, 2, 0) for s in range(4)])
    rounded = [_fingerprinted(s, "aa", sums, 2, 0) for s in range(2)]
    rounded += [_fingerprinted(s, "bb", ulps, 1, 1) for s in range(2, 4)]
    b = _write(tmp_path / "b.jsonl", rounded)
    assert verify([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "the ledgers are the same: 4 steps (steps 0..3)" in out
    distance = rounding_distance(sums, ulps)
    assert f"steps 2..3: parameters equal to rounding (fingerprints at most {distance:.3g} apart)" in out
    assert rounding_distance(sums, ulps) < 1e-15 and rounding_distance(sums, sums) == 0
    assert verify([str(a), str(b), "--rtol", "1e-17"]) == 1
    capsys.readouterr()
    c = _write(tmp_path / "c.jsonl", [*rounded[:3], _fingerprinted(3, "cc", far, 1, 1)])
    assert verify([str(a), str(c)]) == 1
    out = capsys.readouterr().out
    assert "the ledgers differ first at step 3:" in out
    assert "stage 0 parameters differ: " in out
    assert "their fingerprints are 1e-05 apart, more than rounding (--rtol 1e-09)" in out
    assert f"committed by {a} with 2 pipeline(s) in generation 0, {c} with 1 pipeline(s) in generation 1" in (
        out
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"step": 0, "samples": {"0": [1]}, "digests": {}}\n{"step": 1, "samples"', ":2: not JSON"),
        ('[1, 2]\n', ":1: expected a JSON object, got list"),
        ('{"step": "0", "samples": {}, "digests": {}}\n', ":1: field 'step' must be a int, got '0'"),
        ('{"step": 0, "samples": {"0": ["x"]}, "digests": {}}\n', ":1: samples must map a pipeline index"),
        ('{"step": 0, "samples": {}, "digests": {}}\n\n{"step": 0, "samples": {}, "digests": {}}\n',
         ":3: step 0 appears again (first at line 1)"),
    ],
)
def test_verify_names_file_and_line_of_a_malformed_ledger(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, expected: str
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(text)
    good = _write(tmp_path / "good.jsonl", [_step(0, [1, 2, 3, 4])])
    assert verify([str(good), str(bad)]) == 2
    assert f"verify: {bad}{expected}" in capsys.readouterr().err
    assert verify([str(good), str(tmp_path / "missing.jsonl")]) == 2
    assert f"verify: {tmp_path / 'missing.jsonl'}: no such ledger file" in capsys.readouterr().err


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("order", ["permuted", "sequential"])
def test_a_failover_with_tied_weights_is_bit_exact(tmp_path: Path, order: str) -> None:
    """2 stages x 2 pipelines, one weight used on stage 0 and stage 1 (``pipe_variants.Tied``), Adam,
    clipping: member 3 (stage 1 of pipeline 1) is SIGKILLed in step 2 and member 2 then holds both uses. Its
    two copies are summed in the same order as two members' (lightning_bamboo.pipeline.ties) and its clipping
    norm adds the stages' sums as the two members' all-reduce does (lightning_bamboo.step.clipping), so the
    ledgers, samples and parameter digests, equal the uninterrupted run's. Both sample orders: with the
    dataset's own (``sequential``) order, a running sum of the norm over both stages made pipeline 1's
    coefficient of step 3 one ulp off pipeline 0's, and the digests differed from step 4 on."""
    from tests.bamboo.test_elastic import CLIP

    tied = ("--variant", "tied", "--optimizer", "adam", "--clip", str(CLIP), "--order", order)
    runs = {"plain": "", "lost": "3:2:forward"}
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = {name: pool.submit(_elastic, tmp_path / name, f, 4, tied) for name, f in runs.items()}
        ledgers = {name: future.result() for name, future in futures.items()}
    assert _lines(ledgers["lost"])[2]["owners"]["pipelines"]["1"] == {"0": 2, "1": 2}
    cmd = [sys.executable, "-m", "lightning_bamboo.verify", str(ledgers["plain"]), str(ledgers["lost"])]
    out = run_process(cmd, timeout=60).stdout
    # bit for bit: no step "equal to rounding"
    assert out == "the ledgers are the same: 6 steps (steps 0..5), samples and parameter digests\n"
    _check_bit_exact(tmp_path / "plain", tmp_path / "lost")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_failover_fusing_three_tied_stages_into_two_is_bit_exact(tmp_path: Path) -> None:
    """1 pipeline of 3 stages, the tie on stages 0 and 2 (``pipe_variants.Tied``), Adam, clipping, the samples
    in their sequential order: member 2 is SIGKILLed in step 2 and member 1 then holds stages 1 and 2. Its
    clipping norm adds the two stages' sums as the three members' all-reduce of per-stage sums does, so the
    run is bit-exact (a running sum over its two stages was one ulp off the three members' norm: parameters
    up to 6.9e-18 apart at the end, verify's "equal to rounding" from step 4)."""
    from tests.bamboo.test_elastic import CLIP

    tied = ("--variant", "tied", "--optimizer", "adam", "--clip", str(CLIP), "--order", "sequential")
    runs = {"plain": "", "lost": "2:2:forward"}
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = {name: pool.submit(_elastic, tmp_path / name, f, 3, tied, 3) for name, f in runs.items()}
        ledgers = {name: future.result() for name, future in futures.items()}
    assert _lines(ledgers["lost"])[2]["owners"]["pipelines"] == {"0": {"0": 0, "1": 1, "2": 1}}
    cmd = [sys.executable, "-m", "lightning_bamboo.verify", str(ledgers["plain"]), str(ledgers["lost"])]
    out = run_process(cmd, timeout=60).stdout
    assert out == "the ledgers are the same: 6 steps (steps 0..5), samples and parameter digests\n"
    _check_bit_exact(tmp_path / "plain", tmp_path / "lost", finished=2)


def _check_bit_exact(plain: Path, lost: Path, finished: int = 3) -> None:
    """Every parameter and optimizer state tensor each finished member of ``lost`` holds equals, bit for bit,
    the one the uninterrupted ``plain`` run's members hold under that name (``train_elastic.py``'s finals)."""
    import torch
    from safetensors.torch import load_file

    reference: dict[str, torch.Tensor] = {}
    for path in sorted(plain.glob("final_member*.safetensors")):
        reference.update(load_file(str(path)))
    finals = sorted(lost.glob("final_member*.safetensors"))
    assert len(finals) == finished, finals
    for path in finals:
        for key, value in load_file(str(path)).items():
            torch.testing.assert_close(value, reference[key], rtol=0, atol=0,
                                       msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("shuffle", ["no", "yes", "generator", "persistent"])
def test_a_one_process_run_records_the_samples_it_trains_on(tmp_path: Path, shuffle: str) -> None:
    """``strategy="auto"``: the ledger's samples of every step (3 epochs of 3 batches) are the dataset indices
    the training step really received, for an unshuffled loader, ``shuffle=True`` (the global generator), a
    seeded ``generator=`` and persistent workers; no stage digests."""
    import torch
    from lightning.pytorch import Trainer, seed_everything
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_bamboo.ledger import BambooLedger
    from tests.bamboo.test_data_order import Recorder

    seed_everything(0)
    model = Recorder()
    data = TensorDataset(torch.randn(12, 2), torch.randn(12), torch.arange(12))
    generator = torch.Generator().manual_seed(3) if shuffle == "generator" else None
    workers = {"num_workers": 1, "persistent_workers": True} if shuffle == "persistent" else {}
    loader = DataLoader(data, batch_size=4, shuffle=shuffle != "no", generator=generator, **workers)
    ledger = tmp_path / "ledger.jsonl"
    Trainer(max_epochs=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[BambooLedger(ledger)]).fit(model, loader)
    lines = _lines(ledger)
    assert [i for line in lines for i in line["samples"]["0"]] == model.seen
    assert [line["step"] for line in lines] == list(range(9)) and all(not line["digests"] for line in lines)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_verify_compares_bamboo_with_a_one_process_run(tmp_path: Path) -> None:
    """The same script (``shuffle=True`` after ``seed_everything``, 2 epochs) under ``strategy="auto"`` and
    under Bamboo (2 stages): ``verify`` finds the same samples at every step (the one-process ledger has no
    stage digests; the parameters are compared with ``check_final``, float64); a Bamboo run of another
    order is told apart."""
    from tests.bamboo.conftest import _elastic_reference
    from tests.bamboo.test_elastic import check_final

    shuffled = ("--shuffle", "yes", "--epochs", "2")
    reference = _elastic_reference(tmp_path / "auto", *shuffled, "--ledger", str(tmp_path / "auto.jsonl"))
    bamboo = _elastic(tmp_path / "bamboo", "", extra=shuffled)
    check_final(tmp_path / "bamboo", reference)
    out = run_process([sys.executable, "-m", "lightning_bamboo.verify", str(tmp_path / "auto.jsonl"),
                       str(bamboo)], timeout=60).stdout
    assert "the ledgers are the same: 6 steps (steps 0..5), samples (" in out
    assert "a one-process run, no stage digests to compare" in out
    other = _elastic(tmp_path / "unshuffled", "", extra=("--epochs", "2"))
    assert verify([str(tmp_path / "auto.jsonl"), str(other)]) == 1
