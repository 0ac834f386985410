"""The sync worker: one connection at a time, keep-alive without starving anyone.

A sync worker keeps a connection alive only while no other client waits in the accept queue:
before each response head it polls the listeners with a zero timeout, and if someone is
waiting the response carries ``Connection: close``; while it holds an idle keep-alive
connection it also watches the listeners, and if it accepts a newcomer it parks the idle
connection and serves the newcomer. So 50 keep-alive clients on 2 workers never wait for
each other's idle timeout (uWSGI's http11-socket does make them wait).

Owns: that loop, and what a worker busy in its one request does at a stop from its signal
handlers (it cannot act otherwise until the request ends). The requests themselves are
``Pipeline``'s.
"""

from __future__ import annotations

import select
import signal
import socket
import time
from typing import Any

from forkserve.sockets import Listener, accept_queue_length, queued_clients
from forkserve.workers.base import WorkerState
from forkserve.workers.connection import Connection
from forkserve.workers.pipeline import Pipeline, stop_grace_end

POLLIN = select.POLLIN
RUNNING = WorkerState.RUNNING


class SyncWorker(Pipeline):
    multithread = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # What the signal handlers below share with the loop (they may run while the app loads).
        self.busy = False  # inside a connection (the loop cannot act on a signal right now)
        self.parked: list[Connection] = []  # idle keep-alive connections set aside (wait_idle)
        self.taken: list[tuple[socket.socket, Any, Listener]] = []  # see _on_alarm
        self.queue_watch = False  # SIGALRM re-checks the accept queue (see _watch_queue)
        self.queue_checks = 0  # alarms in a row that found the accept queue no shorter
        self.queue_seen = 0
        self.listeners_changed = False  # a handler closed a listener: the loop must forget it
        self.listeners_muted = False  # left out of main_poll while accepting is paused

    def serve(self) -> None:
        self.setup_http()
        # The listeners alone: the zero-timeout "is anyone waiting?" check.
        self.waiting_poll = select.poll()
        # Everything that can end a wait: listeners, signals, the arbiter's death.
        self.main_poll = select.poll()
        for listener in self.listeners:
            self.waiting_poll.register(listener.fd, POLLIN)
            self.main_poll.register(listener.fd, POLLIN)
        self.main_poll.register(self.wakeup_r, POLLIN)
        self.main_poll.register(self.alive_fd, POLLIN)
        self.listener_fds = {listener.fd: listener for listener in self.listeners}
        try:
            self._loop()
            if self.state is WorkerState.STOPPING and not self.retire_reason:
                self._drain_accept_queue()
            elif self.state is WorkerState.CANCELLED:
                self._turn_away_queue()
        finally:
            for listener in self.listeners:
                listener.sock.close()

    def _loop(self) -> None:
        heartbeat_ms = self.heartbeat_interval * 1000.0
        while self.state is RUNNING:
            if self.pause_requested:
                self._pause()
            elif self.listeners_changed:
                self._forget_closed_listeners()
            accepted = self._accept()
            if accepted is not None:
                self._handle(*accepted)
                continue
            self.before_waiting()
            for fd, _ in self._poll_main(heartbeat_ms):
                self._wake(fd)

    def _poll_main(self, timeout_ms: float) -> list[tuple[int, int]]:
        """main_poll's wait, leaving the listeners out while accepting is paused (out of
        descriptors: a queued client keeps them readable, which would be a busy loop)."""
        pause = self.accept_paused_for()
        if pause:
            if not self.listeners_muted:
                for fd in self.listener_fds:
                    self.main_poll.modify(fd, 0)
                self.listeners_muted = True
            timeout_ms = min(timeout_ms, pause * 1000.0 + 1)
        elif self.listeners_muted:
            for fd in self.listener_fds:
                self.main_poll.modify(fd, POLLIN)
            self.listeners_muted = False
        return self.main_poll.poll(timeout_ms)

    def _drain_accept_queue(self) -> None:
        """On a graceful stop, serve the clients already queued in the kernel (each answered
        with Connection: close) rather than let closing the listener reset them (see
        takes_queue for which queues are ours to serve). One at a time, as the other
        workers do: the queue is shared fairly, so it empties soonest. New clients keep
        coming, but none joins a queue the arbiter made refuse them, so this ends; the bound
        is for a unix socket's queue, which cannot refuse them."""
        self._serve_taken()
        for listener in self.listeners:
            if self.takes_queue(listener):
                budget = queued_clients([listener]) + socket.SOMAXCONN
                while budget > 0 and self.state is WorkerState.STOPPING:
                    client = self.accept_from(listener)
                    if client is None:
                        break
                    budget -= 1
                    self._handle(*client, listener)
                    self._serve_taken()  # what _on_alarm took meanwhile
            listener.sock.close()
        if self.state is WorkerState.CANCELLED:
            self._turn_away_queue()  # the deadline passed meanwhile: what is left gets a 503

    def _serve_taken(self) -> None:
        """The clients _on_alarm took from the queue while this worker was busy."""
        while self.taken and self.state is WorkerState.STOPPING:
            self._handle(*self.taken.pop(0))

    def _turn_away_queue(self) -> None:
        taken = tuple(sock for sock, _, _ in self.taken)
        self.taken = []
        self.turn_away_queue(self.listeners, taken)

    def _pause(self) -> None:
        """TTOU: serve the clients already queued, then close every listener of ours. The pause
        stays requested until then: each of those clients is answered with Connection: close,
        or a kept-alive one would keep us (and the port) for as long as it sends."""
        while self.state is RUNNING:
            accepted = self._accept()
            if accepted is None:
                break
            self._handle(*accepted)
        for listener in self.listeners:
            listener.sock.close()
        self._forget_closed_listeners()
        self.pause_requested = False

    def _forget_closed_listeners(self) -> None:
        """Unregister listeners closed (here or by a signal handler) before polling again: their
        fd numbers may already belong to something else."""
        self.listeners_changed = False
        for fd, listener in list(self.listener_fds.items()):
            if listener.sock.fileno() < 0:
                self.main_poll.unregister(fd)
                self.waiting_poll.unregister(fd)
                del self.listener_fds[fd]

    def _wake(self, fd: int) -> None:
        if fd == self.wakeup_r:
            self.handle_wakeups()
        elif fd == self.alive_fd:
            self.arbiter_gone()

    def _accept(self) -> tuple[socket.socket, Any, Listener] | None:
        for listener in self.listeners:
            accepted = self.accept_from(listener)
            if accepted is not None:
                return accepted[0], accepted[1], listener
        return None

    def should_close(self) -> bool:
        """Close rather than keep this client alive when someone waits in the accept queue or
        behind a parked connection; also while a pause waits for this worker: one
        kept-alive client would otherwise hold it (and so its copy of the port, and the
        clients queued at the pause) for as long as it keeps sending."""
        return (self.state is not RUNNING or bool(self.parked) or self.settings.keepalive <= 0
                or self.pause_requested or bool(self.waiting_poll.poll(0)))

    # -- one connection --------------------------------------------------------------------
    def _handle(self, sock: socket.socket, addr: Any, listener: Listener) -> None:
        conn = self.open_connection(sock, addr)
        self.admit(conn)
        self.busy = True
        try:
            self.keep_serving(conn, listener)
        finally:
            self.busy = bool(self.parked)

    def wait_idle(self, conn: Connection) -> bool:
        """Between requests on a kept-alive connection. True when the client sent more.

        If a newcomer is accepted meanwhile, this connection is parked (not closed: closing
        it could race the client's next request, which would then be lost) and the newcomer
        is served at once with ``Connection: close``; then the wait here goes on.
        """
        keepalive = self.settings.keepalive
        if keepalive <= 0:
            return False
        poller = self.main_poll
        deadline = conn.idle_since + keepalive
        while self.state is RUNNING:
            if self.listeners_changed:
                self._forget_closed_listeners()
            self.before_waiting()
            now = time.monotonic()
            if now >= deadline:
                return False
            poller.register(conn.fd, POLLIN)
            try:
                ready = self._poll_main(min(deadline - now, self.heartbeat_interval) * 1000.0 + 1)
            finally:
                poller.unregister(conn.fd)
            fds = [fd for fd, _ in ready]
            if conn.fd in fds:
                # The idle client spoke: serve it. A newcomer waiting too makes this
                # response say Connection: close (should_close), so it is next.
                return True
            newcomer = None
            for fd in fds:
                if fd in self.listener_fds:
                    newcomer = newcomer or self._accept()
                else:
                    self._wake(fd)
            if newcomer is not None:
                self.parked.append(conn)
                try:
                    self._handle(*newcomer)
                finally:
                    self.parked.remove(conn)
        return self._wait_idle_stopping(conn, deadline)

    def _wait_idle_stopping(self, conn: Connection, deadline: float) -> bool:
        """Stopping with a kept-alive connection idle (its last response promised keep-alive
        before the stop): a request that arrives within the close grace is answered (with
        Connection: close); the connection closes once it has been quiet for the grace."""
        if conn.output_ended:
            return False  # half-closed at the stop (close_quiet_parked): done
        deadline = min(deadline, stop_grace_end(conn, self.stop_began()))
        poller = select.poll()
        poller.register(conn.fd, POLLIN)
        poller.register(self.wakeup_r, POLLIN)
        while self.state is WorkerState.STOPPING:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for fd, _ in poller.poll(remaining * 1000.0 + 1):
                if fd == conn.fd:
                    return True
                self.handle_wakeups()
        # Past the deadline (or a hard stop) no new request is taken.
        return self.state is WorkerState.STOPPING and conn.readable_now()

    # -- signal handlers: a busy worker at a stop ------------------------------------------
    # -- runs in a signal handler (see the list in base.py): TERM half-closes parked idle
    # keep-alive connections quiet for the close grace and, when the worker is inside a
    # connection and its accept queues are empty, closes its own listening sockets, so new
    # clients are refused now, not at the end of this request (no queued client can be
    # reset: the queues are empty); ALRM, while the queue is not empty yet, looks again.
    def _on_graceful(self, signum: int, frame: Any) -> None:
        super()._on_graceful(signum, frame)
        self.close_quiet_parked()
        self._release_listeners()

    def _on_pause(self, signum: int, frame: Any) -> None:
        super()._on_pause(signum, frame)
        self._release_listeners()

    def _release_listeners(self) -> None:
        still_queued = False
        if self.busy:
            for listener in self.listeners:
                if listener.sock.fileno() < 0:
                    continue
                length = accept_queue_length(listener)
                if length == 0:
                    listener.sock.close()
                    self.listeners_changed = True
                elif length is not None:
                    still_queued = True
                # A unix socket's queue cannot be measured: the loop drains it after the
                # request (no alarms for it, which would only interrupt the app's calls).
        self._watch_queue(still_queued or self._parked_to_close())

    def _watch_queue(self, on: bool) -> None:
        """A busy worker whose accept queue still held clients at the stop looks again every
        0.1 s (SIGALRM): once the other workers have taken them it closes its copy of the
        listener, so that new clients are refused rather than left retrying their SYNs
        against a queue that refuses them until this worker's request ends; and it closes its
        parked idle connections once their close grace is over. Only where the application
        leaves SIGALRM alone."""
        if on and not self.queue_watch:
            if signal.getsignal(signal.SIGALRM) is not signal.SIG_DFL:
                return  # the application's own: leave it (the loop closes after the request)
            signal.signal(signal.SIGALRM, self._on_alarm)
            signal.setitimer(signal.ITIMER_REAL, 0.1, 0.1)
            self.queue_watch = True
        elif not on and self.queue_watch:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            self.queue_watch = False

    def _on_alarm(self, signum: int, frame: Any) -> None:
        """When for 0.3 s the queue has not shrunk (no other worker is free to take those
        clients), a busy worker takes them itself (they would wait for it either way) and
        closes its listeners, so that new clients are refused rather than kept retrying
        their SYNs for as long as this request runs; it serves them once the request is
        done. While the queue shrinks, the other workers are serving it."""
        queued = queued_clients([l for l in self.listeners if l.sock.fileno() >= 0])
        self.queue_checks = self.queue_checks + 1 if queued >= self.queue_seen else 0
        self.queue_seen = queued
        if self.busy and queued and self.queue_checks >= 3 and self.state is WorkerState.STOPPING:
            for listener in self.listeners:
                if listener.sock.fileno() < 0 or not self.takes_queue(listener):
                    continue
                while True:
                    client = self.accept_from(listener)
                    if client is None:
                        break
                    self.taken.append((*client, listener))
        if self.busy and self.state is WorkerState.STOPPING:
            self.close_quiet_parked()
        self._release_listeners()

    def close_quiet_parked(self) -> None:
        """Parked idle keep-alive connections that have been quiet for the close grace and have
        nothing waiting are closed now (the client sees the end at once); the others are
        answered or closed by the loop once the request in progress is done."""
        now = time.monotonic()
        for conn in self.parked:
            if (not conn.output_ended and now >= stop_grace_end(conn, self.stop_began())
                    and not conn.readable_now()):
                conn.end_output()

    def _parked_to_close(self) -> bool:
        return (self.busy and self.state is WorkerState.STOPPING
                and any(not conn.output_ended and not conn.readable_now() for conn in self.parked))


__all__ = ["SyncWorker"]
