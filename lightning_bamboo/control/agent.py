"""One agent per machine of a multi-machine elastic Bamboo job (``python -m lightning_bamboo.launch --nnodes
MIN:MAX --nproc-per-node K --rdzv-endpoint etcd://HOST:PORT --job-id ID train.py``).

A spot preemption takes a whole machine, so the machine is the failure domain. Each agent:

* registers its machine in the store and keeps a *lease* there: a counter it bumps every renewal period (a
  fraction of the lease) on a store connection of its own (:mod:`lightning_bamboo.control.machines` has the
  keys);
* starts its ``K`` workers (:class:`~lightning_bamboo.control.workers.LocalWorkers`, each with
  ``BAMBOO_LOCAL_RANK``), watches them by PID and heartbeat and reports their exits into the store;
* fences itself: when it has not renewed its lease for the lease time (cut off from the store), it SIGKILLs
  its own workers by PID and exits (3), since the others have by then counted the machine as lost;
* takes part in electing the one coordinator: ``compare_set`` of the ``coordinator`` key, taken over by
  another agent when the holder's lease expires.

The coordinator (:class:`~lightning_bamboo.control.node_coordinator.CoordinatorRole` over a
:class:`~lightning_bamboo.control.coordinator.Coordinator`, the same decisions as the one-machine
supervisor's) closes the rendezvous once ``MIN`` machines registered (at ``MAX``, or
``--rdzv-last-call`` seconds after ``MIN``), deals generation 0's member ids so that stages alternate across
machines (:func:`~lightning_bamboo.control.machines.placement`) and says which single machine (or zone)
would force a checkpoint fallback. It then decides every generation from the workers' reported exits and
from leases: a machine whose lease expired is lost with all its members, as ONE membership change. A
machine registering after the rendezvous is a joiner: its members take fresh ids and join at a step
boundary, as on one machine. When every member of the current generation has finished, it writes the job's
end and every agent exits with that code.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from urllib.parse import urlparse

import torch.distributed as dist

from lightning_bamboo.control import machines as mc
from lightning_bamboo.control import store as ms
from lightning_bamboo.control.coordinator import Superseded
from lightning_bamboo.control.node_coordinator import CoordinatorRole, JobShape, NodeCoordinator, PeerWatch
from lightning_bamboo.control.workers import LocalWorkers, worker_env

__all__ = ["FENCED", "Agent", "LeaseKeeper", "NodeCoordinator"]

FENCED = 3
"""An agent's exit code when it stopped its own workers because it could not renew its lease."""


def _unreachable(err: BaseException) -> bool:
    """Whether ``err`` says the store did not answer (a network failure), not a bug."""
    return isinstance(err, (OSError, TimeoutError)) or type(err).__module__.startswith("etcd3gw")


class LeaseKeeper:
    """This machine's own lease: bumps it on a store connection of its own and fences the machine (SIGKILLs
    its workers by PID, sets :attr:`fenced`) when it could not renew it for a whole lease. Two daemon threads,
    started by :meth:`start`, stopped by :attr:`done`."""

    def __init__(self, store: dist.Store, machine: int, lease: float, poll: float, store_url: str,
                 local: LocalWorkers, say: Callable[[str], None]) -> None:
        self.store, self.machine, self.lease, self.poll = store, machine, lease, poll
        self.store_url, self.local, self.say = store_url, local, say
        self.renewed_at = time.monotonic()
        self.fenced = threading.Event()
        self.done = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._renew, name="bamboo-lease", daemon=True).start()
        threading.Thread(target=self._watchdog, name="bamboo-fence", daemon=True).start()

    def _renew(self) -> None:
        """Bump the lease every renewal period (:func:`~lightning_bamboo.control.machines.renewal_period`). A
        renewal counts from when it was *sent* (an observer may see it any time after), so this machine
        fences no later than the others count it lost. A renewal that failed (a request timed out, the store
        was slow or cut off) is retried at once, not a period later: one slow answer must not cost the
        machine its lease."""
        while not self.done.is_set() and not self.fenced.is_set():
            sent = time.monotonic()
            try:
                self.store.add(f"node/{self.machine}/hb", 1)
                self.renewed_at = sent
                pause = mc.renewal_period(self.lease)
            except Exception:  # unreachable or slow: the watchdog fences when the lease runs out
                pause = min(self.poll, self.lease / 30)
            self.done.wait(pause)

    def _watchdog(self) -> None:
        while not self.done.wait(min(self.lease / 10, 0.1)):
            silent = time.monotonic() - self.renewed_at
            if silent > self.lease:
                self.fenced.set()
                killed = self.local.kill_all()
                self.say(
                    f"lease not renewed for {silent:.1f}s (the store at {self.store_url} cannot be reached): "
                    f"the others count this machine as lost; killed its workers {killed}"
                )
                return


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
        preload: fork the workers from a preload server (:mod:`lightning_bamboo.control.preload`).
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
        preload: bool = True,
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
        self.local = LocalWorkers(command, self.store, hang_timeout, log, workers_on_machine=nproc_per_node,
                                  preload=preload)
        endpoint = urlparse(store_url)
        self.liveness = mc.Liveness((endpoint.hostname or "127.0.0.1", endpoint.port or 0))
        self.machine = mc.register(
            self.store, nproc_per_node, zone, socket.gethostname(), os.getpid(), self.liveness.address
        )
        self.own_lease = LeaseKeeper(ms.connect(store_url, job, request_timeout=request_s), self.machine,
                                     node_lease, poll, store_url, self.local, self.say)
        self.peers = PeerWatch(self.store, self.machine, node_lease, poll)
        shape = JobShape(nproc_per_node, min_nodes, max_nodes, rdzv_last_call)
        self.role = CoordinatorRole(self.store, self.machine, shape, self.peers, self.local, settle,
                                    stop_timeout, log, self.say)
        self.members: list[int] = []
        self.lost: set[int] = set()
        self.finished: set[int] = set()
        self._reported: set[int] = set()
        self._stop_signal: int | None = None
        self._drain_until: float | None = None
        self.say(f"machine {self.machine} registered ({nproc_per_node} workers, zone {zone or '-'})")
        self.own_lease.start()

    def say(self, text: str) -> None:
        self.log(f"[bamboo.agent {self.machine}] {text}", flush=True)

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
            self.own_lease.done.set()
            self.local.kill_all()
            self.liveness.close()
            if handler is not None:
                signal.signal(signal.SIGTERM, handler)

    def _run(self) -> int:
        deadline = time.monotonic() + self.rdzv_timeout
        rendezvous = None
        while rendezvous is None:
            if self.own_lease.fenced.is_set():
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
            with ms.one_pass(self.store):
                self._elect()
                if self.role.coordinator is not None:
                    self.role.close_rendezvous()
                closed = ms.read_if_set(self.store, mc.CLOSED)
            if closed is not None:
                rendezvous = mc.Rendezvous.from_json(closed)
            else:
                time.sleep(self.poll)
        self._start_workers(rendezvous)
        while True:
            if self.own_lease.fenced.is_set():
                return FENCED
            try:
                with ms.one_pass(self.store):
                    code = self._tick()
            except Superseded as err:  # deposed while deciding: the other coordinator's map stands
                self.say(f"{err}: no longer the coordinator")
                self.role.coordinator = None
                continue
            except Exception as err:
                if self.own_lease.fenced.is_set():
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
        end = ms.read_if_set(self.store, mc.END)
        if end is not None:
            code = int(end)
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
        self.peers.probe()
        self._elect()
        code = self.role.coordinate() if self.role.coordinator is not None else None
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
        self.peers.observe()
        holder = mc.coordinator(self.store)
        if holder is not None and holder[1] == self.machine:
            if self.role.coordinator is None:
                self.role.become(holder)
            return
        if self.role.coordinator is not None:  # deposed (a term passed while it did not renew in time)
            self.say(f"machine {holder[1] if holder else '?'} is the coordinator now")
            self.role.coordinator = None
        if self.peers.vacant(holder) and mc.take_coordinator(self.store, self.machine, holder):
            self.role.become(mc.coordinator(self.store))
