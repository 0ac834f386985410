"""The lifecycle matrix's load: raw-socket HTTP/1.1 clients that classify every failure.

``Load(port, app, clients=16, mode="close").start()`` starts ``procs`` client processes
(spawned, so the bench's own threads never starve them of the GIL), each running its share of
``clients`` threads. Each thread sends ``GET /`` in a loop until ``stop()`` or ``seconds``
pass, and reads every response whole (Content-Length, chunked, or until EOF), comparing the
body with the one the app always sends.

Each request ends in exactly one of these outcomes:

| outcome | meaning |
|---|---|
| ok | status 200 and the whole, correct body |
| refused | ``connect()`` got ECONNREFUSED (nobody listens: a balancer retries this safely) |
| reset | ECONNRESET or EPIPE while connecting, sending or reading |
| empty | EOF before the first byte of the response (our request was on the wire) |
| 5xx | a status of 500 or more (the body is read; HAProxy's own 502 counts here too) |
| unavailable | HAProxy's own 503 "No server is available": it had no usable server, so the request reached none (the balancer's ECONNREFUSED) |
| timeout | no progress for ``timeout`` seconds on any socket operation |
| partial | EOF in the middle of the head or the body, or a body that is not the app's |
| other | anything else: another status, a local error such as EADDRNOTAVAIL |

Keep-alive (``mode="keepalive"``): a connection is reused until the server says
``Connection: close`` (then we reconnect, no failure) or closes it while it is idle, which the
client sees *before* sending (a zero-timeout poll and a peek, as urllib3 does): again a
reconnect, no failure. But a connection the server closes *after* our request went out on it is
a failure (empty or reset): that is the keep-alive race a server must not lose, and it is
counted, never retried. ``mode="mix"``: even threads keep-alive, odd threads close.

After a refused connect (or the balancer's "no server") a thread waits 10 ms before its next try, so that a stopped server is
not hammered; the count of refusals is therefore a rate, not a backlog.

Timestamps are ``time.monotonic()``, which is one clock for every process of the machine, so
the bench compares them with the moments it sent its signals.
"""

from __future__ import annotations

import errno
import multiprocessing
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

KINDS = ("refused", "unavailable", "reset", "empty", "5xx", "timeout", "partial", "other")
MAX_SAMPLES = 2000  # failure details kept per process (the counts are always complete)
REFUSED_PAUSE = 0.01
NO_SERVER = b"No server is available to handle this request"  # HAProxy's own 503 page
SLOW = 1.0  # a request slower than this is counted as slow (a stall, e.g. a SYN retransmit)


class Failure(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


@dataclass
class Result:
    """What one request did (``kind`` is "ok" or one of KINDS)."""
    kind: str
    detail: str = ""
    pid: int | None = None
    close: bool = True


def classify_oserror(exc: BaseException, stage: str, got_bytes: bool = False) -> Failure:
    if isinstance(exc, socket.timeout):
        return Failure("timeout", f"{stage}: timed out")
    if isinstance(exc, ConnectionRefusedError):
        return Failure("refused", f"{stage}: connection refused")
    if isinstance(exc, (ConnectionResetError, BrokenPipeError)):
        return Failure("reset", f"{stage}: {type(exc).__name__}" + (" mid-response" if got_bytes else ""))
    if isinstance(exc, OSError) and exc.errno is not None:
        return Failure("other", f"{stage}: {errno.errorcode.get(exc.errno, exc.errno)}")
    return Failure("other", f"{stage}: {exc!r}")


class Reader:
    """A buffered reader over a socket that knows when nothing at all was received."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.received = 0

    def fill(self, stage: str) -> None:
        try:
            chunk = self.sock.recv(262144)
        except OSError as exc:
            raise classify_oserror(exc, stage, self.received > 0) from None
        if not chunk:
            if self.received == 0:
                raise Failure("empty", "EOF before any byte of the response")
            raise Failure("partial", f"EOF in the {stage} after {self.received} bytes")
        self.received += len(chunk)
        self.buf += chunk

    def until(self, marker: bytes, stage: str, limit: int = 65536) -> bytes:
        while True:
            at = self.buf.find(marker)
            if at >= 0:
                out = bytes(self.buf[:at])
                del self.buf[:at + len(marker)]
                return out
            if len(self.buf) > limit:
                raise Failure("partial", f"{stage} longer than {limit} bytes")
            self.fill(stage)

    def exactly(self, n: int, stage: str) -> bytes:
        while len(self.buf) < n:
            self.fill(stage)
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def rest(self) -> bytes:
        while True:
            try:
                chunk = self.sock.recv(262144)
            except OSError as exc:
                raise classify_oserror(exc, "body (until EOF)", True) from None
            if not chunk:
                out = bytes(self.buf)
                self.buf.clear()
                return out
            self.buf += chunk


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response: status, lower-cased headers, body (framed by its headers)."""
    reader = Reader(sock)
    head = reader.until(b"\r\n\r\n", "head")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise Failure("other", f"not an HTTP response: {lines[0][:80]!r}")
    status = int(parts[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if status in (204, 304) or 100 <= status < 200:
        return status, headers, b""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = bytearray()
        while True:
            size_line = reader.until(b"\r\n", "body (chunk size)")
            try:
                size = int(size_line.split(b";")[0].strip(), 16)
            except ValueError:
                raise Failure("partial", f"bad chunk size {size_line[:20]!r}") from None
            if size == 0:
                while reader.until(b"\r\n", "body (trailer)"):
                    pass
                return status, headers, bytes(body)
            body += reader.exactly(size, "body")
            if reader.exactly(2, "body") != b"\r\n":
                raise Failure("partial", "chunk not followed by CRLF")
    if "content-length" in headers:
        return status, headers, reader.exactly(int(headers["content-length"]), "body")
    return status, headers, reader.rest()


def peer_closed(sock: socket.socket) -> bool:
    """An idle keep-alive connection the server has closed (or sent something unasked on)."""
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset while idle: nothing of ours was on it
    return True  # EOF, or unsolicited bytes (e.g. a 408): either way do not reuse it


def request(sock: socket.socket, close: bool, expected: bytes, path: str = "/") -> Result:
    req = (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
           + ("Connection: close\r\n" if close else "") + "\r\n").encode()
    try:
        sock.sendall(req)
    except OSError as exc:
        raise classify_oserror(exc, "send") from None
    status, headers, body = read_response(sock)
    pid = int(headers["x-pid"]) if headers.get("x-pid", "").isdigit() else None
    server_close = "close" in headers.get("connection", "").lower()
    if status == 503 and NO_SERVER in body:
        return Result("unavailable", "HAProxy: no server is available", pid, True)
    if status >= 500:
        return Result("5xx", f"status {status}: {body[:120]!r}", pid, True)
    if status != 200:
        return Result("other", f"status {status}: {body[:120]!r}", pid, True)
    if body != expected:
        return Result("partial", f"body of {len(body)} bytes, not the app's {len(expected)}", pid, True)
    return Result("ok", "", pid, close or server_close)


@dataclass
class Tally:
    """One process's results (merged by the parent)."""
    sent: int = 0
    counts: dict[str, int] = field(default_factory=lambda: {k: 0 for k in ("ok", *KINDS)})
    samples: list[tuple[float, str, str]] = field(default_factory=list)  # (time, kind, detail)
    failure_times: dict[str, list[float]] = field(default_factory=dict)
    reconnects: int = 0
    pids: dict[int, float] = field(default_factory=dict)  # worker pid -> first response at
    last_ok: float = 0.0
    first_refused: float = 0.0
    last_connect: float = 0.0  # the latest connect() that completed (the kernel took it)
    max_latency: float = 0.0  # the slowest request, connect to last byte, whatever its outcome
    slow: int = 0  # requests that took over SLOW seconds

    def add(self, result: Result, at: float, began: float) -> None:
        self.counts[result.kind] += 1
        self.max_latency = max(self.max_latency, at - began)
        self.slow += at - began > SLOW
        if result.kind == "ok":
            self.last_ok = max(self.last_ok, at)
        else:
            self.failure_times.setdefault(result.kind, []).append(at)
            if result.kind == "refused" and not self.first_refused:
                self.first_refused = at
            if len(self.samples) < MAX_SAMPLES:
                self.samples.append((at, result.kind, result.detail))
        if result.pid is not None and result.pid not in self.pids:
            self.pids[result.pid] = at

    def merge(self, other: "Tally") -> None:
        self.sent += other.sent
        for kind, n in other.counts.items():
            self.counts[kind] += n
        self.samples = sorted(self.samples + other.samples)
        for kind, times in other.failure_times.items():
            self.failure_times.setdefault(kind, []).extend(times)
        self.reconnects += other.reconnects
        self.max_latency = max(self.max_latency, other.max_latency)
        self.last_connect = max(self.last_connect, other.last_connect)
        self.slow += other.slow
        for pid, at in other.pids.items():
            self.pids[pid] = min(at, self.pids.get(pid, at))
        self.last_ok = max(self.last_ok, other.last_ok)
        if other.first_refused and (not self.first_refused or other.first_refused < self.first_refused):
            self.first_refused = other.first_refused


def client_thread(port: int, keepalive: bool, expected: bytes, timeout: float, deadline: float,
                  stop: Any, tally: Tally, lock: threading.Lock, progress: Any) -> None:
    sock: socket.socket | None = None
    while not stop.is_set() and time.monotonic() < deadline:
        if sock is not None and peer_closed(sock):
            sock.close()
            sock = None
            with lock:
                tally.reconnects += 1
        began = time.monotonic()
        try:
            if sock is None:
                try:
                    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
                except OSError as exc:
                    raise classify_oserror(exc, "connect") from None
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                connected = time.monotonic()
                with lock:
                    tally.last_connect = max(tally.last_connect, connected)
            with lock:
                tally.sent += 1
            result = request(sock, not keepalive, expected)
        except Failure as failure:
            result = Result(failure.kind, failure.detail)
        at = time.monotonic()
        if result.close or result.kind != "ok":
            if sock is not None:
                sock.close()
            sock = None
        with lock:
            tally.add(result, at, began)
        with progress.get_lock():
            progress.value += 1 if result.kind == "ok" else 1 << 32
        if result.kind in ("refused", "unavailable"):
            stop.wait(REFUSED_PAUSE)
    if sock is not None:
        sock.close()


def client_process(port: int, modes: list[bool], expected: bytes, timeout: float, seconds: float,
                   stop: Any, progress: Any, out: Any) -> None:
    deadline = time.monotonic() + seconds
    tally = Tally()
    lock = threading.Lock()
    threads = [threading.Thread(target=client_thread, daemon=True,
                                args=(port, keepalive, expected, timeout, deadline, stop, tally,
                                      lock, progress)) for keepalive in modes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0) + 2 * timeout + 1)
    with lock:
        out.send(tally)
    out.close()


class Load:
    """``clients`` threads over ``procs`` spawned processes against 127.0.0.1:``port``."""

    def __init__(self, port: int, expected: bytes, clients: int = 16, mode: str = "close",
                 procs: int = 2, seconds: float = 120.0, timeout: float = 5.0) -> None:
        if mode not in ("close", "keepalive", "mix"):
            raise ValueError(f"unknown client mode {mode!r}")
        self.port = port
        self.seconds = seconds
        self.timeout = timeout
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._progress = ctx.Value("q", 0)  # ok in the low 32 bits, failures above
        modes = [mode == "keepalive" or (mode == "mix" and i % 2 == 0) for i in range(clients)]
        procs = max(1, min(procs, clients))
        self._pipes = []
        self._procs = []
        for i in range(procs):
            recv, send = ctx.Pipe(duplex=False)
            self._pipes.append(recv)
            self._procs.append(ctx.Process(
                target=client_process, daemon=True, name=f"lifecycle-client-{i}",
                args=(port, modes[i::procs], expected, timeout, seconds, self._stop,
                      self._progress, send)))
        self.missing: list[str] = []
        self.tally: Tally | None = None
        self.started_at = 0.0
        self.stopped_at = 0.0

    def start(self) -> "Load":
        self.started_at = time.monotonic()
        for proc in self._procs:
            proc.start()
        return self

    @property
    def ok(self) -> int:
        return int(self._progress.value) & 0xFFFFFFFF

    @property
    def failed(self) -> int:
        return int(self._progress.value) >> 32

    def wait_ok(self, count: int, timeout: float) -> bool:
        """Until ``count`` more requests have succeeded than now (False at the timeout)."""
        target = self.ok + count
        deadline = time.monotonic() + timeout
        while self.ok < target:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def stop(self) -> Tally:
        """Stop every client (bounded), collect and merge their tallies."""
        if self.tally is not None:
            return self.tally
        self._stop.set()
        self.stopped_at = time.monotonic()
        total = Tally()
        deadline = time.monotonic() + 2 * self.timeout + 5
        for pipe, proc in zip(self._pipes, self._procs):
            if pipe.poll(max(deadline - time.monotonic(), 0)):
                total.merge(pipe.recv())
            else:
                self.missing.append(proc.name)  # reported by the bench: its counts are unknown
            proc.join(max(deadline - time.monotonic(), 0.1))
            if proc.is_alive():
                proc.kill()
                proc.join(2)
            pipe.close()
        self.tally = total
        return total

    def kill(self) -> None:
        """For error paths: no result wanted, just no process left."""
        self._stop.set()
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join(2)


def probe(port: int, path: str = "/", timeout: float = 5.0, expected: bytes | None = None) -> Result:
    """One request on a fresh connection (classified as the load's are)."""
    try:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        except OSError as exc:
            raise classify_oserror(exc, "connect") from None
        with sock:
            if expected is None:
                req = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode()
                try:
                    sock.sendall(req)
                except OSError as exc:
                    raise classify_oserror(exc, "send") from None
                status, headers, _ = read_response(sock)
                pid = int(headers["x-pid"]) if headers.get("x-pid", "").isdigit() else None
                return Result("ok" if status == 200 else ("5xx" if status >= 500 else "other"),
                              f"status {status}", pid)
            return request(sock, True, expected, path)
    except Failure as failure:
        return Result(failure.kind, failure.detail)
