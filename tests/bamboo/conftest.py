"""Session fixtures: the batched launches behind the Bamboo exactness tests (tests/bamboo/pipe_runs.py), and
the uninterrupted reference the elastic tests compare with."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.bamboo.pipe_runs import run_bamboo, run_references
from tests.process import REPO, run_process


@pytest.fixture(scope="session")
def pipe_references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Case name -> folder of its single-process reference run (all in one process)."""
    return run_references(tmp_path_factory.mktemp("pipe-references"))


@pytest.fixture(scope="session")
def pipe_bamboo_2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Case name -> folder of its 2-process Bamboo run (all in one launch)."""
    return run_bamboo(tmp_path_factory.mktemp("pipe-bamboo-2"), devices=2)


@pytest.fixture(scope="session")
def pipe_bamboo_4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Case name -> folder of its 4-process Bamboo run (all in one launch)."""
    return run_bamboo(tmp_path_factory.mktemp("pipe-bamboo-4"), devices=4)


def _elastic_reference(out: Path, *extra: str) -> dict[str, torch.Tensor]:
    from tests.bamboo.test_elastic import SCRIPT, STEPS

    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--strategy", "auto", "--steps", str(STEPS)]
    cmd += extra
    run_process(cmd, timeout=240)
    return load_file(str(out / "final_reference.safetensors"))


@pytest.fixture(scope="session")
def elastic_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """Final state of the uninterrupted single-process run of ``train_elastic.py`` (launched once for the
    failover and fallback tests, which train the same model for the same steps)."""
    return _elastic_reference(tmp_path_factory.mktemp("elastic-reference"))


@pytest.fixture(scope="session")
def elastic_reference_clipped(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The same uninterrupted run with ``Trainer(gradient_clip_val=CLIP)`` (Lightning's norm clipping)."""
    from tests.bamboo.test_elastic import CLIP

    return _elastic_reference(tmp_path_factory.mktemp("elastic-reference-clipped"), "--clip", str(CLIP))


@pytest.fixture(scope="session")
def user_model_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The uninterrupted run of ``pipe_variants.UserModel`` with norm clipping (issue 17's user model)."""
    from tests.bamboo.test_elastic import CLIP

    out = tmp_path_factory.mktemp("elastic-reference-user")
    return _elastic_reference(out, "--variant", "user", "--clip", str(CLIP))


@pytest.fixture(scope="session")
def unused_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The uninterrupted run of ``pipe_variants.WithUnused`` (Adam with weight decay, a gradient-less
    parameter)."""
    return _elastic_reference(tmp_path_factory.mktemp("elastic-reference-unused"), "--variant", "unused")


@pytest.fixture(scope="session")
def double_precision_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The uninterrupted run of a float32-built ``PipeMLP`` under ``Trainer(precision="64-true")``."""
    out = tmp_path_factory.mktemp("elastic-reference-64-true")
    return _elastic_reference(out, "--dtype", "float32", "--precision", "64-true")


@pytest.fixture(scope="session")
def accumulate_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The uninterrupted run of issue 17's user model with ``accumulate_grad_batches=2`` (two batches per
    step) and norm clipping."""
    from tests.bamboo.test_elastic import CLIP

    out = tmp_path_factory.mktemp("elastic-reference-accumulate")
    return _elastic_reference(out, "--variant", "user", "--clip", str(CLIP), "--accumulate", "2")


@pytest.fixture(scope="session")
def tied_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The uninterrupted run of ``pipe_variants.Tied`` (one weight used by layers 0 and 4), Adam, clipping."""
    from tests.bamboo.test_elastic import CLIP

    out = tmp_path_factory.mktemp("elastic-reference-tied")
    return _elastic_reference(out, "--variant", "tied", "--optimizer", "adam", "--clip", str(CLIP))


@pytest.fixture(scope="session")
def tied_gpt_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The uninterrupted run of ``pipe_variants.TiedGPT`` (LM head = token embedding) with clipping."""
    from tests.bamboo.test_elastic import CLIP

    out = tmp_path_factory.mktemp("elastic-reference-tied-gpt")
    return _elastic_reference(out, "--variant", "tied-gpt", "--clip", str(CLIP))


@pytest.fixture(scope="session")
def tied_gpt_named_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The uninterrupted run of ``pipe_variants.TiedGPTNamed`` (name-based AdamW groups) with clipping."""
    from tests.bamboo.test_elastic import CLIP

    out = tmp_path_factory.mktemp("elastic-reference-tied-gpt-named")
    return _elastic_reference(out, "--variant", "tied-gpt-named", "--clip", str(CLIP))


@pytest.fixture(scope="session")
def etcd_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``host:port`` of an etcd server: ``BAMBOO_TEST_ETCD`` (scripts/test.sh starts one through
    scripts/services.sh), else one started here with scripts/services.sh (its logs and data in a pytest temp
    folder) and stopped by its PID."""
    if os.environ.get("BAMBOO_TEST_ETCD"):
        yield os.environ["BAMBOO_TEST_ETCD"]
        return
    services = tmp_path_factory.mktemp("services")
    printed = services / "services.out"  # read even when services.sh times out: the servers it started
    with printed.open("w") as stdout:
        proc = subprocess.Popen(["bash", str(REPO / "scripts" / "services.sh")], stdout=stdout,
                                stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "DORYLUS_SERVICES_DIR": str(services)})
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = printed.read_text()
    pairs = [line.split("=", 1) for line in out.splitlines() if "=" in line]
    pids = [int(value) for key, value in pairs if key == "PID"]  # one per server services.sh started
    try:
        assert proc.returncode == 0 and "BAMBOO_TEST_ETCD" in dict(pairs), f"services.sh failed:\n{out}"
        yield dict(pairs)["BAMBOO_TEST_ETCD"]
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
