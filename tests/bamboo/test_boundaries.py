"""Stage boundaries that carry a tuple or a dict of tensors (a mask, a float without grad, a skip tensor with
grad beside the hidden state).

``scripts/masked_pipe.py`` trains ``MaskedPipe`` (float64) for 3 steps under ``strategy="auto"`` and under
Bamboo with 2 stages (a ``(hidden, mask)`` tuple crosses) and 3 stages (the tuple, then a dict of four
tensors); after every step every stage's parameters must equal auto's, every FR output must equal the
successor's F output bit for bit, and ``trainer.predict`` must return auto's outputs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_bamboo.pipeline.transfers import BoundaryLayout, boundary_tensors
from tests.bamboo.launch import run_script, snapshot

STEPS = 3
TOL = {"rtol": 1e-10, "atol": 1e-12}


@pytest.fixture(scope="module")
def masked_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("masked")
    runs = {"auto": root / "auto", "2": root / "bamboo-2", "3": root / "bamboo-3"}
    run_script("masked_pipe.py", ["--out", str(runs["auto"]), "--strategy", "auto"], timeout=300)
    for stages in (2, 3):
        args = ["--out", str(runs[str(stages)]), "--stages", str(stages)]
        run_script("masked_pipe.py", args, timeout=420, nprocs=stages)
    return runs


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 3])
def test_tuple_and_dict_boundaries_match_auto(masked_runs: dict[str, Path], stages: int) -> None:
    run, ref = masked_runs[str(stages)], masked_runs["auto"]
    for step in range(1, STEPS + 1):
        expected = snapshot(ref, step, 0)
        covered = set()
        ranks = [snapshot(run, step, rank) for rank in range(stages)]
        for rank, got in enumerate(ranks):
            for key in (k for k in got if k.startswith("own/")):
                where = f"step {step} rank {rank} {key}"
                torch.testing.assert_close(got[key], expected[key], **TOL, msg=where)
                covered.add(key)
            successor = ranks[(rank + 1) % stages]
            fr = {k: v for k, v in got.items() if k.startswith("fr/")}
            assert fr and len(fr) == len([k for k in successor if k.startswith("fwd/")])
            for key, value in fr.items():  # FR of the successor's stage equals its F, bit for bit
                assert torch.equal(value, successor["fwd/" + key[3:]]), f"step {step} rank {rank} {key}"
        assert covered == {k for k in expected if k.startswith("own/")}
    # the boundaries really carried several tensors: 2 (tuple) after stage 0; with 3 stages 4 (dict) after 1
    assert len([k for k in snapshot(run, 1, 0) if k.startswith("fwd/0/")]) == 2
    if stages == 3:
        assert len([k for k in snapshot(run, 1, 1) if k.startswith("fwd/0/")]) == 4
    reference = load_file(str(ref / "predict_rank0.safetensors"))["outputs"]
    for rank in range(stages):
        got = load_file(str(run / f"predict_rank{rank}.safetensors"))["outputs"]
        torch.testing.assert_close(got, reference, **TOL)


def test_layout_packs_a_dict_and_the_gradients_of_its_grad_tensors() -> None:
    h = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, False, True]] * 2)
    value = {"h": h * 1, "mask": mask, "scale": torch.ones(2, dtype=torch.float32)}
    layout = BoundaryLayout.of(value, grads=True)
    assert layout.grads == (True, False, False) and layout.keys == ("h", "mask", "scale")
    assert BoundaryLayout.from_bytes(layout.to_bytes()) == layout  # JSON, nothing pickled
    buffer = layout.pack(list(value.values()))
    assert buffer.dtype == torch.uint8 and buffer.numel() == layout.nbytes()
    back = layout.rebuild(layout.unpack(buffer))
    assert list(back) == ["h", "mask", "scale"]
    for key, tensor in back.items():
        assert torch.equal(tensor, value[key].detach()) and tensor.dtype == value[key].dtype
        assert tensor.storage_offset() == 0  # its own storage: aligned like a tensor received alone
    grad = torch.randn(2, 3, dtype=torch.float64)
    (unpacked,) = layout.unpack(layout.pack([grad], gradients=True), gradients=True)
    assert torch.equal(unpacked, grad)
    assert BoundaryLayout.of(value, grads=False).grads == (False, False, False)  # evaluation: no gradients


def test_boundary_refuses_nested_or_non_tensor_values() -> None:
    assert boundary_tensors((torch.zeros(1), torch.ones(1)))[0] == "tuple"
    match = r"got a tuple holding Tensor, tuple: a stage boundary carries one tensor"
    with pytest.raises(TypeError, match=match):
        boundary_tensors((torch.zeros(1), (torch.zeros(1),)))
    with pytest.raises(TypeError, match=r"got a dict: a stage boundary carries one tensor"):
        boundary_tensors({})
