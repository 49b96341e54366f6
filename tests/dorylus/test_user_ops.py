"""Ops from the user's own module (``docs/examples/gin_ops.py``: GIN's MLP in numpy, registered with
``lightning_dorylus.ops.register_ops``) run on the inline, local and Lambda (local endpoint) executors: a
``GINConv`` built on it (``docs/examples/gin_conv.py``) equals PyG's ``GINConv`` in forward and in every
gradient at float64. An executor that lacks the op says which op and what to do."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch_geometric.nn import GINConv as PygGINConv

from lightning_dorylus import deploy
from lightning_dorylus.data import partition_graph
from lightning_dorylus.executors import (
    ExecutorError,
    InlineExecutor,
    LambdaExecutor,
    LocalPoolExecutor,
    RemoteOpError,
    TensorOpExecutor,
    TensorOpRequest,
)
from lightning_dorylus.graph import GhostExchange, GraphContext
from lightning_dorylus.nn import DorylusRuntime
from lightning_dorylus.ops import OpSpec, bundle, handlers, register_ops, registry
from tests.dorylus.aws_services import start_lambda_local
from tests.dorylus.scripts.exact_run import INTERVAL_SIZE, NUM_FEATURES, make_graph
from tests.process import REPO

EXAMPLES = REPO / "docs" / "examples"


USER_MODULES = ("gin_ops", "gin_conv", "bad_ops", "userpkg", "userpkg.double_ops", "fragile_ops", "alias_ops")


@pytest.fixture
def op_state() -> Iterator[None]:
    """No user op registered yet (another test may have imported the examples) and ``docs/examples``
    importable; the op table, the registry, ``sys.path`` and the imported modules restored after."""
    ops, owners, path = dict(handlers.OPS), dict(registry._OP_MODULE), list(sys.path)
    modules = {name: sys.modules.pop(name) for name in USER_MODULES if name in sys.modules}
    for name in set(handlers.OPS) - registry.BUILTIN_OPS:
        del handlers.OPS[name]
    registry._OP_MODULE.clear()
    sys.path.insert(0, str(EXAMPLES))
    try:
        yield
    finally:
        handlers.OPS.clear()
        handlers.OPS.update(ops)
        registry._OP_MODULE.clear()
        registry._OP_MODULE.update(owners)
        sys.path[:] = path
        for name in USER_MODULES:
            sys.modules.pop(name, None)
        sys.modules.update(modules)


def _gin_vs_pyg(executor: TensorOpExecutor) -> None:
    """GINConv on ``executor`` (8 intervals) vs PyG's GINConv with the same weights: output and gradients."""
    from gin_conv import GINConv

    [part] = partition_graph(make_graph(), 1, interval_size=INTERVAL_SIZE)
    graph = GraphContext(part)
    assert len(graph.intervals) > 1
    torch.manual_seed(0)
    layer = GINConv(NUM_FEATURES, 16, 5, eps=0.25).double()
    layer.attach(DorylusRuntime(executor=executor, exchange=GhostExchange()))
    mlp = torch.nn.Sequential(torch.nn.Linear(NUM_FEATURES, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    pyg = PygGINConv(mlp.double(), eps=0.25)
    with torch.no_grad():
        mlp[0].weight.copy_(layer.w1.T), mlp[0].bias.copy_(layer.b1)
        mlp[2].weight.copy_(layer.w2.T), mlp[2].bias.copy_(layer.b2)
    x = part.x.clone().requires_grad_(True)
    x_ref = part.x.clone().requires_grad_(True)
    out, ref = layer(x, graph), pyg(x_ref, part.edge_index)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    weights = torch.randn_like(ref)
    (out * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    for ours, theirs in ((layer.w1.grad, mlp[0].weight.grad.T), (layer.b1.grad, mlp[0].bias.grad),
                         (layer.w2.grad, mlp[2].weight.grad.T), (layer.b2.grad, mlp[2].bias.grad)):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def test_user_op_runs_inline_and_equals_pyg(op_state: None) -> None:
    _gin_vs_pyg(InlineExecutor())


def test_local_pool_ships_the_user_op_module(op_state: None) -> None:
    import gin_ops  # noqa: F401

    assert registry.op_modules() == ("gin_ops",)
    with LocalPoolExecutor(num_workers=2) as pool:
        _gin_vs_pyg(pool)


DOUBLE_OPS = """
from lightning_dorylus.ops import OpSpec, register_ops


def double(inputs, attrs):
    return {"h": 2 * inputs["z"]}


def double_backward(inputs, attrs):
    return {"grad_z": 2 * inputs["grad_h"]}


register_ops({
    "userpkg.double.forward": OpSpec(double, ("z",), outputs=("h",), backward="userpkg.double.backward",
                                     row_inputs=("z",), row_outputs=("h",)),
    "userpkg.double.backward": OpSpec(double_backward, ("grad_h",), outputs=("grad_z",),
                                      row_inputs=("grad_h",), row_outputs=("grad_z",)),
})
"""


def test_an_op_module_inside_a_package_ships_without_the_package_init(op_state: None, tmp_path: Path) -> None:
    """``userpkg/__init__.py`` imports torch (as a real package's may): the bundle ships a stub instead."""
    (tmp_path / "userpkg").mkdir()
    (tmp_path / "userpkg" / "__init__.py").write_text("import torch\n")
    (tmp_path / "userpkg" / "double_ops.py").write_text(DOUBLE_OPS)
    sys.path.insert(0, str(tmp_path))
    import userpkg.double_ops  # noqa: F401

    assert registry.op_modules() == ("userpkg.double_ops",)
    z = torch.arange(6.0).reshape(3, 2)
    with LocalPoolExecutor(num_workers=1) as pool:
        [out] = pool.map([TensorOpRequest("userpkg.double.forward", {"z": z})], timeout=60)
    torch.testing.assert_close(out["h"], 2 * z)


ALIAS_OPS = """
import dataclasses

from lightning_dorylus.ops import register_ops
from lightning_dorylus.ops.vertex import OPS

forward = dataclasses.replace(OPS["apply_vertex.forward"], backward="alias.av.backward")
register_ops({"alias.av.forward": forward, "alias.av.backward": OPS["apply_vertex.backward"]})
"""


def test_ops_ship_with_the_module_that_registers_them(op_state: None, tmp_path: Path) -> None:
    """The functions are built-in (``vertex.py``); what a worker must import is the registering module."""
    (tmp_path / "alias_ops.py").write_text(ALIAS_OPS)
    sys.path.insert(0, str(tmp_path))
    import alias_ops  # noqa: F401

    assert registry.op_modules() == ("alias_ops",)
    z, w = torch.randn(5, 3, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    with LocalPoolExecutor(num_workers=1) as pool:
        [out] = pool.map([TensorOpRequest("alias.av.forward", {"z": z, "weight": w})], timeout=60)
    torch.testing.assert_close(out["h"], z @ w)


FRAGILE_OPS = """
import importlib.util

from lightning_dorylus.ops import OpSpec, register_ops

if importlib.util.find_spec("torch") is None:  # true in a worker: it has the standard library and numpy only
    raise RuntimeError("fragile_ops needs torch after all")


def same(inputs, attrs):
    return {"h": inputs["z"]}


register_ops({"fragile.same": OpSpec(same, ("z",), outputs=("h",), row_inputs=("z",), row_outputs=("h",))})
"""


def test_an_op_module_failing_in_the_worker_stops_the_pool_start_with_its_error(
    op_state: None, tmp_path: Path
) -> None:
    (tmp_path / "fragile_ops.py").write_text(FRAGILE_OPS)
    sys.path.insert(0, str(tmp_path))
    import fragile_ops  # noqa: F401  (fine here: torch is installed)

    pool = LocalPoolExecutor(num_workers=1, startup_timeout=60)
    match = (r"worker 0 \(pid \d+\) failed to start: importing op modules \['fragile_ops'\] failed: "
             r"RuntimeError: fragile_ops needs torch")
    with pytest.raises(ExecutorError, match=match):
        pool.start()
    pool.close()


def test_a_pool_started_before_the_op_module_names_the_op_and_the_fix(op_state: None) -> None:
    with LocalPoolExecutor(num_workers=1) as pool:
        import gin_ops  # noqa: F401  (registered here, after the pool shipped its bundle)

        request = TensorOpRequest("gin.mlp.forward", {k: torch.ones(2, 2) for k in ("z", "w1", "w2")}
                                  | {"b1": torch.ones(2), "b2": torch.ones(2)})
        with pytest.raises(RemoteOpError, match=(
            r"unknown op 'gin.mlp.forward': this handler has \[.*\]\. An op from your own module must be "
            r"registered with lightning_dorylus.ops.register_ops in that module, and the executor must "
            r"import the module: the local pool ships every op module imported before it starts; a Lambda "
            r"function needs a redeploy with `python -m lightning_dorylus.deploy --op-module <module>`")):
            pool.submit(request).result(timeout=60)


def test_bad_registrations_are_named(op_state: None) -> None:
    import gin_ops

    spec = handlers.OPS["gin.mlp.forward"]
    with pytest.raises(ValueError, match=r"op 'apply_vertex.forward' is built into the handler; give your op "
                                         r"a name of its own"):
        register_ops({"apply_vertex.forward": spec})
    with pytest.raises(TypeError, match=r"op 'x' must map to a lightning_dorylus.ops.OpSpec, got dict"):
        register_ops({"x": {}})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"op 'y' names backward='y.backward', which is not registered"):
        register_ops({"y": OpSpec(gin_ops.mlp_forward, ("z",), backward="y.backward")})

    def script_op(inputs: dict, attrs: dict) -> dict:
        return inputs

    script_op.__module__ = "__main__"
    with pytest.raises(ValueError, match=r"op 'z' is defined in __main__ .* define the op in a module of its "
                                         r"own"):
        register_ops({"z": OpSpec(script_op, ("z",))})
    moved = OpSpec(script_op, ("z",))
    object.__setattr__(moved, "fn", _elsewhere)
    with pytest.raises(ValueError, match=r"op 'gin.mlp.forward' is already registered by module 'gin_ops'"):
        register_ops({"gin.mlp.forward": moved})
    assert handlers.OPS["gin.mlp.forward"] is spec  # nothing of a refused call was registered


def _elsewhere(inputs: dict, attrs: dict) -> dict:
    return inputs


def test_op_module_that_imports_torch_is_refused_before_any_worker_starts(
    op_state: None, tmp_path: Path
) -> None:
    (tmp_path / "bad_ops.py").write_text("import torch\nfrom lightning_dorylus.ops import register_ops\n")
    sys.path.insert(0, str(tmp_path))
    with pytest.raises(ImportError, match=r"op modules import what an executor does not have .*"
                                          r"\{'bad_ops': \['torch'\]\}"):
        bundle.write_bundle(tmp_path / "bundle", ["bad_ops"])
    with pytest.raises(ImportError, match=r"op module 'no_such_ops' cannot be found"):
        bundle.write_bundle(tmp_path / "bundle", ["no_such_ops"])


def test_deploy_refuses_a_module_that_registers_no_op(op_state: None, tmp_path: Path) -> None:
    (tmp_path / "empty_ops.py").write_text("import numpy\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(ValueError, match=r"--op-module empty_ops: importing it registered no op"):
            deploy.build_zip(tmp_path / "h.zip", ["empty_ops"])
    finally:
        sys.modules.pop("empty_ops", None)


@pytest.mark.services  # a lambda_local of its own, started from the zip deploy builds
@pytest.mark.timeout(300)
def test_lambda_zip_deployed_with_the_op_module_runs_it(op_state: None, tmp_path: Path, aws_env) -> None:
    zip_path = tmp_path / "handler.zip"
    assert deploy.main(["--dry-run", str(zip_path), "--op-module", "gin_ops"]) == 0
    server = start_lambda_local(zip_path, concurrency=2)
    try:
        with LambdaExecutor(function_name="gin", region="us-east-1", endpoint_url=server.url) as executor:
            _gin_vs_pyg(executor)
    finally:
        server.stop()
