"""Op versions checked end to end (issue 32): a Lambda function that kept an older zip after the user changed
an op is refused at its first request, naming the op and both fingerprints, instead of training another
model, or, asked to (``redeploy_on_mismatch=True``), redeployed with the graph server's own code and the
request retried once. Fingerprints (``lightning_dorylus/ops/fingerprint.py``) cover the wire version, the
op's declaration and the source of its modules; every request carries the graph server's, every response
the handler's."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lightning_dorylus import deploy, wire
from lightning_dorylus.executors import InlineExecutor, LambdaExecutor, RemoteOpError, TensorOpRequest
from lightning_dorylus.ops import fingerprint, handlers
from tests.dorylus.aws_services import endpoint_stats, start_lambda_local
from tests.dorylus.test_user_ops import op_state

__all__ = ["op_state"]  # the fixture: the op table and registry restored after each test

OP_MODULE = '''"""A user op module: h = {factor} * z."""
from lightning_dorylus.ops import OpSpec, register_ops


def scale(inputs, attrs):
    return {{"h": {factor} * inputs["z"]}}


def scale_backward(inputs, attrs):
    return {{"grad_z": {factor} * inputs["grad_h"]}}


register_ops({{
    "fp.scale.forward": OpSpec(scale, ("z",), outputs=("h",), backward="fp.scale.backward",
                               row_inputs=("z",), row_outputs=("h",)),
    "fp.scale.backward": OpSpec(scale_backward, ("z", "grad_h"), outputs=("grad_z",),
                                row_inputs=("z", "grad_h"), row_outputs=("grad_z",)),
}})
'''


@pytest.fixture
def fp_ops(op_state: None, tmp_path: Path) -> Iterator[Path]:
    """``fp_ops`` (``h = 2 z``) importable from ``tmp_path``; returns its file (rewrite it, then reload)."""
    path = tmp_path / "fp_ops.py"
    path.write_text(OP_MODULE.format(factor=2.0))
    sys.path.insert(0, str(tmp_path))
    importlib.import_module("fp_ops")
    try:
        yield path
    finally:
        sys.modules.pop("fp_ops", None)


def _change_op(path: Path) -> str:
    """The user edits the op (``h = 3 z``) and this process re-imports it; its new fingerprint."""
    path.write_text(OP_MODULE.format(factor=3.0))
    importlib.reload(sys.modules["fp_ops"])
    return handlers.fingerprint("fp.scale.forward")  # type: ignore[return-value]


def _request(op: str = "fp.scale.forward") -> TensorOpRequest:
    return TensorOpRequest(op, {"z": torch.arange(6, dtype=torch.float64).reshape(3, 2)}, {}, interval=0)


def test_fingerprint_follows_the_code_and_the_wire_version(fp_ops: Path, monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    old = handlers.fingerprint("fp.scale.forward")
    assert old is not None and old.startswith("sha256:") and len(old) == len("sha256:") + 16
    assert handlers.fingerprint("fp.scale.backward") != old  # per op
    importlib.reload(sys.modules["fp_ops"])  # the same code again: the same fingerprint
    assert handlers.fingerprint("fp.scale.forward") == old
    new = _change_op(fp_ops)
    assert new != old
    monkeypatch.setattr(wire, "VERSION", wire.VERSION + 1)
    fingerprint._CACHE.clear()
    assert handlers.fingerprint("fp.scale.forward") not in (old, new)
    fingerprint._CACHE.clear()


def test_handler_refuses_a_request_for_another_version_of_the_op(fp_ops: Path) -> None:
    ours = handlers.fingerprint("fp.scale.forward")
    header = handlers.request_header("fp.scale.forward", {}, 0)
    assert header["fingerprint"] == ours
    response, _ = wire.decode(handlers.handle(wire.encode(header, {"z": _request().tensors["z"].numpy()})))
    assert response["fingerprint"] == ours  # the handler reports the op it ran
    forged = {**header, "fingerprint": "sha256:0123456789abcdef"}
    with pytest.raises(fingerprint.OpVersionError,
                       match=rf"op 'fp.scale.forward' is different code here than on the graph server: the "
                             rf"graph server runs sha256:0123456789abcdef, this handler runs {ours}"):
        handlers.handle(wire.encode(forged, {"z": _request().tensors["z"].numpy()}))


@pytest.mark.services  # a lambda_local of its own, started from the zip deploy builds
@pytest.mark.timeout(300)
def test_lambda_function_running_an_older_op_is_refused_with_both_fingerprints(
    fp_ops: Path, tmp_path: Path, aws_env
) -> None:
    zip_path, _, _ = deploy.build_zip(tmp_path / "handler.zip", ["fp_ops"])  # deployed: h = 2 z
    deployed = handlers.fingerprint("fp.scale.forward")
    server = start_lambda_local(zip_path, concurrency=1)
    try:
        with LambdaExecutor(function_name="fp", region="us-east-1", endpoint_url=server.url) as executor:
            out = executor.map([_request()])[0]  # the same code on both sides: runs
            torch.testing.assert_close(out["h"], 2 * _request().tensors["z"])
            current = _change_op(fp_ops)  # the user changed the op and did not redeploy
            assert current != deployed
            expected = 3 * _request().tensors["z"]
            torch.testing.assert_close(InlineExecutor().map([_request()])[0]["h"], expected)
            message = (rf"op 'fp.scale.forward' is different code here than on the graph server: the graph "
                       rf"server runs {current}, this handler runs {deployed}")
            with pytest.raises(RemoteOpError, match=message) as info:
                executor.map([_request()])
            assert info.value.error_type == "OpVersionError"
            assert executor.stats["retries"] == 0  # refused, not retried
    finally:
        server.stop()


@pytest.mark.services  # a lambda_local of its own, started from the zip deploy builds
@pytest.mark.timeout(300)
def test_lambda_function_running_an_older_op_is_redeployed_when_asked(
    fp_ops: Path, tmp_path: Path, aws_env
) -> None:
    """The function keeps ``h = 2 z``; the graph server now runs ``h = 3 z``. With ``redeploy_on_mismatch``
    the executor uploads its own zip and the retried request computes ``3 z``; its one redeploy spent, a
    further change is refused with both fingerprints."""
    zip_path, _, _ = deploy.build_zip(tmp_path / "handler.zip", ["fp_ops"])  # deployed: h = 2 z
    server = start_lambda_local(zip_path, concurrency=2)
    try:
        current = _change_op(fp_ops)
        with LambdaExecutor(function_name="fp", region="us-east-1", endpoint_url=server.url,
                            redeploy_on_mismatch=True) as executor:
            outs = executor.map([_request(), _request()])  # both meet the old code; one redeploy
            for out in outs:
                torch.testing.assert_close(out["h"], 3 * _request().tensors["z"])
            assert executor.stats["redeploys"] == 1 and executor.stats["retries"] == 0
            assert endpoint_stats(server.url, "fp")["code_updates"] == 1
            newer = fp_ops.read_text().replace("3.0", "4.0")
            fp_ops.write_text(newer)
            importlib.reload(sys.modules["fp_ops"])
            latest = handlers.fingerprint("fp.scale.forward")
            message = (rf"op 'fp.scale.forward' is different code here than on the graph server: the graph "
                       rf"server runs {latest}, this handler runs {current}")
            with pytest.raises(RemoteOpError, match=message):
                executor.map([_request()])
            assert executor.stats["redeploys"] == 1
        # the function now runs the redeployed code for everyone (h = 3 z): this server's 4 z is refused
        with LambdaExecutor(function_name="fp", region="us-east-1", endpoint_url=server.url) as plain, \
                pytest.raises(RemoteOpError, match=message):
            plain.map([_request()])
    finally:
        server.stop()


def test_redeploy_option_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match=r"redeploy_on_mismatch='yes': expected True or False"):
        LambdaExecutor(function_name="fp", redeploy_on_mismatch="yes")  # type: ignore[arg-type]
