"""The stop: lameduck, drain, cancel, halt — the arbiter's side of the main state table
(:mod:`forkserve.lifecycle`).

# -- machine: the server (the table is lifecycle.TRANSITIONS) ----------------------------------
    running ──TERM──▶ lameduck ──(--lameduck over)──▶ draining ──DRAINED──▶ flushing ──▶ stopped
                                                       │ deadline          (workers gone)
                                                       ▼
                                                   cancelling ──DRAINED──▶ flushing
    any stopping state ──QUIT, or a second INT──▶ halting ──WORKERS_GONE──▶ stopped
Accepting stops at the drain's start: the listeners refuse new clients, the workers serve
what is queued, then close; DRAINED is decided from the workers' live counters.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Iterator

from forkserve.lifecycle import Event, State, accepts
from forkserve.sockets import refuse_new_connections
from forkserve.arbiter.workers import KILL_GRACE
from forkserve.arbiter.part import Part

PROGRESS_EVERY = 1.0  # seconds between "Draining in-flight connections" lines


@dataclass(kw_only=True)
class Drain(Part):
    """How the server stops (a mixin of :class:`forkserve.arbiter.Arbiter`)."""

    deadline: float | None = None  # the drain deadline
    lameduck_until: float | None = None
    next_progress: float = 0.0  # next "Draining in-flight connections" line
    int_count: int = 0

    # -- signals (dispatched from the loop) ---------------------------------------------------
    def stop(self) -> None:
        if not accepts(self.state, Event.STOP):
            return  # already stopping: a second TERM changes nothing
        self.leave_status_port()
        self.read_counters()
        self.numbers_fresh()  # asks busy workers for their numbers: the line waits for them
        if self.reload_wanted or self.upgrade_wanted:
            self.log.info("A coalesced reload or upgrade is dropped: the server is stopping")
            self.reload_wanted = self.upgrade_wanted = False
        self.transition(Event.STOP, "Received shutdown signal, draining connections",
                        live_numbers=True, lameduck=self.config.lameduck)
        if self.state is State.LAMEDUCK:
            # Still serving and accepting; readiness already fails, so load balancers can take
            # this instance out before it stops accepting.
            self.lameduck_until = time.monotonic() + self.config.lameduck
            if self.config.lameduck > 0:
                # Workers answer with Connection: close from now on, so a balancer's pooled
                # keep-alive connections leave this instance one response at a time (each
                # closed by us after the client read that it closes), instead of being closed
                # idle at the drain, where one the balancer reuses at that moment is lost.
                self.signal_workers(signal.SIGTTIN, list(self.workers.values()))
                return
            self.lameduck_until = None
        self.begin_drain()

    def begin_drain(self) -> None:
        """Stop accepting (workers serve what is queued, then close), drain what is in flight."""
        if self.state is State.LAMEDUCK:
            self.lameduck_until = None
            self.transition(Event.LAMEDUCK_OVER, "Stopped accepting; draining in-flight work",
                            live_numbers=True)
        for listener in self.listeners:
            # New clients are refused from now on (their SYNs dropped until the port closes);
            # the queue can only shrink, and the workers drain it, then close.
            refuse_new_connections(listener)
            listener.sock.close()  # the workers hold the accept queue until they drained it
        now = time.monotonic()
        self.deadline = now + self.config.drain_timeout
        self.next_progress = now + 1.0
        self.notify("stopping")
        self.signal_workers(signal.SIGTERM, list(self.workers.values()))
        self.check_drained()

    def cancel(self) -> None:
        """The drain deadline: cancel what still runs, give it the cancel grace, then kill."""
        totals = self.totals()
        self.transition(Event.DEADLINE, "Drain timeout reached, cancelling in-flight requests",
                        level="warning", remaining_connections=totals["active_connections"])
        when = time.monotonic() + self.config.cancel_grace
        for handle in self.workers.values():
            self.send(handle, signal.SIGUSR2)
            handle.escalate(when, signal.SIGKILL)
        self.check_drained()

    def check_drained(self) -> None:
        """Event-driven from the counters: nothing in flight in any worker that took the stop."""
        if not accepts(self.state, Event.DRAINED):
            return
        if self.workers:
            if not all(h.draining for h in self.workers.values()):
                return  # a worker's numbers are not live yet
            totals = self.totals()
            if totals["active_connections"] or totals["in_flight_requests"] or totals["background_tasks"]:
                return
        self.transition(Event.DRAINED, "All connections drained")
        self.check_gone()

    def interrupt(self) -> None:
        self.int_count += 1
        if self.int_count > 1 and self.state in (State.LAMEDUCK, State.DRAINING, State.CANCELLING,
                                                 State.FLUSHING):
            self.halt()
        else:
            self.stop()

    def halt(self) -> None:
        if not accepts(self.state, Event.HARD_STOP):
            return
        self.leave_status_port()
        self.transition(Event.HARD_STOP, "Hard stop: stopping workers now")
        self.halt_workers()

    def halt_workers(self) -> None:
        for listener in self.listeners:
            listener.sock.close()
        now = time.monotonic()
        for handle in self.workers.values():
            handle.stopping = True
            self.send(handle, signal.SIGQUIT)
            handle.escalate(now + KILL_GRACE, signal.SIGKILL)
        self.check_gone()

    def check_gone(self) -> None:
        if self.workers:
            return
        if accepts(self.state, Event.DRAINED):
            self.check_drained()  # logs "All connections drained", then comes back here
        elif accepts(self.state, Event.WORKERS_GONE):
            self.transition(Event.WORKERS_GONE, "All workers stopped")

    def drain_deadlines(self) -> Iterator[float]:
        if self.deadline is not None:
            yield self.deadline
        if self.lameduck_until is not None:
            yield self.lameduck_until
        if self.state in (State.DRAINING, State.CANCELLING):
            yield self.next_progress

    def drain_tick(self, now: float) -> None:
        if self.lameduck_until is not None and now >= self.lameduck_until:
            self.begin_drain()
        if self.state in (State.DRAINING, State.CANCELLING) and now >= self.next_progress:
            self.next_progress = now + PROGRESS_EVERY
            self.log.info("Draining in-flight connections", state=self.state.value,
                          **self.totals())
            self.notify("status")
        if self.deadline is not None and now >= self.deadline:
            self.deadline = None
            if accepts(self.state, Event.DEADLINE):
                self.cancel()
