"""The agent of one machine of an elastic Bamboo job: the job's only control loop, whatever the number of
machines (``python -m lightning_bamboo.launch --nnodes MIN:MAX --nproc-per-node K --rdzv-endpoint
etcd://HOST:PORT --job-id ID train.py`` on each machine; ``--nproc N`` and ``Trainer(devices=N)`` run one
agent for one machine, over a TCPStore it serves: :mod:`lightning_bamboo.control.supervisor`).

A spot preemption takes a whole machine, so the machine is the failure domain. Each agent:

* registers its machine in the store and keeps a *lease* there: a counter it bumps every renewal period (a
  fraction of the lease) on a store connection of its own (:mod:`lightning_bamboo.control.machines` has the
  keys);
* starts its ``K`` workers (:class:`~lightning_bamboo.control.workers.LocalWorkers`, each with
  ``BAMBOO_LOCAL_RANK``), watches them by PID and heartbeat (a worker silent for ``hang_timeout`` seconds is
  SIGKILLed by PID and lost) and reports their exits into the store; ``replace``: starts a replacement worker
  (a new member id, which joins at a step boundary) ``replace_delay`` seconds after each local loss, once
  the coordinator has published a generation without the lost member;
* fences itself: when it has not renewed its lease for the lease time (cut off from the store), it SIGKILLs
  its own workers by PID and exits (3), since the others have by then counted the machine as lost;
* takes part in electing the one coordinator: ``compare_set`` of the ``coordinator`` key, taken over by
  another agent when the holder's lease expires (alone, it is elected at once);
* on SIGTERM: drains its machine (the workers leave at a step boundary, the others go on) or, when its
  machine is the last of the job, stops the job at a step boundary (the final checkpoint is written when the
  strategy has one configured), SIGKILLs by PID whatever is left after ``stop_timeout`` seconds, exits 143.

The coordinator (:class:`~lightning_bamboo.control.node_coordinator.CoordinatorRole` over a
:class:`~lightning_bamboo.control.coordinator.Coordinator`) closes the rendezvous once ``MIN`` machines
registered (at ``MAX``, or ``--rdzv-last-call`` seconds after ``MIN``), deals generation 0's member ids so
that stages alternate across machines (:func:`~lightning_bamboo.control.machines.placement`) and says which
single machine (or zone) would force a checkpoint fallback. It then decides every generation from the
workers' reported exits and from leases: a machine whose lease expired is lost with all its members, as ONE
membership change. A worker started while the job runs (a replacement, the workers of a machine that came
after the rendezvous) takes a fresh id and joins at a step boundary. A worker that exits with an error of the
training code (:mod:`lightning_bamboo.protocol.crash`) stops the job (exit 1): a failover would only raise it
again. When every member of the current generation has finished, it writes the job's end and every agent
exits with that code. The agent that coordinates writes the job's record (:meth:`Agent.record`) to
``BAMBOO_EVENTS`` when set.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

import torch.distributed as dist

from lightning_bamboo.control import machines as mc
from lightning_bamboo.control.coordinator import Superseded
from lightning_bamboo.control.node_coordinator import CoordinatorRole, JobShape, PeerWatch
from lightning_bamboo.control.workers import LocalWorkers, worker_env
from lightning_bamboo.protocol import store as ms

__all__ = ["FENCED", "Agent", "LeaseKeeper", "first_formed"]

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
        store_url: ``etcd://host:port`` or ``tcp://host:port`` (a TCPStore another process serves).
        job: the job id every machine of the job is given.
        min_nodes, max_nodes: generation 0 starts with at least ``min_nodes`` machines, at most ``max_nodes``.
        node_lease: seconds without a lease renewal after which a machine is lost.
        zone: a coarser failure domain (machines of one zone can be lost together).
        hang_timeout: seconds without a heartbeat after which a worker is SIGKILLed and lost.
        settle: seconds to wait after a loss for losses that arrive with it (handled as one change).
        rdzv_last_call: seconds to wait for more machines once ``min_nodes`` registered.
        stop_timeout: seconds the workers get to stop at a step boundary before they are SIGKILLed.
        replace: replacement workers to start, one after each loss of a worker of this machine (-1: no limit).
        replace_delay: seconds after a loss before its replacement starts (a new spot machine's arrival).
        poll: seconds between two passes of the loop.
        preload: fork the workers from a preload server (:mod:`lbd_common.preload`).
        backend: the workers' process-group backend (their NCCL environment follows it).
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
        replace: int = 0,
        replace_delay: float = 0.0,
        poll: float = 0.1,
        log=print,
        preload: bool = True,
        backend: str | None = None,
    ) -> None:
        if nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
        if not 1 <= min_nodes <= max_nodes:
            raise ValueError(f"--nnodes MIN:MAX needs 1 <= MIN <= MAX, got {min_nodes}:{max_nodes}")
        if node_lease <= 0:
            raise ValueError(f"--node-lease must be > 0 seconds, got {node_lease}")
        if stop_timeout < 0:
            raise ValueError(f"--stop-timeout must be >= 0 seconds, got {stop_timeout}")
        if hang_timeout <= 0:
            raise ValueError(f"--hang-timeout must be > 0 seconds, got {hang_timeout}")
        if replace_delay < 0:
            raise ValueError(f"--replace-delay must be >= 0 seconds, got {replace_delay}")
        self.command = command
        self.nproc_per_node = nproc_per_node
        self.store_url = store_url
        self.job = job
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.lease = node_lease
        self.zone = zone
        self.rdzv_timeout = rdzv_timeout
        self.stop_timeout = stop_timeout
        self.replacements = replace
        self.replace_delay = replace_delay
        self.poll = poll
        self.log = log
        request_s = max(node_lease / 3, 0.5)  # a cut-off store answers nothing: notice within the lease
        self.store = ms.connect(store_url, job, request_timeout=max(request_s, 2.0))
        self.local = LocalWorkers(command, self.store, hang_timeout, log, workers_on_machine=nproc_per_node,
                                  preload=preload, backend=backend)
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
        self.returncode: int | None = None
        self._nproc = 0  # generation 0's member count (the workers are told it)
        self._replaced: set[int] = set()  # lost members a replacement was scheduled for (or not: no budget)
        self._due: list[tuple[float, int]] = []  # (when, for which lost member) the next replacements start
        self._stop_signal: int | None = None
        self._stop_handled = False
        self._drain_until: float | None = None
        self._lock = threading.RLock()  # add_worker may come from another thread while run() runs
        self._written: object = None  # what the record file last held (:meth:`_write_record`)
        self.say(f"machine {self.machine} registered ({nproc_per_node} workers, zone {zone or '-'})")
        self.own_lease.start()

    def say(self, text: str) -> None:
        self.log(f"[bamboo.agent {self.machine}] {text}", flush=True)

    # ------------------------------------------------------------------ called from other threads
    @property
    def workers(self) -> dict:
        """This machine's worker processes by member id."""
        return self.local.workers

    @property
    def joins(self) -> list[dict[str, object]]:
        """One entry per completed join this agent saw as the coordinator: members, step, generation,
        start_s, wait_s, join_s."""
        return list(self.role.decided.joins) if self.role.decided else []

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """What SIGTERM to the agent does (see the module docstring). Safe from another thread."""
        self._stop_signal = signum

    def kill(self, member: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one of this machine's workers, by PID (tests and benchmarks preempt this way)."""
        self.local.kill(member, sig)

    def live_members(self) -> list[int]:
        """Member ids of this machine's workers whose process is running."""
        return self.local.live_members()

    def add_worker(self) -> int:
        """Start one more worker on this machine while the job runs; it joins at a step boundary once its
        model is built. Safe from another thread while :meth:`run` runs; returns its member id."""
        with self._lock:
            if not self._nproc:
                raise RuntimeError("add_worker() needs the job's rendezvous closed (wait_formed() first)")
            return self._start_joiners(1)[0]

    def wait_formed(self, timeout: float = 300.0) -> None:
        """Block until all members formed generation 0 (for callers that run :meth:`run` in a thread)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if first_formed(self.store):
                return
            if self.returncode is not None:
                raise RuntimeError(f"the job ended (exit code {self.returncode}) before generation 0 formed")
            time.sleep(0.05)
        raise TimeoutError(f"generation 0 did not form in {timeout}s")

    def stop_all(self) -> None:
        """SIGKILL by PID whatever is left of this machine's workers (a caller's cleanup)."""
        self.local.kill_all()

    # ------------------------------------------------------------------ the record of the job
    def record(self) -> dict[str, object]:
        """What happened to the job so far, as this agent knows it, as JSON data (the ``BAMBOO_EVENTS``
        file, docs/bamboo-elastic-reference.md): ``changes`` (every generation change this agent decided as
        the coordinator: kind, lost, left, joined, old and new map), ``joins`` (completed joins with their
        cost),
        ``hung`` (members killed for a silent heartbeat), ``error`` (the error of the training code that
        stopped the job), ``stop`` (reason, exit code, members killed for not stopping in time: ``None`` until
        known), ``exits`` (each worker's exit code, negative for a signal, ``None`` while it runs),
        ``returncode`` (``None`` while the job runs), ``pids`` (each worker's PID), ``store`` and ``job``
        (where the job's store is: a watcher reads :func:`first_formed` there), ``machine``."""
        decided = self.role.decided
        with self.local.lock:
            pids = {str(m): w.proc.pid for m, w in sorted(self.workers.items())}
        return {
            "changes": list(decided.events) if decided else [],
            "joins": list(decided.joins) if decided else [],
            "hung": list(self.local.hung),
            "error": decided.error if decided else None,
            "stop": self.role.stopped,
            "exits": {str(m): code for m, code in self.local.exits().items()},
            "returncode": self.returncode,
            "pids": pids,
            "store": self.store_url,
            "job": self.job,
            "machine": self.machine,
        }

    def _write_record(self) -> None:
        """Write :meth:`record` to ``BAMBOO_EVENTS`` when set and it changed, whole (a reader never sees half
        a file). Only the agent that coordinates (or did) writes it: it holds the job's changes."""
        path = os.environ.get("BAMBOO_EVENTS")
        if not path or self.role.decided is None:
            return
        record = self.record()
        if record == self._written:
            return
        target = Path(path)
        partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(record, indent=1))
        partial.replace(target)
        self._written = record

    # ------------------------------------------------------------------ the agent's loop
    def run(self) -> int:
        """Rendezvous, start the workers, watch until the job ends; returns the exit code (also
        :attr:`returncode`). On the main thread it handles SIGTERM (:meth:`stop` does the same from another
        thread)."""
        handler = None
        if threading.current_thread() is threading.main_thread():
            handler = signal.signal(signal.SIGTERM, lambda signum, _frame: self.stop(signum))
        code = 1
        try:
            code = self._run()
        finally:
            self.own_lease.done.set()
            self.local.kill_all()
            self.liveness.close()
            if handler is not None:
                signal.signal(signal.SIGTERM, handler)
            self.returncode = code
            self._write_record()
        return code

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
                with self._lock, ms.one_pass(self.store):
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
            self._write_record()
            if code is not None:
                return code
            time.sleep(self.poll)

    def _start_workers(self, rendezvous: mc.Rendezvous) -> None:
        self._nproc = rendezvous.nproc
        if self.machine not in rendezvous.members:  # came after the rendezvous: its workers join the job
            self.say(f"joining the running job with {self.nproc_per_node} workers")
            self._start_joiners(self.nproc_per_node)
            return
        self.members = list(rendezvous.members[self.machine])
        self.store.set(f"node/{self.machine}/members", json.dumps(self.members))
        self.say(f"generation 0: members {self.members}")
        for member in self.members:
            self.local.start(member, worker_env(self.store_url, self.job, member, self._nproc, False))
        self._write_record()  # the workers' PIDs

    def _start_joiners(self, count: int) -> list[int]:
        """Start ``count`` workers with fresh member ids that join the running job at a step boundary."""
        end = int(self.store.add("members/next", count))
        joiners = list(range(end - count, end))
        self.members += joiners
        self.store.set(f"node/{self.machine}/members", json.dumps(self.members))
        for member in joiners:
            self.local.start(member, worker_env(self.store_url, self.job, member, self._nproc, True))
            mc.report_joining(self.store, self.machine, member)
        return joiners

    def _tick(self) -> int | None:
        """One pass: the job's end, this machine declared lost, a stop signal, the local workers, the
        election, and (as the coordinator) the decisions. Returns an exit code when this agent is done."""
        end = ms.read_if_set(self.store, mc.END)
        if end is not None:
            code = int(end)
            self.local.finish()
            self.say(f"job ended with exit code {code}")
            return code
        if self.store.check([f"node/{self.machine}/dead"]):
            killed = self.local.kill_all()
            self.say(f"this machine was counted as lost (its lease expired); killed its workers {killed}")
            return FENCED
        if self._stop_signal is not None and not self._stop_handled:
            self._stop_handled = True
            self._on_stop_signal(self._stop_signal)
        self.local.report(self.store, self.machine)
        for member in sorted(self.local.lost - self._replaced):  # also those the coordinator found
            if self.replacements != 0 and self._drain_until is None and not self.role.stopped:
                self._due.append((time.monotonic() + self.replace_delay, member))
                self.replacements -= 1
        self._replaced |= self.local.lost
        while self._due and self._due[0][0] <= time.monotonic() and self._handled(self._due[0][1]):
            self._due.pop(0)
            self._start_joiners(1)
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

    def _handled(self, member: int) -> bool:
        """Whether the coordinator has published a generation without the lost ``member``: its replacement
        then joins that generation, never one that still counts the member (as a replacement machine
        arrives after the failover)."""
        generation = ms.current_generation(self.store)
        if generation < 0 or not self.store.check([f"gen{generation}/map"]):
            return False
        current = ms.read_map(self.store, generation)
        return member not in set(current.members()) | set(current.spares)

    def _on_stop_signal(self, signum: int) -> None:
        """SIGTERM to the agent: the last machine of the job stops the job at a step boundary (as the
        coordinator it is); any other machine drains (:meth:`_drain_local`)."""
        self._elect()
        others = set(range(self.peers.registered)) - {self.machine} - self.peers.dead
        if self.role.coordinator is not None and not others:
            self.role.stop_job(f"{signal.Signals(signum).name} received", 128 + signum)
        else:
            self._drain_local(signum)

    def _drain_local(self, signum: int) -> None:
        """The machine is being taken away with notice: pass the signal to the workers, which leave at a step
        boundary (an announced departure: the coordinator, maybe this agent, publishes the generation without
        them); the agent exits 143 once they are gone (at most ``stop_timeout`` s)."""
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


def first_formed(store: dist.Store) -> bool:
    """Whether every member of generation 0 has formed it (its process group is up: training runs)."""
    if not store.check(["gen0/map", "gen0/formed"]):
        return False
    return int(store.add("gen0/formed", 0)) >= len(ms.read_map(store, 0).members())
