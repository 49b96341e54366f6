"""Drive an elastic job through the launcher's Python API: ``run()`` in a thread, ``add_worker()`` from here.

``python rejoin_driver.py --nproc N --add K -- worker.py args...``: starts the job with ``N`` workers, waits
until generation 0 formed, adds ``K`` workers, waits for the job, and exits with its return code after
printing ``joins=<json>`` (the supervisor's record of every completed join).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading

from lightning_bamboo.control.supervisor import Supervisor


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--add", type=int, required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = [a for a in args.command if a != "--"]
    supervisor = Supervisor([sys.executable, *command], args.nproc)
    thread = threading.Thread(target=supervisor.run, name="supervisor")
    thread.start()
    supervisor.wait_formed()
    added = [supervisor.add_worker() for _ in range(args.add)]
    print(f"[driver] added members {added}; live {supervisor.live_members()}", flush=True)
    thread.join()
    print(f"joins={json.dumps(supervisor.record()['joins'])}", flush=True)
    return supervisor.returncode if supervisor.returncode is not None else 1


if __name__ == "__main__":
    sys.exit(main())
