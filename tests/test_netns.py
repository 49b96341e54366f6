"""The network-namespace fixture (``tests/netns.py``): hosts that reach each other and the bridge and nothing
else, a partition that cuts a host off, shaping, and a teardown that leaves no process or name behind."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.netns import (
    Host,
    NetemUnavailable,
    NetnsUnavailable,
    Network,
    check_available,
    links,
    namespaces,
    pid_alive,
    sweep_stale,
    used_networks,
)

pytestmark = pytest.mark.netns
MakeNetwork = Callable[[int], Network]  # the make_network fixture (tests/conftest.py)

PORT = 5000
# a listener in a host: answers every connection with b"hello <its address>"
LISTEN = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
while True:
    conn, _ = server.accept()
    conn.sendall(b"hello " + sys.argv[1].encode())
    conn.close()
"""
# a client in a host: prints what it received, or "failed <error>"
CONNECT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as conn:
        print("received", conn.recv(64).decode())
except OSError as exc:
    print("failed", type(exc).__name__, exc)
"""


def listen(net: Network, host: Host, port: int = PORT) -> subprocess.Popen[str]:
    proc = net.popen(host, [sys.executable, "-c", LISTEN, host.address, str(port)])
    assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
    return proc


def connect(net: Network, host: Host, address: str, port: int = PORT, timeout_s: float = 3.0) -> str:
    cmd = [sys.executable, "-c", CONNECT, address, str(port), str(timeout_s)]
    return net.run(host, cmd, timeout=timeout_s + 20).stdout.strip()


@contextlib.contextmanager
def bridge_service(net: Network) -> Iterator[int]:
    """A service in the root namespace on the bridge's address (where etcd listens): it answers every
    connection with ``hello bridge`` until the block ends; yields its port."""
    server = socket.create_server((net.bridge_address, 0))
    port = server.getsockname()[1]
    stop = threading.Event()

    def answer() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                conn, _ = server.accept()
                conn.sendall(b"hello bridge")
                conn.close()

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        stop.set()
        with contextlib.suppress(OSError):
            socket.create_connection((net.bridge_address, port), timeout=1).close()  # wakes the accept
        thread.join(10)
        server.close()


def ours(prefix: str) -> list[str]:
    return [name for name in namespaces() + links() if name.startswith(prefix)]


def test_hosts_reach_each_other_and_the_bridge_and_nothing_else(make_network: MakeNetwork) -> None:
    net = make_network(2)
    a, b = net.hosts
    assert net.subnet is not None
    assert {a.address, b.address, net.bridge_address} <= {str(h) for h in net.subnet}
    assert len({a.namespace, b.namespace}) == 2 and a.inode() != b.inode()
    for host in net.hosts:  # one route: the private /24 on eth0 (no default route out of it)
        routes = net.run(host, ["ip", "-4", "route", "show", "table", "all"], timeout=10).stdout.split("\n")
        routes = [r for r in routes if r and " table local " not in r and not r.startswith("local ")]
        assert routes and all(r.startswith(str(net.subnet)) for r in routes), routes
    listen(net, a)
    assert connect(net, b, a.address) == f"received hello {a.address}"
    # a service in the root namespace on the bridge's address (etcd, say) is reachable from every host
    with bridge_service(net) as port:
        assert connect(net, b, net.bridge_address, port) == "received hello bridge"
    # an address of this machine's own network is not routed from a host: refused at once
    outside = next(u for u in used_networks() if not u.overlaps(net.subnet) and not u.is_loopback)
    answer_outside = connect(net, b, str(next(outside.hosts(), outside.network_address)))
    assert answer_outside.startswith("failed OSError [Errno 101] Network is unreachable"), answer_outside
    # each host's loopback is its own
    listen_lo = net.popen(a, [sys.executable, "-c", LISTEN, "127.0.0.1", str(PORT)])
    assert listen_lo.stdout is not None and listen_lo.stdout.readline().strip() == "listening"
    assert connect(net, a, "127.0.0.1") == "received hello 127.0.0.1"
    assert connect(net, b, "127.0.0.1").startswith("failed ConnectionRefusedError")


def test_partition_cuts_a_host_off_until_healed(make_network: MakeNetwork) -> None:
    net = make_network(3)
    a, b, c = net.hosts
    listen(net, a)
    net.partition(b)
    assert connect(net, b, a.address, timeout_s=2.0) == "failed TimeoutError timed out"  # lost, not refused
    assert connect(net, c, a.address) == f"received hello {a.address}"  # the others still talk
    net.heal(b)
    assert connect(net, b, a.address) == f"received hello {a.address}"
    net.partition(a)  # the listener's own host cut off: nobody reaches it
    assert connect(net, c, a.address, timeout_s=2.0) == "failed TimeoutError timed out"


def test_a_host_added_later_joins_the_network(make_network: MakeNetwork) -> None:
    net = make_network(1)
    (a,) = net.hosts
    listen(net, a)
    c = net.add_host()
    assert c.index == 1 and c.address == str(ipaddress.ip_address(a.address) + 1)
    assert connect(net, c, a.address) == f"received hello {a.address}"


def test_hosts_added_later_leave_the_others_reaching_the_bridge(make_network: MakeNetwork) -> None:
    """A replacement machine's link on the bridge must not change the bridge's own address: a bridge whose
    address was never set takes its ports' lowest, and the hosts' cached address of the bridge (where etcd
    listens) then led nowhere for many seconds (a multi-machine benchmark lost its store and fenced)."""
    net = make_network(2)
    a = net.hosts[0]
    with bridge_service(net) as port:
        assert connect(net, a, net.bridge_address, port) == "received hello bridge"  # a's entry cached
        mac = links_address(net.bridge)
        for _ in range(6):  # random port addresses: unpinned, one of the six would be the lowest 3 times in 4
            net.add_host()
            assert links_address(net.bridge) == mac
            assert connect(net, a, net.bridge_address, port, timeout_s=2.0) == "received hello bridge"


def links_address(link: str) -> str:
    shown = subprocess.run(["ip", "-j", "link", "show", link], capture_output=True, text=True, check=True)
    return str(json.loads(shown.stdout)[0]["address"])


def test_kill_host_kills_every_process_inside_it(make_network: MakeNetwork) -> None:
    net = make_network(2)
    a, b = net.hosts
    server = listen(net, a)
    other = listen(net, b)
    killed = net.kill_host(a)
    assert server.pid in killed and server.wait(10) == -9
    assert other.poll() is None  # the other machine lives on
    assert connect(net, b, b.address) == f"received hello {b.address}"


def test_each_host_has_its_own_temporary_folder_removed_with_the_network() -> None:
    """What a killed machine's processes left in their temporary folder (a preload server's socket folder)
    goes with the network, not into the test machine's /tmp."""
    make = "import tempfile; print(tempfile.mkdtemp(prefix='left-'))"
    with Network(2) as net:
        a, b = net.hosts
        left = [Path(net.run(h, [sys.executable, "-c", make], timeout=20).stdout.strip()) for h in (a, b)]
        assert left[0].parent == Path(a.tmpdir) and left[1].parent == Path(b.tmpdir) and a.tmpdir != b.tmpdir
        net.kill_host(a)
        assert left[0].is_dir()
    assert not any(path.exists() for path in left) and not Path(a.tmpdir).exists()


def test_shape_rate_limits_and_netem_says_when_the_kernel_cannot(make_network: MakeNetwork) -> None:
    net = make_network(2)
    a, b = net.hosts
    listen(net, a)
    net.shape(a, rate="1mbit")
    assert "tbf" in net.qdisc(a) and "rate 1Mbit" in net.qdisc(a)
    assert connect(net, b, a.address) == f"received hello {a.address}"  # slowed, not cut
    net.unshape(a)
    assert "tbf" not in net.qdisc(a)
    try:
        net.shape(a, delay_ms=20, loss_percent=1)
    except NetemUnavailable as exc:  # this project's test kernel: CONFIG_NET_SCH_NETEM is not set
        assert "CONFIG_NET_SCH_NETEM" in str(exc) and a.namespace in str(exc)
    else:
        assert "netem" in net.qdisc(a) and "delay 20ms" in net.qdisc(a)
        assert connect(net, b, a.address) == f"received hello {a.address}"
    with pytest.raises(ValueError, match=re.escape("loss_percent=150: expected 0..100")):
        net.shape(a, loss_percent=150)


def test_two_networks_at_once_take_different_subnets_that_nothing_else_uses(
make_network: MakeNetwork) -> None:
    before = used_networks()
    first, second = make_network(1), make_network(1)
    assert first.subnet is not None and second.subnet is not None
    assert not first.subnet.overlaps(second.subnet) and first.prefix != second.prefix
    assert not any(first.subnet.overlaps(u) or second.subnet.overlaps(u) for u in before)
    assert connect(first, first.hosts[0], second.hosts[0].address).startswith("failed OSError [Errno 101]")


def test_close_kills_every_process_and_removes_every_name_even_after_a_failure() -> None:
    net = Network(2)
    with pytest.raises(ZeroDivisionError), net:
        a, b = net.hosts
        started = [net.popen(host, ["sleep", "600"]).pid for host in (a, b)]
        # a process that left our process group (its own session): found inside the namespace by PID
        escape = "import subprocess as s; print(s.Popen(['sleep', '600'], start_new_session=True).pid)"
        started.append(int(net.run(b, [sys.executable, "-c", escape], timeout=20).stdout))
        assert all(pid_alive(pid) for pid in started)
        assert len(ours(net.prefix)) == 5  # 2 namespaces, 2 veths, the bridge
        1 / 0  # noqa: B018  the test fails here; the context manager still removes everything
    assert not any(pid_alive(pid) for pid in started)  # killed by PID
    assert ours(net.prefix) == [] and net.leftovers() == []


def test_sweep_removes_the_leftovers_of_a_dead_process_only() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert not pid_alive(dead.pid)
    alive = Network(1).create()  # (creating a network sweeps too: the stale one is made after it)
    stale = Network(1, prefix=f"lbd{dead.pid}z").create()  # as if pytest {dead.pid} had been SIGKILLed
    try:
        removed = sweep_stale()
        assert sorted(removed) == sorted(stale.names())
        assert ours(stale.prefix) == [] and len(ours(alive.prefix)) == 3
    finally:
        stale.close()
        alive.close()


def test_no_iproute2_or_no_root_fails_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(NetnsUnavailable, match="network namespaces need iproute2: no 'ip' or 'tc' on PATH="):
        check_available({"PATH": str(tmp_path)})
    with monkeypatch.context() as patch:
        patch.setenv("PATH", str(tmp_path))
        with pytest.raises(NetnsUnavailable, match="need iproute2"):
            Network(1).create()  # fails: the tests that need namespaces do not skip
    # an unprivileged user (nobody) is told it needs root
    nobody = "import os; from tests.netns import check_available; os.setuid(65534); check_available()"
    done = subprocess.run([sys.executable, "-c", nobody], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 1
    assert "NetnsUnavailable: network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN); this process " \
        "runs as uid 65534" in done.stderr
    check_available()  # this machine: root with iproute2 (the tests above need it and must not skip)
    assert os.geteuid() == 0


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match=re.escape("size=0: expected 1..200")):
        Network(0)
    with pytest.raises(ValueError, match="prefix='eth': expected 'lbd<pid><letter>'"):
        Network(1, prefix="eth")
