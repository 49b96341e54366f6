"""Graph servers on several hosts: 2 machines as network namespaces (``tests/netns.py``), one torchrun per
machine with c10d rendezvous, train Cora (float64) to the same per-epoch losses and weights as 2 servers on
one host.

Each host has only loopback and ``eth0`` on a private bridge, so the rendezvous store, Lightning's process
group and every Dorylus exchange cross the bridge. What torchrun needs there, as on real machines whose
hostname does not resolve to the interface the peers reach (docs/dorylus-multihost.md):
``--local-addr`` (the address the other nodes reach; torchrun hands rank 0's to the workers as
``MASTER_ADDR``), ``--rdzv-conf is_host=1`` on the rendezvous host (torchrun cannot recognise the endpoint
as its own by hostname), and ``GLOO_SOCKET_IFNAME=eth0`` (gloo otherwise binds the address the hostname
resolves to, here 127.0.0.1).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.dorylus.scripts.launch import SCRIPTS, run_script
from tests.netns import Network
from tests.process import DATA, launch_env

SCRIPT = SCRIPTS / "cora_nodes_run.py"
PLANETOID = DATA / "planetoid"
EPOCHS = 3
HOSTS = 2  # one graph server each (3 also passes: ~25 s more on 2 cores)
RDZV_PORT = 29400  # inside the first host's own namespace: no other process can hold it
TIMEOUT_S = 240.0


def torchrun() -> list[str]:
    """The torchrun of this interpreter (its console script, else the module it runs)."""
    found = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


def run_on_hosts(net: Network, out: Path, work: Path) -> str:
    """One ``torchrun --nnodes N --nproc-per-node 1`` per host, all at once; returns their output.

    Raises:
        AssertionError: a host's torchrun failed or the run outlived ``TIMEOUT_S`` (with every host's log).
    """
    first = net.hosts[0]
    env = launch_env({"GLOO_SOCKET_IFNAME": first.interface})
    for launcher_sets in ("MASTER_ADDR", "MASTER_PORT"):  # torchrun's rendezvous decides them
        env.pop(launcher_sets)
    logs, procs = [], []
    for host in net.hosts:
        cmd = [
            *torchrun(),
            "--nnodes", str(len(net.hosts)), "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{first.address}:{RDZV_PORT}", "--rdzv-id", "cora",
            "--local-addr", host.address, "--max-restarts", "0",
            *(["--rdzv-conf", "is_host=1"] if host is first else []),
            str(SCRIPT), str(out), str(PLANETOID), "--work", str(work / f"host{host.index}"),
            "--nodes", str(len(net.hosts)), "--devices", "1", "--epochs", str(EPOCHS),
        ]
        logs.append((out / f"host{host.index}.log").open("w"))
        procs.append(net.popen(host, cmd, env=env, cwd=out, stdout=logs[-1]))
    deadline, failed_at = time.monotonic() + TIMEOUT_S, None
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > 5:
            break  # one host failed: the others had 5 s to report their side
        time.sleep(0.1)
    for host in net.hosts:  # whatever still runs (a failed or late run) is killed by PID
        net.kill_host(host)
    for log in logs:
        log.close()
    tails = [(out / f"host{i}.log").read_text()[-4000:] for i in range(len(procs))]
    output = "\n".join(f"--- host{i} ---\n{tail}" for i, tail in enumerate(tails))
    codes = [p.wait(10) for p in procs]
    if any(codes):
        late = " (timed out)" if time.monotonic() >= deadline else ""
        raise AssertionError(f"torchrun exit codes by host {codes}{late}:\n{output}")
    return output


def weights(out: Path, ranks: int) -> list[dict[str, torch.Tensor]]:
    return [load_file(str(out / f"weights_rank{r}.safetensors")) for r in range(ranks)]


@pytest.mark.multiprocess
@pytest.mark.netns
@pytest.mark.timeout(600)
def test_cora_on_two_hosts_with_torchrun_equals_one_host(
    make_network: Callable[[int], Network], tmp_path: Path
) -> None:
    """Per-epoch losses, val accuracy and final weights equal bit for bit; each rank ran in its own host."""
    assert (PLANETOID / "Cora" / "raw").is_dir(), f"Cora raw files not found in {PLANETOID}"
    one_host = tmp_path / "one_host"
    one_host.mkdir()
    args = [str(one_host), str(PLANETOID), "--work", str(one_host / "work"), "--nodes", "1",
            "--devices", str(HOSTS), "--epochs", str(EPOCHS)]
    run_script(SCRIPT.name, args, timeout=TIMEOUT_S, cwd=one_host, nprocs=HOSTS)  # all servers on loopback

    net = make_network(HOSTS)
    hosts = tmp_path / "hosts"
    hosts.mkdir()
    run_on_hosts(net, hosts, work=tmp_path / "host_disks")

    expected = json.loads((one_host / "result.json").read_text())
    got = json.loads((hosts / "result.json").read_text())
    assert len(got["losses"]) == EPOCHS
    assert got["losses"] == expected["losses"]  # float64, bit for bit: the same partitions, the same sums
    assert got["val_acc"] == expected["val_acc"]
    reference = weights(one_host, HOSTS)[0]
    for replica in weights(hosts, HOSTS):
        assert replica.keys() == reference.keys()
        assert all(torch.equal(replica[k], reference[k]) for k in reference)
    # each rank ran as node <rank> inside its own host's namespace, handed host 0's address by torchrun
    for rank, host in enumerate(net.hosts):
        where = json.loads((hosts / f"rank{rank}.json").read_text())
        assert where["environment"] == "TorchElasticEnvironment"
        assert where["node_rank"] == rank and where["world_size"] == HOSTS
        assert where["master_addr"] == net.hosts[0].address
        assert where["netns"] == f"net:[{host.inode()}]"
    root_netns = os.readlink("/proc/self/ns/net")
    assert json.loads((one_host / "rank1.json").read_text())["netns"] == root_netns
    # every host partitioned Cora on its own disk (Lightning's prepare_data runs once per node)
    assert all(any((tmp_path / "host_disks" / f"host{i}" / "partitions").iterdir()) for i in range(HOSTS))
