"""``python -m lightning_bamboo.launch --nproc N script.py args``: start an elastic Bamboo job's supervisor
(:class:`lightning_bamboo.elastic.supervisor.Supervisor`, which serves the store, starts and watches the
workers and decides every membership change; see its module for what it does on a loss, a join or SIGTERM).

A script started this way is a worker (``Trainer(devices=1, strategy="bamboo")``); a plain ``python train.py``
with ``Trainer(devices=N, strategy="bamboo")`` makes its own process this supervisor instead.
"""

from __future__ import annotations

import argparse
import sys

from lightning_bamboo.elastic.supervisor import Supervisor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_bamboo.launch", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--nproc", type=int, required=True, help="workers to start")
    parser.add_argument(
        "--store",
        default=None,
        help="etcd://host:port to keep the job's state in etcd (default: a TCPStore here)",
    )
    parser.add_argument(
        "--hang-timeout",
        type=float,
        default=5.0,
        help="seconds without a heartbeat after which a worker is killed and lost",
    )
    parser.add_argument(
        "--replace",
        type=int,
        default=0,
        help="start up to this many replacement workers, one after each loss (-1: no limit)",
    )
    parser.add_argument(
        "--replace-delay",
        type=float,
        default=0.0,
        help="seconds after a loss before its replacement worker starts (a new spot machine's arrival)",
    )
    parser.add_argument(
        "--stop-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM: seconds the workers get to stop at a step boundary before they are killed",
    )
    parser.add_argument("-m", dest="module", action="store_true", help="the script is a module (python -m)")
    parser.add_argument("script", help="the training script (or module, with -m)")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = [sys.executable, *(["-m"] if args.module else []), args.script, *args.args]
    try:
        supervisor = Supervisor(
            command,
            args.nproc,
            args.store,
            args.hang_timeout,
            replace=args.replace != 0,
            replace_delay=args.replace_delay,
            stop_timeout=args.stop_timeout,
        )
    except ConnectionError as err:  # the store named by --store cannot be reached
        print(f"python -m lightning_bamboo.launch: {err}", file=sys.stderr)
        return 2
    return supervisor.run(replacements=args.replace)


if __name__ == "__main__":
    sys.exit(main())
