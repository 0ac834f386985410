"""The sync worker: one connection at a time, keep-alive without starving anyone.

A sync worker keeps a connection alive only while no other client waits in the accept queue:
before each response head it polls the listeners with a zero timeout, and if someone is
waiting the response carries ``Connection: close``; while it holds an idle keep-alive
connection it also watches the listeners, and if it accepts a newcomer it parks the idle
connection and serves the newcomer. So 50 keep-alive clients on 2 workers never wait for
each other's idle timeout (uWSGI's http11-socket does make them wait).

A sync worker commits itself to a connection only once its request is ready: the whole head,
and the body or its first --body-buffer bytes (``Connection.gather``, without waiting). A
client that connected and has not sent that yet waits among the worker's *pending* connections,
watched by
the same poll, each bounded by --header-timeout; so slow and silent clients (slowloris) cost
a poll entry, not the worker. What a sync worker cannot escape by design: a request it serves
holds it to the end, a client that reads its response slowly included (a buffering proxy in
front absorbs those; see the README's Security section).

Owns: that loop, and what a worker busy in its one request does at a stop from its signal
handlers (it cannot act otherwise until the request ends). The requests themselves are
``Pipeline``'s.
"""

from __future__ import annotations

import select
import signal
import socket
import sys
import time
from typing import Any

from forkserve.context import RequestContext, RequestTimedOut
from forkserve.sockets import Listener, accept_queue_length, queued_clients
from forkserve.workers.base import WorkerState
from forkserve.workers.connection import Connection
from forkserve.workers.pipeline import CLOSE, IDLE, LINGER, Pipeline, stop_grace_end

POLLIN = select.POLLIN
RUNNING = WorkerState.RUNNING


class SyncWorker(Pipeline):
    multithread = False
    defers_writes = True  # a whole response a slow reader has not taken: the loop writes it
    closes_at_once = True  # (one thread, no yield: the close follows the last send at once)
    # A WebSocket would hold the worker's one connection for its whole life (everyone else
    # waits), and beat no heartbeat past --timeout: refused, with the way out.
    upgrade_refusal = ("the sync worker serves one connection at a time; a WebSocket needs "
                       "the thread or gevent worker (-k thread, -k gevent)")

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
        # Accepted, request not ready yet (see the module's docstring): fd -> conn, listener,
        # the time it may take until.
        self.pending: dict[int, tuple[Connection, Listener, float]] = {}
        self.limit = self.settings.max_connections or 1000  # connections held, pending ones too
        self.timed: RequestContext | None = None  # the request --request-timeout watches
        self.timed_until = 0.0  # (monotonic) when its time is up

    def serve(self) -> None:
        self.setup_http()
        if self.request_timeout:
            self._take_alarm()
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
            self._settle_pending()
            if self.state is WorkerState.STOPPING and not self.retire_reason:
                self._drain_accept_queue()
                self._settle_pending()  # (responses to those still going out)
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
            if self.lingering:
                self.end_lingering(time.monotonic())
            if self.pending or self.flushing:
                # Pending clients whose request came are served before anyone new: under a
                # steady queue they would otherwise wait for a lull.
                self._expire_pending()
                if self._round(0.0):
                    continue
            accepted = self._accept() if self.counters.active_connections < self.limit else None
            if accepted is not None:
                sock, addr, listener = accepted  # (not self._take(*accepted): see _take)
                self._take(sock, addr, listener)
                # Clients that come and never finish a request (slowloris) keep this loop from
                # ever waiting: the heartbeat must not depend on a wait or a served request.
                now = time.monotonic()
                if now >= self.next_heartbeat:
                    self.heartbeat(now)
                continue
            self.before_waiting()
            self._round(self._until_due(heartbeat_ms))

    def _round(self, timeout_ms: float, listen: bool = True) -> bool:
        """One poll of everything: signals, the arbiter, pending clients (and, to end the wait,
        the listeners). True when it served a request or read a signal: the loop looks at the
        state and the queue again."""
        acted = False
        for fd, _ in self._poll_main(timeout_ms, listen):
            if fd in self.pending or fd in self.flushing:
                ready = self._gather(fd) if fd in self.pending else self._write_out(fd)
                if ready is not None:
                    self._serve(*ready)
                    # What else this poll saw may be stale now (a closed fd's number reused):
                    # the next poll reports it again.
                    return True
            elif fd in self.lingering:
                self.linger_more(fd)
            elif fd not in self.listener_fds:
                self._wake(fd)
                acted = True
        return acted

    def _until_due(self, timeout_ms: float) -> float:
        """``timeout_ms``, or less: until the first pending or flushing client's time is up."""
        if self.pending or self.flushing or self.lingering:
            due = min([deadline for _, _, deadline in self.pending.values()]
                      + [flushing[3] for flushing in self.flushing.values()]
                      + [lingering[1] for lingering in self.lingering.values()])
            timeout_ms = min(timeout_ms, max(due - time.monotonic(), 0.0) * 1000.0 + 1)
        return timeout_ms

    # -- pending clients ---------------------------------------------------------------------
    def _take(self, sock: socket.socket, addr: Any, listener: Listener) -> None:
        """A client just accepted: served now if its request is here (the usual case: one recv
        reads it), else pending."""
        ready = self._pend(sock, addr, listener)
        if ready is not None:
            # Not self._serve(*ready): CPython 3.11 specializes no call with *args (nor the
            # load of the method it calls), and this is every new client's path.
            conn, listener = ready
            self._serve(conn, listener)

    def _pend(self, sock: socket.socket, addr: Any,
              listener: Listener) -> tuple[Connection, Listener] | None:
        """A client just accepted: its connection once its request is ready, else it is
        pending (None)."""
        conn = self.open_connection(sock, addr)
        self.admit(conn)
        ready = self.gather(conn)
        if ready:
            return conn, listener
        if ready is False:
            deadline = time.monotonic() + self.settings.header_timeout
            self.pending[conn.fd] = (conn, listener, self.gathered_until(conn, deadline))
            self.main_poll.register(conn.fd, POLLIN)
            self.waiting_poll.register(conn.fd, POLLIN)  # a client waits: see should_close
        return None

    def _gather(self, fd: int) -> tuple[Connection, Listener] | None:
        """Read what a pending client sent; the connection and its listener once its request
        is ready (no longer pending), else None."""
        conn, listener, deadline = self.pending[fd]
        ready = self.gather(conn)
        if ready is False:
            self.pending[fd] = (conn, listener, self.gathered_until(conn, deadline))
            return None
        self._unpend(fd)
        return (conn, listener) if ready else None

    def _unpend(self, fd: int) -> None:
        del self.pending[fd]
        self.main_poll.unregister(fd)
        self.waiting_poll.unregister(fd)

    # -- responses the loop writes out (Pipeline.write_later) -------------------------------
    def watch_writable(self, fd: int, on: bool) -> None:
        if on:
            self.main_poll.register(fd, select.POLLOUT)
        else:
            self.main_poll.unregister(fd)

    def watch_readable(self, fd: int, on: bool) -> None:  # (Pipeline.close_later)
        if on:
            self.main_poll.register(fd, POLLIN)
        else:
            self.main_poll.unregister(fd)

    def _write_out(self, fd: int) -> tuple[Connection, Listener] | None:
        """The client took more. Once all is out the connection ends, or waits pending for its
        next request (a kept-alive one), or is returned to be served at once (a pipelined
        request is already here)."""
        done = self.write_more(fd)
        if done is None:
            return None
        conn, listener, ending = done
        if ending is not IDLE:
            self.end_connection(conn, linger=ending is LINGER)
            return None
        if conn.events:
            return conn, listener
        deadline = conn.idle_since + self.settings.keepalive
        if self.state is not RUNNING:
            deadline = min(deadline, stop_grace_end(conn, self.stop_began()))
        self.pending[fd] = (conn, listener, deadline)
        self.main_poll.register(fd, POLLIN)
        self.waiting_poll.register(fd, POLLIN)
        return None

    def _expire_pending(self) -> None:
        """Pending clients whose time is up: a request begun and not finished in time gets a
        408 here (it never reaches the app); a silent one is closed, unless a stopping worker
        finds its request arrived just now (answered, never reset). A client that stopped
        reading its response is closed."""
        now = time.monotonic()
        if self.flushing:
            self.end_writes(now)
        for fd, (conn, listener, deadline) in list(self.pending.items()):
            if now < deadline or fd not in self.pending:
                continue
            # The worker may have been busy with a request past this deadline, reading no
            # one: what the client sent meanwhile counts (a whole request is served, more of
            # one gets its time), as it would had the worker been waiting.
            ready = self._gather(fd)
            if ready is not None:
                self._serve(*ready)
                continue
            if fd not in self.pending or self.pending[fd][2] > now:
                continue  # refused (closed), or it sent more and has time again
            self._unpend(fd)
            if conn.received:
                self.refuse(conn, 408, "Request Timeout", wait=False)
            elif self.state is WorkerState.STOPPING and conn.readable_now():
                self._serve(conn, listener)
                continue
            self.release(conn)

    def _settle_pending(self) -> None:
        """The worker stops with clients pending: a request begun is served to its end
        within its own bounds (as one being read would be); a silent client gets the stop's
        short grace; past the drain deadline, a request begun gets a 503."""
        stop_began = self.stop_began() if self.pending else 0.0
        for fd, (conn, listener, deadline) in list(self.pending.items()):
            if not conn.received:
                self.pending[fd] = (conn, listener, min(deadline, stop_grace_end(conn, stop_began)))
        while ((self.pending or self.flushing or self.lingering)
               and self.state is WorkerState.STOPPING):
            self.end_lingering(time.monotonic())
            self._expire_pending()
            self.before_waiting()
            self._round(self._until_due(self.heartbeat_interval * 1000.0), listen=False)
        for fd, (conn, _, _) in list(self.pending.items()):
            self._unpend(fd)
            if conn.received and self.state is WorkerState.CANCELLED:
                self.refuse(conn, 503, "Service Unavailable", wait=False)
            self.release(conn)
        self.end_writes()  # responses still going out are cut at the deadline
        self.end_lingering()

    def _poll_main(self, timeout_ms: float, listen: bool = True) -> list[tuple[int, int]]:
        """main_poll's wait, leaving the listeners out while the worker takes no one (full,
        out of descriptors, settling its pending clients at a stop): a queued client keeps
        them readable, which would make the wait a busy loop."""
        if self.listeners_changed:
            # Closed (by the TERM handler, or at a stop): a closed fd left in the poll is
            # reported POLLNVAL at once, muted or not, and the wait would be a busy loop.
            self._forget_closed_listeners()
        pause = self.accept_paused_for()
        if pause:
            timeout_ms = min(timeout_ms, pause * 1000.0 + 1)
        mute = bool(pause) or not listen or self.counters.active_connections >= self.limit
        if mute is not self.listeners_muted:
            for fd in self.listener_fds:
                self.main_poll.modify(fd, 0 if mute else POLLIN)
            self.listeners_muted = mute
        return self.main_poll.poll(timeout_ms)

    def _drain_accept_queue(self) -> None:  # (pending clients: settled before this)
        """On a graceful stop, serve the clients already queued in the kernel (each answered
        with Connection: close) rather than let closing the listener reset them (see
        takes_queue for which queues are ours to serve). One at a time, as the other
        workers do: the queue is shared fairly, so it empties soonest. New clients keep
        coming, but none joins a queue the arbiter made refuse them, so this ends; the bound
        is for a unix socket's queue, which cannot refuse them."""
        self._serve_taken()
        for listener in self.listeners:
            if self.takes_queue(listener):
                budget = [queued_clients([listener]) + socket.SOMAXCONN]
                self.take_queue(
                    listener, lambda: self._take_queued(listener, WorkerState.STOPPING, budget),
                    time.sleep)
            listener.sock.close()
            self.listeners_changed = True  # (_poll_main forgets it)
        if self.state is WorkerState.CANCELLED:
            self._turn_away_queue()  # the deadline passed meanwhile: what is left gets a 503

    def _take_queued(self, listener: Listener, state: WorkerState, budget: list[int]) -> bool:
        """(Pipeline.take_queue) Stopping or pausing: serve the clients queued on
        ``listener`` one at a time, while the worker stays in ``state`` and ``budget[0]``
        (shared by the looks) lasts; False once either ends."""
        while budget[0] > 0 and self.state is state:
            client = self.accept_from(listener)
            if client is None:
                return True
            budget[0] -= 1
            self._handle(*client, listener)
            self._serve_taken()  # what _on_alarm took meanwhile (stopping only)
        return False

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
        for listener in self.listeners:
            unbounded = [sys.maxsize]
            self.take_queue(listener, lambda: self._take_queued(listener, RUNNING, unbounded),
                            time.sleep)
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

    def _newcomer(self) -> tuple[Connection, Listener] | None:
        """While a kept-alive connection idles: a client from the queue whose request is
        ready (else it is pending, and None)."""
        if self.counters.active_connections >= self.limit:
            return None
        accepted = self._accept()
        return None if accepted is None else self._pend(*accepted)

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
                or self.lameduck or self.pause_requested or bool(self.waiting_poll.poll(0)))  # (pending clients too)

    # -- one connection --------------------------------------------------------------------
    def _handle(self, sock: socket.socket, addr: Any, listener: Listener) -> None:
        """A client taken from the queue at a stop (its request read the usual way, bounded)."""
        conn = self.open_connection(sock, addr)
        self.admit(conn)
        self._serve(conn, listener)

    def _serve(self, conn: Connection, listener: Listener) -> None:
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
                if newcomer is not None:
                    continue  # (still readable at the next poll)
                if fd in self.listener_fds:
                    newcomer = self._newcomer()
                elif fd in self.pending:
                    newcomer = self._gather(fd)
                elif fd in self.flushing:
                    newcomer = self._write_out(fd)
                elif fd in self.lingering:
                    self.linger_more(fd)
                else:
                    self._wake(fd)
            self._expire_pending()
            if newcomer is not None:
                self.parked.append(conn)
                try:
                    self._serve(*newcomer)
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

    # -- --request-timeout: SIGALRM -----------------------------------------------------------
    # The worker's one thread runs the request, so only a signal reaches it: SIGALRM, armed
    # (setitimer) when the app is called, disarmed when the request ends. Its handler raises
    # RequestTimedOut in the request (like USR2's cancel): from the line the app is at, or
    # from a blocking call the signal interrupts (a sleep, a socket wait: PEP 475 retries
    # one only when the handler returns). The same handler serves the stop's queue watch
    # (_watch_queue); while that ticks every 0.1 s, the timer is left to it.
    def _take_alarm(self) -> None:
        """SIGALRM is ours for the timeout unless the application took it (at import)."""
        if signal.getsignal(signal.SIGALRM) is not signal.SIG_DFL:
            self.log.warning("--request-timeout is off in this sync worker: the application "
                             "handles SIGALRM itself", worker=self.worker_id)
            self.request_timeout = 0.0
            return
        signal.signal(signal.SIGALRM, self._on_alarm)

    def time_request(self, context: RequestContext, conn: Connection) -> None:
        self.timed_until = time.monotonic() + self.request_timeout
        self.timed = context
        if not self.queue_watch:
            signal.setitimer(signal.ITIMER_REAL, self.request_timeout)

    def untime_request(self, context: RequestContext) -> None:
        self.timed = None  # first: an alarm from now on finds nothing to cancel
        if not self.queue_watch:
            signal.setitimer(signal.ITIMER_REAL, 0)

    def _on_alarm(self, signum: int, frame: Any) -> None:
        # -- runs in a signal handler (see the list in base.py); raises only into the live
        # request that --request-timeout times, once.
        context = self.timed
        if context is not None and self.cancellable is context and not context.cancelled:
            left = self.timed_until - time.monotonic()
            if left <= 0.001:
                context.cancelled = context.timed_out = True
                raise RequestTimedOut()
            if not self.queue_watch:  # (early, by the clocks' difference): the rest
                signal.setitimer(signal.ITIMER_REAL, left)
        if self.queue_watch:
            self._check_queue()

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
        leaves SIGALRM alone (--request-timeout's timer shares it: see _on_alarm)."""
        if on and not self.queue_watch:
            handler = signal.getsignal(signal.SIGALRM)
            if handler is not signal.SIG_DFL and handler != self._on_alarm:
                return  # the application's own: leave it (the loop closes after the request)
            signal.signal(signal.SIGALRM, self._on_alarm)
            signal.setitimer(signal.ITIMER_REAL, 0.1, 0.1)
            self.queue_watch = True
        elif not on and self.queue_watch:
            signal.setitimer(signal.ITIMER_REAL, 0)
            self.queue_watch = False
            if not self.request_timeout:
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
            elif self.timed is not None:  # the request's own timer again, for what is left
                signal.setitimer(signal.ITIMER_REAL,
                                 max(self.timed_until - time.monotonic(), 0.001))

    def _check_queue(self) -> None:
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
