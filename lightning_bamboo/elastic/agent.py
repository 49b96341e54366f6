"""One agent per machine of a multi-machine elastic Bamboo job (``python -m lightning_bamboo.launch --nnodes
MIN:MAX --nproc-per-node K --rdzv-endpoint etcd://HOST:PORT --job-id ID train.py``).

A spot preemption takes a whole machine, so the machine is the failure domain. Each agent:

* registers its machine in the store and keeps a *lease* there: a counter it bumps every renewal period (a
  fraction of the lease) on a store connection of its own (:mod:`lightning_bamboo.elastic.machines` has the
  keys);
* starts its ``K`` workers (:class:`~lightning_bamboo.elastic.workers.LocalWorkers`, each with
  ``BAMBOO_LOCAL_RANK``), watches them by PID and heartbeat and reports their exits into the store;
* fences itself: when it has not renewed its lease for the lease time (cut off from the store), it SIGKILLs
  its own workers by PID and exits (3), since the others have by then counted the machine as lost;
* takes part in electing the one coordinator: ``compare_set`` of the ``coordinator`` key, taken over by
  another agent when the holder's lease expires.

The coordinator (a :class:`~lightning_bamboo.elastic.coordinator.Coordinator`, the same decisions as the
one-machine supervisor's) closes the rendezvous once ``MIN`` machines registered (at ``MAX``, or
``--rdzv-last-call`` seconds after ``MIN``), deals generation 0's member ids so that stages alternate across
machines (:func:`~lightning_bamboo.elastic.machines.placement`) and says which single machine (or zone)
would force a checkpoint fallback. It then decides every generation from the workers' reported exits and
from leases: a machine whose lease expired is lost with all its members, as ONE membership change. A
machine registering after the rendezvous is a joiner: its members take fresh ids and join at a step
boundary, as on one machine. When every member of the current generation has finished, it writes the job's
end and every agent exits with that code.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from urllib.parse import urlparse

from lightning_bamboo.elastic import machines as mc
from lightning_bamboo.elastic import store as ms
from lightning_bamboo.elastic.coordinator import Coordinator, Superseded
from lightning_bamboo.elastic.workers import LocalWorkers, worker_env

FENCED = 3
"""An agent's exit code when it stopped its own workers because it could not renew its lease."""


def _unreachable(err: BaseException) -> bool:
    """Whether ``err`` says the store did not answer (a network failure), not a bug."""
    return isinstance(err, (OSError, TimeoutError)) or type(err).__module__.startswith("etcd3gw")


class NodeCoordinator(Coordinator):
    """The coordinator role of an agent: a :class:`Coordinator` fed by the store's reports and leases."""

    def __init__(self, store, log, codes: dict[int, int | None]) -> None:
        super().__init__(store, log)
        self.codes = codes

    def exit_codes(self, members: set[int]) -> dict[int, int | None]:
        return {m: self.codes.get(m) for m in members}


class Agent:
    """The agent of one machine (see the module docstring).

    Args:
        command: the worker command (``python train.py ...``).
        nproc_per_node: workers on this machine.
        store_url: ``etcd://host:port`` (or ``tcp://`` to a store another process serves).
        job: the job id every machine of the job is given.
        min_nodes, max_nodes: generation 0 starts with at least ``min_nodes`` machines, at most ``max_nodes``.
        node_lease: seconds without a lease renewal after which a machine is lost.
        zone: a coarser failure domain (machines of one zone can be lost together).
        rdzv_last_call: seconds to wait for more machines once ``min_nodes`` registered.
    """

    def __init__(
        self,
        command: list[str],
        nproc_per_node: int,
        store_url: str,
        job: str,
        min_nodes: int,
        max_nodes: int,
        node_lease: float = 5.0,
        zone: str = "",
        hang_timeout: float = 5.0,
        settle: float = 0.3,
        rdzv_last_call: float = 2.0,
        rdzv_timeout: float = 600.0,
        stop_timeout: float = 30.0,
        poll: float = 0.1,
        log=print,
    ) -> None:
        if nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
        if not 1 <= min_nodes <= max_nodes:
            raise ValueError(f"--nnodes MIN:MAX needs 1 <= MIN <= MAX, got {min_nodes}:{max_nodes}")
        if node_lease <= 0:
            raise ValueError(f"--node-lease must be > 0 seconds, got {node_lease}")
        self.command = command
        self.nproc_per_node = nproc_per_node
        self.store_url = store_url
        self.job = job
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.lease = node_lease
        self.zone = zone
        self.settle = settle
        self.rdzv_last_call = rdzv_last_call
        self.rdzv_timeout = rdzv_timeout
        self.stop_timeout = stop_timeout
        self.poll = poll
        self.log = log
        request_s = max(node_lease / 3, 0.5)  # a cut-off store answers nothing: notice within the lease
        self.store = ms.connect(store_url, job, request_timeout=max(request_s, 2.0))
        self._lease_store = ms.connect(store_url, job, request_timeout=request_s)
        self.local = LocalWorkers(command, self.store, hang_timeout, log, workers_on_machine=nproc_per_node)
        endpoint = urlparse(store_url)
        self.liveness = mc.Liveness((endpoint.hostname or "127.0.0.1", endpoint.port or 0))
        self.machine = mc.register(
            self.store, nproc_per_node, zone, socket.gethostname(), os.getpid(), self.liveness.address
        )
        self.leases = mc.LeaseWatch(self.store, node_lease)
        self.coordinator: NodeCoordinator | None = None
        self.members: list[int] = []
        self.lost: set[int] = set()
        self.finished: set[int] = set()
        self._reported: set[int] = set()
        self._renewed_at = time.monotonic()
        self._fenced = threading.Event()
        self._done = threading.Event()
        self._stop_signal: int | None = None
        self._drain_until: float | None = None
        # coordinator state
        self._codes: dict[int, int | None] = {}
        self._reports = mc.Reports(self.store)
        self._dead: set[int] = set()
        self._joiner_machines: set[int] = set()
        self._risks_told = False
        self._ending: tuple[int, float] | None = None
        self._min_reached_at: float | None = None
        self._probed: tuple[int, int] = (-1, 0)  # (generation, lost-peer reports) of the last probe
        self._refusing: set[int] = set()
        self._late_probed: dict[int, int | None] = {}  # machine -> its lease counter when last probed
        self.say(f"machine {self.machine} registered ({nproc_per_node} workers, zone {zone or '-'})")
        threading.Thread(target=self._renew, name="bamboo-lease", daemon=True).start()
        threading.Thread(target=self._watchdog, name="bamboo-fence", daemon=True).start()

    def say(self, text: str) -> None:
        self.log(f"[bamboo.agent {self.machine}] {text}", flush=True)

    # ------------------------------------------------------------------ lease and fencing
    def _renew(self) -> None:
        """Bump the lease every renewal period (:func:`~lightning_bamboo.elastic.machines.renewal_period`). A
        renewal counts from when it was *sent* (an observer may see it any time after), so this machine
        fences no later than the others count it lost. A renewal that failed (a request timed out, the store
        was slow or cut off) is retried at once, not a period later: one slow answer must not cost the
        machine its lease."""
        while not self._done.is_set() and not self._fenced.is_set():
            sent = time.monotonic()
            try:
                self._lease_store.add(f"node/{self.machine}/hb", 1)
                self._renewed_at = sent
                pause = mc.renewal_period(self.lease)
            except Exception:  # unreachable or slow: the watchdog fences when the lease runs out
                pause = min(self.poll, self.lease / 30)
            self._done.wait(pause)

    def _watchdog(self) -> None:
        while not self._done.wait(min(self.lease / 10, 0.1)):
            silent = time.monotonic() - self._renewed_at
            if silent > self.lease:
                self._fenced.set()
                killed = self.local.kill_all()
                self.say(
                    f"lease not renewed for {silent:.1f}s (the store at {self.store_url} cannot be reached): "
                    f"the others count this machine as lost; killed its workers {killed}"
                )
                return

    # ------------------------------------------------------------------ the agent's loop
    def stop(self, signum: int = signal.SIGTERM) -> None:
        self._stop_signal = signum

    def run(self) -> int:
        """Rendezvous, start the workers, watch until the job ends; returns the exit code."""
        handler = None
        if threading.current_thread() is threading.main_thread():
            handler = signal.signal(signal.SIGTERM, lambda signum, _frame: self.stop(signum))
        try:
            return self._run()
        finally:
            self._done.set()
            self.local.kill_all()
            self.liveness.close()
            if handler is not None:
                signal.signal(signal.SIGTERM, handler)

    def _run(self) -> int:
        deadline = time.monotonic() + self.rdzv_timeout
        rendezvous = None
        while rendezvous is None:
            if self._fenced.is_set():
                return FENCED
            if time.monotonic() > deadline:
                self.say(
                    f"rendezvous not closed in {self.rdzv_timeout:g}s: {mc.count(self.store)} of at least "
                    f"{self.min_nodes} machines registered"
                )
                return 1
            if self.store.check([mc.END]):  # a machine started after the job ended (a late replacement)
                code = int(ms.get_str(self.store, mc.END))
                self.say(f"the job is already over (exit code {code}): nothing to join")
                return code
            self._elect()
            if self.coordinator is not None:
                self._close_rendezvous()
            if self.store.check([mc.CLOSED]):
                rendezvous = mc.Rendezvous.from_json(self.store.get(mc.CLOSED))
            else:
                time.sleep(self.poll)
        self._start_workers(rendezvous)
        while True:
            if self._fenced.is_set():
                return FENCED
            try:
                code = self._tick()
            except Superseded as err:  # deposed while deciding: the other coordinator's map stands
                self.say(f"{err}: no longer the coordinator")
                self.coordinator = None
                continue
            except Exception as err:
                if self._fenced.is_set():
                    return FENCED
                if not _unreachable(err):
                    raise
                # the store did not answer: retry until it does, or until the lease runs out (the watchdog
                # then fences this machine)
                self.say(f"the store did not answer ({type(err).__name__}); retrying")
                time.sleep(self.poll)
                continue
            if code is not None:
                return code
            time.sleep(self.poll)

    def _start_workers(self, rendezvous: mc.Rendezvous) -> None:
        if self.machine in rendezvous.members:
            self.members, joining = rendezvous.members[self.machine], False
        else:  # a machine that came after the rendezvous: its workers join the running job
            end = int(self.store.add("members/next", self.nproc_per_node))
            self.members, joining = list(range(end - self.nproc_per_node, end)), True
        self.store.set(f"node/{self.machine}/members", json.dumps(self.members))
        self.say(f"{'joining' if joining else 'generation 0'}: members {self.members}")
        for member in self.members:
            self.local.start(member, worker_env(self.store_url, self.job, member, rendezvous.nproc, joining))

    def _tick(self) -> int | None:
        """One pass: the job's end, this machine declared lost, the local workers, the election, and (as the
        coordinator) the decisions. Returns an exit code when this agent is done."""
        if self.store.check([mc.END]):
            code = int(ms.get_str(self.store, mc.END))
            self.local.kill_all()
            self.say(f"job ended with exit code {code}")
            return code
        if self.store.check([f"node/{self.machine}/dead"]):
            killed = self.local.kill_all()
            self.say(f"this machine was counted as lost (its lease expired); killed its workers {killed}")
            return FENCED
        if self._stop_signal is not None and self._drain_until is None:
            self._drain_local()
        for member in self.local.check(self.lost, self.finished, set()):
            self.lost.add(member)
        for member in sorted((self.lost | self.finished) - self._reported):
            code = self.local.returncode(member)
            mc.report(self.store, self.machine, member, 0 if code is None else code)
            self._reported.add(member)
        self._probe()
        self._elect()
        code = self._coordinate() if self.coordinator is not None else None
        drained = self._drain_until is not None and (
            self.local.all_exited() or time.monotonic() > self._drain_until
        )
        if code is None and drained:
            killed = self.local.kill_all()
            late = f"; killed {killed} (not gone in {self.stop_timeout:g}s)" if killed else ""
            code = 128 + (self._stop_signal or signal.SIGTERM)
            self.say(f"this machine's workers left{late}: exit {code}")
        return code

    def _drain_local(self) -> None:
        """SIGTERM to the agent (the machine is being taken away with notice): pass it to the workers, which
        leave at a step boundary (an announced departure: the coordinator, maybe this agent, publishes the
        generation without them); the agent exits 143 once they are gone (at most ``stop_timeout`` s)."""
        signum = self._stop_signal or signal.SIGTERM
        members = self.local.live_members()
        for member in members:
            self.local.kill(member, signum)
        # said once every worker has the signal (a watcher of this log then knows they all have it)
        self.say(f"{signal.Signals(signum).name} received: passed to workers {members}; draining the machine")
        self._drain_until = time.monotonic() + self.stop_timeout

    # ------------------------------------------------------------------ election
    def _elect(self) -> None:
        machines = list(range(mc.count(self.store)))
        self.leases.observe([m for m in machines if m not in self._dead])
        holder = mc.coordinator(self.store)
        if holder is not None and holder[1] == self.machine:
            if self.coordinator is None:
                self._become_coordinator(holder)
            return
        if self.coordinator is not None:  # deposed (a term passed while this agent did not renew in time)
            self.say(f"machine {holder[1] if holder else '?'} is the coordinator now")
            self.coordinator = None
        vacant = holder is None or self.leases.expired(holder[1]) or mc.is_dead(self.store, holder[1])
        vacant = vacant or holder[1] in self._refusing
        if vacant and mc.take_coordinator(self.store, self.machine, holder):
            self._become_coordinator(mc.coordinator(self.store))

    def _become_coordinator(self, holder: tuple[int, int] | None) -> None:
        term = holder[0] if holder else 0
        self.coordinator = NodeCoordinator(self.store, self.log, self._codes)
        self._reports = mc.Reports(self.store)
        if term > 0:
            self.say(f"took over as the coordinator (term {term}): the previous one's machine is lost "
                     "(its lease expired or its agent refuses connections)")
        else:
            self.say("is the coordinator")

    # ------------------------------------------------------------------ the coordinator's part
    def _close_rendezvous(self) -> None:
        registered = mc.count(self.store)
        if registered < self.min_nodes or self.store.check([mc.CLOSED]):
            return
        now = time.monotonic()
        if self._min_reached_at is None:
            self._min_reached_at = now
        if registered < self.max_nodes and now - self._min_reached_at < self.rdzv_last_call:
            return
        chosen = [m for m in range(min(registered, self.max_nodes)) if not self.leases.expired(m)]
        zones = {}
        for machine in chosen:
            info = mc.describe(self.store, machine) or {}
            if int(info.get("nproc", self.nproc_per_node)) != self.nproc_per_node:  # type: ignore[arg-type]
                raise ValueError(
                    f"machine {machine} runs {info.get('nproc')} workers but this one "
                    f"{self.nproc_per_node}: give every agent the same --nproc-per-node"
                )
            zones[machine] = str(info.get("zone", ""))
        rendezvous = mc.placement(chosen, zones, self.nproc_per_node)
        self.store.set("members/next", str(rendezvous.nproc))
        self.store.set("gen", "0")
        if self.store.compare_set(mc.CLOSED, "", rendezvous.to_json()).decode() == rendezvous.to_json():
            self.say(
                f"rendezvous closed: machines {rendezvous.order}, members "
                f"{ {m: rendezvous.members[m] for m in rendezvous.order} }"
            )

    def _coordinate(self) -> int | None:
        coordinator = self.coordinator
        assert coordinator is not None
        if self._ending is not None:
            return self._end_when_stopped()
        self._tell_risks()
        lost = self._collect()
        leaving = coordinator._departures()
        if lost or leaving:
            if lost:
                proven = {m for machine in self._refusing for m in mc.members_of(self.store, machine)}
                if not lost <= proven:  # machines found gone by one probe need no wait to be grouped
                    time.sleep(self.settle)  # losses that arrive together are handled together
                    self._await_suspects()
                lost |= self._collect()
                coordinator.lost |= lost
                leaving |= coordinator._departures()
            if coordinator._failure_in_code(lost) is not None:
                coordinator._stop_generation()
                self._ending = (1, time.monotonic() + self.stop_timeout)
                return None
            coordinator.departed |= leaving
            if not coordinator._reform(lost, [], leaving):
                return self._end(1)
        self._find_joiners()
        coordinator._advance_joins()
        if coordinator._job_done():
            return self._end(0)
        return None

    def _await_suspects(self) -> None:
        """Machines lost together (a zone, a rack) stop renewing at the same moment, but their last renewals
        are up to a renewal period apart: wait (at most lease/2) until every machine silent for more than
        half a lease has renewed or expired, so that they are lost in ONE generation."""
        deadline = time.monotonic() + self.lease / 2
        while True:
            machines = [m for m in range(mc.count(self.store)) if m != self.machine and m not in self._dead]
            self.leases.observe(machines)
            silent = [m for m in machines if self.leases.silent_for(m) > self.lease / 2]
            suspects = [m for m in silent if not self.leases.expired(m)]
            if not suspects or time.monotonic() > deadline:
                return
            time.sleep(self.poll)

    def _probe(self) -> None:
        """Add the machines whose agent refuses a connection (:class:`~lightning_bamboo.elastic.machines.
        Liveness`) to :attr:`_refusing`, so that a machine whose processes died is lost at once, not a lease
        later. Probed: every machine once per new lost-peer report of the current generation's workers (a
        worker whose peer's connection was reset or closed), and a machine whose lease is late once per
        renewal it missed (its loss is found by no worker when none was talking to it: the survivors were
        waiting at the step's commit, say). Once per tick, before the election and the decisions."""
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
        suspects -= self._dead | {self.machine}
        timeout = min(0.2, self.lease / 5)
        self._refusing |= {m for m in sorted(suspects) if mc.refuses(self.store, m, timeout)}

    def _collect(self) -> set[int]:
        """Members newly lost: reported exits (non-zero) and every member of a machine whose lease expired
        or whose agent is gone (:meth:`_probe`)."""
        coordinator = self.coordinator
        assert coordinator is not None
        lost: set[int] = set()
        for entry in self._reports.new():
            member, code = int(entry["member"]), int(entry["code"])
            if code == 0:
                coordinator.finished.add(member)
            else:
                self._codes.setdefault(member, code)
                lost.add(member)
        for machine in range(mc.count(self.store)):
            if machine == self.machine:
                continue
            marked = mc.is_dead(self.store, machine)  # by an earlier coordinator
            expired = self.leases.expired(machine)
            gone = machine in self._refusing
            if machine not in self._dead and (marked or expired or gone):
                self._dead.add(machine)
                members = mc.members_of(self.store, machine)
                if marked:
                    self.say(f"machine {machine} was counted lost before; its members {members}")
                else:
                    self.store.set(f"node/{machine}/dead", "1")
                    why = (f"lease not renewed for {self.leases.silent_for(machine):.1f}s" if expired
                           else "its agent refuses connections (its processes are gone)")
                    self.say(f"machine {machine} lost: {why}; its members {members}")
            if machine in self._dead:
                for member in mc.members_of(self.store, machine):
                    if member not in coordinator.finished:
                        self._codes[member] = None  # lost with its machine: preempted, not a failure of code
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

    def _find_joiners(self) -> None:
        """Members of machines that registered after the rendezvous: proposed to join once registered."""
        coordinator = self.coordinator
        assert coordinator is not None
        rendezvous = mc.Rendezvous.from_json(self.store.get(mc.CLOSED))
        for machine in range(mc.count(self.store)):
            if machine in rendezvous.members or machine in self._joiner_machines or machine in self._dead:
                continue
            members = mc.members_of(self.store, machine)
            if members:
                self._joiner_machines.add(machine)
                with coordinator._lock:
                    coordinator._pending_joins += [m for m in members if m not in coordinator._pending_joins]
                    for member in members:
                        coordinator._added_at[member] = time.monotonic()
                self.say(f"machine {machine} joins with members {members}")

    def _tell_risks(self) -> None:
        """Once generation 0 exists: which single machine (or zone) the replicas cannot cover."""
        if self._risks_told or not self.store.check(["gen0/map"]):
            return
        self._risks_told = True
        owners = ms.read_map(self.store, 0)
        rendezvous = mc.Rendezvous.from_json(self.store.get(mc.CLOSED))
        domains = {f"machine {m}": rendezvous.members[m] for m in rendezvous.order}
        zones: dict[str, list[int]] = {}
        for machine in rendezvous.order:
            zone = str((mc.describe(self.store, machine) or {}).get("zone", ""))
            if zone:
                zones.setdefault(f"zone {zone}", []).extend(rendezvous.members[machine])
        if len(zones) > 1:
            domains.update(zones)
        risks = mc.fallback_risks(owners, domains)
        covered = "every single machine loss is covered by replicas"
        self.say("placement: " + ("; ".join(risks) if risks else covered))

    def _end_when_stopped(self) -> int | None:
        """After a ``stop`` generation: end the job once its members have exited (or the time is up)."""
        assert self._ending is not None and self.coordinator is not None
        code, deadline = self._ending
        self._collect()
        _, current = self.coordinator._current()
        members = set(current.members()) if current is not None else set()
        if time.monotonic() > deadline or members <= set(self._codes) | self.coordinator.finished:
            return self._end(code)
        return None

    def _end(self, code: int) -> int:
        self.store.compare_set(mc.END, "", str(code))
        code = int(ms.get_str(self.store, mc.END))
        self.say(f"the job is over: exit code {code}")
        with contextlib.suppress(Exception):
            self.local.kill_all()
        return code
