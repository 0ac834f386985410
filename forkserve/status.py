"""The status server: /healthz, /readyz, /metrics and /status, served by the arbiter itself.

Owns: a small HTTP/1.1 server that lives in the arbiter's poll loop (non-blocking, one request
per connection, bounded in size, time and count), so it answers while every worker is busy and
through the whole drain, and stops last; and the arbiter's live gauges for ``/metrics``.

It never runs application code and never blocks the loop: requests are parsed with httptools
(llhttp), answers are built from what the arbiter already knows, and output that does not fit
the socket buffer waits for POLLOUT.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import select
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httptools

from forkserve.http.response import reason_phrase

MAX_HEAD = 8192  # a status request is a GET with a few headers
MAX_CLIENTS = 64  # beyond this, new connections are closed at once (the loop stays light)
CLIENT_TIMEOUT = 5.0  # seconds a connection may take to send its request and read the answer
POLLIN, POLLOUT = select.POLLIN, select.POLLOUT

Answer = tuple[int, str, bytes]  # status, content type, body


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
    """Accepts and answers status requests; the arbiter calls :meth:`serve` from its loop."""

    def __init__(self, sock: socket.socket, poller: Any,
                 handler: Callable[[str, str, dict[bytes, bytes]], Answer]) -> None:
        self.sock = sock
        sock.setblocking(False)
        self.poller = poller
        self.handler = handler
        self.clients: dict[int, _Client] = {}
        poller.register(sock.fileno(), POLLIN)

    def fileno(self) -> int:
        return self.sock.fileno()

    def fds(self) -> list[int]:
        """Everything a forked worker must close."""
        return [self.sock.fileno(), *self.clients]

    def next_deadline(self) -> float | None:
        return min((c.deadline for c in self.clients.values()), default=None)

    def serve(self, ready: list[tuple[int, int]], now: float) -> None:
        listen_fd = self.sock.fileno()
        for fd, events in ready:
            if fd == listen_fd:
                self._accept(now)
            elif fd in self.clients:
                client = self.clients[fd]
                if client.out:
                    self._send(fd, client)
                else:
                    self._read(fd, client)
        for fd, client in list(self.clients.items()):
            if now >= client.deadline:
                self._drop(fd)

    def _accept(self, now: float) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ECONNABORTED):
                    return
                raise
            if len(self.clients) >= MAX_CLIENTS:
                conn.close()
                continue
            conn.setblocking(False)
            client = _Client(conn, now + CLIENT_TIMEOUT)
            client.parser = httptools.HttpRequestParser(client)
            self.clients[conn.fileno()] = client
            self.poller.register(conn.fileno(), POLLIN)

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
        if client.complete:
            method = client.method
            path = httptools.parse_url(client.url).path.decode("latin-1") if client.url else "/"
            if method not in ("GET", "HEAD"):
                answer = _text(405, "only GET and HEAD\n")
            else:
                answer = self.handler(method, path, client.headers)
            self._answer(fd, client, answer, head_only=method == "HEAD")

    def _answer(self, fd: int, client: _Client, answer: Answer, head_only: bool) -> None:
        status, content_type, body = answer
        head = (f"HTTP/1.1 {status} {reason_phrase(status)}\r\n"
                f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                "Cache-Control: no-store\r\nConnection: close\r\n\r\n").encode("latin-1")
        client.out = head if head_only else head + body
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
            self.poller.modify(fd, POLLOUT)
        else:
            self._drop(fd)

    def _drop(self, fd: int) -> None:
        client = self.clients.pop(fd)
        self.poller.unregister(fd)
        client.sock.close()

    def finish(self, deadline: float) -> None:
        """Before an in-place upgrade's exec: answer the connections already accepted (their
        requests may be a moment away), accepting no more — the listener and its queue go to
        the new image. Bounded by ``deadline``; what is left then is closed."""
        while self.clients:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            poller = select.poll()
            for fd, client in self.clients.items():
                poller.register(fd, POLLOUT if client.out else POLLIN)
            self.serve(poller.poll(remaining * 1000.0), time.monotonic())
        for fd in list(self.clients):
            self._drop(fd)

    def close(self) -> None:
        for fd in list(self.clients):
            self._drop(fd)
        if self.sock.fileno() >= 0:
            self.poller.unregister(self.sock.fileno())
            self.sock.close()


def _text(status: int, body: str) -> Answer:
    return status, "text/plain; charset=utf-8", body.encode()


def bind_status(address: str) -> socket.socket:
    """The status listener. SO_REUSEPORT, so a successor started with -sf can bind it while
    this instance drains (both answer until this one stops)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.set_inheritable(False)
        sock.bind((host, int(port)))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


# -- /metrics: the arbiter's live numbers --------------------------------------------------------

WORKER_STATES = ("booting", "running", "stopping", "draining")
PER_WORKER = (
    ("forkserve_active_connections", "Connections a worker holds open", "active_connections"),
    ("forkserve_in_flight_requests",
     "Requests in flight in a worker (from the first byte until the app's iterable is closed)",
     "in_flight_requests"),
    ("forkserve_background_tasks", "Background tasks queued or running in a worker",
     "background_tasks"),
    ("forkserve_worker_rss_bytes", "Resident memory of a worker", "rss_bytes"),
    ("forkserve_worker_heartbeat_age_seconds", "Seconds since a worker was last heard from",
     "seconds_since_heartbeat"),
)


class ArbiterCollector:
    """prometheus_client collector over one snapshot of the arbiter (the same one /status
    shows). A worker that is gone is not in the snapshot, so its gauges vanish with it."""

    def __init__(self, snapshot: dict[str, Any], states: list[str]) -> None:
        self.snapshot = snapshot
        self.states = states

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        snap = self.snapshot
        state = GaugeMetricFamily("forkserve_state", "The arbiter's life-cycle state (one-hot)",
                                  labels=["state"])
        for name in self.states:
            state.add_metric([name], 1.0 if name == snap["state"] else 0.0)
        yield state
        yield GaugeMetricFamily("forkserve_ready", "1 when /readyz answers 200",
                                value=1.0 if snap["ready"] else 0.0)
        yield GaugeMetricFamily("forkserve_generation", "Worker generation now serving",
                                value=snap["generation"])
        yield GaugeMetricFamily("forkserve_start_time_seconds",
                                "When the arbiter started, in seconds since the epoch",
                                value=snap["started"])
        workers = GaugeMetricFamily("forkserve_workers", "Worker processes by state",
                                    labels=["state"])
        for name in WORKER_STATES:
            workers.add_metric([name], sum(1 for w in snap["workers"] if w["state"] == name))
        yield workers
        for metric, help_text, key in PER_WORKER:
            family = GaugeMetricFamily(metric, help_text, labels=["worker", "pid"])
            for w in snap["workers"]:
                family.add_metric([str(w["worker_id"]), str(w["pid"])], w[key])
            yield family
