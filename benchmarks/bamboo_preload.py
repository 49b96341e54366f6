"""How soon a Bamboo worker is ready, started fresh or forked from the preload server.

``python benchmarks/bamboo_preload.py [--repeats N]``: :class:`~lightning_bamboo.control.workers.LocalWorkers`
starts a worker script whose first line records the time, which then imports what a Bamboo worker imports
(``torch``, ``lightning.pytorch``, ``lightning_bamboo``) and records the time again. Reported per mode (median
over N starts, one worker at a time): seconds from ``LocalWorkers.start`` to the script's first line and to
"imports done" (where a fresh worker's ~7 CPU-seconds go). ``preloaded (warm)`` forks from a server that is
already up (a replacement or joining worker); ``preloaded (cold)`` includes starting the server
(generation 0).
Interleaved, so that load on the machine falls on all modes alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from lbd_common import preload
from lightning_bamboo.control.workers import LocalWorkers

WORKER = """
import time
first = time.time()
import json, sys
import torch, lightning.pytorch, lightning_bamboo  # what a Bamboo worker imports first
json.dump({"first": first, "ready": time.time()}, open(sys.argv[1], "w"))
"""


def one_start(folder: Path, mode: str, index: int) -> dict[str, float]:
    """Start one worker in ``mode`` (fresh / cold / warm) and return its two delays in seconds."""
    script, out = folder / "worker.py", folder / f"{mode}-{index}.json"
    if mode == "cold":  # a new server: forget the ones this process started
        for server in preload._SERVERS.values():
            server.stop()
        preload._SERVERS.clear()
    workers = LocalWorkers([sys.executable, str(script), str(out)], dist.HashStore(), hang_timeout=60.0,
                           log=lambda *a, **k: None, preload=mode != "fresh")
    began = time.time()
    workers.start(0, {})
    code = workers.workers[0].proc.wait(timeout=300)
    if code != 0:
        raise RuntimeError(f"the {mode} worker exited with {code}")
    seen = json.loads(out.read_text())
    return {"first_line_s": seen["first"] - began, "ready_s": seen["ready"] - began}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="starts per mode (interleaved)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.pop("BAMBOO_PRELOAD", None)
    with tempfile.TemporaryDirectory(prefix="bamboo-preload-bench-") as tmp:
        folder = Path(tmp)
        (folder / "worker.py").write_text(WORKER)
        runs: dict[str, list[dict[str, float]]] = {"fresh": [], "cold": [], "warm": []}
        for index in range(args.repeats):
            for mode in runs:
                runs[mode].append(one_start(folder, mode, index))
    names = {"fresh": "fresh interpreter", "cold": "preloaded (cold)", "warm": "preloaded (warm)"}
    keys = ("first_line_s", "ready_s")
    result = {names[m]: {k: round(statistics.median(r[k] for r in rs), 3) for k in keys}
              for m, rs in runs.items()}
    print(json.dumps({"repeats": args.repeats, "median": result}, indent=1))


if __name__ == "__main__":
    main()
