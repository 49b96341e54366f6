"""``python -m lightning_bamboo.launch --nproc N script.py args``: start an elastic Bamboo job on this machine
(:class:`lightning_bamboo.control.supervisor.Supervisor`: the agent of a one-machine job, which serves the
store, starts and watches the workers and decides every membership change).

Several machines: on each, ``python -m lightning_bamboo.launch --nnodes MIN:MAX --nproc-per-node K
--rdzv-endpoint etcd://HOST:PORT --job-id ID script.py args`` starts that machine's agent
(:mod:`lightning_bamboo.control.agent`, the same loop: its K workers, its lease in the store; one agent,
elected through the store, decides membership; see that module for what happens on a loss, a join or SIGTERM).

A script started this way is a worker (``Trainer(devices=1, strategy="bamboo")``); a plain ``python train.py``
with ``Trainer(devices=N, strategy="bamboo")`` makes its own process this supervisor instead.
"""

from __future__ import annotations

import argparse
import sys

from lightning_bamboo.control.supervisor import Supervisor


def build_parser() -> argparse.ArgumentParser:
    """The CLI's arguments (also used to check the launch commands of the deployment examples)."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_bamboo.launch", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--nproc", type=int, default=None, help="workers to start (one machine)")
    nodes = parser.add_argument_group("several machines (one agent per machine)")
    nodes.add_argument("--nnodes", default=None, help="MIN:MAX (or N) machines to start generation 0 with")
    nodes.add_argument("--nproc-per-node", type=int, default=None, help="workers on this machine")
    nodes.add_argument("--rdzv-endpoint", default=None, help="etcd://host:port, the job's store")
    nodes.add_argument("--job-id", default=None, help="the same id on every machine of the job")
    nodes.add_argument(
        "--node-lease", type=float, default=5.0,
        help="seconds without a lease renewal after which a machine is lost with all its workers",
    )
    nodes.add_argument("--zone", default="", help="this machine's zone (a coarser failure domain)")
    nodes.add_argument(
        "--rdzv-last-call", type=float, default=2.0,
        help="seconds to wait for more machines once MIN registered",
    )
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
        help="start up to this many replacement workers, one after each loss of a worker of this machine "
        "(-1: no limit)",
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
    parser.add_argument(
        "--no-preload", dest="preload", action="store_false",
        help="start every worker as a fresh interpreter, not forked from a server that imported torch and "
        "Lightning once (also: BAMBOO_PRELOAD=0)",
    )
    parser.add_argument("-m", dest="module", action="store_true", help="the script is a module (python -m)")
    parser.add_argument("script", help="the training script (or module, with -m)")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = [sys.executable, *(["-m"] if args.module else []), args.script, *args.args]
    if args.nnodes is not None:
        return _agent(parser, args, command)
    if args.nproc is None:
        parser.error("give --nproc N (one machine) or --nnodes MIN:MAX --nproc-per-node K (each machine)")
    try:
        supervisor = Supervisor(
            command,
            args.nproc,
            args.store,
            args.hang_timeout,
            replace=args.replace,
            replace_delay=args.replace_delay,
            stop_timeout=args.stop_timeout,
            preload=args.preload,
        )
    except ConnectionError as err:  # the store named by --store cannot be reached
        print(f"python -m lightning_bamboo.launch: {err}", file=sys.stderr)
        return 2
    return supervisor.run()


def _nnodes(parser: argparse.ArgumentParser, text: str) -> tuple[int, int]:
    try:
        low, _, high = text.partition(":")
        bounds = int(low), int(high or low)
    except ValueError:
        parser.error(f"--nnodes must be MIN:MAX or N (integers), got {text!r}")
    if not 1 <= bounds[0] <= bounds[1]:
        parser.error(f"--nnodes MIN:MAX needs 1 <= MIN <= MAX, got {text!r}")
    return bounds


def _agent(parser: argparse.ArgumentParser, args: argparse.Namespace, command: list[str]) -> int:
    """This machine's agent of a multi-machine job (:mod:`lightning_bamboo.control.agent`)."""
    from lightning_bamboo.control.agent import Agent

    min_nodes, max_nodes = _nnodes(parser, args.nnodes)
    missing = [f"--{n.replace('_', '-')}" for n in ("nproc_per_node", "rdzv_endpoint", "job_id")
               if getattr(args, n) is None]
    if missing:
        parser.error(f"--nnodes needs {', '.join(missing)}")
    if args.nproc is not None:
        parser.error("--nproc is the one-machine launch; with --nnodes give --nproc-per-node")
    if not args.rdzv_endpoint.startswith(("etcd://", "tcp://")):
        parser.error(f"--rdzv-endpoint must be etcd://host:port, got {args.rdzv_endpoint!r}")
    try:
        agent = Agent(
            command, args.nproc_per_node, args.rdzv_endpoint, args.job_id, min_nodes, max_nodes,
            node_lease=args.node_lease, zone=args.zone, hang_timeout=args.hang_timeout,
            rdzv_last_call=args.rdzv_last_call, stop_timeout=args.stop_timeout, replace=args.replace,
            replace_delay=args.replace_delay, preload=args.preload,
        )
    except ConnectionError as err:
        print(f"python -m lightning_bamboo.launch: {err}", file=sys.stderr)
        return 2
    except ValueError as err:
        parser.error(str(err))
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
