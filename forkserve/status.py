"""The status server: /healthz, /readyz, /metrics and /status, served by the arbiter itself.

Owns: a small HTTP/1.1 server that lives in the arbiter's poll loop (non-blocking, one request
per connection, bounded in size, time and count), so it answers while every worker is busy and
through the whole drain, and stops last. (The arbiter's live gauges for ``/metrics`` are in
:mod:`forkserve.metrics`; the stand-in that answers through an upgrade's exec, in
:mod:`forkserve.standin`.)

It never runs application code and never blocks the loop: requests are parsed with httptools
(llhttp), answers are built from what the arbiter already knows, and output that does not fit
the socket buffer waits for POLLOUT.
"""

from __future__ import annotations

import errno
import ipaddress
import select
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httptools

from forkserve.http.response import reason_phrase, response_head
from forkserve.reactor import Reactor
from forkserve.sockets import Listener, refuse_new_connections, steer_new_connections_here

MAX_HEAD = 8192  # a status request is a GET with a few headers
MAX_CLIENTS = 64  # beyond this, the longest-idle connection is closed to make room
HEAD_TIMEOUT = 2.0  # seconds a new connection has to send its request head
CLIENT_TIMEOUT = 5.0  # seconds from the request to the end of the answer
ACCEPT_PAUSE = 0.5  # seconds the listener rests after accept() ran out of descriptors
STATUS_BACKLOG = 128
# Seconds, at the exit, for the clients already accepted to send their request and take its
# answer (see StatusServer.close); a probe does both at once, so this is only a bound.
FINAL_GRACE = 1.0
POLLIN, POLLOUT = select.POLLIN, select.POLLOUT

# status, content type, body, and (optionally) extra header (name, value) pairs
Answer = tuple[int, str, bytes] | tuple[int, str, bytes, tuple[tuple[str, str], ...]]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass
class _Client:
    sock: socket.socket
    deadline: float
    parser: Any = None
    received: int = 0
    url: bytes = b""
    method: str = ""
    headers: dict[bytes, bytes] = field(default_factory=dict)
    complete: bool = False
    out: bytes = b""

    # httptools callbacks. Only the first request counts: llhttp goes on parsing whatever
    # follows it (a pipelined request, garbage), which must not change what is answered.
    def on_url(self, url: bytes) -> None:
        if not self.complete:
            self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.complete:
            self.headers[name.lower()] = value

    def on_message_complete(self) -> None:
        if not self.complete:
            self.complete = True
            self.method = self.parser.get_method().decode("latin-1")


class StatusServer:
    """Accepts and answers status requests, called back by the loop's reactor for its
    descriptors; the loop calls :meth:`expire` each round for its deadlines.

    Nothing here may raise into the arbiter's loop: a client whose handling fails is answered
    500 (or dropped) and the failure logged. Bounded: at most MAX_CLIENTS connections (the
    oldest is closed to make room: a crowd of idle connections cannot lock probes out), a
    request head must arrive within HEAD_TIMEOUT, the whole exchange within CLIENT_TIMEOUT.

    The handler may answer ``None`` ("not yet": it wants fresher numbers from the workers);
    the client then waits, without blocking the loop, until :meth:`resume` asks again.
    """

    def __init__(self, sock: socket.socket, reactor: Reactor,
                 handler: Callable[[str, str, dict[bytes, bytes]], Answer | None],
                 log: Any, accepting: bool = True) -> None:
        self.sock = sock
        sock.setblocking(False)
        self.reactor = reactor
        self.handler = handler
        self.log = log
        self.clients: dict[int, _Client] = {}
        self.waiting: dict[int, tuple[str, str]] = {}  # fd -> (method, path) not yet answered
        self.accept_paused_until: float | None = None  # out of fds: accept again later
        # False: the listener is held, not polled (a successor's, until its workers are booted:
        # the instance it replaces answers meanwhile, see start_accepting).
        self.accepting = accepting
        if accepting:
            reactor.add(sock.fileno(), POLLIN, self._on_listener)

    def start_accepting(self) -> None:
        """Answer on the listener from now on; one bound but not yet listening (a successor's
        SO_REUSEPORT socket) joins the port now, not before."""
        if self.accepting or self.sock.fileno() < 0:
            return
        if not self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            self.sock.listen(STATUS_BACKLOG)
            if steer_new_connections_here(self.sock):
                self.log.info("Status server: new connections to the shared port come here")
        self.accepting = True
        self.reactor.add(self.sock.fileno(), POLLIN, self._on_listener)

    def leave(self, own_queue: bool) -> None:
        """Another instance serves this status port now: stop answering on it at once, rather
        than tell its balancer checks that the port is going away. ``own_queue``: the listener
        is ours alone (SO_REUSEPORT beside the successor's): new clients are turned away first
        (their SYNs dropped: they retry, and reach the successor), what is queued already is
        accepted and answered, then it closes, so none is reset. Otherwise the successor holds
        this very listener and its queue: closing our copy is all."""
        if self.sock.fileno() < 0:
            return
        if own_queue and self.accepting:
            refuse_new_connections(Listener(self.sock, "status"))
            self._accept(time.monotonic())
        self.stop_listening()

    def fileno(self) -> int:
        return self.sock.fileno()

    def fds(self) -> list[int]:
        """Everything a forked worker must close (the listener only while it is open: paused,
        or not bound again at a resume, it is closed already)."""
        listener = self.sock.fileno()
        return [*([listener] if listener >= 0 else []), *self.clients]

    def next_deadline(self) -> float | None:
        deadlines = [c.deadline for c in self.clients.values()]
        if self.accept_paused_until is not None:
            deadlines.append(self.accept_paused_until)
        return min(deadlines, default=None)

    # -- the reactor's callbacks, and the deadlines --------------------------------------
    def _on_listener(self, fd: int, events: int) -> None:
        self._accept(time.monotonic())

    def _on_client(self, fd: int, events: int) -> None:
        client = self.clients.get(fd)
        if client is None:
            return
        try:
            if client.out:
                self._send(fd, client)
            elif fd not in self.waiting:
                self._read(fd, client)
        except Exception as exc:  # never into the arbiter's loop
            self.log.exception("Status server: a request failed", exc)
            if fd in self.clients:
                self._drop(fd)

    def expire(self, now: float) -> None:
        """Each round: drop clients past their deadline; accept again after a pause."""
        for fd, client in list(self.clients.items()):
            if now >= client.deadline:
                self._drop(fd)
        if self.accept_paused_until is not None and now >= self.accept_paused_until:
            self.accept_paused_until = None
            self.reactor.add(self.sock.fileno(), POLLIN, self._on_listener)

    def _accept(self, now: float) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors or memory: the listener stays readable, so stop
                    # polling it for a moment rather than spin.
                    self.log.warning("Status server: accept() failed; pausing it",
                                     error=exc.strerror)
                    self.reactor.remove(self.sock.fileno())
                    self.accept_paused_until = now + ACCEPT_PAUSE
                return  # anything else (ECONNABORTED, a network error): that client only
            if len(self.clients) >= MAX_CLIENTS:
                # Make room by closing the connection that has been idle longest (the one
                # with the earliest deadline that has not sent a whole request).
                idle = [fd for fd, c in self.clients.items() if not c.complete]
                if not idle:
                    conn.close()
                    continue
                self._drop(min(idle, key=lambda fd: self.clients[fd].deadline))
            conn.setblocking(False)
            client = _Client(conn, now + HEAD_TIMEOUT)
            client.parser = httptools.HttpRequestParser(client)
            self.clients[conn.fileno()] = client
            self.reactor.add(conn.fileno(), POLLIN, self._on_client)

    def _read(self, fd: int, client: _Client) -> None:
        try:
            data = client.sock.recv(MAX_HEAD)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(fd)
            return
        if not data:
            self._drop(fd)
            return
        client.received += len(data)
        if client.received > MAX_HEAD:
            self._answer(fd, client, _text(431, "request too large\n"), head_only=False)
            return
        try:
            client.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            client.on_message_complete()
        except httptools.HttpParserError:
            if not client.complete:
                self._answer(fd, client, _text(400, "bad request\n"), head_only=False)
                return
        if not client.complete:
            return
        client.deadline = max(client.deadline, time.monotonic() + CLIENT_TIMEOUT)
        method = client.method
        try:
            path = httptools.parse_url(client.url).path.decode("latin-1") if client.url else "/"
        except httptools.HttpParserError:  # llhttp takes targets parse_url refuses
            self._answer(fd, client, _text(400, "bad request target\n"), head_only=False)
            return
        if method not in ("GET", "HEAD"):
            self._answer(fd, client, _text(405, "only GET and HEAD\n"), head_only=False)
            return
        self._ask(fd, client, method, path)

    def _ask(self, fd: int, client: _Client, method: str, path: str) -> None:
        answer = self.handler(method, path, client.headers)
        if answer is None:
            if fd not in self.waiting:
                self.waiting[fd] = (method, path)
                self.reactor.modify(fd, 0)  # nothing to read meanwhile (a close shows as POLLHUP)
            return
        self.waiting.pop(fd, None)
        self._answer(fd, client, answer, head_only=method == "HEAD")

    def resume(self) -> None:
        """Fresh numbers arrived: answer the requests that waited for them."""
        for fd, (method, path) in list(self.waiting.items()):
            client = self.clients.get(fd)
            if client is None:
                self.waiting.pop(fd)
                continue
            try:
                self._ask(fd, client, method, path)
            except Exception as exc:  # never into the arbiter's loop
                self.log.exception("Status server: a request failed", exc)
                if fd in self.clients:
                    self._drop(fd)

    def _answer(self, fd: int, client: _Client, answer: Answer, head_only: bool) -> None:
        status, content_type, body, *more = answer
        headers = [("Content-Type", content_type), ("Content-Length", str(len(body))),
                   *(more[0] if more else ()), ("Cache-Control", "no-store"),
                   ("Connection", "close")]
        client.out = response_head(f"{status} {reason_phrase(status)}", headers,
                                   body=b"" if head_only else body)
        self._send(fd, client)

    def _send(self, fd: int, client: _Client) -> None:
        try:
            sent = client.sock.send(client.out)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._drop(fd)
            return
        client.out = client.out[sent:]
        if client.out:
            self.reactor.modify(fd, POLLOUT)
        else:
            self._drop(fd)

    def _drop(self, fd: int) -> None:
        client = self.clients.pop(fd)
        self.waiting.pop(fd, None)
        self.reactor.remove(fd)
        client.sock.close()
        client.parser = None  # it holds the client's bound methods: a cycle otherwise

    # -- an upgrade's exec: the accepted clients change hands -------------------------------
    def hand_over(self) -> None:
        """A child forked just now (the upgrade's stand-in) answers our accepted clients (see
        adopt): forget them here and close our copies of their sockets (a close, not a
        shutdown: the child's copies stay open)."""
        for fd, client in list(self.clients.items()):
            self.reactor.remove(fd)
            client.sock.close()
        self.clients.clear()
        self.waiting.clear()

    def adopt(self, clients: dict[int, _Client], waiting: dict[int, tuple[str, str]]) -> None:
        """In the stand-in: the clients its parent had accepted (their parsers' state too: a
        fork's copy), each answered as if it had been accepted here; those that waited for
        fresh numbers are asked again of this server's handler at once."""
        for fd, client in clients.items():
            self.clients[fd] = client
            events = POLLOUT if client.out else 0 if fd in waiting else POLLIN
            self.reactor.add(fd, events, self._on_client)
        self.waiting.update(waiting)
        self.resume()

    def stop_listening(self) -> str:
        """TTOU (pause): free the port for a successor; connections in progress finish.
        Returns the address, to bind again on TTIN."""
        address = self.sock.getsockname()
        if self.accept_paused_until is None and self.accepting:
            self.reactor.remove(self.sock.fileno())
        self.accept_paused_until = None
        self.accepting = True  # (what listen() gets back on TTIN)
        self.sock.close()
        host = f"[{address[0]}]" if ":" in address[0] else address[0]
        return f"{host}:{address[1]}"

    def listen(self, sock: socket.socket) -> None:
        """TTIN (resume): a listener bound again."""
        self.sock = sock
        sock.setblocking(False)
        self.reactor.add(sock.fileno(), POLLIN, self._on_listener)

    def close(self, grace: float = 0.0) -> None:
        """At the exit: the listener closes, then the clients already accepted get up to
        ``grace`` seconds to send their request and take its answer. Closed with its request
        unread, a client is reset: a balancer's probe, accepted as this instance left the
        port to a successor (or as it stopped), failed for no fault of its own. Requests that
        wait on the workers' numbers are not answered (no more come)."""
        if self.sock.fileno() >= 0:
            if self.accept_paused_until is None and self.accepting:
                self.reactor.remove(self.sock.fileno())
            self.sock.close()
        deadline = time.monotonic() + grace
        while True:
            pending = [fd for fd in self.clients if fd not in self.waiting]
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                break
            poller = select.poll()
            for fd in pending:
                poller.register(fd, select.POLLOUT if self.clients[fd].out else select.POLLIN)
            for fd, events in poller.poll(left * 1000):
                self._on_client(fd, events)
        for fd in list(self.clients):
            self._drop(fd)


def _text(status: int, body: str) -> Answer:
    return status, "text/plain; charset=utf-8", body.encode()


def bind_status(address: str, reuse_port: bool, listen: bool = True) -> socket.socket:
    """The status listener. With ``reuse_port`` (--reuse-port), SO_REUSEPORT as the other
    listeners: a successor started with it too binds the port while this instance serves;
    ``listen`` False: bound only (a bound socket gets no connections), so the successor joins
    the port once it can answer ready (StatusServer.start_accepting), and this instance
    leaves it at its stop (StatusServer.leave)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.set_inheritable(False)
        sock.bind((host, int(port)))
        if listen:
            sock.listen(STATUS_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock
