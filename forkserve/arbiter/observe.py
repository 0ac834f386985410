"""What the arbiter tells the world: readiness, the status snapshot, the status server's
pages (/healthz /readyz /status /metrics), the workers' live numbers on demand, the restart
and reload counters, and systemd's notifications and watchdog.

# -- machine: a numbers refresh ---------------------------------------------------------------
    idle ──a status request, numbers older than FRESH_FOR──▶ asked (SIGWINCH to busy workers)
    asked ──every asked worker answered, or REFRESH_WAIT over──▶ idle (the waiting requests
    are answered)
A busy sync worker sends heartbeats only between requests: asking is how an answer's
numbers are live. The loop never waits for them (only the control socket's status does).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from forkserve import __version__
from forkserve.lifecycle import Rollout, State
from forkserve.metrics import RELOADS_HELP, RESTARTS_HELP, ArbiterCollector, Store, rss_bytes
from forkserve.status import Answer, StatusServer
from forkserve.systemd import Notifier, status_line
from forkserve.arbiter.part import Part

# Seconds a replacement's boot keeps the instance ready while no other worker serves (all of
# them recycled at once by --max-requests): clients wait in the queue that long at most.
READY_THROUGH_BOOT = 5.0
REFRESH_WAIT = 0.1  # seconds a status answer waits for the workers' live numbers
FRESH_FOR = 0.05  # numbers this recent answer without asking again (a burst of scrapes)


@dataclass(kw_only=True)
class Observe(Part):
    """Readiness, status and numbers (a mixin of :class:`forkserve.arbiter.Arbiter`)."""

    status_sock: socket.socket | None = None  # the --status-bind listener, bound by the cli
    status_server: StatusServer | None = None
    metrics: Store | None = None  # when metrics are on
    notifier: Notifier | None = None  # when systemd is listening
    next_watchdog: float | None = None  # next WATCHDOG=1, when systemd asks for them
    fresh: set[int] | None = None  # workers heard from since numbers_fresh() asked
    refresh_asked: set[int] = field(default_factory=set)
    refresh_until: float = 0.0
    refreshed_at: float = -1.0
    started_at: float = field(default_factory=time.time)

    # -- live numbers on demand ------------------------------------------------------------
    # A busy sync worker sends heartbeats only between requests, so a status answer asks the
    # workers for their numbers first (SIGWINCH: the handler writes one record). The loop never
    # waits for them: a status request waits (StatusServer), the answers come in as records.
    def numbers_fresh(self) -> bool:
        """True when the workers' numbers are fresh enough to answer with; otherwise asks for
        them (once for any number of waiting requests) and says False for now."""
        now = time.monotonic()
        if self.fresh is None:
            if now - self.refreshed_at < FRESH_FOR:
                return True
            # Not a worker still loading its app (it cannot answer yet), nor one that took
            # the stop (it reports every change by itself).
            self.refresh_asked = {pid for pid, h in self.workers.items()
                                  if h.booted and not h.draining}
            if not self.refresh_asked:
                self.refreshed_at = now
                return True
            self.fresh = set()
            self.refresh_until = now + REFRESH_WAIT
            for pid in self.refresh_asked:
                self.send(self.workers[pid], signal.SIGWINCH)
            return False
        self.read_counters()
        return self.refresh_done(now)

    def refresh_done(self, now: float) -> bool:
        if self.fresh is None:
            return True
        if (self.refresh_asked & set(self.workers)) <= self.fresh or now >= self.refresh_until:
            self.fresh = None
            self.refreshed_at = now
            return True
        return False

    def settle_refresh(self, now: float) -> None:
        """Each round: end a refresh whose numbers are in (or whose wait is over), then answer
        the status requests that waited for numbers, whoever's refresh brought them: a
        control-socket status that came meanwhile waits for the same refresh in place and ends
        it. (Run after the round's clients, as one may have ended it: no deadline is left to
        wake the loop for the waiting ones.)"""
        if self.fresh is not None:
            self.refresh_done(now)
        server = self.status_server
        if self.fresh is None and server is not None and server.waiting:
            server.resume()

    def refresh_counters(self) -> None:
        """The control socket's status: the same, waiting here (bounded by REFRESH_WAIT)."""
        while not self.numbers_fresh():
            select.select([self.counter_r], [], [], max(self.refresh_until - time.monotonic(), 0))

    def ready(self) -> bool:
        """Readiness means "send me traffic": running (or, after an in-place upgrade, booting
        with the old image's workers serving), not paused, and at least one booted worker of
        any generation that is not stopping, or replacements booting for recycled workers.
        A reload or upgrade in progress does not make the instance unready (its old workers
        serve until the new ones have booted); going away (lameduck, drain, halt), or having
        no worker that serves and none about to (boots failing, or slower than
        READY_THROUGH_BOOT), does."""
        serving = self.state is State.RUNNING or (self.state is State.BOOTING
                                                   and self.rollout is Rollout.ADOPTING)
        if not serving or self.paused:
            return False
        if any(h.serves() for h in self.workers.values()):
            return True
        # Every worker is retiring (max-requests) or gone (a crash) at once, and their
        # replacements are booting: the listeners stay open and the queue is served in a
        # moment, so the instance is not going away. Unless boots are failing, or one is slow.
        now = time.monotonic()
        return self.state is State.RUNNING and self.boot_failures == 0 and any(
            not h.booted and not h.stopping and not h.deaf and now - h.spawned_at < READY_THROUGH_BOOT
            for h in self.workers.values())

    def status(self) -> dict[str, Any]:
        """One snapshot of everything: the control socket's and /status's answer, and what
        /metrics's live gauges are made of (callers refresh the numbers first)."""
        now = time.monotonic()
        return {
            "ok": True, "state": self.state.value, "ready": self.ready(),
            "generation": self.generation, "pid": os.getpid(), "version": __version__,
            "worker_class": self.config.worker_class, "started": self.started_at,
            "uptime": round(time.time() - self.started_at, 3), "paused": self.paused,
            **self.totals(),
            "workers": [{
                "pid": h.pid, "worker_id": h.worker_id, "generation": h.generation,
                "state": h.state(),
                "age": round(now - h.spawned_at, 3), "requests_served": h.requests_served,
                "active_connections": h.active_connections,
                "in_flight_requests": h.in_flight_requests,
                "background_tasks": h.background_tasks, "booted": h.booted,
                "rss_bytes": rss_bytes(h.pid),
                "seconds_since_heartbeat": round(now - h.last_seen, 3),
            } for h in sorted(self.workers.values(), key=lambda h: (h.generation, h.worker_id))],
        }

    # -- the status server (/healthz /readyz /status /metrics) -------------------------------------
    def answer_status(self, method: str, path: str, headers: dict[bytes, bytes]) -> Answer | None:
        if path in ("/status", "/metrics") and not self.numbers_fresh():
            return None  # asked the workers; answered when their numbers are in
        try:
            return self.status_page(path, headers)
        except Exception as exc:  # a status page must never take the arbiter down
            self.log.exception(f"Status request {path} failed", exc)
            return json_answer(500, {"error": f"{type(exc).__name__}: {exc}"})

    def status_page(self, path: str, headers: dict[bytes, bytes]) -> Answer:
        if path == "/healthz":
            return json_answer(200, {"status": "alive", "state": self.state.value})
        if path == "/readyz" and self.status_left:
            # A request we had accepted before we left the port: the successor serves it.
            return json_answer(200, {"ready": True, "state": self.state.value,
                               "generation": self.generation, "reloading": False,
                               "successor": True})
        if path == "/readyz":
            ready = self.ready()
            return json_answer(200 if ready else 503, {
                "ready": ready, "state": "paused" if self.paused else self.state.value,
                "generation": self.generation,
                "reloading": self.reloading()})
        if path == "/status":
            return json_answer(200, self.status())
        if path == "/metrics":
            if self.metrics is None:
                return json_answer(404, {"error": "metrics are off"})
            snapshot = self.status()
            collector = ArbiterCollector(snapshot, [s.value for s in State])
            accept = headers.get(b"accept", b"").decode("latin-1")
            body, content_type = self.metrics.exposition(accept, collector)
            return 200, content_type, body
        return json_answer(404, {"error": f"no such page {path}; try /healthz /readyz /status /metrics"})

    def count_restart(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.add("forkserve_worker_restarts", {"reason": reason}, RESTARTS_HELP)

    def count_reload(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.add("forkserve_reloads", {"outcome": outcome}, RELOADS_HELP)

    def notify(self, what: str) -> None:
        """Tell systemd (when it listens) what we are doing; a no-op otherwise."""
        notifier = self.notifier
        if notifier is None or not notifier.enabled:
            return
        if what == "ready":
            notifier.ready(f"serving: {len(self.current())} workers")
        elif what == "reloading":
            notifier.reloading()
        elif what == "stopping":
            notifier.stopping("draining")
        else:
            notifier.status(status_line(self.state.value, self.totals()))

    def metrics_dir(self) -> str | None:
        """Where the workers' metric files go (the workers get it in their settings)."""
        return self.metrics.path if self.metrics is not None else None

    def observe_deadlines(self) -> Iterator[float]:
        if self.next_watchdog is not None:
            yield self.next_watchdog
        if self.fresh is not None:
            yield self.refresh_until
        if self.status_server is not None:
            client_deadline = self.status_server.next_deadline()
            if client_deadline is not None:
                yield client_deadline

    def observe_tick(self, now: float) -> None:
        notifier = self.notifier
        if self.next_watchdog is not None and now >= self.next_watchdog and notifier is not None:
            # The loop is alive enough to get here: that is what the watchdog asks.
            notifier.watchdog()
            self.next_watchdog = now + (notifier.watchdog_interval or 1.0)


def json_answer(status: int, body: dict[str, Any]) -> Answer:
    return status, "application/json", json.dumps(body, default=str).encode() + b"\n"
