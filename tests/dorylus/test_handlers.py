"""The numpy tensor-op handlers against torch references (forward) and torch.autograd (backward)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch_geometric.utils import softmax as pyg_softmax

from lightning_dorylus import wire
from lightning_dorylus.ops import bundle, handlers


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


def _run(op: str, attrs: dict | None = None, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
    out = handlers.run_op(op, {k: _np(v) for k, v in inputs.items()}, attrs or {})
    return {k: torch.from_numpy(v) for k, v in out.items()}


_ACT = {"relu": F.relu, "elu": F.elu, "none": lambda t: t}


@pytest.mark.parametrize("activation", ["relu", "elu", "none"])
@pytest.mark.parametrize("has_bias", [True, False])
def test_apply_vertex_matches_autograd(activation: str, has_bias: bool) -> None:
    g = torch.Generator().manual_seed(0)
    z = torch.randn(37, 11, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(11, 7, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(7, dtype=torch.float64, generator=g, requires_grad=True)
    h = _ACT[activation](z @ w + b if has_bias else z @ w)
    grad_h = torch.randn_like(h)
    h.backward(grad_h)

    bias = {"bias": b} if has_bias else {}
    fwd = _run("apply_vertex.forward", {"activation": activation}, z=z, weight=w, **bias)
    torch.testing.assert_close(fwd["h"], h.detach())
    bwd = _run("apply_vertex.backward", {"activation": activation, "has_bias": has_bias},
               z=z, weight=w, h=fwd["h"], grad_h=grad_h)
    torch.testing.assert_close(bwd["grad_z"], z.grad)
    torch.testing.assert_close(bwd["grad_weight"], w.grad)
    if has_bias:
        torch.testing.assert_close(bwd["grad_bias"], b.grad)
    else:
        assert "grad_bias" not in bwd


def test_apply_vertex_backward_skips_grad_z_when_not_needed() -> None:
    g = torch.Generator().manual_seed(3)
    z = torch.randn(19, 6, dtype=torch.float64, generator=g)
    w = torch.randn(6, 4, dtype=torch.float64, generator=g, requires_grad=True)
    h = F.relu(z @ w)
    grad_h = torch.randn_like(h)
    h.backward(grad_h)
    attrs = {"activation": "relu", "has_bias": False, "needs_grad_z": False}
    bwd = _run("apply_vertex.backward", attrs, z=z, weight=w, h=h.detach(), grad_h=grad_h)
    assert set(bwd) == {"grad_weight"}
    torch.testing.assert_close(bwd["grad_weight"], w.grad)
    with pytest.raises(ValueError, match=r"needs_grad_z='no' must be true or false"):
        _run("apply_vertex.backward", {**attrs, "needs_grad_z": "no"}, z=z, weight=w, h=h.detach(),
             grad_h=grad_h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtype_is_preserved(dtype: torch.dtype) -> None:
    out = _run("apply_vertex.forward", {"activation": "relu"}, z=torch.randn(4, 3, dtype=dtype),
               weight=torch.randn(3, 2, dtype=dtype), bias=torch.randn(2, dtype=dtype))
    assert out["h"].dtype == dtype


@pytest.mark.parametrize(("heads", "channels"), [(8, 8), (1, 5)])
def test_gat_project_matches_autograd(heads: int, channels: int) -> None:
    g = torch.Generator().manual_seed(1)
    n, fi = 29, 13
    x = torch.randn(n, fi, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(fi, heads * channels, dtype=torch.float64, generator=g, requires_grad=True)
    att_src = torch.randn(heads, channels, dtype=torch.float64, generator=g, requires_grad=True)
    att_dst = torch.randn(heads, channels, dtype=torch.float64, generator=g, requires_grad=True)
    h = x @ w
    a_src = (h.view(n, heads, channels) * att_src).sum(-1)
    a_dst = (h.view(n, heads, channels) * att_dst).sum(-1)
    gh, gs, gd = torch.randn_like(h), torch.randn_like(a_src), torch.randn_like(a_dst)
    torch.autograd.backward([h, a_src, a_dst], [gh, gs, gd])

    fwd = _run("gat.project.forward", x=x, weight=w, att_src=att_src, att_dst=att_dst)
    torch.testing.assert_close(fwd["h"], h.detach())
    torch.testing.assert_close(fwd["alpha_src"], a_src.detach())
    torch.testing.assert_close(fwd["alpha_dst"], a_dst.detach())
    bwd = _run("gat.project.backward", x=x, weight=w, att_src=att_src, att_dst=att_dst, h=fwd["h"],
               grad_h=gh, grad_alpha_src=gs, grad_alpha_dst=gd)
    torch.testing.assert_close(bwd["grad_x"], x.grad)
    torch.testing.assert_close(bwd["grad_weight"], w.grad)
    torch.testing.assert_close(bwd["grad_att_src"], att_src.grad)
    torch.testing.assert_close(bwd["grad_att_dst"], att_dst.grad)
    no_x = _run("gat.project.backward", {"needs_grad_x": False}, x=x, weight=w, att_src=att_src,
                att_dst=att_dst, h=fwd["h"], grad_h=gh, grad_alpha_src=gs, grad_alpha_dst=gd)
    assert "grad_x" not in no_x
    for name in ("grad_weight", "grad_att_src", "grad_att_dst"):
        torch.testing.assert_close(no_x[name], bwd[name])


def ragged_dst_ptr(n: int, seed: int) -> torch.Tensor:
    """In-degrees 0..5 with plenty of 1s (a vertex whose only in-edge is its self loop) and some 0s."""
    g = torch.Generator().manual_seed(seed)
    deg = torch.randint(0, 6, (n,), generator=g)
    deg[::3] = 1
    deg[1] = 0
    deg[-1] = 0
    return torch.cat([torch.zeros(1, dtype=torch.int64), deg.cumsum(0)])


@pytest.mark.parametrize("heads", [8, 1])
@pytest.mark.parametrize("slope", [0.2, 0.01])
def test_apply_edge_matches_pyg_softmax_and_autograd(heads: int, slope: float) -> None:
    g = torch.Generator().manual_seed(2)
    n = 23
    dst_ptr = ragged_dst_ptr(n, seed=3)
    num_edges = int(dst_ptr[-1])
    dst = torch.repeat_interleave(torch.arange(n), dst_ptr.diff())
    # Large scores: a naive exp would overflow; the stable softmax must not.
    a_src_e = (50 * torch.randn(num_edges, heads, dtype=torch.float64, generator=g)).requires_grad_()
    a_dst = (50 * torch.randn(n, heads, dtype=torch.float64, generator=g)).requires_grad_()
    att = pyg_softmax(F.leaky_relu(a_src_e + a_dst[dst], slope), dst, num_nodes=n)
    grad_att = torch.randn_like(att)
    att.backward(grad_att)

    fwd = _run("apply_edge.forward", {"negative_slope": slope}, alpha_src_e=a_src_e, alpha_dst=a_dst,
               dst_ptr=dst_ptr)
    assert torch.isfinite(fwd["attention"]).all()
    torch.testing.assert_close(fwd["attention"], att.detach())
    bwd = _run("apply_edge.backward", {"negative_slope": slope}, alpha_src_e=a_src_e, alpha_dst=a_dst,
               dst_ptr=dst_ptr, attention=fwd["attention"], grad_attention=grad_att)
    torch.testing.assert_close(bwd["grad_alpha_src_e"], a_src_e.grad)
    torch.testing.assert_close(bwd["grad_alpha_dst"], a_dst.grad)
    assert (bwd["grad_alpha_dst"][dst_ptr.diff() == 0] == 0).all()


def test_apply_edge_float32_and_no_edges() -> None:
    a_src_e = torch.zeros(0, 2)
    a_dst = torch.randn(3, 2)
    dst_ptr = torch.zeros(4, dtype=torch.int64)
    out = _run("apply_edge.forward", alpha_src_e=a_src_e, alpha_dst=a_dst, dst_ptr=dst_ptr)
    assert out["attention"].shape == (0, 2) and out["attention"].dtype == torch.float32
    bwd = _run("apply_edge.backward", alpha_src_e=a_src_e, alpha_dst=a_dst, dst_ptr=dst_ptr,
               attention=out["attention"], grad_attention=out["attention"])
    torch.testing.assert_close(bwd["grad_alpha_dst"], torch.zeros(3, 2))


def test_handle_round_trip_through_wire() -> None:
    z, w = np.random.default_rng(0).standard_normal((5, 3)), np.random.default_rng(1).standard_normal((3, 2))
    request = wire.encode(handlers.request_header("apply_vertex.forward", {"activation": "none"}),
                          {"z": z, "weight": w})
    header, out = wire.decode(handlers.handle(request))
    assert header == {"op": "apply_vertex.forward", "ok": True,
                      "fingerprint": handlers.fingerprint("apply_vertex.forward")}  # the op it ran
    np.testing.assert_array_equal(out["h"], z @ w)


def test_unknown_op_is_named_with_valid_ops() -> None:
    request = wire.encode(handlers.request_header("apply_vertex.sideways"), {})
    match = (r"unknown op 'apply_vertex.sideways': this handler has \[.*'apply_edge.forward'.*\]\. An op "
             r"from your own module must be registered with lightning_dorylus.ops.register_ops")
    with pytest.raises(ValueError, match=match):
        handlers.handle(request)


def test_missing_and_unexpected_inputs_are_named() -> None:
    with pytest.raises(ValueError, match=r"op 'apply_vertex.backward' is missing input\(s\) \['grad_h'\]"):
        handlers.run_op("apply_vertex.backward", {k: np.ones((2, 2)) for k in ("z", "weight", "h")})
    with pytest.raises(ValueError, match=r"unexpected input\(s\) \['zz'\]"):
        handlers.run_op("apply_vertex.forward", {"z": np.ones((2, 2)), "weight": np.ones((2, 2)),
                                                 "zz": np.ones(1)})


def test_bad_values_are_named() -> None:
    z, w = np.ones((2, 3), np.float32), np.ones((3, 4), np.float32)
    with pytest.raises(ValueError, match=r"activation='tanh' is not supported; expected one of"):
        handlers.run_op("apply_vertex.forward", {"z": z, "weight": w}, {"activation": "tanh"})
    with pytest.raises(ValueError, match=r"share one dtype.*'z': 'float32', 'weight': 'float64'"):
        handlers.run_op("apply_vertex.forward", {"z": z, "weight": w.astype(np.float64)})
    with pytest.raises(ValueError, match=r"z \(2, 3\) @ weight \(4, 3\)"):
        handlers.run_op("apply_vertex.forward", {"z": z, "weight": w.T.copy()})
    with pytest.raises(ValueError, match=r"dst_ptr must be non-decreasing from 0 to the number of edges"):
        handlers.run_op("apply_edge.forward", {"alpha_src_e": np.ones((3, 1)), "alpha_dst": np.ones((2, 1)),
                                               "dst_ptr": np.array([0, 2, 2])})


def test_ops_package_imports_and_runs_without_torch(tmp_path) -> None:
    """What the Lambda zip ships (wire.py + ops/, no package __init__) works with torch unimportable."""
    root = bundle.write_bundle(tmp_path / "bundle")
    script = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None  # any "import torch" now raises ImportError
        sys.path[:0] = [{str(root)!r}, {bundle.numpy_path()!r}]
        import numpy as np
        from lightning_dorylus import wire
        from lightning_dorylus.ops import handlers
        req = wire.encode(handlers.request_header("apply_vertex.forward", {{"activation": "relu"}}),
                          {{"z": np.ones((2, 3), np.float32), "weight": np.ones((3, 4), np.float32)}})
        header, out = wire.decode(handlers.handle(req))
        assert out["h"].dtype == np.float32 and (out["h"] == 3).all(), out
        assert "torch" not in {{m.split(".")[0] for m in sys.modules if sys.modules[m] is not None}}
        print("ok", handlers.__file__)
    """)
    # -S: no site-packages hooks, so the editable install of lightning_dorylus (which imports torch)
    # is invisible, exactly as in a Lambda runtime.
    proc = subprocess.run([sys.executable, "-S", "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok " + str(root))


def test_bundle_sources_import_only_numpy_and_stdlib() -> None:
    bundle.check_imports()
    imported = set().union(*bundle.imported_modules().values())
    assert "lightning_dorylus.wire" in imported and not any(m.startswith("torch") for m in imported)


def test_worker_import_path_holds_numpy_but_not_torch(tmp_path) -> None:
    """The local pool's workers run like this: python -S, cwd = bundle, PYTHONPATH = link_numpy dir."""
    root = bundle.write_bundle(tmp_path / "code")
    site = bundle.link_numpy(tmp_path / "site")
    script = textwrap.dedent("""
        import importlib.util, numpy
        from lightning_dorylus.ops import handlers
        print(numpy.__version__, importlib.util.find_spec("torch") is None, handlers.__file__)
    """)
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(site)}
    proc = subprocess.run([sys.executable, "-S", "-c", script], cwd=root, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    version, torch_missing, handlers_file = proc.stdout.split()
    assert version == np.__version__ and torch_missing == "True"
    assert handlers_file.startswith(str(root))
