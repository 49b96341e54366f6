"""The coordinator's part of a machine's agent (:mod:`lightning_bamboo.control.agent`): what the one elected
agent decides for the whole job, apart from watching its own machine.

Held by every agent as a :class:`CoordinatorRole` whose :attr:`~CoordinatorRole.coordinator` is set while
this agent holds the ``coordinator`` key: it closes the rendezvous, collects what the agents report (exits,
workers started to join) and the machines whose lease expired or whose agent refuses connections
(:class:`PeerWatch`), and has the :class:`~lightning_bamboo.control.coordinator.Coordinator` decide every
next generation from them. What it learnt (exit codes, lost machines) outlives a term. A job on one machine
goes through the same role: its agent is elected at once and its workers' exits reach it as reports.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from lightning_bamboo.control import machines as mc
from lightning_bamboo.control.coordinator import Coordinator
from lightning_bamboo.control.workers import LocalWorkers
from lightning_bamboo.protocol import store as ms


class PeerWatch:
    """The other machines as this agent sees them: their leases, the machines counted lost (:attr:`dead`)
    and those whose agent refuses a connection (:attr:`refusing`, found by :meth:`probe`)."""

    def __init__(self, store: dist.Store, machine: int, lease: float, poll: float) -> None:
        self.store, self.machine, self.lease, self.poll = store, machine, lease, poll
        self.leases = mc.LeaseWatch(store, lease)
        self.dead: set[int] = set()
        self.refusing: set[int] = set()
        self._probed: tuple[int, int] = (-1, 0)  # (generation, lost-peer reports) of the last probe
        self._late_probed: dict[int, int | None] = {}  # machine -> its lease counter when last probed
        self.registered = 0  # machines registered, as the last :meth:`observe` read it

    def observe(self) -> None:
        """Read the number of machines registered and every live machine's lease counter (once per tick,
        before the election). The coordinator's decisions in the same tick use this count (:attr:`registered`)
        rather than reading it again: on etcd a re-read in a tick is a round trip of its own, and the
        coordinator's two were about a quarter of its requests (benchmarks/results/bamboo-elastic-history.md,
        "Where the CPU goes"). A machine registering meanwhile is seen at the next tick."""
        self.registered = mc.count(self.store)
        self.leases.observe([m for m in range(self.registered) if m not in self.dead])

    def vacant(self, holder: tuple[int, int] | None) -> bool:
        """Whether the coordinator ``holder`` (term, machine) is gone: none, its lease expired, counted lost
        or its agent refuses connections."""
        if holder is None:
            return True
        machine = holder[1]
        return (self.leases.expired(machine) or mc.is_dead(self.store, machine)) or machine in self.refusing

    def probe(self) -> None:
        """Add the machines whose agent refuses a connection (:class:`~lightning_bamboo.control.machines.
        Liveness`) to :attr:`refusing`, so that a machine whose processes died is lost at once, not a lease
        later. Probed: every machine once per new lost-peer report of the current generation's workers (a
        worker whose peer's connection was reset or closed), and a machine whose lease is late once per
        renewal it missed (its loss is found by no worker when none was talking to it: the survivors were
        waiting at the step's commit, say); and once one machine is found gone, every other. Once per tick,
        before the election and the decisions."""
        generation = ms.current_generation(self.store)
        reports = ms.lost_peer_reports(self.store, generation) if generation >= 0 else 0
        suspects = set()
        if reports and (generation, reports) != self._probed:
            self._probed = (generation, reports)
            suspects.update(range(mc.count(self.store)))
        for machine in self.leases.observed():  # no store read: the last tick's observation
            if self.leases.late(machine) and self._late_probed.get(machine) != self.leases.beat(machine):
                self._late_probed[machine] = self.leases.beat(machine)
                suspects.add(machine)
        if self._probe(suspects):  # machines are lost together (a zone, a rack): one found gone makes every
            # other a suspect, so that those whose lease is not late yet are lost in the same generation
            self._probe(set(range(mc.count(self.store))) - suspects)

    def probe_everyone(self) -> None:
        """Probe every machine not counted lost yet (see :meth:`probe`)."""
        self._probe(set(range(mc.count(self.store))))

    def _probe(self, suspects: set[int]) -> set[int]:
        """Adds those of ``suspects`` whose agent refuses a connection to :attr:`refusing`; returns them."""
        timeout = min(0.2, self.lease / 5)
        suspects = suspects - self.dead - self.refusing - {self.machine}
        found = {m for m in sorted(suspects) if mc.refuses(self.store, m, timeout)}
        self.refusing |= found
        return found

    def await_suspects(self) -> None:
        """Machines lost together (a zone, a rack) stop renewing at the same moment, but their last renewals
        are up to a renewal period apart: wait (at most lease/2) until every machine silent for more than
        half a lease has renewed or expired, so that they are lost in ONE generation."""
        deadline = time.monotonic() + self.lease / 2
        while True:
            machines = [m for m in range(mc.count(self.store)) if m != self.machine and m not in self.dead]
            self.leases.observe(machines)
            silent = [m for m in machines if self.leases.silent_for(m) > self.lease / 2]
            suspects = [m for m in silent if not self.leases.expired(m)]
            if not suspects or time.monotonic() > deadline:
                return
            time.sleep(self.poll)


@dataclass(frozen=True)
class JobShape:
    """What every agent of the job is given: its machine count bounds and workers per machine."""

    nproc_per_node: int
    min_nodes: int
    max_nodes: int
    rdzv_last_call: float


class CoordinatorRole:
    """The decisions of the elected agent (see the module docstring); :attr:`coordinator` is ``None`` while
    another agent coordinates.

    Args:
        store: the job's store.
        machine: this agent's machine.
        shape: the job's machine bounds and workers per machine.
        peers: the other machines' leases and liveness.
        local: this machine's workers (stopped when the job ends).
        settle: seconds to wait for losses that arrive together.
        stop_timeout: seconds the members of a ``stop`` generation have to exit.
        log: the agent's ``print``; ``say``: a line prefixed with the agent's name.
    """

    def __init__(
        self,
        store: dist.Store,
        machine: int,
        shape: JobShape,
        peers: PeerWatch,
        local: LocalWorkers,
        settle: float,
        stop_timeout: float,
        log: Callable[..., None],
        say: Callable[[str], None],
    ) -> None:
        self.store, self.machine, self.shape, self.peers, self.local = store, machine, shape, peers, local
        self.settle, self.stop_timeout, self.log, self.say = settle, stop_timeout, log, say
        self.coordinator: Coordinator | None = None
        self.decided: Coordinator | None = None
        """The coordinator of this agent's latest term, kept after it is deposed (the agent's record)."""
        self.codes: dict[int, int | None] = {}
        self.stopped: dict[str, object] | None = None
        """How this coordinator stopped the job (:meth:`stop_job`): reason, exit code, members killed late
        (``None`` until the agent knows)."""
        self._reports = mc.Reports(store)
        self._rendezvous: mc.Rendezvous | None = None
        self._risks_told = False
        self._formed0 = False
        self._ending: tuple[int, float] | None = None
        self._min_reached_at: float | None = None

    # ------------------------------------------------------------------ terms
    def become(self, holder: tuple[int, int] | None) -> None:
        """Take the role for the term of ``holder`` (read back after taking the key)."""
        term = holder[0] if holder else 0
        self.coordinator = self.decided = Coordinator(self.store, self.log, self.codes)
        self._reports = mc.Reports(self.store)
        if term > 0:
            self.say(f"took over as the coordinator (term {term}): the previous one's machine is lost "
                     "(its lease expired or its agent refuses connections)")
        else:
            self.say("is the coordinator")

    # ------------------------------------------------------------------ the rendezvous
    def close_rendezvous(self) -> None:
        """Close the rendezvous once ``min_nodes`` registered (at ``max_nodes``, or ``rdzv_last_call`` s
        later): deal generation 0's members over the machines (:func:`~lightning_bamboo.control.machines.
        placement`)."""
        shape = self.shape
        registered = mc.count(self.store)
        if registered < shape.min_nodes or self.store.check([mc.CLOSED]):
            return
        now = time.monotonic()
        if self._min_reached_at is None:
            self._min_reached_at = now
        if registered < shape.max_nodes and now - self._min_reached_at < shape.rdzv_last_call:
            return
        chosen = [m for m in range(min(registered, shape.max_nodes)) if not self.peers.leases.expired(m)]
        zones = {}
        for machine in chosen:
            info = mc.describe(self.store, machine) or {}
            if int(info.get("nproc", shape.nproc_per_node)) != shape.nproc_per_node:  # type: ignore[arg-type]
                raise ValueError(
                    f"machine {machine} runs {info.get('nproc')} workers but this one "
                    f"{shape.nproc_per_node}: give every agent the same --nproc-per-node"
                )
            zones[machine] = str(info.get("zone", ""))
        rendezvous = mc.placement(chosen, zones, shape.nproc_per_node)
        self.store.set("members/next", str(rendezvous.nproc))
        self.store.set("gen", "0")
        if self.store.compare_set(mc.CLOSED, "", rendezvous.to_json()).decode() == rendezvous.to_json():
            self.say(
                f"rendezvous closed: machines {rendezvous.order}, members "
                f"{ {m: rendezvous.members[m] for m in rendezvous.order} }"
            )

    # ------------------------------------------------------------------ every tick
    def coordinate(self) -> int | None:
        """One round of decisions; the job's exit code once it is over."""
        coordinator = self.coordinator
        assert coordinator is not None
        with coordinator.one_pass():
            return self._decide(coordinator)

    def _decide(self, coordinator: Coordinator) -> int | None:
        if self._ending is not None:
            return self._end_when_stopped()
        self._tell_risks()
        lost = self._collect()
        leaving = coordinator._departures()
        if lost or leaving:
            if lost:
                proven = {m for machine in self.peers.refusing for m in mc.members_of(self.store, machine)}
                if lost <= proven:  # found gone: no wait (a failover's time is the job's), one more probe
                    # of every machine groups the losses that are already visible
                    self.peers.probe_everyone()
                else:  # a lease expired: others may expire up to a renewal period later
                    time.sleep(self.settle)  # losses that arrive together are handled together
                    self.peers.await_suspects()
                    self.local.report(self.store, self.machine)  # this machine's among them
                lost |= self._collect()
                coordinator.lost |= lost
                leaving |= coordinator._departures()
            failure = coordinator._failure_in_code(lost)
            if failure is not None:
                self.stop_job(f"member {failure['member']} failed", 1)
                return None
            coordinator.departed |= leaving
            if not coordinator._reform(lost, [], leaving):
                return self._end(1)
        coordinator._advance_joins()
        if coordinator._job_done():
            return self._end(0)
        if self._none_formed():
            self.say("every worker exited before generation 0 formed")
            return self._end(1)
        return None

    def stop_job(self, reason: str, code: int) -> None:
        """Stop every member at a step boundary: publish a ``stop`` generation (each member leaves ``fit`` at
        its next boundary, all at the same committed step, after writing the final checkpoint when one is
        configured); the job ends with ``code`` once they have exited, or ``stop_timeout`` seconds later
        (each agent then SIGKILLs what is left of its workers by PID)."""
        coordinator = self.coordinator
        assert coordinator is not None
        members = coordinator._stop_generation()
        self.local.kill_all(set(self.local.live_members()) - members)  # no stage (spares): nothing to finish
        self.stopped = {"reason": reason, "code": code, "killed": None}
        self._ending = (code, time.monotonic() + self.stop_timeout)
        self.say(f"{reason}: stopping the workers at the next step boundary (at most {self.stop_timeout:g}s)")

    def _none_formed(self) -> bool:
        """Every member of the rendezvous exited before generation 0 formed (a script that is no Bamboo
        worker, or one that failed while starting): nothing will ever form it."""
        if self._formed0 or self.store.check(["gen0/map"]):
            self._formed0 = True
            return False
        members = {m for ms_ in self._closed().members.values() for m in ms_}
        coordinator = self.coordinator
        assert coordinator is not None
        return members <= set(self.codes) | coordinator.finished

    def _collect(self) -> set[int]:
        """Members newly lost: reported exits (non-zero) and every member of a machine whose lease expired
        or whose agent is gone (:meth:`PeerWatch.probe`)."""
        coordinator = self.coordinator
        assert coordinator is not None
        lost: set[int] = set()
        for entry in self._reports.new():
            member = int(entry["member"])
            if entry.get("joining"):  # started while the job runs: proposed to join once registered
                with coordinator._lock:
                    if member not in coordinator._pending_joins:
                        coordinator._pending_joins.append(member)
                    coordinator._added_at[member] = time.monotonic()
                self.say(f"member {member} (machine {entry['machine']}) joins")
                continue
            code = int(entry["code"])
            if code == 0:
                coordinator.finished.add(member)
            else:
                self.codes.setdefault(member, code)
                lost.add(member)
        dead = self.peers.dead
        for machine in range(self.peers.registered):
            if machine == self.machine:
                continue
            marked = mc.is_dead(self.store, machine)  # by an earlier coordinator
            expired = self.peers.leases.expired(machine)
            gone = machine in self.peers.refusing
            if machine not in dead and (marked or expired or gone):
                dead.add(machine)
                members = mc.members_of(self.store, machine)
                if marked:
                    self.say(f"machine {machine} was counted lost before; its members {members}")
                else:
                    mc.mark_dead(self.store, machine, by=self.machine, how="lease" if expired else "refused")
                    why = (f"lease not renewed for {self.peers.leases.silent_for(machine):.1f}s" if expired
                           else "its agent refuses connections (its processes are gone)")
                    self.say(f"machine {machine} lost: {why}; its members {members}")
            if machine in dead:
                for member in mc.members_of(self.store, machine):
                    if member not in coordinator.finished:
                        self.codes[member] = None  # lost with its machine: preempted, not a failure of code
                        lost.add(member)
        return (lost & self._placed()) - coordinator.lost

    def _placed(self) -> set[int]:
        """Members a loss concerns: those of the current generation (owners and spares), of a proposed join
        and the joiners waiting (a member lost and handled before, e.g. by an earlier coordinator, is not)."""
        coordinator = self.coordinator
        assert coordinator is not None
        _, current = coordinator._current()
        placed = set(current.members()) | set(current.spares) if current is not None else set()
        if coordinator._proposal is not None:
            placed |= set(coordinator._proposal[1].members())
        with coordinator._lock:
            return placed | set(coordinator._pending_joins)

    def _closed(self) -> mc.Rendezvous:
        """The rendezvous (read once: it never changes after it closed)."""
        if self._rendezvous is None:
            self._rendezvous = mc.Rendezvous.from_json(self.store.get(mc.CLOSED))
        return self._rendezvous

    def _tell_risks(self) -> None:
        """Once generation 0 has formed: which single machine (or zone) its redundancy cannot cover (the
        members say at forming whether they hold replicas)."""
        if self._risks_told or not self.store.check(["gen0/map"]):
            return
        replicas = ms.read_if_set(self.store, ms.REPLICAS)
        if replicas is None:
            return
        self._risks_told = True
        owners = ms.read_map(self.store, 0)
        rendezvous = self._closed()
        domains = {f"machine {m}": rendezvous.members[m] for m in rendezvous.order}
        zones: dict[str, list[int]] = {}
        for machine in rendezvous.order:
            zone = str((mc.describe(self.store, machine) or {}).get("zone", ""))
            if zone:
                zones.setdefault(f"zone {zone}", []).extend(rendezvous.members[machine])
        if len(zones) > 1:
            domains.update(zones)
        risks = mc.fallback_risks(owners, domains, replicas=replicas == b"1")
        self.store.set(mc.RISKS, json.dumps(risks))
        covered = "every single machine loss is covered by " + ("replicas" if replicas == b"1" else "peers")
        self.say("placement: " + ("; ".join(risks) if risks else covered))

    # ------------------------------------------------------------------ the end
    def _end_when_stopped(self) -> int | None:
        """After a ``stop`` generation: end the job once its members have exited (or the time is up)."""
        assert self._ending is not None and self.coordinator is not None
        code, deadline = self._ending
        self._collect()
        _, current = self.coordinator._current()
        members = set(current.members()) if current is not None else set()
        running = members - set(self.codes) - self.coordinator.finished
        if running and time.monotonic() <= deadline:
            return None
        if self.stopped is not None:
            self.stopped["killed"] = sorted(running)
            reason = self.stopped["reason"]
            late = f"; members {sorted(running)} did not stop in {self.stop_timeout:g}s" if running else ""
            self.say(f"job stopped ({reason}){late}; exit code {code}")
        return self._end(code)

    def _end(self, code: int) -> int:
        self.store.compare_set(mc.END, "", str(code))
        code = int(ms.get_str(self.store, mc.END))
        self.say(f"the job is over: exit code {code}")
        with contextlib.suppress(Exception):
            self.local.finish()
        return code
