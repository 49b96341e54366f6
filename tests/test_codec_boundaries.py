"""Each boundary of both packages on :mod:`lbd_common.codec`: the nested structures it sends come back exactly
(every allowed dtype, empty and 0-dim tensors), over real collectives too, and a malformed header is refused
with an error naming the boundary, before anything is sized from it."""

from __future__ import annotations

import json
import sys
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lbd_common import codec
from lbd_common.broadcast import encode_json, encode_object
from lightning_bamboo.checkpoint.layers import describe, gather, materialize
from lightning_bamboo.pipeline.replica import follow_schema, hyperparameter_schema
from lightning_bamboo.pipeline.transfers import BoundaryLayout
from lightning_bamboo.step.broadcast import _describe, _rebuild, _specs
from lightning_dorylus.predict import _check_headers, _header
from tests.process import REPO, run_ranks


def broadcast_header(obj: object) -> bytes:
    """What ``DorylusStrategy.broadcast``'s source sends first (``b""``: every rank raises)."""
    return encode_object(obj, "DorylusStrategy.broadcast")


Pair = namedtuple("Pair", ["x", "mask"])


def nested_batch() -> dict[Any, Any]:
    """A batch as the Bamboo broadcast carries it: every allowed dtype, 0-dim and empty tensors, in dicts
    (str and int keys), lists, tuples and namedtuples, with JSON scalars beside them."""
    g = torch.Generator().manual_seed(3)
    by_dtype = {
        codec.dtype_name(dtype): (torch.randn(2, 3, generator=g, dtype=torch.float64) * 100).to(dtype)
        for dtype in codec.DTYPES
    }
    return {
        "by_dtype": by_dtype,
        "pair": Pair(torch.randn(3, 2, generator=g, dtype=torch.float64), torch.tensor([True, False, True])),
        "scalars": [torch.tensor(7, dtype=torch.int32), torch.tensor(0.5, dtype=torch.bfloat16)],
        "empty": (torch.zeros(0, 4), torch.zeros(2, 0, dtype=torch.int64)),
        "meta": ("name", 3, 0.5, None, True),
        1: [[torch.arange(4)], {"deep": (torch.ones(1, 1, 1, dtype=torch.float16),)}],
    }


def assert_same_batch(got: Any, expected: Any) -> None:
    """Same structure (container types included), same tensors bit for bit, same scalars."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype and got.shape == expected.shape
        assert torch.equal(got, expected)
        return
    assert type(got) is type(expected), (type(got), type(expected))
    if isinstance(expected, dict):
        assert list(got) == list(expected)
        for key in expected:
            assert_same_batch(got[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            assert_same_batch(a, b)
    else:
        assert got == expected


def _over_the_wire(batch: Any) -> tuple[Any, torch.Tensor]:
    """What broadcast_batch's source sends: the JSON tree (as broadcast_json encodes it) and the buffer."""
    tensors: list[torch.Tensor] = []
    tree = json.loads(codec.json_bytes(encode_json(_describe(batch, tensors), "BambooStrategy.broadcast")))
    return tree, codec.pack(tensors)


def test_broadcast_batch_tree_rebuilds_every_dtype_and_container() -> None:
    batch = nested_batch()
    tree, buffer = _over_the_wire(batch)
    specs: list[codec.Spec] = []
    _specs(tree, specs)
    assert codec.spans(specs)[1] == buffer.numel()  # the receiver sizes its buffer from the tree alone
    offset = [0]
    assert_same_batch(_rebuild(tree, buffer, offset, batch), batch)
    assert offset[0] == buffer.numel()


@pytest.mark.parametrize(
    ("tree", "match"),
    [
        ({"t": ["complex64", [2]]}, r"corrupt batch header: unknown dtype 'complex64'"),
        ({"t": ["float32", [-2]]}, r"corrupt batch header: shape \[-2\] is not a list"),
        ({"x": 1}, r"corrupt batch header: node .* is not one of"),
        ({"l": 3}, r"corrupt batch header: 'l' holds 3, not a list"),
        ({"d": [["a"]]}, r"corrupt batch header: dict items"),
        ([1, 2], r"corrupt batch header: node \[1, 2\]"),
    ],
    ids=str,
)
def test_broadcast_batch_refuses_a_malformed_tree(tree: Any, match: str) -> None:
    with pytest.raises(codec.MalformedHeader, match=match):
        _specs(tree, [])


def test_broadcast_batch_refuses_a_buffer_shorter_than_its_tree() -> None:
    tree, buffer = _over_the_wire({"x": torch.zeros(4, dtype=torch.float64)})
    with pytest.raises(codec.MalformedHeader, match=r"corrupt batch: a float64 tensor of shape \[4\] needs"):
        _rebuild(tree, buffer[:8], [0], None)


def test_broadcast_batch_refuses_a_dtype_outside_the_allow_list_at_the_source() -> None:
    with pytest.raises(TypeError, match=r"cannot send a tensor of dtype torch.complex64 from stage 0"):
        _describe({"z": torch.zeros(2, dtype=torch.complex64)}, [])


def test_stage_boundary_layout_with_empty_and_0_dim_tensors() -> None:
    value = (torch.tensor(2.5, dtype=torch.float64), torch.zeros(0, 3), torch.ones(2, dtype=torch.bool))
    layout = BoundaryLayout.of(value, grads=False)
    assert BoundaryLayout.from_bytes(layout.to_bytes()) == layout
    back = layout.rebuild(layout.unpack(layout.pack(list(value))))
    assert_same_batch(back, value)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b'["tuple", [], ["nn"], [[1]], [false]]', r"corrupt boundary layout: unknown dtype 'nn'"),
        (b'["tuple", [], ["float32"], [[-1]], [false]]', r"corrupt boundary layout: shape \[-1\]"),
        (b'["tuple", [], ["float32"], [], [false]]', r"corrupt boundary layout: \['tuple'"),
        (b'["set", [], [], [], []]', r"corrupt boundary layout: \['set'"),
        (b'{"kind": "tuple"}', r"corrupt boundary layout: \{'kind'"),
        (b"\x80", r"corrupt boundary layout: not JSON"),
    ],
    ids=str,
)
def test_stage_boundary_refuses_a_malformed_layout(data: bytes, match: str) -> None:
    with pytest.raises(RuntimeError, match=match):
        BoundaryLayout.from_bytes(data)


def _layer_with_state() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(3, 2).double(), nn.BatchNorm1d(2).double())
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1)
    layer(torch.randn(4, 3, dtype=torch.float64)).square().sum().backward()
    optimizer.step()  # state: 0-dim float32 ``step``, float64 moments; BatchNorm's int64 0-dim counter
    return layer, optimizer


def _moved(desc: dict[str, Any], tensors: list[torch.Tensor]) -> Any:
    """``materialize`` into a fresh template from ``desc`` (as JSON) and ``tensors`` (as if received)."""
    template = nn.Sequential(nn.Linear(3, 2).double(), nn.BatchNorm1d(2).double())
    sent = iter(tensors)

    def fetch(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = next(sent)
        assert tensor.dtype == dtype and tuple(tensor.shape) == shape
        return tensor.detach().clone()

    return materialize(template, json.loads(json.dumps(desc)), fetch, torch.device("cpu"))


def test_layer_description_round_trips_parameters_buffers_and_optimizer_state() -> None:
    layer, optimizer = _layer_with_state()
    (held,) = gather({0: layer}, optimizer).values()
    desc, tensors = describe(held)
    got = _moved(desc, tensors)
    assert_same_batch(dict(got.module.state_dict()), dict(layer.state_dict()))
    assert set(got.state) == set(held.state)
    for name, values in held.state.items():
        assert_same_batch(got.state[name], values)
    # a description written before the codec (dtypes as "torch.float64") still loads: checkpoints on disk
    old = json.loads(json.dumps(desc).replace('"float', '"torch.float').replace('"int64"', '"torch.int64"'))
    assert '"torch.float64"' in json.dumps(old)
    assert_same_batch(dict(_moved(old, tensors).module.state_dict()), dict(layer.state_dict()))


def test_layer_description_refuses_an_unknown_dtype_or_shape() -> None:
    layer, optimizer = _layer_with_state()
    desc, tensors = describe(next(iter(gather({0: layer}, optimizer).values())))
    forged = json.loads(json.dumps(desc))
    forged["params"][0][1] = "Tensor"
    with pytest.raises(codec.MalformedHeader, match=r"corrupt layer description: unknown dtype 'Tensor'"):
        _moved(forged, tensors)
    forged = json.loads(json.dumps(desc))
    forged["buffers"][0][2] = [2.0]
    with pytest.raises(codec.MalformedHeader, match=r"corrupt layer description: shape \[2.0\]"):
        _moved(forged, tensors)


def test_replica_schema_names_tensor_settings_by_the_codec_and_refuses_others() -> None:
    """A tensor learning rate travels in the replica's hyper-parameter schema as a codec spec; a schema
    naming another dtype, or a bad shape, is refused (nothing is looked up on ``torch`` by name)."""
    params = [nn.Parameter(torch.ones(2))]
    stage = torch.optim.SGD(params, lr=torch.tensor(0.1, dtype=torch.float64))
    schema = json.loads(json.dumps(hyperparameter_schema(stage)))
    replica = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    follow_schema(replica, schema)
    assert replica.param_groups[0]["lr"].dtype == torch.float64 and replica.param_groups[0]["lr"].shape == ()
    forged = [
        (["lr", "tensor", [], "nn"], "unknown dtype 'nn'"),
        (["lr", "tensor", [-1], "float64"], "shape"),
    ]
    for entry, match in forged:
        with pytest.raises(codec.MalformedHeader, match=rf"corrupt replica hyper-parameter schema: {match}"):
            follow_schema(torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1), [[entry]])


def test_dorylus_broadcast_and_prediction_headers_use_the_allow_list() -> None:
    assert json.loads(broadcast_header(torch.zeros((), dtype=torch.bfloat16))) == {
        "kind": "tensor", "dtype": "bfloat16", "shape": []
    }
    assert broadcast_header(torch.zeros(2, dtype=torch.complex64)) == b""  # every rank raises
    assert broadcast_header(float("nan")) != b""  # a NaN metric is a JSON value here
    rows = torch.zeros(3, 2, dtype=torch.complex64)
    with pytest.raises(ValueError, match=r"predict_step on graph server 0 returned a tensor of shape \(3"):
        _check_headers(_header(rows, 3)[None], [3])
    for dtype in codec.DTYPES:
        _check_headers(_header(torch.zeros(3, 2, dtype=dtype), 3)[None], [3])


@pytest.mark.multiprocess
def test_broadcasts_over_two_gloo_ranks(tmp_path: Path) -> None:
    """broadcast_batch / broadcast_json / all_gather_json between two processes: the receiver gets the
    source's nested batch bit for bit, in its own container types (scripts/codec_ranks.py asserts it)."""
    script = REPO / "tests" / "scripts" / "codec_ranks.py"
    run_ranks([sys.executable, str(script), str(tmp_path)], nprocs=2, timeout=240)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results == [{"batch": "same", "json": "same", "gathered": [0, 1]}] * 2
