"""Handing the ports to another instance, on both sides: ``-sf``/``-st`` (we replace running
instances: steer new connections here, then stop them), the ``listeners`` command (we give
ours to a successor started with ``--takeover``), leaving a shared status port at our stop,
and TTOU/TTIN (HAProxy's pause protocol: a successor that could not bind asks us to let go
of the port, and to take it back if it fails).

# -- machine: pause (its table: lifecycle.PAUSE) ----------------------------------------------
    listening ──TTOU──▶ paused ──TTIN, bind ok──▶ listening (a new generation gets the sockets)
                          │ TTIN, port still held by our own paused workers
                          ▼
                        resuming (bind retried every RESUME_RETRY, until the drain timeout)
                          ──bind ok──▶ listening;  ──TTOU──▶ paused;  ──given up──▶ paused
    A TTOU during an upgrade's check calls the upgrade off (a successor takes the ports).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from forkserve import signals as sigs
from forkserve.lifecycle import Cue, Pause, State, Step, next_pause
from forkserve.sockets import (BindError, bind, holds_inode, holds_socket, other_listeners,
                               refuse_new_connections, socket_inode, steer_new_connections_here,
                               still_listening)
from forkserve.status import bind_status
from forkserve.arbiter.part import Part

RESUME_RETRY = 0.02  # seconds between binds while a TTIN waits for our paused workers' port
RELEASE_GRACE = 0.5  # seconds of binds still failing once they let it go, before giving up


@dataclass(kw_only=True)
class Handoff(Part):
    """Ports handed over and taken back (a mixin of :class:`forkserve.arbiter.Arbiter`)."""

    pause_state: Pause = Pause.LISTENING
    paused_addresses: list[str] = field(default_factory=list)
    paused_status: str = ""  # the status server's address while paused (TTOU)
    paused_inodes: list[int] = field(default_factory=list)  # the listeners we closed at TTOU
    # A TTIN whose bind found the port still held by our own paused workers (serving what was
    # queued at the pause): tried again at resume_retry_at, until resume_until.
    resume_retry_at: float | None = None
    resume_until: float = 0.0
    released_at: float | None = None  # when the paused workers were first seen to let it go
    # A successor's status listener (-sf with --takeover or --reuse-port): held, not answered
    # on, until our workers are booted; the instance we replace answers ready meanwhile.
    status_deferred: bool = False
    # Instances we handed our status listener to (the `listeners` command), by pid.
    status_successors: set[int] = field(default_factory=set)
    status_left: bool = False  # we left the status port to a successor serving it (at our stop)

    def stop_predecessors(self) -> None:
        """-sf / -st: we serve now, so the instances we replace can go."""
        if self.inherited is not None:
            return  # an upgraded image: those PIDs were dealt with long ago (and may be reused)
        if self.config.soft_stop or self.config.hard_stop:
            for listener in self.listeners:
                # --reuse-port: from now on the kernel gives every new connection to us, none
                # to the instances we replace: they drain a queue that only shrinks and close
                # it, and no client's SYN is dropped or reset meanwhile.
                if steer_new_connections_here(listener.sock):
                    self.log.info("Handoff: new connections now come to this instance",
                                  listening=listener.name())
        for pids, signum in ((self.config.soft_stop, signal.SIGTERM),
                             (self.config.hard_stop, signal.SIGQUIT)):
            for pid in pids:
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    self.log.warning("Handoff: the old instance is already gone", pid=pid)
                    continue
                self.log.info(f"Handoff: sent {sigs.name(signum)} to the old instance", pid=pid)

    def hand_listeners(self) -> tuple[dict[str, Any], list[int]]:
        """The `listeners` command: our listening sockets (and the status listener, last), for
        a successor started with --takeover; shared with it from now on."""
        if not self.listeners:
            return {"ok": False, "error": "not listening (paused or stopping)"}, []
        for listener in self.listeners:
            listener.unix_path = None  # shared with the successor now: never unlink it
            listener.shared = True  # nor make it refuse clients when we stop
        answer: dict[str, Any] = {"ok": True, "listeners": [l.name() for l in self.listeners]}
        fds = [l.fd for l in self.listeners]
        server = self.status_server
        if server is not None and server.sock.fileno() >= 0 and not self.status_left:
            # The status listener goes with them (last): the successor answers on this very
            # socket once it is ready, and we leave it at our stop (leave_status_port).
            host, port = server.sock.getsockname()[:2]
            answer["status"] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            fds.append(server.sock.fileno())
            if self.control is not None and self.control.peer_pid:
                self.status_successors.add(self.control.peer_pid)
        return answer, fds

    def leave_status_port(self) -> None:
        """At our stop, when a successor serves our status port (the -sf handoff, with
        --takeover: one we handed this very listener to still holds it; with --reuse-port:
        another listener on the same address): leave it at once. Answering 503 there would
        tell the balancer that the port is going away while the successor serves it."""
        server = self.status_server
        if server is None or server.sock.fileno() < 0 or self.status_left:
            return
        shared = any(holds_socket(pid, server.sock) for pid in self.status_successors)
        if not shared and not (self.config.reuse_port and other_listeners(server.sock)):
            return
        address = server.sock.getsockname()
        server.leave(own_queue=not shared)
        self.status_left = True
        self.log.info("Left the status port to the successor serving it",
                      status_bind=f"{address[0]}:{address[1]}",
                      how="shared listener" if shared else "SO_REUSEPORT")

    @property
    def paused(self) -> bool:
        return self.pause_state is not Pause.LISTENING

    def cue(self, cue: Cue) -> None:
        self.pause_state = next_pause(self.pause_state, cue)

    # -- pause and resume (TTOU / TTIN): HAProxy's handoff protocol ------------------------------
    def pause(self) -> None:
        if self.pause_state is Pause.RESUMING:
            self.cue(Cue.PAUSE)  # the last word is TTOU's: stay paused
            self.resume_retry_at = None
            self.log.info("Paused: the resume that was waiting for the port is called off")
            return
        if self.state is not State.RUNNING or self.paused:
            return
        self.call_off_upgrade("the server is paused (a successor takes its ports)")
        self.cue(Cue.PAUSE)
        self.paused_addresses = [l.name() for l in self.listeners]
        self.paused_inodes = [socket_inode(l.sock) for l in self.listeners if l.sock.fileno() >= 0]
        for listener in self.listeners:
            # As at a stop: the queue only shrinks (new clients wait for the port's next
            # owner), so the workers can drain it and free the port while clients keep coming.
            refuse_new_connections(listener)
            listener.close(unlink=False)
        self.listeners = []
        if self.status_server is not None and self.status_server.sock.fileno() >= 0:
            self.paused_status = self.status_server.stop_listening()
        # Workers serve what is queued, then close their copies: the port is then free.
        for handle in self.workers.values():
            handle.deaf = True
        self.signal_workers(signal.SIGTTOU, list(self.workers.values()))
        self.log.info("Paused: not listening", addresses=",".join(self.paused_addresses))

    def resume(self) -> None:
        if not self.paused or self.state is not State.RUNNING:
            if self.pause_state is Pause.RESUMING:
                self.cue(Cue.GAVE_UP)  # the server is stopping: it stays paused
            self.resume_retry_at = None
            return
        try:
            self.listeners = bind(self.paused_addresses, self.config.backlog, self.config.reuse_port,
                                  defer_accept=self.config.defer_accept)
        except BindError as exc:
            if self.resume_waits(time.monotonic()):
                self.cue(Cue.PORT_HELD)
            else:
                self.cue(Cue.GAVE_UP)
                self.log.error(f"Resume failed, still paused: {exc}")
            return
        self.resume_retry_at = None
        self.cue(Cue.BOUND)
        if self.status_server is not None and self.paused_status:
            try:
                self.status_server.listen(bind_status(self.paused_status, self.config.reuse_port))
            except OSError as exc:
                self.log.error("Resume: cannot bind the status server again; serving without it",
                               status_bind=self.paused_status, error=exc.strerror)
            self.paused_status = ""
        self.log.info("Resumed: listening again", listening=",".join(l.name() for l in self.listeners))
        # The workers closed their listeners; a new generation gets the new ones.
        self.step(Step.RESUME)
        self.start_generation("Resume")

    def resume_waits(self, now: float) -> bool:
        """The bind failed: is the port still held by our own paused workers, serving what was
        queued at the pause before they close their copies (a TTIN soon after a TTOU, a sync
        worker in a long request)? Then try again shortly, bounded by the drain timeout; a port
        held by anyone else fails the resume once binds have gone on failing for RELEASE_GRACE
        with none of our workers holding it."""
        held = any(holds_inode(pid, inode) for pid in self.workers
                   for inode in self.paused_inodes) or still_listening(self.paused_inodes)
        if self.resume_retry_at is None:
            self.resume_until = now + self.config.drain_timeout
            self.released_at = None
            if held:
                self.log.info("Resume: the paused workers still hold the port while they serve "
                              "what was queued; listening again once they have let it go")
        elif now >= self.resume_until:
            self.resume_retry_at = None
            return False
        if not held:
            # Not held by our workers now, and the bind failed. Perhaps they let it go between
            # the two (seen on a loaded machine: a TTIN just after a TTOU, whose new
            # generation had booted meanwhile), or the close is not finished in the kernel;
            # else someone else has it. A few more tries within RELEASE_GRACE tell them apart.
            self.released_at = now if self.released_at is None else self.released_at
            if now - self.released_at >= RELEASE_GRACE:
                self.resume_retry_at = None
                return False
        self.resume_retry_at = now + RESUME_RETRY
        return True

    def handoff_deadlines(self) -> Iterator[float]:
        if self.resume_retry_at is not None:
            yield self.resume_retry_at

    def handoff_tick(self, now: float) -> None:
        if self.resume_retry_at is not None and now >= self.resume_retry_at:
            self.resume()
