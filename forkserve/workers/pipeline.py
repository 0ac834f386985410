"""The request pipeline every worker class shares, written once.

Owns: a connection's life in a worker (admitted, its requests read and served, released),
one request's run through the application (environ, context, the app, its body, the access
log and metrics), the answers the server gives itself (a refusal for a bad or slow request, a
500 or 503 when the app fails or is cancelled, a 503 to a client still queued past the drain
deadline), and the stop's policy for a wait on a client (how long a stopping worker still
waits for a request, and when a wait is given up).

Not here: who waits on what. ``sync.py`` (one connection at a time), ``thread.py`` (a pool of
request threads fed by a poll loop) and ``gevent.py`` (greenlets on gevent's loop) each
subclass ``Pipeline`` and hold only their concurrency model. A drain fix made here holds for
all three.

Must not import the arbiter (see base.py).
"""

from __future__ import annotations

import _socket
import enum
import errno
import os
import socket
import time
from typing import Any, Callable, NoReturn

from forkserve.context import (RequestCancelled, RequestContext, RequestTimedOut, reset_current,
                               set_current)
from forkserve.hooks import RequestInfo, ResponseInfo
from forkserve.http import HTTPError, Request
from forkserve.http.proxy_protocol import ProxyProtocolError
from forkserve.http.response import DateCache, reason_phrase, simple_response
from forkserve.proxy import TrustedProxies
from forkserve.sockets import Listener, deferred_connections, refusing_new_connections
from forkserve.workers.base import Worker, WorkerState
from forkserve.workers.connection import (LINGER_BYTES, LINGER_TIME, RECV_SIZE, Abandoned,
                                          Connection, Timeout, linger_together)
from forkserve.wsgi import (CheckedHeads, ClientGone, ClientSocket, ErrorStream, Exchange,
                            FileWrapper, HeaderKeys, Input, NO_BODY, UpgradeRefused,
                            base_environ, build_environ)

NEW_CONNECTION_GRACE = 0.5  # seconds a silent new connection gets once the worker stops
DEFERRED_WAIT = 0.005  # seconds between looks for clients --defer-accept holds back (a stop)
# Seconds an idle keep-alive connection must have been quiet before a stopping worker closes it.
# Closing an idle connection races a request the client (a balancer reusing its connection)
# may be sending right then: that request would be lost. So a stopping worker answers what
# arrives within this grace (with Connection: close) and closes only connections that have
# been quiet for it, which a client is unlikely to pick at that very moment. Quiet counts from
# the last response or the stop, whichever is later: a balancer that marked us down (paused)
# leaves its pooled connections idle, and picks them up again just as the resume retires us.
KEEPALIVE_CLOSE_GRACE = 0.5
PROXY_LOG_INTERVAL = 10.0  # seconds between log lines about refused PROXY headers
# accept() failing for want of descriptors or memory: the client stays queued and the listener
# stays readable, so retrying at once is a busy loop (and a log line per try). The worker
# stops accepting this long at a time, serving its open connections, and retries.
ACCEPT_BACKOFF = 0.1
ACCEPT_LOG_INTERVAL = 10.0  # seconds between log lines about failing accepts
EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
RUNNING = WorkerState.RUNNING
STOPPING = WorkerState.STOPPING
CANCELLED = WorkerState.CANCELLED
HALTING = WorkerState.HALTING


# The standard library's socket class (a listener's, made by the arbiter before any gevent
# patch): accept_from takes its clients without socket.accept's per-call Python. The client's
# socket is of the class ``socket.socket`` names at the time, as in socket.accept: gevent's
# in a gevent worker (an app that takes the connection over blocks cooperatively).
PLAIN_SOCKET: type | None = socket.socket if issubclass(socket.socket, _socket.socket) else None


class Ending(enum.Enum):
    """How ``serve_connection`` left a connection."""

    IDLE = "kept alive, nothing of its next request here yet"  # the caller waits on it
    CLOSE = "to close"
    LINGER = "to close once what the client still sends is drained"  # see Connection.close


# The endings by name: ``Ending.IDLE`` is a class attribute looked up anew each time (CPython
# 3.11 specializes no attribute load on a class), and a worker tests one or two a request.
IDLE, CLOSE, LINGER = Ending.IDLE, Ending.CLOSE, Ending.LINGER


class Pipeline(Worker):
    """The child runtime plus the request pipeline; a subclass adds its concurrency model:
    ``serve()`` and ``should_close()``, and the two knobs below."""

    # Waits on a client watch the stop and cancel pipes (thread and gevent workers: their
    # waits run in pool threads or greenlets, which a signal handler does not interrupt), not
    # the signal wakeup pipe (the sync worker, whose waits run in the main thread).
    stop_pipes = False
    # A cancel reaches a request in the application by killing its greenlet (gevent), so a
    # wait inside a request leaves the cancel to that kill.
    kills_requests = False
    # The worker's own loop writes out a whole response a slow reader has not taken yet
    # (thread worker: so that the request thread is free at once; see Connection.send_last).
    defers_writes = False
    # Why an app may not take a connection over (a WebSocket upgrade, see wsgi.ClientSocket)
    # on this worker class; None where it may.
    upgrade_refusal: str | None = None

    connection_class = Connection  # (the gevent worker's waits are its loop's own)
    # A response that ends its connection goes out with the FIN in one segment (see
    # Connection.send_last), where the close follows the send at once: in the sync worker.
    # A thread worker's request thread may wait for the GIL between the two, and a gevent
    # worker's greenlet may yield; the held segment would wait with them.
    closes_at_once = False

    # Pipeline's own attributes (see Worker's __slots__).
    __slots__ = ("accept_failures", "accept_logged_at", "accept_resumes", "accept_troubled",
                 "cancel_r", "cancel_signalled", "cancel_w", "connections", "dates",
                 "environs", "fired", "flushing", "heads", "keys", "lingering", "peer_certs",
                 "post_request_hook", "pre_request_hook", "proxies", "proxy_logged_at",
                 "proxy_refused", "request_hooks", "request_timeout", "socket_kinds", "stop_r",
                 "stop_seen", "stop_signalled", "stop_w", "timing", "upgrade_refused_logged")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Set here, not in serve(): a signal handler may look at them while the app loads.
        self.connections: set[Connection] = set()
        self.stop_seen: float | None = None  # see stop_began
        self.stop_r = self.stop_w = self.cancel_r = self.cancel_w = -1  # see _open_stop_pipes
        self.stop_signalled = self.cancel_signalled = False
        self.proxy_refused = 0  # PROXY headers refused since the last line about them
        self.proxy_logged_at = -PROXY_LOG_INTERVAL
        # fd -> a connection whose response the loop writes out, how it ends then, deadline
        self.flushing: dict[int, tuple[Connection, Listener, Ending, float]] = {}
        # fd -> a half-closed connection the loop drains before closing, its deadline, bytes
        # dropped so far (see close_later)
        self.lingering: dict[int, tuple[Connection, float, int]] = {}
        self.accept_resumes = 0.0  # monotonic time accepting resumes (see accept_paused_for)
        self.accept_failures = 0  # failed accepts since the last line about them
        self.accept_troubled = False  # accept() failed, and no line has said it works again
        self.accept_logged_at = -ACCEPT_LOG_INTERVAL
        self.upgrade_refused_logged = False
        self.socket_kinds: dict[socket.socket, tuple[int, int, int]] = {}  # (accept_from)
        # --request-timeout (0: off; a class that cannot apply it turns it off): the requests
        # in the application, in the order they began, so in the order their time is up
        # (see time_request), and those a timeout was sent into that have not ended yet.
        self.request_timeout = self.settings.request_timeout
        self.timing: dict[RequestContext, tuple[float, Connection]] = {}
        self.fired: set[RequestContext] = set()
        # The request hooks, read once: a request pays one check when neither is defined.
        self.pre_request_hook = self.hooks.pre_request
        self.post_request_hook = self.hooks.post_request
        self.request_hooks = self.pre_request_hook is not None or self.post_request_hook is not None

    def setup_http(self) -> None:
        """What every request on this worker shares: the Date cache, header keys, environs."""
        self.dates = DateCache()
        self.keys = HeaderKeys()
        self.heads = CheckedHeads()
        self.proxies = TrustedProxies(self.settings.forwarded_allow_ips,
                                      self.settings.forwarded_for)
        errors = ErrorStream(lambda: self.log.fd)
        self.environs: dict[int, dict[str, Any]] = {}
        for listener in self.listeners:
            name, port = listener.server_name_port()
            # By the listener itself, not its fd: a stopping worker closes its listeners while
            # the connections it accepted from them are still being served (fd -1 by then).
            base = self.environs[id(listener)] = base_environ(name, port, errors,
                                                              self.multithread)
            if self.settings.tls is not None:
                base["wsgi.url_scheme"], base["HTTPS"] = "https", "on"
        # Client certificates: as the context this worker serves with asks for them (after a
        # HUP that refused a new certificate, that is the old one's rule, not the setting's).
        material = self.settings.tls_material
        self.peer_certs = material is not None and material.cert_reqs != "none"
        if self.stop_pipes:
            self._open_stop_pipes()

    def should_close(self) -> bool:
        """Asked as a response head is written: close rather than keep this client alive?"""
        raise NotImplementedError

    # -- waits on clients and the stop ----------------------------------------------------
    def _open_stop_pipes(self) -> None:
        """Two pipes that waits on clients watch (see ``stop_pipes``): one byte each, written
        once, at the stop and at the drain deadline. Never drained, so every wait, now or
        later, sees them. A stop signalled while the app loaded is written at once."""
        self.stop_r, self.stop_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.cancel_r, self.cancel_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.stop_signalled:
            os.write(self.stop_w, b"\0")
        if self.cancel_signalled:
            os.write(self.cancel_w, b"\0")

    def signal_stop(self, cancel: bool = False) -> None:
        """Wake every wait on a client (see _open_stop_pipes); at the deadline, twice."""
        if not self.stop_signalled:
            self.stop_signalled = True
            if self.stop_w >= 0:
                os.write(self.stop_w, b"\0")
        if cancel and not self.cancel_signalled:
            self.cancel_signalled = True
            if self.cancel_w >= 0:
                os.write(self.cancel_w, b"\0")  # waits that took the stop watch this one

    def open_connection(self, sock: socket.socket, addr: Any) -> Connection:
        interrupt_fd = self.stop_r if self.stop_pipes else self.wakeup_r
        tls = self.settings.tls
        if tls is not None:
            # The handshake waits for the first read, in the connection's own waits (bounded).
            sock = tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return self.connection_class(sock, remote_of(addr), self.settings.limits,
                          self.settings.header_timeout, self.should_close, interrupt_fd,
                          self.interrupted, self.proxies.trusts_peer(addr),
                          self.settings.proxy_protocol, tls is not None, self.defers_writes)

    def interrupted(self, conn: Connection) -> bool:
        """-- may run in a pool thread. A wait on ``conn``'s client saw its interrupt fd
        fire (a signal, the stop or the cancel): give the wait up (True: Abandoned)?"""
        if not self.stop_pipes:
            self.handle_wakeups()  # the signal pipe: the handlers have run, the state is new
        state = self.state
        if state is CANCELLED or state is HALTING:
            if not conn.in_request:
                return True  # waiting for a request head at the deadline: nothing more is taken
            if not self.kills_requests:
                # A request reading its body or writing its response: cancelled like one in
                # the app (a BaseException: an app's `except Exception` does not swallow it).
                raise RequestCancelled("cancelled: the drain timeout passed")
        elif state is not RUNNING:
            self.stop_cutoff(conn)
        if self.stop_pipes:
            # The stop pipe's byte is taken: watch the cancel pipe next, then nothing (both
            # stay readable: watching one again would spin).
            conn.interrupt_on(self.cancel_r if conn.interrupt_fd != self.cancel_r else -1)
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
        if conn.awaiting_request:
            conn.cut_off(stop_grace_end(conn, self.stop_began()))

    # -- the listeners ---------------------------------------------------------------------
    def accept_from(self, listener: Listener) -> tuple[socket.socket, Any] | None:
        """One waiting client of this listener, or None (none waiting, it is closed, or
        accepting is paused: see accept_paused_for)."""
        if listener.sock.fileno() < 0:
            return None  # closed at the stop signal (see SyncWorker._on_graceful)
        if self.accept_resumes and time.monotonic() < self.accept_resumes:
            if self.state is RUNNING and not self.pause_requested:
                return None
            # Stopping or paused (TTOU), the caller empties the queue and then closes the
            # listener, which would reset whoever is still queued: wait out the pause (0.1 s)
            # and try again.
            time.sleep(max(self.accept_resumes - time.monotonic(), 0.0))
        sock = listener.sock
        try:
            if type(sock) is PLAIN_SOCKET:
                # socket.accept() without its per-call Python: the listener's family and type
                # are looked up (two enum conversions) and its timeout asked each time.
                # Listeners are non-blocking, so the new socket needs no setblocking(True).
                kind = self.socket_kinds.get(sock)
                if kind is None:
                    kind = self.socket_kinds[sock] = (sock.family, sock.type, sock.proto)
                fd, addr = sock._accept()  # type: ignore[attr-defined]
                accepted = socket.socket(*kind, fileno=fd), addr  # (gevent's, where patched)
            else:
                accepted = sock.accept()  # (gevent's cooperative socket)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            self._accept_failed(exc)
            return None
        if self.accept_troubled:
            self._accept_failed(None)
        return accepted

    def accept_paused_for(self) -> float:
        """Seconds until accepting resumes after accept() ran out of descriptors (0: it is
        not paused). The loops leave the listeners out of their polls meanwhile."""
        if not self.accept_resumes:
            return 0.0
        left = self.accept_resumes - time.monotonic()
        if left <= 0:
            self.accept_resumes = 0.0
            return 0.0
        return left

    def _accept_failed(self, exc: OSError | None) -> None:
        """accept() failed (``exc``), or worked again after failures (None). Out of
        descriptors or memory, accepting pauses (ACCEPT_BACKOFF) while open connections are
        served. At most one line per interval, failure or recovery, with the count of
        failures since the last one (hovering at the limit must not flood the log). A client
        that reset before we took it (ECONNABORTED) is not worth a line."""
        now = time.monotonic()
        due = now - self.accept_logged_at >= ACCEPT_LOG_INTERVAL
        if exc is None:
            if due:
                self.accept_logged_at = now
                self.log.warning("Accepting connections again",
                                 failed_accepts=self.accept_failures, worker=self.worker_id)
                self.accept_failures, self.accept_troubled = 0, False
            return
        if exc.errno == errno.ECONNABORTED:
            return
        self.accept_failures += 1
        self.accept_troubled = True
        self.accept_resumes = now + ACCEPT_BACKOFF
        if due:
            self.accept_logged_at = now
            exhausted = exc.errno in EXHAUSTED
            self.log.error("accept() failed; new connections wait in the listen queue, open ones "
                           "are still served" if exhausted else "accept() failed",
                           error=exc.strerror, failed_accepts=self.accept_failures,
                           worker=self.worker_id)
            self.accept_failures = 0

    def gather(self, conn: Connection) -> bool | None:
        """``conn.gather()`` (sync and thread workers: is its request ready to serve?); None
        when it began with a refused PROXY header, and it is closed (no answer: not HTTP)."""
        try:
            return conn.gather(self.settings.body_buffer)
        except ProxyProtocolError as exc:
            self._proxy_refused(str(exc))
            self.release(conn)
            return None
        except Exception as exc:  # a bug of ours must cost one connection, not the worker
            self.log.exception("Reading a request failed", exc, worker=self.worker_id)
            self.release(conn)
            return None

    def gathered_until(self, conn: Connection, deadline: float) -> float:
        """After a ``gather()`` that left ``conn``'s request unready: until when its client
        may take, bounded as a wait on it would be: the head by --header-timeout from its
        first byte, a body by the same time between its pieces; ``deadline`` (the wait for
        the first byte) while nothing came."""
        if not conn.received:
            return deadline
        began = time.monotonic() if conn.events else conn.head_began
        return began + self.settings.header_timeout

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

    def deferred_coming(self, listener: Listener, until: float) -> bool:
        """Stopping or pausing with --defer-accept: are clients whose handshake is done
        still to send their first bytes? The kernel holds those outside the accept queue, and
        closing the listener would reset each as its bytes came. The caller looks before it
        empties the queue (a client whose bytes come after the look is in the queue by then)
        and, while this is True, waits DEFERRED_WAIT and looks and empties it again. Bounded
        by ``until``, the grace a silent new connection gets at a stop: without the flag such
        a client is accepted, and closed once that grace passes."""
        return bool(self.settings.defer_accept) and time.monotonic() < until \
            and deferred_connections(listener) > 0

    def take_queue(self, listener: Listener, take_ready: Callable[[], object],
                   sleep: Callable[[float], None]) -> None:
        """Stopping or pausing: ``take_ready`` empties the listener's accept queue, again
        while clients --defer-accept holds back are still coming (see deferred_coming),
        with ``sleep`` (the worker's own: a thread's, or gevent's) between the looks; it
        returns False to take no more (the sync worker: its state moved on, or its bound
        was reached), anything else to go on (the thread worker's count taken, even 0)."""
        settle = time.monotonic() + NEW_CONNECTION_GRACE
        while True:
            coming = self.deferred_coming(listener, settle)
            if take_ready() is False or not coming:
                return
            sleep(DEFERRED_WAIT)

    def turn_away_queue(self, listeners: list[Listener],
                        taken: tuple[socket.socket, ...] = ()) -> None:
        """Past the drain deadline: every client still queued (and those already ``taken``
        from the queue) gets a 503 now, never a reset. All are answered and half-closed
        first, then drained together (a lingering close, so that closing with their unread
        requests does not reset them before they read the 503), within a bounded share of
        the cancel grace."""
        deadline = time.monotonic() + self.settings.cancel_grace / 2
        answered = [self.turn_away(sock, deadline) for sock in taken]
        for listener in listeners:
            while time.monotonic() < deadline:
                accepted = self.accept_from(listener)
                if accepted is None:
                    break
                answered.append(self.turn_away(accepted[0], deadline))
        linger_together(answered, deadline)

    def turn_away(self, sock: socket.socket, deadline: float) -> Connection:
        """A client still queued past the drain deadline: a 503 and the end of our output
        (counted as a refusal: its request was never read). The caller closes it. Over TLS
        the 503 needs the handshake first (a plaintext answer would be garbage to the
        client): at most a second of it, within ``deadline``."""
        tls = self.settings.tls
        if tls is not None:
            sock = tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        conn = Connection(sock, ("-", "0"), self.settings.limits, 1.0, tls=tls is not None)
        try:
            if conn.handshake(min(deadline, time.monotonic() + 1.0)):
                conn.send(simple_response(503, "Service Unavailable", self.dates))
        except (ClientGone, Timeout):
            self.log.debug("A queued client left before its 503")
        conn.end_output()
        if self.metrics is not None:
            self.metrics.request("-", 503, None)
        return conn

    def write_telemetry(self) -> None:
        """Write out what the access log and span sinks buffered (before a wait for work)."""
        if self.access_log is not None:
            self.access_log.flush()
        if self.spans is not None:
            self.spans.flush()

    def before_waiting(self) -> None:
        """About to wait for work: write out telemetry, send a heartbeat if one is due."""
        self.write_telemetry()
        now = time.monotonic()
        if now >= self.next_heartbeat:
            self.heartbeat(now)

    # -- one connection --------------------------------------------------------------------
    def admit(self, conn: Connection) -> None:
        self.counters.active_connections += 1
        self.connections.add(conn)

    def release(self, conn: Connection, linger: bool = False) -> bool:
        """The connection ends: closed (after a lingering drain), counted out. False when it
        had already ended (a thread worker's cancel that landed after the hand-back)."""
        if conn.closed:
            return False
        self.connections.discard(conn)
        conn.close(linger)
        if not conn.released:  # finish_request() already counted it out
            self.counters.active_connections -= 1
        if self.state is not RUNNING:
            self.report()  # (running, the heartbeats carry the numbers)
        return True

    def keep_serving(self, conn: Connection, listener: Listener) -> None:
        """A connection served in one place to its end (the sync worker): its
        requests, and between them the worker's own ``wait_idle``; then it is released,
        or, with a response the client has not taken yet, left to the worker's loop
        (``write_later``)."""
        base = self.environs[id(listener)]
        linger = False
        handed = False
        try:
            while True:
                ending = self.serve_connection(conn, base)
                if conn.unsent is not None:
                    self.write_later(conn, listener, ending)
                    handed = True
                    return
                if ending is not IDLE or not self.wait_idle(conn):
                    linger = ending is LINGER
                    return
        except ClientGone:
            return
        finally:
            if not handed:
                self.end_connection(conn, linger)

    def end_connection(self, conn: Connection, linger: bool) -> None:
        """``release``, where a lingering close is the loop's (``close_later``) when it can
        be (sync and thread workers, plain sockets)."""
        if linger and conn.defer_writes and not conn.closed:
            self.close_later(conn)
        else:
            self.release(conn, linger)

    # -- lingering closes the loop does (where ``defers_writes``) ----------------------------
    def close_later(self, conn: Connection) -> None:
        """A lingering close (see Connection.close) without waiting: half-closed now, so the
        client sees the end of the response; the loop reads and drops what the client still
        sends (``linger_more``) and closes at the client's end, after LINGER_BYTES, or after
        LINGER_TIME. Done in place, it held a sync worker, a request thread or the thread
        worker's poll loop for up to LINGER_TIME per connection."""
        conn.end_output()
        self.lingering[conn.fd] = (conn, time.monotonic() + LINGER_TIME, 0)
        self.watch_readable(conn.fd, True)

    def watch_readable(self, fd: int, on: bool) -> None:
        """The loop's poll watches (or no longer watches) ``fd`` for POLLIN."""
        raise NotImplementedError

    def linger_more(self, fd: int) -> None:
        """A lingering client sent more (or closed): drop it; close at its end or the cap."""
        conn, deadline, dropped = self.lingering[fd]
        sock = conn.sock
        while True:
            try:
                data = sock.recv(RECV_SIZE)
            except BlockingIOError:
                self.lingering[fd] = (conn, deadline, dropped)
                return
            except OSError:
                data = b""
            dropped += len(data)
            if not data or dropped >= LINGER_BYTES:
                self._end_linger(fd)
                return

    def end_lingering(self, now: float | None = None) -> None:
        """Close the lingering connections past their time at ``now``, or all of them. The
        dict is in deadline order (each is its insertion time + LINGER_TIME; linger_more
        updates in place), so the scan stops at the first one not yet due: the loop calls
        this on every turn, and a busy worker may have dozens lingering."""
        lingering = self.lingering
        if now is None:
            for fd in list(lingering):
                self._end_linger(fd)
            return
        while lingering:
            fd, (_, deadline, _) = next(iter(lingering.items()))
            if now < deadline:
                return
            self._end_linger(fd)

    def _end_linger(self, fd: int) -> None:
        conn = self.lingering.pop(fd)[0]
        self.watch_readable(fd, False)
        self.release(conn)

    # -- responses the loop writes out (where ``defers_writes``) ----------------------------
    def write_later(self, conn: Connection, listener: Listener, ending: Ending) -> None:
        """A whole response the client did not take at once: the worker's loop sends the rest
        as it reads, bounded by --header-timeout between its reads (``write_more``), then ends
        the connection as ``ending`` says or goes on serving it. The worker (or request
        thread) is free for the next request meanwhile."""
        self.flushing[conn.fd] = (conn, listener, ending,
                                  time.monotonic() + self.settings.header_timeout)
        self.watch_writable(conn.fd, True)

    def watch_writable(self, fd: int, on: bool) -> None:
        """The loop's poll watches (or no longer watches) ``fd`` for POLLOUT."""
        raise NotImplementedError

    def write_more(self, fd: int) -> tuple[Connection, Listener, Ending] | None:
        """The loop saw a flushing client take more: send what it takes. None while some is
        left; else the connection, no longer flushing, and how it ends now."""
        conn, listener, ending, _ = self.flushing[fd]
        try:
            done = conn.write_unsent()
        except ClientGone:
            done, ending = True, CLOSE
        if not done:
            self.flushing[fd] = (conn, listener, ending,
                                 time.monotonic() + self.settings.header_timeout)
            return None
        del self.flushing[fd]
        self.watch_writable(fd, False)
        return conn, listener, ending

    def end_writes(self, now: float | None = None) -> None:
        """Close the flushing connections whose client stopped reading (past their time at
        ``now``), or all of them (None: cut at the drain deadline). One past its time is
        tried once first: a sync worker busy with a request saw no POLLOUT meanwhile, and a
        client that read in that time has not stopped (the loop's next poll sees the rest)."""
        for fd, (conn, listener, ending, deadline) in list(self.flushing.items()):
            if now is None or now >= deadline:
                if now is not None and conn.unsent is not None:
                    left = len(conn.unsent)
                    try:
                        if conn.write_unsent() or len(conn.unsent or b"") < left:
                            self.flushing[fd] = (conn, listener, ending,
                                                 now + self.settings.header_timeout)
                            continue
                    except ClientGone:
                        pass
                del self.flushing[fd]
                self.watch_writable(fd, False)
                self.release(conn)

    def wait_idle(self, conn: Connection) -> bool:
        """Between requests on a kept-alive connection: True when the client sent more."""
        raise NotImplementedError

    def serve_connection(self, conn: Connection, base: dict[str, Any]) -> Ending:
        """Read and serve the requests the client sent, pipelined ones too, until the
        connection is idle (kept alive, nothing more here) or must close."""
        header_timeout = self.settings.header_timeout
        while True:
            try:
                # From the head's first byte if some came already (the thread worker's poll
                # loop gathers heads), else from now.
                request = conn.read_head((conn.head_began or time.monotonic()) + header_timeout)
            except HTTPError as exc:
                self.refuse(conn, exc.status, exc.reason, refused=True)
                return LINGER
            except ProxyProtocolError as exc:
                self._proxy_refused(str(exc))
                return CLOSE  # not HTTP: no answer a balancer would read
            except Timeout:
                if conn.received:
                    self.refuse(conn, 408, "Request Timeout")
                return CLOSE
            except Abandoned:
                if conn.received:
                    self.refuse(conn, 503, "Service Unavailable")
                    return LINGER
                if self.state is STOPPING and conn.readable_now():
                    continue  # its request arrived just now: answer it, never reset it
                return CLOSE
            if request is None:
                return CLOSE
            if not self.serve_request(conn, request, base):
                if conn.taken:
                    return CLOSE  # the app's until it returned; nothing to drain
                # Linger only where the client may still be sending (a body the app did not
                # read, pipelined bytes): closing then would reset it. A request read to its
                # end leaves nothing (lingering would hold the connection, and so the
                # drain, until the client closes: up to 1 s).
                return LINGER if conn.has_unread() else CLOSE
            if not conn.events or conn.unsent is not None:
                # (Unsent output first: the worker's loop writes it, then serves what is next.)
                return IDLE  # else a pipelined request is already here

    def _proxy_refused(self, why: str) -> None:
        """A broken or untrusted PROXY header: the connection is closed; one line per
        interval says how many (a scanner must not be able to flood the log)."""
        self.proxy_refused += 1
        now = time.monotonic()
        if now - self.proxy_logged_at >= PROXY_LOG_INTERVAL:
            self.log.warning("PROXY protocol header refused; connection closed", reason=why,
                             refused=self.proxy_refused, worker=self.worker_id)
            self.proxy_refused, self.proxy_logged_at = 0, now

    def refuse(self, conn: Connection, status: int, reason: str, refused: bool = False,
               wait: bool = True) -> None:
        """A request the server answers itself: it never reaches the application.
        ``refused``: the parser refused it (not a timeout or a stop). ``wait=False`` (a poll
        loop's 408 or 503, which must wait on no client): one try, what the client's window
        does not take is dropped (the connection closes next)."""
        send = conn.send if wait else conn.send_once
        try:
            send(simple_response(status, reason_phrase(status), self.dates,
                                      body=f"{status} {reason}\n".encode("utf-8", "replace"),
                                      head=conn.parser.refusing_head(refused)))
        except ClientGone:
            return
        if self.metrics is not None:
            self.metrics.request("-", status, None)  # refused: counted, not timed
        if self.access_log is not None:
            now = time.time()
            self.access_log.request(conn.remote[0], "-", "-", "-", status, 0, None, None, now, 0.0,
                                    "-")

    # -- one request -------------------------------------------------------------------------
    def serve_request(self, conn: Connection, request: Request, base: dict[str, Any]) -> bool:
        """Run the app for one request. True when the connection may serve another."""
        access_log = self.access_log
        metrics = self.metrics
        started = time.time() if access_log is not None or metrics is not None else 0.0
        counters = self.counters
        counters.in_flight_requests += 1
        exchange = Exchange(conn, request, self.dates, self.heads)
        conn.begin(exchange)
        # (A bound method and its arguments, not a lambda: a closure would make self, conn and
        # exchange cells for the whole of this method, and allocate them per request.)
        context = RequestContext(self._finish_early, self.pool, self.spans, (conn, exchange))
        wsgi_input = Input(conn) if request.has_body else NO_BODY
        environ = build_environ(request, base, self.keys, conn.remote, wsgi_input)
        environ["forkserve.finish_request"] = context.finish
        if conn.peer is not None:
            environ["forkserve.peer_addr"] = conn.peer[0]  # a PROXY header named the client
        if self.peer_certs:
            environ["forkserve.peer_cert"] = conn.peer_certificate()
        if conn.trusted:
            self.proxies.apply(environ)  # a proxy's word on the scheme (and the client)
        if request.upgrade:
            # The keys gunicorn and werkzeug's server set, where WebSocket libraries look for
            # the socket; only a request that asks for an upgrade can be taken over.
            environ["gunicorn.socket"] = environ["werkzeug.socket"] = ClientSocket(
                conn, self.refuse_upgrade if self.upgrade_refusal else None)
        if access_log is not None:
            # The client's (or its proxy's) X-Request-ID, else a new one: the app sees the
            # same id the access log records.
            request_id = environ["HTTP_X_REQUEST_ID"] = self.request_ids.take(  # type: ignore[union-attr]
                environ.get("HTTP_X_REQUEST_ID"))
        status = 0
        keep = False
        timed = self.request_timeout
        hooked = None
        if self.request_hooks:
            hooked = RequestInfo(request.method, request.target, request.path, request.query,
                                 request.version, request.headers, environ["REMOTE_ADDR"])
        token = set_current(context)
        self.in_request = True
        try:
            self.cancellable = context
            if hooked is not None and not self._pre_request(hooked):
                status = self._fail(conn, exchange, 500, None)  # the app is not called
            else:
                if timed:
                    self.time_request(context, conn)
                keep = self._run_app(exchange, environ, context)
                status = exchange.status_code
        except ClientGone:
            status = exchange.status_code or 499
        except HTTPError as exc:  # from wsgi.input: a body over --limit-request-body
            status = self._fail(conn, exchange, exc.status, None)
        except UpgradeRefused:  # (the sync worker: one line, not a traceback per try)
            status = self._fail(conn, exchange, 501, None)
        except RequestTimedOut as exc:
            status = self._timed_out(conn, exchange, environ, exc)
        except (RequestCancelled, Abandoned) as exc:
            # Abandoned: a wait on the request body, ended by the cancel.
            self.log.warning("Request cancelled", reason=str(exc) or "cancelled",
                             method=request.method, target=environ["RAW_URI"],
                             worker=self.worker_id)
            if metrics is not None:
                metrics.cancelled()
            status = self._fail(conn, exchange, 503, None)
        except Exception as exc:
            # A taken connection's app may end with StopIteration: what flask-sock raises to
            # tell gunicorn "no response" (when it found only gunicorn.socket). Not an error.
            quiet = conn.taken and type(exc) is StopIteration
            status = self._fail(conn, exchange, 500, None if quiet else exc)
        finally:
            self.cancellable = None
            if timed:
                try:
                    self.untime_request(context)
                except RequestTimedOut:
                    # (A thread's) timeout sent as the request was ending landed here, before
                    # untime_request could clear it: taken, the request ends as it was.
                    self.untime_request(context)
            self.in_request = False
            if context.functions:
                context.run_shutdown_functions(self.log)
            if hooked is not None:
                self._post_request(hooked, environ, exchange, status)
            reset_current(token)
            counters.in_flight_requests -= 1
            conn.end_request()
            if self.state is not RUNNING:
                self.report()  # (running, the heartbeats carry the numbers)
        if conn.taken:
            # 101: what the app answered itself (the access log's bytes stay 0: what it sent
            # on the socket is its own, not counted by the server).
            status = 101
        elif exchange.framing_broken:
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
                    environ["REMOTE_ADDR"], request.method, environ["RAW_URI"],
                    environ["SERVER_PROTOCOL"], status, exchange.sent, environ.get("HTTP_REFERER"),
                    environ.get("HTTP_USER_AGENT"), started, duration, request_id, environ,
                    exchange.headers)
        if self.spans is not None:
            self.spans.flush_if_due()
        now = time.monotonic()
        if now >= self.next_heartbeat:
            self.heartbeat(now)
        return keep and not conn.released and conn.discard_body(request)

    def refuse_upgrade(self) -> NoReturn:
        """An app tries to take its connection over where ``upgrade_refusal`` says it may
        not: a clear error in the app (and one log line per worker), not a worker held by
        one WebSocket."""
        if not self.upgrade_refused_logged:
            self.upgrade_refused_logged = True
            self.log.warning("Connection upgrade (WebSocket) refused", reason=self.upgrade_refusal,
                             worker=self.worker_id)
        raise UpgradeRefused(self.upgrade_refusal)

    # -- --request-timeout ----------------------------------------------------------------
    # A request is timed from the moment the application is called (its head is in) to the
    # end of its response. Who watches the time, and how the cancel reaches the request, is
    # the worker class's (thread: the poll loop, an asynchronous exception; gevent: a timer
    # greenlet, a throw into the request's greenlet; sync: SIGALRM); what the request then
    # sees and the client gets is this class's (_timed_out).
    def time_request(self, context: RequestContext, conn: Connection) -> None:
        """The request begins: its time is up --request-timeout from now."""
        self.timing[context] = (time.monotonic() + self.request_timeout, conn)

    def untime_request(self, context: RequestContext) -> None:
        """The request ends (first thing, before its shutdown functions): no timeout now."""
        self.timing.pop(context, None)
        self.fired.discard(context)

    def next_request_deadline(self, now: float) -> float:
        """When the first timed request's time is up; with none, the earliest a request
        that begins now could time out (a watch that waits no longer misses none)."""
        for deadline, _ in self.timing.values():
            return deadline  # the first to begin is the first to time out
        return now + self.request_timeout

    def overdue_requests(self, now: float) -> list[tuple[RequestContext, Connection]]:
        """Take the requests whose time is up: each is then ``fired`` until it ends (the
        caller sends it the cancel). One cancel per request, never two."""
        overdue = []
        for context, (deadline, conn) in self.timing.items():
            if deadline > now:
                break
            overdue.append((context, conn))
        for context, conn in overdue:
            del self.timing[context]
            if conn.taken:
                continue  # a WebSocket (the app took the socket): it lasts as long as it lasts
            if not context.cancelled:  # (the drain's cancel came first)
                context.cancelled = context.timed_out = True
                self.fired.add(context)
        return [(context, conn) for context, conn in overdue if context in self.fired]

    def _timed_out(self, conn: Connection, exchange: Exchange, environ: dict[str, Any],
                   exc: RequestTimedOut) -> int:
        """A request cancelled by --request-timeout: one error record with the traceback of
        where it was (its frames from the app down to the wait or the line it was in), then
        a 504 if no response began, else the connection is closed: the client sees a
        truncated response, never a complete-looking one."""
        request = exchange.request
        self.log.exception(f"Request cancelled: it ran past --request-timeout "
                           f"({self.request_timeout:g}s)", exc, method=request.method,
                           target=environ["RAW_URI"], worker=self.worker_id,
                           response_begun=exchange.headers_sent)
        if self.metrics is not None:
            self.metrics.timed_out()
        return self._fail(conn, exchange, 504, None)

    def _pre_request(self, req: RequestInfo) -> bool:
        """The pre_request hook; False when it raised (logged: the request is answered 500
        and never reaches the application)."""
        hook = self.pre_request_hook
        if hook is None:
            return True
        try:
            hook(self.info, req)
        except Exception as exc:
            self.log.exception("The pre_request hook raised; answering 500 without calling "
                               "the application", exc, hook="pre_request", method=req.method,
                               target=req.uri, worker=self.worker_id)
            return False
        return True

    def _post_request(self, req: RequestInfo, environ: dict[str, Any], exchange: Exchange,
                      status: int) -> None:
        """The post_request hook, once the response is complete; a failure is logged."""
        hook = self.post_request_hook
        if hook is None:
            return
        resp = ResponseInfo(exchange.status, status or exchange.status_code,
                            list(exchange.headers), exchange.sent)
        try:
            hook(self.info, req, environ, resp)
        except Exception as exc:
            self.log.exception("The post_request hook raised; serving on", exc,
                               hook="post_request", method=req.method, target=req.uri,
                               worker=self.worker_id)

    def _finish_early(self, conn: Connection, exchange: Exchange) -> None:
        """forkserve.finish_request(): the response ends for the client now. The connection
        cannot serve another request while the app works on, so it is closed (the client
        sees the end of the body and the close at once) and counted out."""
        if conn.released:
            return
        exchange.close = True
        exchange.finish()
        conn.release()
        self.counters.active_connections -= 1
        self.report()

    def _run_app(self, exchange: Exchange, environ: dict[str, Any],
                 context: RequestContext) -> bool:
        result = self.app(environ, exchange.start_response)  # type: ignore[misc]
        try:
            kind = type(result)
            if (kind is list or kind is tuple) and len(result) == 1 and type(result[0]) is bytes:
                # The hello-world path: one send in all. The close follows at once (one
                # segment with the FIN: Connection.send_last) when no code of the app's runs
                # in between (no shutdown function, no request hook; a list has no close())
                # and the client itself asked to close: after that it sends nothing (RFC 9112
                # §9.6), so no late request can turn the close into a reset of a held response.
                request = exchange.request
                exchange.send_whole(result[0], self.closes_at_once and not request.keep_alive
                                    and not request.upgrade and not context.functions
                                    and not self.request_hooks)
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

    def _fail(self, conn: Connection, exchange: Exchange, status: int,
              exc: BaseException | None) -> int:
        """The app (or its request body) failed: a clean error response if none started."""
        if exc is not None:
            request = exchange.request
            self.log.exception(f"Error handling request {request.method} "
                               f"{request.target.decode('latin-1')}", exc, worker=self.worker_id)
        if exchange.headers_sent or conn.taken:
            exchange.close = True  # the client sees a truncated response, never a wrong one
            return exchange.status_code
        try:
            conn.send(simple_response(status, reason_phrase(status), self.dates,
                                      head=exchange.request.method == "HEAD"))
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
