"""The machines of a multi-machine elastic Bamboo job, as the store sees them (pure over a store; the
processes are :mod:`lightning_bamboo.control.agent`).

Keys (under the job's prefix, next to those of :mod:`lightning_bamboo.protocol.store`):

* ``nodes/count``: machines registered so far; a machine's index is its arrival order (``store.add``).
* ``node/{i}``: its description (JSON: workers, zone, host, agent PID, the agent's liveness address);
  ``node/{i}/members``: its members'
  ids (JSON list); ``node/{i}/hb``: its lease, a counter the agent bumps every :func:`renewal_period`;
  ``node/{i}/dead``: written by the coordinator when the lease expired (the machine is lost, with all its
  members; an agent that finds its own machine dead stops its workers).
* ``coordinator``: ``"{term}:{machine}"``, the agent deciding membership. Taken with ``compare_set`` from the
  value read, when the holder's lease has expired: one winner per term.
* ``rdzv/closed``: the rendezvous (JSON: the machines of generation 0 in placement order, the members of
  each, the member count); ``members/next``: the next free member id for machines that come later (joiners,
  ids taken with ``store.add``).
* ``reports/count``, ``reports/{k}``: what agents saw happen to their workers (JSON: machine, member, exit
  code; or ``joining``: a worker started while the job runs), an append-only log every coordinator reads
  from the start, so a coordinator that takes over knows it all.
* ``job/end``: the job's exit code, written by the coordinator when the job is over (every agent then stops).
* ``placement/risks``: JSON list of the single machines (or zones) whose loss the replicas cannot cover
  (:func:`fallback_risks`), written by the coordinator once generation 0 exists.

Leases are judged by the observer's own clock (a counter that stops changing for ``lease`` seconds), so
machines need no synchronised clocks.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_bamboo.layout.ownership import FallbackNeeded, OwnershipMap, failover
from lightning_bamboo.protocol import store as ms

RENEWALS_PER_LEASE = 6
"""An agent renews its machine's lease this many times per lease (every ``lease / RENEWALS_PER_LEASE`` s,
:func:`renewal_period`); observers call a machine :meth:`LeaseWatch.late` after a missed renewal."""

COORDINATOR = "coordinator"
CLOSED = "rdzv/closed"
RISKS = "placement/risks"
END = "job/end"


def renewal_period(lease: float) -> float:
    """Seconds between two renewals of a ``lease``-second lease."""
    return lease / RENEWALS_PER_LEASE


def register(store: dist.Store, nproc: int, zone: str, host: str, pid: int, liveness: str = "") -> int:
    """Register this machine; returns its index."""
    index = int(store.add("nodes/count", 1)) - 1
    description = {"nproc": nproc, "zone": zone, "host": host, "pid": pid, "liveness": liveness}
    store.set(f"node/{index}", json.dumps(description))
    return index


class Liveness:
    """The agent's liveness socket: a TCP port on the address the machine reaches the store from.

    A lease can only tell a lost machine by its silence (seconds). When a machine's processes die while its
    host stays up (a spot machine's processes SIGKILLed, an OOM kill, a container stopped), a connection to
    this port is *refused* at once: proof that the agent is gone, with its workers. A machine taken away
    whole answers nothing, and then only its lease tells (:func:`refuses` says no).
    """

    def __init__(self, toward: tuple[str, int]) -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as route:  # no packet: picks the interface
            route.connect(toward)
            host = route.getsockname()[0]
        self._server = socket.create_server((host, 0))
        self.address = f"{host}:{self._server.getsockname()[1]}"
        threading.Thread(target=self._accept, name="bamboo-liveness", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._server.accept()
            except OSError:
                return
            connection.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):  # wakes the accepting thread: the port refuses from now on
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()


def refuses(store: dist.Store, index: int, timeout: float) -> bool:
    """Whether machine ``index``'s agent refuses a connection (its host answered: nothing listens, the agent
    is gone). A timeout or an unreachable host is no proof (a partition, a machine taken away)."""
    address = str((describe(store, index) or {}).get("liveness") or "")
    if not address:
        return False
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


def count(store: dist.Store) -> int:
    return int(store.add("nodes/count", 0))


def describe(store: dist.Store, index: int) -> dict[str, object] | None:
    value = ms.read_if_set(store, f"node/{index}")
    return json.loads(value) if value is not None else None


def members_of(store: dist.Store, index: int) -> list[int]:
    value = ms.read_if_set(store, f"node/{index}/members")
    return [int(m) for m in json.loads(value)] if value is not None else []


def is_dead(store: dist.Store, index: int) -> bool:
    return store.check([f"node/{index}/dead"])


LOSS_HOW = ("lease", "refused")
"""How a coordinator finds a machine lost: its lease not renewed, or its agent refusing connections."""


def mark_dead(store: dist.Store, index: int, by: int, how: str) -> None:
    """Count machine ``index`` lost, found by the coordinator on machine ``by`` (``how``: see LOSS_HOW)."""
    if how not in LOSS_HOW:
        raise ValueError(f"how must be one of {LOSS_HOW}, got {how!r}")
    store.set(f"node/{index}/dead", json.dumps({"by": by, "how": how}))


def loss_of(store: dist.Store, index: int) -> dict[str, Any] | None:
    """Who found machine ``index`` lost and how (:func:`mark_dead`), or ``None`` while it is not."""
    value = ms.read_if_set(store, f"node/{index}/dead")
    return json.loads(value) if value is not None else None


@dataclass(frozen=True)
class Rendezvous:
    """Generation 0's machines: ``order`` (placement order), ``members`` per machine, ``nproc`` in all."""

    order: list[int]
    members: dict[int, list[int]]
    nproc: int

    def to_json(self) -> str:
        members = {str(k): v for k, v in self.members.items()}
        return json.dumps({"order": self.order, "members": members, "nproc": self.nproc})

    @classmethod
    def from_json(cls, text: str | bytes) -> Rendezvous:
        data = json.loads(text)
        return cls(
            [int(i) for i in data["order"]],
            {int(k): [int(m) for m in v] for k, v in data["members"].items()},
            int(data["nproc"]),
        )


def placement(machines: list[int], zones: dict[int, str], nproc_per_node: int) -> Rendezvous:
    """Member ids for generation 0, so that stages alternate across machines.

    Generation 0 makes member ``m`` stage ``m % S`` of pipeline ``m // S``
    (:func:`~lightning_bamboo.layout.ownership.initial`), so consecutive ids are adjacent stages (and the
    ring's neighbours, which hold each other's replica, are ``S - 1`` apart). Dealing the ids round-robin
    over the machines puts consecutive ids on different machines whenever there are two or more, and a
    stage and its replica holder on different machines unless the machine count divides ``S - 1``.
    Machines are ordered so that zones alternate too (round-robin over the zones, each zone's machines in
    arrival order), which extends the same rule to zones when there are enough of them.
    """
    by_zone: dict[str, list[int]] = {}
    for machine in sorted(machines):
        by_zone.setdefault(zones.get(machine, ""), []).append(machine)
    queues = [list(q) for _, q in sorted(by_zone.items(), key=lambda kv: kv[1][0])]
    order: list[int] = []
    while any(queues):
        for queue in queues:
            if queue:
                order.append(queue.pop(0))
    n = len(order)
    members = {machine: [p + n * j for j in range(nproc_per_node)] for p, machine in enumerate(order)}
    return Rendezvous(order, members, n * nproc_per_node)


def fallback_risks(owners: OwnershipMap, domains: dict[str, list[int]], replicas: bool = True) -> list[str]:
    """Which single failure domains (a machine, a zone: name -> its members) the job's redundancy cannot
    cover (their loss falls back to the checkpoint), and which drop a whole pipeline; one line each.
    ``replicas=False`` (``recovery="peers"``): only data-parallel peers cover a loss, so a machine holding
    one stage of every pipeline is a fallback there and covered by the replicas otherwise."""
    lines = []
    for name, members in sorted(domains.items()):
        lost = set(members) & set(owners.members())
        if not lost:
            continue
        try:
            new = failover(owners, lost, replicas=replicas)
        except FallbackNeeded:
            lines.append(f"losing {name} (members {sorted(lost)}) falls back to the last checkpoint")
            continue
        dropped = len(owners.pipelines) - len(new.pipelines)
        if dropped:
            lines.append(f"losing {name} (members {sorted(lost)}) drops {dropped} pipeline(s)")
    return lines


def report(store: dist.Store, machine: int, member: int, code: int) -> None:
    """Append what happened to a local worker (``code``: its exit code, negative for a signal)."""
    _append(store, {"machine": machine, "member": member, "code": code})


def report_joining(store: dist.Store, machine: int, member: int) -> None:
    """Append that a worker was started to join the running job (a replacement, a machine that came late)."""
    _append(store, {"machine": machine, "member": member, "joining": True})


def _append(store: dist.Store, entry: dict[str, object]) -> None:
    index = int(store.add("reports/count", 1)) - 1
    store.set(f"reports/{index}", json.dumps(entry))


class Reports:
    """Reads the report log from the start, once each entry."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        self.seen = 0

    def new(self, wait: float = 5.0) -> list[dict[str, int]]:
        """Entries not read yet. The writer bumps the count before it writes the entry: one missing is
        waited for ``wait`` seconds, then skipped (its writer died in between, with its machine)."""
        total = int(self.store.add("reports/count", 0))
        out = []
        while self.seen < total:
            key = f"reports/{self.seen}"
            with contextlib.suppress(TimeoutError, dist.DistStoreError):
                self.store.wait([key], timedelta(seconds=wait))
                out.append(json.loads(self.store.get(key)))
            self.seen += 1
        return out


class LeaseWatch:
    """Each machine's lease as seen from here: when its counter last changed (this process's clock)."""

    def __init__(self, store: dist.Store, lease: float) -> None:
        self.store = store
        self.lease = lease
        self._seen: dict[int, tuple[int, float]] = {}

    def observe(self, machines: list[int]) -> None:
        now = time.monotonic()
        for machine in machines:
            key = f"node/{machine}/hb"
            beat = int(self.store.add(key, 0))  # a read (EtcdStore, TCPStore)
            last = self._seen.get(machine)
            if last is None or last[0] != beat:
                self._seen[machine] = (beat, now)

    def silent_for(self, machine: int) -> float:
        """Seconds since ``machine``'s lease was last renewed (0 for one not observed yet)."""
        last = self._seen.get(machine)
        return 0.0 if last is None else time.monotonic() - last[1]

    def expired(self, machine: int) -> bool:
        return self.silent_for(machine) > self.lease

    def observed(self) -> list[int]:
        """The machines observed so far (only they can be :meth:`late`)."""
        return sorted(self._seen)

    def beat(self, machine: int) -> int | None:
        """The last counter value seen for ``machine`` (``None`` before the first observation)."""
        last = self._seen.get(machine)
        return None if last is None else last[0]

    def late(self, machine: int) -> bool:
        """Whether ``machine`` missed a renewal (:func:`renewal_period`): silent for more than a renewal
        period and a quarter. Not proof of anything (a loaded machine renews late), only a reason to look
        (:func:`refuses`)."""
        return self.silent_for(machine) > renewal_period(self.lease) * 1.25


def coordinator(store: dist.Store) -> tuple[int, int] | None:
    """``(term, machine)`` of the current coordinator, ``None`` before the first."""
    value = ms.read_if_set(store, COORDINATOR)
    if value is None:
        return None
    term, machine = value.decode().split(":")
    return int(term), int(machine)


def take_coordinator(store: dist.Store, machine: int, holder: tuple[int, int] | None) -> bool:
    """Become the coordinator in place of ``holder`` (``None``: the first); ``True`` when this machine won."""
    expected = "" if holder is None else f"{holder[0]}:{holder[1]}"
    mine = f"{0 if holder is None else holder[0] + 1}:{machine}"
    return store.compare_set(COORDINATOR, expected, mine).decode() == mine
