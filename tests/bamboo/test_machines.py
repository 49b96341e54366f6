"""The store protocol of a multi-machine job (``lightning_bamboo/control/machines.py``) and the agent CLI's
argument checks, in one process over a ``HashStore``."""

from __future__ import annotations

import shlex
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from lightning_bamboo.control import machines as mc
from lightning_bamboo.control.agent import Agent
from lightning_bamboo.control.coordinator import Coordinator, Superseded
from lightning_bamboo.launch import build_parser, main
from lightning_bamboo.layout.ownership import failover, initial
from lightning_bamboo.protocol import store as ms
from lightning_bamboo.strategy import BambooStrategy


def test_placement_puts_adjacent_stages_on_different_machines() -> None:
    """Member ids are dealt round-robin over the machines, so generation 0 (member m = stage m % S of
    pipeline m // S) never puts two stages of one pipeline on one machine: 3 machines x 2 workers, 2 stages
    -> each machine holds one stage of two different pipelines."""
    rendezvous = mc.placement([0, 1, 2], {}, 2)
    assert rendezvous.members == {0: [0, 3], 1: [1, 4], 2: [2, 5]} and rendezvous.nproc == 6
    owners = initial(2, range(rendezvous.nproc))
    for members in rendezvous.members.values():
        assert len({owners.pipeline_of(m) for m in members}) == len(members)
    assert mc.fallback_risks(owners, {f"machine {k}": v for k, v in rendezvous.members.items()}) == []
    assert mc.Rendezvous.from_json(rendezvous.to_json()) == rendezvous


def test_placement_alternates_zones_and_names_the_losses_it_cannot_cover() -> None:
    """Machines of one zone are not neighbours in the order while another zone has machines left; a loss the
    replicas cannot cover (here: a zone holding both stages of every pipeline) is named at start."""
    rendezvous = mc.placement([0, 1, 2, 3], {0: "a", 1: "a", 2: "b", 3: "b"}, 1)
    assert rendezvous.order == [0, 2, 1, 3]
    one_machine = mc.placement([0], {}, 2)
    owners = initial(2, range(one_machine.nproc))
    assert mc.fallback_risks(owners, {"machine 0": one_machine.members[0]}) == [
        "losing machine 0 (members [0, 1]) falls back to the last checkpoint"
    ]
    two = initial(2, range(4))  # pipelines (0, 1) and (2, 3): machine {0, 1} takes a whole pipeline
    assert mc.fallback_risks(two, {"machine 0": [0, 1]}) == [
        "losing machine 0 (members [0, 1]) drops 1 pipeline(s)"
    ]


def test_the_placement_report_follows_the_recovery_mode() -> None:
    """3 stages x 2 pipelines on 3 machines of 2 workers: each machine holds one stage of both pipelines. The
    replicas cover any machine; under recovery="peers" no peer holds that stage, so each is a fallback."""
    rendezvous = mc.placement([0, 1, 2], {}, 2)
    owners = initial(3, range(rendezvous.nproc))
    domains = {f"machine {k}": v for k, v in rendezvous.members.items()}
    assert mc.fallback_risks(owners, domains) == []
    assert mc.fallback_risks(owners, domains, replicas=False) == [
        f"losing {name} (members {members}) falls back to the last checkpoint"
        for name, members in domains.items()
    ]
    two_stages = initial(2, range(rendezvous.nproc))  # each machine: one stage of two different pipelines
    assert mc.fallback_risks(two_stages, domains, replicas=False) == []


def test_one_coordinator_per_term_and_leases_by_the_observers_clock() -> None:
    store = dist.HashStore()
    first, second = mc.register(store, 2, "", "h0", 10), mc.register(store, 2, "", "h1", 11)
    assert (first, second, mc.count(store)) == (0, 1, 2)
    assert mc.describe(store, 1) == {"nproc": 2, "zone": "", "host": "h1", "pid": 11, "liveness": ""}
    assert mc.take_coordinator(store, first, None)
    assert not mc.take_coordinator(store, second, None)  # the key is taken: nobody else wins term 0
    assert mc.coordinator(store) == (0, 0)
    leases = mc.LeaseWatch(store, lease=0.2)
    leases.observe([0, 1])
    store.add("node/1/hb", 1)
    time.sleep(0.25)
    leases.observe([0, 1])  # machine 0 did not renew; machine 1 did, just now
    assert leases.expired(0) and not leases.expired(1)
    assert mc.take_coordinator(store, second, (0, 0)) and mc.coordinator(store) == (1, 1)
    assert not mc.take_coordinator(store, first, (0, 0))  # a stale view of the holder loses


def test_reports_are_read_once_each_in_order() -> None:
    store = dist.HashStore()
    reader = mc.Reports(store)
    mc.report(store, 0, 3, -9)
    mc.report(store, 1, 4, 0)
    assert reader.new() == [{"machine": 0, "member": 3, "code": -9}, {"machine": 1, "member": 4, "code": 0}]
    assert reader.new() == []
    assert len(mc.Reports(store).new()) == 2  # a new coordinator reads the log from the start
    store.add("reports/count", 1)  # a writer that died between counting its entry and writing it
    mc.report(store, 2, 5, 1)
    assert reader.new(wait=0.1) == [{"machine": 2, "member": 5, "code": 1}]


def test_a_lost_machine_records_who_found_it_and_how() -> None:
    store = dist.HashStore()
    assert not mc.is_dead(store, 1) and mc.loss_of(store, 1) is None
    mc.mark_dead(store, 1, by=0, how="refused")
    assert mc.is_dead(store, 1) and mc.loss_of(store, 1) == {"by": 0, "how": "refused"}
    with pytest.raises(ValueError, match=r"how must be one of \('lease', 'refused'\), got 'timeout'"):
        mc.mark_dead(store, 2, by=0, how="timeout")


AGENT = ["--nproc-per-node", "1", "--job-id", "j"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "2", "--nproc-per-node", "1", "t.py"], "--nnodes needs --rdzv-endpoint, --job-id"),
        (["--nnodes", "3:2", *AGENT, "--rdzv-endpoint", "etcd://h:1", "t.py"],
         "--nnodes MIN:MAX needs 1 <= MIN <= MAX, got '3:2'"),
        (["--nnodes", "a:b", *AGENT, "--rdzv-endpoint", "etcd://h:1", "t.py"],
         "--nnodes must be MIN:MAX or N (integers), got 'a:b'"),
        (["--nnodes", "2", *AGENT, "--rdzv-endpoint", "h:1", "t.py"],
         "--rdzv-endpoint must be etcd://host:port, got 'h:1'"),
        (["t.py"], "give --nproc N (one machine) or --nnodes MIN:MAX --nproc-per-node K (each machine)"),
    ],
)
def test_agent_arguments_are_checked(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_an_unreachable_rendezvous_endpoint_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--nnodes", "2", *AGENT, "--rdzv-endpoint", "etcd://127.0.0.1:1", "train.py"]
    assert main(argv) == 2
    assert "cannot reach the job's etcd store at etcd://127.0.0.1:1" in capsys.readouterr().err


def test_a_generation_is_published_once_whoever_coordinates() -> None:
    """Two coordinators (one deposed that has not noticed yet) deciding generation 1: the first map written
    stands and the second raises ``Superseded``; generation 0 keeps the workers' own write."""
    store = dist.HashStore()
    first, second = Coordinator(store, log=lambda *a, **k: None), Coordinator(store, log=lambda *a, **k: None)
    current = initial(2, range(4))
    first._publish(current, "initial")
    first._publish(failover(current, {1}), "failover")
    with pytest.raises(Superseded, match="generation 1 was published by another coordinator"):
        second._publish(failover(current, {3}), "failover")
    assert ms.current_generation(store) == 1 and ms.read_map(store, 1) == failover(current, {1})


def test_a_supervised_worker_takes_the_gpu_of_its_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker an agent started (``Trainer(devices=1)``) with ``BAMBOO_LOCAL_RANK=1`` runs on ``cuda:1`` when
    Lightning gives it CUDA, and on the CPU otherwise (no GPU is needed to check the choice)."""
    env = {ms.ENV_STORE: "tcp://127.0.0.1:1", ms.ENV_JOB: "j", ms.ENV_MEMBER: "3", ms.ENV_NPROC: "4",
           ms.ENV_LOCAL_RANK: "1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    strategy = BambooStrategy(num_stages=2)
    strategy.parallel_devices = [torch.device("cuda", 0)]
    assert strategy.root_device == torch.device("cuda", 1)
    strategy.parallel_devices = [torch.device("cpu")]
    assert strategy.root_device == torch.device("cpu")
    assert strategy.local_rank == 0  # per-node hooks (prepare_data) still run in every worker, as before


EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples" / "bamboo-nodes"


def launch_commands(node: object) -> list[list[str]]:
    """Every ``python -m lightning_bamboo.launch ...`` command in a parsed YAML document (a list of words,
    or a shell line)."""
    found: list[list[str]] = []
    if isinstance(node, dict):
        for value in node.values():
            found += launch_commands(value)
    elif isinstance(node, list):
        if node[:3] == ["python", "-m", "lightning_bamboo.launch"]:
            return [[str(word) for word in node[3:]]]
        for value in node:
            found += launch_commands(value)
    elif isinstance(node, str) and "lightning_bamboo.launch" in node:
        for line in node.splitlines():
            if "python -m lightning_bamboo.launch" in line:
                found.append(shlex.split(line.split("lightning_bamboo.launch", 1)[1]))
    return found


@pytest.mark.parametrize("name", ["skypilot.yaml", "kubernetes.yaml"])
def test_the_deployment_examples_parse_and_launch_agents(name: str) -> None:
    """The SkyPilot task and the Kubernetes manifests are valid YAML and their launch command is an agent's
    command the CLI accepts (neither SkyPilot nor a Kubernetes API server is available to check more)."""
    documents = list(yaml.safe_load_all((EXAMPLES / name).read_text()))
    commands = [c for doc in documents for c in launch_commands(doc)]
    assert len(commands) == 1, commands
    args = build_parser().parse_args(commands[0])
    assert args.nnodes == "3:4" and args.nproc_per_node == 8 and args.rdzv_endpoint.startswith("etcd://")
    assert args.module and args.script == "recipes.train"
    if name == "kubernetes.yaml":
        kinds = [doc["kind"] for doc in documents]
        assert kinds == ["Service", "StatefulSet", "Job"]
        assert args.rdzv_endpoint == f"etcd://{documents[0]['metadata']['name']}:2379"  # the etcd Service
    else:
        assert documents[0]["resources"]["use_spot"] is True and documents[0]["num_nodes"] == 4


def test_a_gone_agent_refuses_and_a_live_or_unreachable_one_does_not() -> None:
    """The liveness port: connected while the agent lives; refused once it is gone (its host answers, nothing
    listens: proof of death). (An address that does not answer is no proof, a partition: the lease decides;
    the partition test in ``test_nodes.py`` covers it.)"""
    store = dist.HashStore()
    liveness = mc.Liveness(("127.0.0.1", 9))
    assert liveness.address.startswith("127.0.0.1:")
    alive = mc.register(store, 2, "", "host", 1, liveness.address)
    assert not mc.refuses(store, alive, timeout=1.0)
    liveness.close()
    assert mc.refuses(store, alive, timeout=1.0)
    assert not mc.refuses(store, mc.register(store, 2, "", "host", 3), timeout=0.1)  # none published


def test_lost_peer_reports_count_per_generation() -> None:
    store = dist.HashStore()
    assert ms.lost_peer_reports(store, 3) == 0
    ms.report_lost_peer(store, 3)
    ms.report_lost_peer(store, 3)
    assert (ms.lost_peer_reports(store, 3), ms.lost_peer_reports(store, 4)) == (2, 0)


def test_a_machine_gone_while_nobody_talked_to_it_is_found_by_its_late_lease_not_its_expiry() -> None:
    """No worker reported a lost peer (the survivors were waiting at a step's commit, say): a machine that
    missed a lease renewal is probed, once per renewal missed, and one whose agent is gone is lost then, well
    before its lease expires. A live machine that renews late is probed and not counted."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    url = f"tcp://127.0.0.1:{server.port}"
    quiet = {"log": lambda *args, **kwargs: None}
    lease = 3.0
    agents = [Agent(["true"], 1, url, "late", 3, 3, node_lease=lease, **quiet) for _ in range(3)]
    watcher, gone, slow = agents
    try:
        watcher.peers.leases.observe([gone.machine, slow.machine])
        gone.own_lease.done.set()  # its processes die: no more renewals, its liveness port refuses
        gone.liveness.close()
        slow.own_lease.done.set()  # stops renewing, but its agent still answers
        late_by = time.monotonic() + mc.renewal_period(lease) * 1.25 + 0.2
        while time.monotonic() < late_by:
            watcher.peers.leases.observe([gone.machine, slow.machine])
            time.sleep(0.05)
        assert watcher.peers.leases.late(gone.machine) and not watcher.peers.leases.expired(gone.machine)
        probes = []
        real_refuses = mc.refuses

        def counted(store, index, timeout):
            probes.append(index)
            return real_refuses(store, index, timeout)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(mc, "refuses", counted)
            watcher.peers.probe()
            watcher.peers.probe()  # the same missed renewal: not probed again
        assert sorted(probes) == sorted([gone.machine, slow.machine])
        assert gone.machine in watcher.peers.refusing and slow.machine not in watcher.peers.refusing
    finally:
        for agent in agents:
            agent.own_lease.done.set()
            agent.liveness.close()


def test_one_machine_found_gone_makes_every_other_a_suspect() -> None:
    """Machines lost together stop renewing up to a renewal period apart: when the probe of a late machine
    finds its agent gone, every other machine is probed in the same round, so one whose lease is not late yet
    is lost in the same generation; a live one is probed and not counted."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    url = f"tcp://127.0.0.1:{server.port}"
    quiet = {"log": lambda *args, **kwargs: None}
    lease = 3.0
    agents = [Agent(["true"], 1, url, "rack", 4, 4, node_lease=lease, **quiet) for _ in range(4)]
    watcher, late, not_late_yet, alive = agents
    try:
        others = [late.machine, not_late_yet.machine, alive.machine]
        watcher.peers.leases.observe(others)
        late.own_lease.done.set()
        late.liveness.close()
        late_by = time.monotonic() + mc.renewal_period(lease) * 1.25 + 0.2
        while time.monotonic() < late_by:
            watcher.peers.leases.observe(others)
            time.sleep(0.05)
        not_late_yet.liveness.close()  # gone a moment ago: its last renewal is still fresh
        assert watcher.peers.leases.late(late.machine) and not watcher.peers.leases.late(not_late_yet.machine)
        watcher.peers.probe()
        assert watcher.peers.refusing == {late.machine, not_late_yet.machine}
    finally:
        for agent in agents:
            agent.own_lease.done.set()
            agent.liveness.close()


class _OneSlowAnswer:
    """A store whose first lease renewal hangs ``hang`` seconds and then fails (an overloaded etcd)."""

    def __init__(self, store: dist.Store, hang: float) -> None:
        self.store, self.hang, self.slow = store, hang, True

    def add(self, key: str, amount: int) -> int:
        if self.slow:
            self.slow = False
            time.sleep(self.hang)
            raise TimeoutError("the store did not answer in time")
        return self.store.add(key, amount)


def test_one_slow_store_answer_does_not_cost_a_machine_its_lease() -> None:
    """A renewal that failed is retried at once: one answer that fails after hanging most of the lease must
    not fence the machine. With a 3 s lease renewed every 0.5 s, a 2.2 s hang leaves time for a retry at
    once, not for one a renewal period later (which fenced the machine)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    agent = Agent(["true"], 1, f"tcp://127.0.0.1:{server.port}", "slow", 1, 1, node_lease=3.0,
                  log=lambda *args, **kwargs: None)
    try:
        hang = 3.0 - 1.5 * mc.renewal_period(3.0) - 0.05  # past a retry a period later, not one at once
        agent.own_lease.store = _OneSlowAnswer(agent.own_lease.store, hang=hang)
        time.sleep(hang + 2.5)
        assert not agent.own_lease.store.slow and not agent.own_lease.fenced.is_set()
    finally:
        agent.own_lease.done.set()
        agent.liveness.close()
