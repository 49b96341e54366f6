"""A job on one machine (``python -m lightning_bamboo.launch --nproc N train.py``, or a plain ``python
train.py`` with ``Trainer(devices=N, strategy="bamboo")``): the multi-machine design with one machine.

The :class:`Supervisor` is that machine's :class:`~lightning_bamboo.control.agent.Agent` (one loop for any
number of machines: it starts and watches the workers, is elected coordinator at once, decides every
membership change, drains or stops on SIGTERM); the only difference is the store. It serves the job's
``TCPStore`` itself (``--store etcd://host:port`` keeps the job's state in an etcd server instead). It is no
training rank, so no preemption of a worker can take it down. What it does on a loss, a join or SIGTERM is
the agent's (see :mod:`lightning_bamboo.control.agent`): alone in its job, SIGTERM stops the job at a step
boundary and it exits 143.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import torch.distributed as dist

from lightning_bamboo.control.agent import Agent, first_formed

__all__ = ["Supervisor", "first_formed"]


class Supervisor(Agent):
    """The agent of a job on one machine, serving its store (see the module docstring).

    Args:
        command: the worker command (``python train.py ...``).
        nproc: workers to start (member ids ``0..N-1``).
        store_url: ``etcd://host:port`` to keep the job's state there; ``None``: a TCPStore served here.
        replace: replacement workers to start, one after each loss (-1: no limit).
        poll: seconds between two passes of the loop (a loss is seen at most this late).
        The others are :class:`~lightning_bamboo.control.agent.Agent`'s.
    """

    def __init__(
        self,
        command: list[str],
        nproc: int,
        store_url: str | None = None,
        hang_timeout: float = 5.0,
        settle: float = 0.3,
        replace: int = 0,
        log=print,
        replace_delay: float = 0.0,
        stop_timeout: float = 30.0,
        preload: bool = True,
        backend: str | None = None,
        poll: float = 0.02,
    ) -> None:
        if nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {nproc}")
        self._server: dist.TCPStore | None = None
        if store_url is None:
            self._server = dist.TCPStore(
                "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
            )
            store_url = f"tcp://127.0.0.1:{self._server.port}"
        super().__init__(
            command, nproc, store_url, uuid.uuid4().hex[:12], 1, 1, hang_timeout=hang_timeout, settle=settle,
            rdzv_last_call=0.0, stop_timeout=stop_timeout, replace=replace, replace_delay=replace_delay,
            poll=poll, log=log, preload=preload, backend=backend,
        )
