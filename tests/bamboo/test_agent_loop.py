"""The one control loop (``Agent.run``) for one machine and many, without training: a job on one machine is
an agent serving its own TCPStore (``Supervisor``), and an agent of a one-machine ``--nnodes 1`` job over a
store another process serves decides the same way."""

from __future__ import annotations

import signal

import pytest

from lightning_bamboo.control.agent import Agent
from lightning_bamboo.control.supervisor import Supervisor
from tests.bamboo.served_store import serve_store


def quiet(*args: object, **kwargs: object) -> None:
    pass


@pytest.mark.parametrize("how", ["supervisor", "agent over a served store"])
def test_workers_that_exit_before_generation_0_end_the_job_with_1(how: str) -> None:
    """A command that is no Bamboo worker exits 0 at once: nothing will form generation 0, so the job ends
    (exit 1) instead of waiting for ever, on one machine as under ``--nnodes``."""
    if how == "supervisor":
        agent: Agent = Supervisor(["true"], nproc=2, log=quiet)
    else:
        served = serve_store()
        agent = Agent(["true"], 2, served.url, served.job, 1, 1, rdzv_last_call=0.0, log=quiet)
    assert agent.run() == 1
    record = agent.record()
    assert record["returncode"] == 1 and record["exits"] == {"0": 0, "1": 0}
    assert record["changes"] == [] and record["stop"] is None


def test_sigterm_to_the_last_machine_stops_the_job_and_kills_what_holds_no_stage() -> None:
    """SIGTERM (here :meth:`Agent.stop`, what the handler calls) to the agent of the job's only machine
    stops the job rather than draining the machine: before generation 0 no worker holds a stage, so every
    worker is SIGKILLed by PID at once and the job exits 143."""
    sup = Supervisor(["sleep", "60"], nproc=2, log=quiet)
    sup.stop(signal.SIGTERM)
    assert sup.run() == 128 + signal.SIGTERM
    record = sup.record()
    assert record["stop"] == {"reason": "SIGTERM received", "code": 143, "killed": []}
    assert record["exits"] == {"0": -signal.SIGKILL, "1": -signal.SIGKILL}


def test_add_worker_before_the_rendezvous_says_what_to_wait_for() -> None:
    sup = Supervisor(["true"], nproc=1, log=quiet)
    with pytest.raises(RuntimeError, match=r"add_worker\(\) needs the job's rendezvous closed \(wait_formed"):
        sup.add_worker()
    sup.stop_all()
