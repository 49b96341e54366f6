"""The test zygote (the product's preload server, :mod:`lbd_common.preload`, with the tests'
modules) stands in for a fresh interpreter: argv, ``__main__``, environment, directory, process group, output
and exit status are those of ``python script.py`` / ``python -m module``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lbd_common.preload import PreloadedProcess, fixed_at_start, stands_in_for
from tests.process import launch_env, start, zygote

PROBE = """
import json, os, signal, sys
import __main__
print(json.dumps({"argv": sys.argv, "name": __name__, "spec": getattr(__main__.__spec__, "name", None),
                  "cwd": os.getcwd(), "probe": os.environ.get("PROBE"), "path0": sys.path[0],
                  "leader": os.getpgid(0) == os.getpid(), "torch": "torch" in sys.modules}))
sys.stderr.write("to stderr\\n")
if sys.argv[-1] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(int(sys.argv[-1]))
"""


def run(cmd: list[str], cwd: Path) -> tuple[subprocess.Popen[str] | PreloadedProcess, dict, str]:
    proc = start(cmd, cwd, launch_env({"PROBE": "yes"}), subprocess.PIPE, process_group=None)
    out, _ = proc.communicate(timeout=120)
    first, _, rest = out.partition("\n")
    return proc, json.loads(first), rest


@pytest.mark.multiprocess  # starts the zygote (one per pytest session) if this session has none yet
@pytest.mark.skipif(os.environ.get("TEST_ZYGOTE") == "0", reason="TEST_ZYGOTE=0: no zygote")
def test_forked_script_and_module_behave_as_fresh_interpreters(tmp_path: Path) -> None:
    server = zygote()
    assert server is not None
    now, then = fixed_at_start(launch_env()), fixed_at_start(server.env)
    changed = {k: (then.get(k), now.get(k)) for k in set(now) | set(then) if now.get(k) != then.get(k)}
    assert not changed, f"an earlier test or fixture left these set (at zygote start, now): {changed}"
    (tmp_path / "probe.py").write_text(PROBE)
    proc, seen, rest = run([sys.executable, str(tmp_path / "probe.py"), "a", "3"], cwd=tmp_path.parent)
    assert isinstance(proc, PreloadedProcess) and proc.returncode == 3
    assert seen == {"argv": [str(tmp_path / "probe.py"), "a", "3"], "name": "__main__", "spec": None,
                    "cwd": str(tmp_path.parent), "probe": "yes", "path0": str(tmp_path), "leader": True,
                    "torch": True}
    assert rest == "to stderr\n"

    proc, seen, _ = run([sys.executable, "-m", "probe", "0"], cwd=tmp_path)
    assert isinstance(proc, PreloadedProcess) and proc.returncode == 0
    assert (seen["argv"], seen["spec"], seen["path0"]) == ([str(tmp_path / "probe.py"), "0"], "probe",
                                                           str(tmp_path))

    proc, _, _ = run([sys.executable, str(tmp_path / "probe.py"), "kill"], cwd=tmp_path)
    assert proc.returncode == -signal.SIGKILL


def test_only_what_a_fork_reproduces_is_forked() -> None:
    env = {**launch_env(), "OMP_NUM_THREADS": "1", "PYTHONPATH": "/repo"}
    assert stands_in_for([sys.executable, "train.py", "--x"], env, env)
    assert stands_in_for([sys.executable, "-m", "recipes.train"], env, env)
    assert not stands_in_for([sys.executable, "-c", "print()"], env, env)
    assert not stands_in_for([sys.executable, "-X", "importtime", "train.py"], env, env)
    assert not stands_in_for(["/usr/bin/python3", "train.py"], env, env)
    assert not stands_in_for([sys.executable, "train.py"], {**env, "OMP_NUM_THREADS": "7"}, env)
    assert not stands_in_for([sys.executable, "train.py"], {**env, "PYTHONPATH": "/elsewhere"}, env)
    assert not stands_in_for([sys.executable, "train.py"], {**env, "PYTHONIOENCODING": "latin-1"}, env)
    assert not stands_in_for([sys.executable, "train.py"], {**env, "MKL_NUM_THREADS": "3"}, env)
    assert stands_in_for([sys.executable, "train.py"], {**env, "BAMBOO_MEMBER": "4", "MASTER_PORT": "1"}, env)
