"""Elastic Bamboo across machines: 3 machines as network namespaces (``tests/netns.py``), etcd on the bridge
address of the root namespace, one ``python -m lightning_bamboo.launch --nnodes 3:3 --nproc-per-node 2``
agent per machine (2 stages x 3 pipelines of ``PipeMLP`` in float64, gloo over each machine's ``eth0``).

Whole machines (the agent and its workers, every process of the namespace, by PID) are SIGKILLed while the
other members wait inside a step; the survivors carry on and the final parameters and optimizer state equal
the uninterrupted single-process run's. Where namespaces cannot be made, the tests fail with the reason.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import etcd3gw.exceptions
import pytest
import torch
from safetensors.torch import load_file

from lightning_bamboo.control import machines as mc
from lightning_bamboo.control.agent import FENCED
from lightning_bamboo.layout.ownership import OwnershipMap
from lightning_bamboo.protocol import store as ms
from tests.bamboo.launch_record import worker_events
from tests.bamboo.test_elastic import SCRIPT, TOL
from tests.netns import Host, Network, pid_alive
from tests.process import launch_env, run_process

STEPS = 8
BATCH = 12  # the global batch: 3 pipelines x 2 micro-batches x 2
LEASE_S = 3.0
TIMEOUT_S = 240.0
TRAIN = ["--stages", "2", "--steps", str(STEPS), "--batch-size", str(BATCH)]


class Job:
    """One agent per host, started by :meth:`start`; logs in ``out/agent_h<i>.log``."""

    def __init__(
        self, net: Network, out: Path, etcd: str, job: str, hold: str, per_node: int, train: list[str]
    ) -> None:
        self.net, self.out, self.etcd, self.job, self.hold = net, out, etcd, job, hold
        self.per_node, self.train = per_node, train
        self.nodes = len(net.hosts)
        self.procs: dict[int, object] = {}
        self.logs: list[IO[str]] = []
        self.store = ms.connect(f"etcd://{etcd}", job, timeout=30)

    def start(self, host: Host) -> None:
        cmd = [
            sys.executable, "-m", "lightning_bamboo.launch", "--nnodes", f"{self.nodes}:{self.nodes}",
            "--nproc-per-node", str(self.per_node),
            "--rdzv-endpoint", f"etcd://{self.etcd}", "--job-id", self.job, "--node-lease", str(LEASE_S),
            str(SCRIPT), "--out", str(self.out), *self.train, "--hold", self.hold,
        ]
        # gloo binds eth0, not the address the (shared) hostname resolves to
        env = launch_env({"GLOO_SOCKET_IFNAME": host.interface})
        self.logs.append((self.out / f"agent_h{host.index}.log").open("w"))
        self.procs[host.index] = self.net.popen(host, cmd, env=env, stdout=self.logs[-1])

    def machine_of(self, host: Host) -> int:
        """The machine index the agent of ``host`` registered as (``node/{i}`` names its PID)."""
        pid = self.procs[host.index].pid  # type: ignore[attr-defined]  # ``ip netns exec`` execs: same PID
        for machine in range(mc.count(self.store)):
            info = mc.describe(self.store, machine)
            if info is not None and info["pid"] == pid:
                return machine
        raise AssertionError(f"the agent of {host.namespace} (pid {pid}) did not register")

    def log(self, host: Host) -> str:
        return (self.out / f"agent_h{host.index}.log").read_text()

    def logs_tail(self) -> str:
        return "\n".join(
            f"--- host {h.index} ---\n{self.log(h)[-5000:]}" for h in self.net.hosts if h.index in self.procs
        )

    def wait_for(self, what: str, ready: Callable[[], bool], timeout: float = TIMEOUT_S) -> None:
        """Poll ``ready`` until it holds; a store that does not answer one poll (the test's own reads, not
        the job's) is polled again until the deadline."""
        deadline = time.monotonic() + timeout

        def ready_now() -> bool:
            try:
                return ready()
            except (etcd3gw.exceptions.ConnectionFailedError, etcd3gw.exceptions.ConnectionTimeoutError):
                return False

        while not ready_now():
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} in {timeout:.0f}s:\n{self.logs_tail()}")
            time.sleep(0.1)

    def close(self) -> None:
        for log in self.logs:
            log.close()


def final_states(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {p.name: load_file(str(p)) for p in sorted(out.glob("final_member*.safetensors"))}


def assert_equal_to(reference: dict[str, torch.Tensor], out: Path) -> None:
    """Every finished member's stages (parameters, Adam state) equal the reference; all are covered."""
    finals = final_states(out)
    assert finals, f"no member finished: {sorted(p.name for p in out.iterdir())}"
    covered: set[str] = set()
    for name, state in finals.items():
        assert int(state.pop("global_step")) == STEPS, name
        for key, value in state.items():
            torch.testing.assert_close(
                value, reference[key], **TOL, msg=lambda m, k=key, n=name: f"{n} {k}: {m}"
            )
            covered.add(key)
    assert covered == {k for k in reference if k != "global_step"}


def kinds(job: Job) -> list[str]:
    """The kind of every generation after generation 0 (``gen{g}/kind`` in the store), in order."""
    return [ms.get_str(job.store, f"gen{g}/kind") for g in range(1, ms.current_generation(job.store) + 1)]


def reference_run(tmp_path: Path) -> dict[str, torch.Tensor]:
    """The uninterrupted single-process run on the same global batches."""
    run_process([sys.executable, str(SCRIPT), "--out", str(tmp_path / "reference"), "--strategy", "auto",
                 *TRAIN], timeout=240)
    return load_file(str(tmp_path / "reference" / "final_reference.safetensors"))


def start_job(
    net: Network, out: Path, tmp_path: Path, hold: str, per_node: int = 2, train: list[str] = TRAIN
) -> tuple[Job, dict[int, Host]]:
    """etcd on the bridge, one agent per host (host 0's first: it becomes machine 0 and the coordinator);
    returns the job and the host of each machine index once the rendezvous closed."""
    etcd = net.serve_etcd(tmp_path / "etcd")
    out.mkdir()
    job = Job(net, out, etcd, "nodes-test", hold, per_node, train)
    first, *others = net.hosts
    job.start(first)
    job.wait_for("coordinator", lambda: mc.coordinator(job.store) is not None)
    for host in others:
        job.start(host)
    job.wait_for("rendezvous", lambda: job.store.check([mc.CLOSED]))
    rendezvous = mc.Rendezvous.from_json(job.store.get(mc.CLOSED))
    assert mc.coordinator(job.store) == (0, 0) and job.machine_of(first) == 0
    # stages alternate across machines: member ids dealt round-robin
    nodes = len(net.hosts)
    assert rendezvous.members == {i: [i + nodes * j for j in range(per_node)] for i in range(nodes)}
    return job, {job.machine_of(h): h for h in net.hosts}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.netns
@pytest.mark.timeout(420)
def test_whole_machines_lost_then_the_coordinators(
    make_network: Callable[[int], Network], tmp_path: Path
) -> None:
    """Machine 1 (members 1 and 4: stage 1 of pipeline 0, stage 0 of pipeline 2) is SIGKILLed whole while
    the others wait inside step 3: its lease expires and ONE failover generation drops both members. Then
    machine 0, the coordinator's (members 0 and 3), is SIGKILLed inside step 6: machine 2's agent takes the
    coordinator over (its lease expired, or its agent refuses connections) and fails both members over in
    one generation. Machine 2's
    members finish every step equal (float64) to the uninterrupted single-process run."""
    reference = reference_run(tmp_path)
    net = make_network(3)
    out = tmp_path / "run"
    # member 2 (on machine 2, which survives) holds at the ends of steps 2 and 5 until released: the others
    # are then inside steps 3 and 6 (waiting for it) when a machine dies
    job, host_of = start_job(net, out, tmp_path, hold="2:2:file,2:5:file")
    try:
        job.wait_for("step 2 of member 2", lambda: (out / "reached2_member2").exists())
        killed = net.kill_host(host_of[1])  # agent and workers, every process of the namespace, by PID
        assert len(killed) >= 3, killed
        (out / "release2").write_text("")
        job.wait_for("step 5 of member 2", lambda: (out / "reached5_member2").exists())
        net.kill_host(host_of[0])  # the coordinator's machine
        (out / "release5").write_text("")
        survivor = job.procs[host_of[2].index]
        job.wait_for("the job's end", lambda: survivor.poll() is not None)  # type: ignore[attr-defined]
        assert survivor.returncode == 0, job.logs_tail()  # type: ignore[attr-defined]
    finally:
        job.close()

    # both machines counted lost (a SIGKILLed machine's agent refuses connections at once, found when its
    # peers report the lost connection; its lease expiring is the other way to find it); machine 2's agent
    # took the coordinator over in term 1
    assert mc.is_dead(job.store, 1) and mc.is_dead(job.store, 0) and not mc.is_dead(job.store, 2)
    assert mc.coordinator(job.store) == (1, 2), job.logs_tail()
    assert kinds(job) == ["failover", "failover"]
    # machine 1's loss was found by machine 0's coordinator (term 0); machine 2's learnt it from the store
    # and did not count it again; machine 0's loss was found by machine 2's
    assert mc.loss_of(job.store, 1)["by"] == 0 and mc.loss_of(job.store, 0)["by"] == 2, job.logs_tail()
    assert {mc.loss_of(job.store, m)["how"] for m in (0, 1)} <= set(mc.LOSS_HOW)
    # one generation per machine lost, not one per worker
    maps = [OwnershipMap.from_json(m) for m in (ms.read_map(job.store, g).to_json() for g in range(3))]
    assert [m.generation for m in maps] == [0, 1, 2] and ms.current_generation(job.store) == 2
    assert maps[1].members() == [0, 2, 3, 5] and maps[2].members() == [2, 5]
    assert sorted(final_states(out)) == ["final_member2.safetensors", "final_member5.safetensors"]
    assert_equal_to(reference, out)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.netns
@pytest.mark.timeout(420)
def test_a_partitioned_machine_fences_its_workers_and_comes_back_as_a_new_machine(
    make_network: Callable[[int], Network], tmp_path: Path
) -> None:
    """Machine 1's link goes down (``ip link set ... down``: its packets are dropped, nothing is killed) while
    the others wait inside step 3. Its agent cannot renew its lease: it SIGKILLs its own workers by PID and
    exits 3 (they must not train on, write checkpoints or rejoin with stale state), while the coordinator
    counts the machine as lost and fails both of its members over in one generation. The link comes back and
    the machine's agent is started again: it registers as a new machine (3), its workers join with fresh ids
    (6, 7) at a step boundary and the job grows back to 3 pipelines of 2 positions. Every member finishes
    equal to the uninterrupted run."""
    reference = reference_run(tmp_path)
    net = make_network(3)
    out = tmp_path / "run"
    # member 2 holds at the end of step 2 (the link goes down while the others wait inside step 3); every
    # member holds at the end of step 5 until the replacement machine's workers are ready to join (all at a
    # boundary: none waits in a collective longer than the process group's timeout)
    holds = ",".join(f"{m}:5:file" for m in (0, 2, 3, 5))
    job, host_of = start_job(net, out, tmp_path, hold=f"2:2:file,{holds}")
    try:
        job.wait_for("step 2 of member 2", lambda: (out / "reached2_member2").exists())
        cut = host_of[1]
        workers = [int((out / f"pid_member{m}").read_text()) for m in (1, 4)]
        net.partition(cut)
        cut_at = time.monotonic()
        (out / "release2").write_text("")
        fenced = job.procs[cut.index]
        job.wait_for("the cut-off agent's exit", lambda: fenced.poll() is not None)  # type: ignore[attr-defined]
        fenced_s = time.monotonic() - cut_at
        assert fenced.returncode == FENCED, job.logs_tail()  # type: ignore[attr-defined]  # lease not renewed
        assert not any(pid_alive(pid) for pid in workers)

        net.heal(cut)
        job.start(cut)  # the same command on the same machine: a new machine for the job
        job.wait_for("the new machine's workers", lambda: job.store.check(["join/6", "join/7"]))
        # the coordinator has proposed the grown layout before anyone leaves step 5 (else the job can end
        # before the proposal is adopted and the join never happens)
        proposed = lambda: job.store.check([f"gen{ms.current_generation(job.store)}/join"])  # noqa: E731
        job.wait_for("the join proposal", proposed)
        job.wait_for("step 5", lambda: all((out / f"reached5_member{m}").exists() for m in (0, 2, 3, 5)))
        (out / "release5").write_text("")
        agents = [job.procs[h.index] for h in net.hosts]
        job.wait_for("the job's end", lambda: all(p.poll() is not None for p in agents))  # type: ignore[attr-defined]
        assert [p.returncode for p in agents] == [0, 0, 0], job.logs_tail()  # type: ignore[attr-defined]
    finally:
        job.close()
    print(f"partitioned machine fenced {fenced_s:.1f}s after its link went down (lease {LEASE_S}s)")
    # one failover, then the new machine's members adopted in one rejoin or, when the coordinator proposed
    # while only one of them had registered, in two
    failover, *rejoins = kinds(job)
    assert failover == "failover" and rejoins and set(rejoins) == {"rejoin"}, job.logs_tail()
    assert ms.read_map(job.store, 1).members() == [0, 2, 3, 5]  # machine 1's members, in one generation
    assert mc.members_of(job.store, 3) == [6, 7]  # the machine came back as machine 3, with fresh ids
    last = ms.read_map(job.store, ms.current_generation(job.store))
    assert last.members() == [0, 2, 3, 5, 6, 7] and len(last.pipelines) == 3
    assert all(len(last.positions(p)) == 2 for p in last.pipeline_ids())
    assert sorted(final_states(out)) == [f"final_member{m}.safetensors" for m in (0, 2, 3, 5, 6, 7)]
    assert_equal_to(reference, out)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.netns
@pytest.mark.timeout(420)
def test_sigterm_to_an_agent_drains_its_machine(
    make_network: Callable[[int], Network], tmp_path: Path
) -> None:
    """SIGTERM to machine 1's agent (a spot notice for the machine) while every member waits at the end of
    step 2: the agent passes it to its workers, which leave at a step boundary (an announced departure, one
    ``drain`` generation, nothing replayed) and exit 0; the agent exits 143 and the rest finish equal to the
    uninterrupted run."""
    reference = reference_run(tmp_path)
    net = make_network(3)
    out = tmp_path / "run"
    job, host_of = start_job(net, out, tmp_path, hold=",".join(f"{m}:2:file" for m in range(6)))
    try:
        job.wait_for("step 2", lambda: all((out / f"reached2_member{m}").exists() for m in range(6)))
        leaving = job.procs[host_of[1].index]
        leaving.send_signal(signal.SIGTERM)  # type: ignore[attr-defined]
        # both workers' notice watchers have seen it before anyone leaves step 2 (else one of them may see it
        # only after the next boundary and leave one drain later)
        job.wait_for("the notices", lambda: all(f"preemption notice on rank {m} " in job.log(host_of[1])
                                                for m in (1, 4)))
        (out / "release2").write_text("")
        agents = [job.procs[h.index] for h in net.hosts]
        job.wait_for("the job's end", lambda: all(p.poll() is not None for p in agents))  # type: ignore[attr-defined]
        codes = {m: job.procs[host_of[m].index].returncode for m in range(3)}  # type: ignore[attr-defined]
        assert codes == {0: 0, 1: 143, 2: 0}, job.logs_tail()
    finally:
        job.close()
    assert kinds(job) == ["drain"], job.logs_tail()
    assert ms.read_map(job.store, 1).members() == [0, 2, 3, 5]  # members 1 and 4 left
    exits = {e["member"]: e["code"] for e in mc.Reports(job.store).new()}
    assert exits.get(1, 0) == exits.get(4, 0) == 0  # no non-zero exit reported (an agent that is done need
    # not report its own workers' clean exits): they left, nothing was lost
    assert sorted(final_states(out)) == [f"final_member{m}.safetensors" for m in (0, 2, 3, 5)]
    assert_equal_to(reference, out)


def lose_two_at_once(
    net: Network, tmp_path: Path, train: list[str], lost: tuple[int, int]
) -> tuple[Job, Path]:
    """One worker per machine; the machines ``lost`` are SIGKILLed together while member 0 waits at the end
    of step 3; returns the job and the output folder once member 0 finished (exit 0)."""
    out = tmp_path / "run"
    job, host_of = start_job(net, out, tmp_path, hold="0:3:file", per_node=1, train=train)
    try:
        job.wait_for("step 3 of member 0", lambda: (out / "reached3_member0").exists())
        net.kill_hosts([host_of[machine] for machine in lost])
        (out / "release3").write_text("")
        survivor = job.procs[host_of[0].index]
        job.wait_for("the job's end", lambda: survivor.poll() is not None)  # type: ignore[attr-defined]
        assert survivor.returncode == 0, job.logs_tail()  # type: ignore[attr-defined]
    finally:
        job.close()
    return job, out


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.netns
@pytest.mark.timeout(420)
def test_two_machines_lost_at_once_fall_back_to_the_checkpoint(
    make_network: Callable[[int], Network], tmp_path: Path
) -> None:
    """One pipeline of 3 stages, one worker per machine, checkpoints every 2 steps in a folder every machine
    sees: machines 1 and 2 (two adjacent stages, whose replicas are each other's) are SIGKILLed together
    while member 0 waits at the end of step 3. Member 0 loads the last complete checkpoint, re-runs the
    steps since, runs all three stages and ends equal to the uninterrupted run. The coordinator groups the
    losses it sees in one probe of every machine (one generation, of kind ``fallback``); a machine whose
    processes are still being torn down by the kernel when the first is found is lost one generation later
    (``failover`` then ``failover``, the second one's workers falling back), with the same result."""
    reference = reference_run(tmp_path)
    train = ["--stages", "3", "--steps", str(STEPS), "--batch-size", str(BATCH), "--checkpoint-every", "2",
             "--checkpoint-dir", str(tmp_path / "checkpoints")]
    job, out = lose_two_at_once(make_network(3), tmp_path, [*train, "--events"], lost=(1, 2))
    assert json.loads(job.store.get(mc.RISKS)) == []  # any single machine is covered by the replicas
    assert kinds(job) in (["fallback"], ["failover", "failover"]), job.logs_tail()
    assert ms.read_map(job.store, len(kinds(job))).members() == [0]
    (fallback,) = worker_events(out, 0, "on_fallback")  # member 0 loaded the checkpoint
    assert Path(fallback["checkpoint_path"]).parent.parent == tmp_path / "checkpoints"
    assert sorted(final_states(out)) == ["final_member0.safetensors"]
    assert_equal_to(reference, out)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.netns
@pytest.mark.timeout(420)
def test_two_non_adjacent_machines_lost_at_once_are_covered_by_the_replicas(
    make_network: Callable[[int], Network], tmp_path: Path
) -> None:
    """One pipeline of 4 stages, one worker per machine: machines 1 and 3 (stages 1 and 3, not adjacent: the
    replica of each is on a survivor, machines 0 and 2) are SIGKILLed together while member 0 waits at the
    end of step 3. Failover drops both (in one generation, or two when the kernel tears the second machine's
    processes down after the coordinator's probe, as in the test above); members 0 and 2 promote their
    replicas, run two stages each and end equal to the uninterrupted run, with no checkpoint."""
    reference = reference_run(tmp_path)
    train = ["--stages", "4", "--steps", str(STEPS), "--batch-size", str(BATCH)]
    job, out = lose_two_at_once(make_network(4), tmp_path, train, lost=(1, 3))
    assert kinds(job) in (["failover"], ["failover", "failover"]), job.logs_tail()
    assert ms.read_map(job.store, len(kinds(job))).members() == [0, 2]
    assert sorted(final_states(out)) == ["final_member0.safetensors", "final_member2.safetensors"]
    assert_equal_to(reference, out)
