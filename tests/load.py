"""A small, bounded load generator for the reload and handoff tests.

``Load(port, threads=4, seconds=30)`` runs ``threads`` client threads, each sending ``GET path``
on a fresh connection (``Connection: close``) in a loop until ``stop()`` is called or ``seconds``
have passed. Every request has its own timeout. It records the successes (status 200, with the
response body and when it arrived) and every failure with its exception or status, so a test can
assert ``load.failures == []`` and look at which code answered when.

Fresh connections by default: what a reload can break is the accept queue (a connection
refused, or reset in a listener that closed), and every request goes through it. With
``keepalive=True`` each thread keeps its connection for as long as the server does: what a
reload can break then is a kept-alive connection closed under a request (an empty reply or a
reset). A connection the server closed while it was idle (before we sent anything on it), or
after a response that said ``Connection: close``, is reconnected without counting a failure;
one closed after we sent a request is a failure.

Failures are also kept by kind (``kinds``): refused, reset, empty, partial, timeout, 5xx,
status (another non-200), other; a stop test may allow ``refused`` after the stop.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from typing import Any, Callable

from tests.harness import Response, get, parse_head, read_response, wait_for


class Load:
    def __init__(self, port: int, path: str = "/", threads: int = 4, seconds: float = 30.0,
                 timeout: float = 5.0, keepalive: bool = False) -> None:
        self.port = port
        self.keepalive = keepalive
        self.kinds: list[tuple[float, str]] = []  # (monotonic time, kind) of every failure
        self.reconnects = 0  # keep-alive connections the server ended cleanly
        self.began: list[float] = []  # when each successful request was begun
        self.path = path
        self.threads = threads
        self.seconds = seconds
        self.timeout = timeout
        self._stop = threading.Event()
        self._local = threading.local()
        self._lock = threading.Lock()
        self.bodies: list[tuple[float, bytes]] = []  # (monotonic time of the response, body)
        self.failures: list[str] = []
        self.started_at = 0.0
        self.stopped_at: float | None = None
        self._threads = [threading.Thread(target=self._run, name=f"load-{i}", daemon=True)
                         for i in range(threads)]

    # -- running --------------------------------------------------------------------------
    def start(self) -> "Load":
        self.started_at = time.monotonic()
        for thread in self._threads:
            thread.start()
        return self

    def _run(self) -> None:
        deadline = self.started_at + self.seconds
        self._local.sock: socket.socket | None = None
        request = f"GET {self.path} HTTP/1.1\r\nHost: load\r\n\r\n".encode()
        while not self._stop.is_set() and time.monotonic() < deadline:
            began = time.monotonic()
            try:
                if self.keepalive:
                    response = self._keepalive_request(request)
                else:
                    response = get(self.port, self.path, timeout=self.timeout)
            except Exception as exc:  # noqa: BLE001 - every failure is recorded, none hidden
                self._close()
                wall = time.time() - (time.monotonic() - began)  # to match the server's log
                self._fail(failure_kind(exc),
                           f"began {began - self.started_at:.3f}s (at {wall:.3f}): {exc!r}")
                continue
            if response.status == 200:
                with self._lock:
                    self.bodies.append((time.monotonic(), response.body))
                    self.began.append(began)
            else:
                self._fail("5xx" if response.status >= 500 else "status",
                           f"status {response.status}: {response.body[:200]!r}")
        self._close()

    def _keepalive_request(self, request: bytes) -> Response:
        sock = self._local.sock  # type: ignore[has-type]
        if sock is not None and closed_by_server(sock):
            self._close()  # closed while idle, before we sent anything: not a failure
            sock = None
            with self._lock:
                self.reconnects += 1
        if sock is None:
            sock = self._local.sock = socket.create_connection(("127.0.0.1", self.port), timeout=self.timeout)
        sock.sendall(request)
        response = read_response(sock, self.timeout)
        if response.headers.get("connection", "").lower() == "close":
            self._close()
            with self._lock:
                self.reconnects += 1
        return response

    def _close(self) -> None:
        sock = getattr(self._local, "sock", None)
        if sock is not None:
            sock.close()
            self._local.sock = None

    def _fail(self, kind: str, detail: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.kinds.append((now, kind))
            self.failures.append(f"{now - self.started_at:.3f}s {kind}: {detail}")

    def stop(self, timeout: float = 10.0) -> "Load":
        self._stop.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        alive = [t.name for t in self._threads if t.is_alive()]
        if self.stopped_at is None:
            self.stopped_at = time.monotonic()
        assert not alive, f"load threads did not stop within {timeout}s: {alive}"
        return self

    def __enter__(self) -> "Load":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- results --------------------------------------------------------------------------
    @property
    def successes(self) -> int:
        with self._lock:
            return len(self.bodies)

    def since(self, moment: float) -> list[bytes]:
        """Bodies of the responses that arrived after ``moment`` (a ``time.monotonic()``)."""
        with self._lock:
            return [body for at, body in self.bodies if at > moment]

    def wait_requests(self, count: int, timeout: float = 10.0, allowed: str | None = None) -> None:
        """Until ``count`` more requests have succeeded than now, or until a failure (one of
        another kind than ``allowed``, when given: the refusals of a pause go on while the
        resumed workers boot, and the wait is for them to serve)."""
        target = self.successes + count
        wait_for(lambda: self.successes >= target or self.failures_except(allowed or "", 0),
                 timeout, lambda: f"{count} more successful requests: {self.summary()}")

    def wait_body(self, predicate: Callable[[bytes], bool], after: float, timeout: float = 10.0,
                  what: str = "a matching response") -> bytes:
        """The first body after ``after`` for which ``predicate`` holds."""
        def find() -> bytes | None:
            return next((b for b in self.since(after) if predicate(b)), None)
        return wait_for(find, timeout, what)  # type: ignore[no-any-return]

    def failures_except(self, allowed: str, after: float) -> list[str]:
        """The failures, less those of kind ``allowed`` that happened after ``after`` (say,
        clients refused once the server stopped accepting)."""
        with self._lock:
            pairs = list(zip(self.kinds, self.failures))
        return [text for (at, kind), text in pairs if not (kind == allowed and at > after)]

    @property
    def elapsed(self) -> float:
        end = self.stopped_at if self.stopped_at is not None else time.monotonic()
        return end - self.started_at

    @property
    def rate(self) -> float:
        return self.successes / self.elapsed if self.elapsed > 0 else 0.0

    def summary(self) -> str:
        how = "keep-alive" if self.keepalive else "a new connection each"
        with self._lock:
            kinds: dict[str, int] = {}
            for _, kind in self.kinds:
                kinds[kind] = kinds.get(kind, 0) + 1
        return (f"{self.successes} ok, {len(self.failures)} failed {kinds or ''} in "
                f"{self.elapsed:.1f}s ({self.rate:.0f} req/s, {self.threads} client threads, {how})")


def closed_by_server(sock: socket.socket) -> bool:
    """Has the server closed this idle connection (EOF or reset waiting, nothing sent yet)?"""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def failure_kind(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)):
        return "reset"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timeout"
    text = str(exc)
    if "before a full response head: b''" in text:
        return "empty"
    if "before a full response head" in text or "body truncated" in text:
        return "partial"
    return "other"


# -- readiness probes ---------------------------------------------------------------------------

def readyz(port: int, timeout: float = 10.0) -> tuple[int, dict[str, Any]]:
    """One /readyz on a fresh connection, read to the server's close."""
    deadline = time.monotonic() + timeout
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(b"GET /readyz HTTP/1.1\r\nHost: s\r\n\r\n")
        data = b""
        while True:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    status, _, body = parse_head(data)
    return status, json.loads(body)


class Prober:
    """/readyz in a loop on a thread until stopped (bounded by ``seconds``); every answer and
    every failure (refused, reset, timed out, garbled) is kept."""

    def __init__(self, port: int, seconds: float = 150.0, timeout: float = 10.0) -> None:
        self.port = port
        self.seconds = seconds
        self.timeout = timeout  # one probe: waiting longer is a failure
        self.answers: list[tuple[int, dict[str, Any]]] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="readyz-prober", daemon=True)
        self.started_at = 0.0

    def __enter__(self) -> "Prober":
        self.started_at = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        deadline = self.started_at + self.seconds
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                self.answers.append(readyz(self.port, self.timeout))
            except Exception as exc:  # noqa: BLE001 - every failure is recorded, none hidden
                self.failures.append(f"{time.monotonic() - self.started_at:.3f}s {exc!r}")
            self._stop.wait(0.005)  # pacing between probes, not a wait for anything

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.timeout + 5)
        assert not self._thread.is_alive(), "the prober did not stop"

    def wait_more(self, count: int, timeout: float = 10.0) -> None:
        """Until ``count`` more probes were answered (or failed) than now."""
        target = len(self.answers) + len(self.failures) + count
        wait_for(lambda: len(self.answers) + len(self.failures) >= target, timeout,
                 f"{count} more probes")

    def states(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, body in list(self.answers):
            out[body.get("state", "?")] = out.get(body.get("state", "?"), 0) + 1
        return out

    def not_ready(self) -> list[tuple[int, dict[str, Any]]]:
        return [a for a in list(self.answers) if a[0] != 200]

    def count(self, predicate: Any) -> int:
        return sum(1 for answer in list(self.answers) if predicate(answer))
