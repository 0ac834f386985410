"""The sync worker: one connection at a time, keep-alive without starving anyone.

A sync worker keeps a connection alive only while no other client waits in the accept queue:
before each response head it polls the listeners with a zero timeout, and if someone is
waiting the response carries ``Connection: close``; while it holds an idle keep-alive
connection it also watches the listeners, and if it accepts a newcomer it closes the idle
connection and serves the newcomer. So 50 keep-alive clients on 2 workers never wait for
each other's idle timeout (uWSGI's http11-socket does make them wait).
"""

from __future__ import annotations

import os
import select
import socket
import time
from typing import Any

from forkserve.context import CURRENT, RequestCancelled, RequestContext
from forkserve.http import HTTPError, Request
from forkserve.http.response import DateCache, reason_phrase, simple_response
from forkserve.sockets import Listener, refusing_new_connections
from forkserve.workers.base import Worker, WorkerState, queued_clients
from forkserve.workers.connection import Abandoned, Connection, Timeout, linger_together
from forkserve.wsgi import (ClientGone, ErrorStream, Exchange, FileWrapper, HeaderKeys, Input,
                            base_environ, build_environ)

POLLIN = select.POLLIN
NEW_CONNECTION_GRACE = 0.5  # seconds a silent new connection gets once the worker stops
# Seconds an idle keep-alive connection must have been quiet before a stopping worker closes it.
# Closing an idle connection races a request the client (a balancer reusing its connection)
# may be sending right then: that request would be lost. So a stopping worker answers what
# arrives within this grace (with Connection: close) and closes only connections that have
# been quiet for it, which a client is unlikely to pick at that very moment. Quiet counts from
# the last response or the stop, whichever is later: a balancer that marked us down (paused)
# leaves its pooled connections idle, and picks them up again just as the resume retires us.
KEEPALIVE_CLOSE_GRACE = 0.5
RUNNING = WorkerState.RUNNING


class SyncWorker(Worker):
    multithread = False

    def setup_http(self) -> None:
        """What every request on this worker shares: the Date cache, header keys, environs."""
        self.dates = DateCache()
        self.keys = HeaderKeys()
        errors = ErrorStream(lambda: self.log.fd)
        self.environs = {}
        for listener in self.listeners:
            name, port = listener.server_name_port()
            # By the listener itself, not its fd: a stopping worker closes its listeners while
            # the connections it accepted from them are still being served (fd -1 by then).
            self.environs[id(listener)] = base_environ(name, port, errors, self.multithread)
        self.connections: set[Connection] = set()
        self.taken: list[tuple[socket.socket, Any, Listener]] = []  # see _on_alarm
        self.stop_seen: float | None = None  # see stop_began
        self.queue_checks = 0  # alarms in a row that found the accept queue no shorter
        self.queue_seen = 0

    # -- the thread and gevent workers' waits on clients ------------------------------------
    def open_stop_pipes(self) -> None:
        """Two pipes that waits on clients watch (thread and gevent workers; a sync worker's
        waits watch its signal pipe): one byte each, written once, at the stop and at the
        drain deadline. Never drained, so every wait, now or later, sees them."""
        self.stop_r, self.stop_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.cancel_r, self.cancel_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.stop_signalled = self.cancel_signalled = False

    def signal_stop(self, cancel: bool = False) -> None:
        """Wake every wait on a client (see open_stop_pipes); at the deadline, twice."""
        if not self.stop_signalled:
            self.stop_signalled = True
            os.write(self.stop_w, b"\0")
        if cancel and not self.cancel_signalled:
            self.cancel_signalled = True
            os.write(self.cancel_w, b"\0")  # waits that already took the stop watch this one

    def next_interrupt(self, conn: Connection) -> None:
        """A wait took the stop pipe's byte: it watches the cancel pipe next, then nothing
        (both stay readable: watching one again would spin)."""
        conn.interrupt_on(self.cancel_r if conn.interrupt_fd != self.cancel_r else -1)

    def open_connection(self, sock: socket.socket, remote: tuple[str, str]) -> Connection:
        conn = Connection(sock, remote, self.settings.limits, self.settings.header_timeout,
                          self.wakeup_r, self._interrupted)
        conn.should_close = self._should_close
        return conn

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
            self._idle()
            for fd, _ in self.main_poll.poll(heartbeat_ms):
                self._wake(fd)

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

    def takes_queue(self, listener: Listener) -> bool:
        """Stopping: must this worker serve the clients queued on ``listener``? Yes when the
        arbiter made it refuse new clients (a full stop: no one else will serve them), or
        where that cannot be told (a unix socket); no while it still admits clients (a
        reload, max-requests, a handoff, a service manager's socket: whoever stays serves
        the queue, and closing our copy of the socket loses nothing)."""
        if listener.sock.fileno() < 0:
            return False
        if self.retire_reason:
            return False
        if listener.sock.family not in (socket.AF_INET, socket.AF_INET6):
            return True
        return refusing_new_connections(listener)

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

    def _turn_away_queue(self, listeners: list[Listener] | None = None) -> None:
        """Past the drain deadline: every client still queued gets a 503 now, never a reset.
        All are answered and half-closed first, then drained together (a lingering close,
        so that closing with their unread requests does not reset them before they read
        the 503), within a bounded share of the cancel grace."""
        deadline = time.monotonic() + self.settings.cancel_grace / 2
        answered = [self.turn_away(sock) for sock, _, _ in self.taken]
        self.taken = []
        for listener in self.listeners if listeners is None else listeners:
            while time.monotonic() < deadline:
                accepted = self.accept_from(listener)
                if accepted is None:
                    break
                answered.append(self.turn_away(accepted[0]))
        linger_together(answered, deadline)

    def turn_away(self, sock: socket.socket) -> Connection:
        """A client still queued past the drain deadline: a 503 and the end of our output
        (counted as a refusal: its request was never read). The caller closes it."""
        conn = Connection(sock, ("-", "0"), self.settings.limits, 1.0)
        try:
            conn.send(simple_response(503, "Service Unavailable", self.dates))
        except ClientGone:
            self.log.debug("A queued client left before its 503")
        conn.end_output()
        if self.metrics is not None:
            self.metrics.request("-", 503, None)
        return conn

    def _idle(self) -> None:
        """About to wait for work: write out telemetry, send a heartbeat if one is due."""
        if self.access_log is not None:
            self.access_log.flush()
        if self.spans is not None:
            self.spans.flush()
        now = time.monotonic()
        if now >= self.next_heartbeat:
            self.heartbeat(now)

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

    def accept_from(self, listener: Listener) -> tuple[socket.socket, Any] | None:
        """One waiting client of this listener, or None (none waiting, or it is closed)."""
        if listener.sock.fileno() < 0:
            return None  # closed at the stop signal (see Worker._on_graceful)
        try:
            return listener.sock.accept()
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            # ECONNABORTED, EMFILE...: log and go on; the listener stays usable.
            self.log.warning("accept() failed", error=exc.strerror, worker=self.worker_id)
            return None

    def _interrupted(self, conn: Connection) -> bool:
        """A signal arrived while a connection waits on its client: give up the wait?"""
        self.handle_wakeups()
        state = self.state
        if state is WorkerState.CANCELLED or state is WorkerState.HALTING:
            return True  # the deadline passed: nothing may keep this worker any longer
        if state is not RUNNING:
            self.stop_cutoff(conn)
        return False

    def stop_began(self) -> float:
        """When this worker first applied a stop's graces: within moments of the stop itself
        (every wait on a client wakes for it), and the same for every connection after."""
        if self.stop_seen is None:
            self.stop_seen = time.monotonic()
        return self.stop_seen

    def stop_cutoff(self, conn: Connection) -> None:
        """The worker is stopping: how much longer a wait for a client's next request head may
        last. Its request may be on the wire right now: never close under it at once."""
        if conn.cutoff is not None or not conn.reading_head or conn.received:
            return
        conn.cutoff = stop_grace_end(conn, self.stop_began())

    def _on_alarm(self, signum: int, frame: Any) -> None:
        """-- runs in a signal handler (see Worker._watch_queue): a busy worker at a stop, its
        accept queue not empty. When for 0.3 s the queue has not shrunk (no other worker is
        free to take those clients), it takes them itself (they would wait for it either
        way) and closes its listeners, so that new clients are refused rather than kept
        retrying their SYNs for as long as this request runs; it serves them once the
        request is done. While the queue shrinks, the other workers are serving it."""
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
        super()._on_alarm(signum, frame)

    def close_quiet_parked(self) -> None:
        now = time.monotonic()
        for conn in self.parked:
            if (not conn.output_ended and now >= stop_grace_end(conn, self.stop_began())
                    and not conn.readable_now()):
                conn.end_output()

    def parked_to_close(self) -> bool:
        return (self.busy and self.state is WorkerState.STOPPING
                and any(not conn.output_ended and not conn.readable_now() for conn in self.parked))

    def _should_close(self) -> bool:
        """Asked as a response head is written: close rather than keep this client alive? Also
        while a pause waits for this worker: one kept-alive client would otherwise hold it
        (and so its copy of the port, and the clients queued at the pause) for as long as it
        keeps sending."""
        return (self.state is not RUNNING or bool(self.parked) or self.settings.keepalive <= 0
                or self.pause_requested or bool(self.waiting_poll.poll(0)))

    # -- one connection --------------------------------------------------------------------
    def _handle(self, sock: socket.socket, addr: Any, listener: Listener) -> None:
        settings = self.settings
        conn = self.open_connection(sock, remote_of(addr))
        base = self.environs[id(listener)]
        counters = self.counters
        counters.active_connections += 1
        self.connections.add(conn)
        self.busy = True
        linger = False
        try:
            while True:
                try:
                    request = conn.read_head(time.monotonic() + settings.header_timeout)
                except HTTPError as exc:
                    self._refuse(conn, exc.status, exc.reason)
                    linger = True
                    return
                except Timeout:
                    if conn.received:
                        self._refuse(conn, 408, "Request Timeout")
                    return
                except Abandoned:
                    if conn.received:
                        self._refuse(conn, 503, "Service Unavailable")
                        linger = True
                    elif self.state is WorkerState.STOPPING and conn.readable_now():
                        continue  # its request arrived just now: answer it, never reset it
                    return
                if request is None:
                    return
                keep = self._serve(conn, request, base)
                conn.served += 1
                if not keep:
                    linger = conn.has_unread()
                    return
                if conn.events:
                    continue  # a pipelined request is already here
                if not self._wait_idle(conn):
                    return
        except ClientGone:
            return
        finally:
            self.connections.discard(conn)
            self.busy = bool(self.parked)
            conn.close(linger)
            if not conn.released:
                counters.active_connections -= 1
                self.report()

    def _wait_idle(self, conn: Connection) -> bool:
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
            self._idle()
            now = time.monotonic()
            if now >= deadline:
                return False
            poller.register(conn.fd, POLLIN)
            try:
                ready = poller.poll(min(deadline - now, self.heartbeat_interval) * 1000.0 + 1)
            finally:
                poller.unregister(conn.fd)
            fds = [fd for fd, _ in ready]
            if conn.fd in fds:
                # The idle client spoke: serve it. A newcomer waiting too makes this
                # response say Connection: close (_should_close), so it is next.
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

    def _refuse(self, conn: Connection, status: int, reason: str) -> None:
        """A request the server answers itself: it never reaches the application."""
        try:
            conn.send(simple_response(status, reason_phrase(status), self.dates,
                                      body=f"{status} {reason}\n".encode("utf-8", "replace")))
        except ClientGone:
            return
        if self.metrics is not None:
            self.metrics.request("-", status, None)  # refused: counted, not timed
        if self.access_log is not None:
            now = time.time()
            self.access_log.request(conn.remote[0], "-", "-", "-", status, 0, None, None, now, 0.0,
                                    "-")

    # -- one request -------------------------------------------------------------------------
    def _serve(self, conn: Connection, request: Request, base: dict[str, Any]) -> bool:
        """Run the app for one request. True when the connection may serve another."""
        access_log = self.access_log
        metrics = self.metrics
        started = time.time() if access_log is not None or metrics is not None else 0.0
        counters = self.counters
        counters.in_flight_requests += 1
        exchange = Exchange(conn, request, self.dates)
        conn.exchange = exchange
        context = RequestContext(lambda: self._finish_early(conn, exchange), self.pool, self.spans)
        wsgi_input = Input(conn if request.has_body else None)
        environ = build_environ(request, base, self.keys, conn.remote, wsgi_input)
        environ["forkserve.finish_request"] = context.finish
        if access_log is not None:
            # The client's (or its proxy's) X-Request-ID, else a new one: the app sees the
            # same id the access log records.
            request_id = environ["HTTP_X_REQUEST_ID"] = self.request_ids.take(
                environ.get("HTTP_X_REQUEST_ID"))
        status = 0
        keep = False
        token = CURRENT.set(context)
        self.in_request = True
        try:
            self.cancellable = context
            keep = self._run_app(conn, exchange, environ)
            status = exchange.status_code
        except ClientGone:
            status = exchange.status_code or 499
        except HTTPError as exc:  # from wsgi.input: a body over --limit-request-body
            status = self._fail(conn, exchange, exc.status, exc.reason, None)
        except (RequestCancelled, Abandoned) as exc:
            # Abandoned: the thread worker's wait on a request body, ended by the cancel.
            self.log.warning("Request cancelled", reason=str(exc) or "cancelled",
                             method=request.method, target=environ["RAW_URI"],
                             worker=self.worker_id)
            if metrics is not None:
                metrics.cancelled()
            status = self._fail(conn, exchange, 503, "Service Unavailable", None)
        except Exception as exc:
            status = self._fail(conn, exchange, 500, "Internal Server Error", exc)
        finally:
            self.cancellable = None
            self.in_request = False
            context.run_shutdown_functions(self.log)
            CURRENT.reset(token)
            counters.in_flight_requests -= 1
            conn.exchange = None
            self.report()
        if exchange.framing_broken:
            self.log.error("Response body did not match its Content-Length; connection closed",
                           method=request.method, target=environ["RAW_URI"],
                           content_length=exchange.content_length, sent=exchange.sent)
        self.request_done()
        if started:
            duration = time.time() - started
            if metrics is not None:
                metrics.request(request.method, status, duration)
            if access_log is not None:
                access_log.request(
                    conn.remote[0], request.method, environ["RAW_URI"],
                    environ["SERVER_PROTOCOL"], status, exchange.sent, environ.get("HTTP_REFERER"),
                    environ.get("HTTP_USER_AGENT"), started, duration, request_id)
        if self.spans is not None:
            self.spans.flush_if_due()
        now = conn.idle_since = time.monotonic()
        if now >= self.next_heartbeat:
            self.heartbeat(now)
        return keep and not conn.released and conn.discard_body(request)

    def _finish_early(self, conn: Connection, exchange: Exchange) -> None:
        """forkserve.finish_request(): the response ends for the client now. A sync worker
        cannot serve this connection again while the app works on, so it is closed (the
        client sees the end of the body and the close at once)."""
        if conn.released:
            return
        exchange.close = True
        exchange.finish()
        conn.end_output()
        conn.released = True
        self.counters.active_connections -= 1
        self.report()

    def _run_app(self, conn: Connection, exchange: Exchange, environ: dict[str, Any]) -> bool:
        result = self.app(environ, exchange.start_response)  # type: ignore[misc]
        try:
            kind = type(result)
            if (kind is list or kind is tuple) and len(result) == 1 and type(result[0]) is bytes:
                exchange.send_whole(result[0])  # the hello-world path: one send in all
            elif not (kind is FileWrapper and exchange.send_file(result)):
                write = exchange.write
                for data in result:
                    write(data)
                    if exchange.event_stream and self.state is not RUNNING:
                        # Server-sent events never end by themselves: at the drain the stream
                        # ends after the event just sent, cleanly terminated; the app's
                        # generator sees GeneratorExit (close() below).
                        exchange.close = True
                        break
                exchange.finish()
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
        return not exchange.close

    def _fail(self, conn: Connection, exchange: Exchange, status: int, reason: str,
              exc: BaseException | None) -> int:
        """The app (or its request body) failed: a clean error response if none started."""
        if exc is not None:
            request = exchange.request
            self.log.exception(f"Error handling request {request.method} "
                               f"{request.target.decode('latin-1')}", exc, worker=self.worker_id)
        if exchange.headers_sent:
            exchange.close = True  # the client sees a truncated response, never a wrong one
            return exchange.status_code
        try:
            conn.send(simple_response(status, reason_phrase(status), self.dates))
        except ClientGone:
            return status
        exchange.close = True
        return status


def stop_grace_end(conn: Connection, stop_began: float) -> float:
    """When a stopping worker gives up waiting for a connection's next request: an idle
    keep-alive one once it has been quiet for the close grace since its last response or the
    stop, one just accepted and silent after a short grace from now (its client may be about
    to send: a reload must not drop it; or it is a pre-connect that never will)."""
    if conn.served:
        return max(conn.idle_since, stop_began) + KEEPALIVE_CLOSE_GRACE
    return time.monotonic() + NEW_CONNECTION_GRACE


def remote_of(addr: Any) -> tuple[str, str]:
    """REMOTE_ADDR and REMOTE_PORT of an accepted peer (unix socket peers have none)."""
    if isinstance(addr, tuple):
        return addr[0], str(addr[1])
    return "127.0.0.1", "0"
