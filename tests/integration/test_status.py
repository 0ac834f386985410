"""The status server (``--status-bind``): /healthz, /readyz, /status and /metrics, answered by the
arbiter itself, against real ``python -m forkserve`` process groups.

Real signals, port 0 for the main listener and for the status listener. Requests are held in
flight on FIFO gates (``/block?fifo=`` of tests.apps.basic, ``/held`` and ``/background`` of
tests.apps.drain), workers are held booting on a FIFO opened by their import
(tests.apps.slow_boot, tests.apps.status), and every wait is a deadline-bounded ``wait_for`` or
log wait. The waits for time itself are the lameduck period and the status server's head
timeout, where time is the point, and a worker held in one C call of a calibrated length
(``/spin`` of tests.apps.status): a FIFO cannot hold a worker where no signal handler runs.

Every status request goes on a fresh connection that does not ask for ``Connection: close``:
:func:`fetch` reads until the server closes, so an answer that leaves the connection open fails.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import forkserve
from forkserve.control import request
from forkserve.status import HEAD_TIMEOUT, MAX_CLIENTS
from tests.harness import (ROOT, Response, Server, get, open_fds, parse_head, read_response,
                           refused, send_get, signal_pending, usr2_with_its_check_held, wait_for,
                           worker_set)

STATUS = ("--status-bind", "127.0.0.1:0")
USAGE = 2
JSON = "application/json"
TOP_KEYS = {"ok", "state", "ready", "generation", "pid", "version", "worker_class", "started",
            "uptime", "paused", "active_connections", "in_flight_requests", "background_tasks",
            "workers"}
WORKER_KEYS = {"pid", "worker_id", "generation", "state", "age", "requests_served",
               "active_connections", "in_flight_requests", "background_tasks", "booted",
               "rss_bytes", "seconds_since_heartbeat"}


# -- helpers ------------------------------------------------------------------------------------

def read_to_close(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes; fails if it keeps the connection open."""
    deadline = time.monotonic() + timeout
    data = b""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"no close from the server within {timeout}s; got {data!r}")
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue  # the deadline check above fails it
        if not chunk:
            return data
        data += chunk


def parse(data: bytes) -> Response:
    if b"\r\n\r\n" not in data:
        raise ConnectionError(f"closed without a full answer: {data!r}")
    return Response(*parse_head(data))


def exchange(port: int, data: bytes, timeout: float = 5.0) -> Response:
    """Send raw bytes on a fresh connection; the answer, read up to the server's close."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        response = parse(read_to_close(sock, timeout))
    assert response.headers.get("connection") == "close", response.headers
    return response


def fetch(port: int, path: str, method: str = "GET", timeout: float = 5.0) -> Response:
    response = exchange(port, f"{method} {path} HTTP/1.1\r\nHost: status\r\n\r\n".encode(), timeout)
    if method != "HEAD":
        assert int(response.headers["content-length"]) == len(response.body), response.headers
    return response


def answer(server: Server, path: str, expected: int = 200, timeout: float = 5.0) -> dict[str, Any]:
    """The JSON body of ``path`` on the status port, which must answer ``expected``."""
    response = fetch(server.status_port, path, timeout=timeout)
    assert response.status == expected, (path, response.status, response.body)
    assert response.headers["content-type"] == JSON, response.headers
    return json.loads(response.body)  # type: ignore[no-any-return]


def readyz(server: Server) -> tuple[int, dict[str, Any]]:
    response = fetch(server.status_port, "/readyz")
    assert response.status in (200, 503), response.status
    return response.status, json.loads(response.body)


def status(server: Server, timeout: float = 5.0) -> dict[str, Any]:
    return answer(server, "/status", timeout=timeout)


def status_when(server: Server, predicate: Any, what: str, timeout: float = 10.0) -> dict[str, Any]:
    """The first /status answer that satisfies ``predicate`` (polled, bounded)."""
    last: list[dict[str, Any]] = []

    def check() -> dict[str, Any] | None:
        snapshot = status(server)
        last[:] = [snapshot]
        return snapshot if predicate(snapshot) else None
    try:
        return wait_for(check, timeout, what)  # type: ignore[no-any-return]
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last /status: {last}\n{server.log_text()}") from None


def in_flight(snapshot: dict[str, Any]) -> int:
    return int(snapshot["in_flight_requests"])


class StatusWatch:
    """Polls /status on fresh connections in a thread, recording every answer, until the port
    refuses connections (or :meth:`stop`). A connection the server closed or reset without an
    answer is recorded in ``dropped`` (with when) and polling goes on; anything else (a refused
    connection, a timeout, a bad answer) ends it and is kept in ``end``."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.samples: list[tuple[float, dict[str, Any]]] = []
        self.dropped: list[tuple[float, BaseException]] = []
        self.end: BaseException | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="status-watch", daemon=True)

    def start(self) -> "StatusWatch":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                response = fetch(self.port, "/status", timeout=5.0)
                if response.status != 200:
                    raise AssertionError(f"/status answered {response.status}: {response.body!r}")
                snapshot = json.loads(response.body)
            except ConnectionRefusedError as exc:
                self.end = exc
                return
            except ConnectionError as exc:  # reset, or closed without an answer
                with self._lock:
                    self.dropped.append((time.monotonic(), exc))
                continue
            except (OSError, AssertionError, ValueError) as exc:
                self.end = exc
                return
            with self._lock:
                self.samples.append((time.monotonic(), snapshot))
            self._stop.wait(0.02)  # pacing the client, not waiting for anything

    def snapshots(self) -> list[dict[str, Any]]:
        with self._lock:
            return [s for _, s in self.samples]

    def count(self) -> int:
        with self._lock:
            return len(self.samples)

    def running(self) -> bool:
        return self._thread.is_alive() and self.end is None

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the /status poller is stuck"

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.join(timeout)


def tcp_sockets() -> list[tuple[int, int, str, str]]:
    """(local port, remote port, state, inode) of every IPv4 TCP socket of this host."""
    out = []
    with open("/proc/net/tcp", encoding="ascii") as fh:
        for line in fh.readlines()[1:]:
            fields = line.split()
            local, remote = fields[1], fields[2]
            out.append((int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16),
                        fields[3], fields[9]))
    return out


def listener_inode(port: int) -> str:
    (inode,) = [i for lp, _, state, i in tcp_sockets() if lp == port and state == "0A"]
    return inode


def socket_inodes(pid: int) -> set[str]:
    return {fd[len("socket:["):-1] for fd in open_fds(pid) if fd.startswith("socket:[")}


def forkserve_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """A forkserve command that is expected to exit by itself (text logs on stderr)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKSERVE_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "forkserve", *args], cwd=str(ROOT), env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=20)


def one_line(text: str) -> str:
    lines = text.splitlines()
    assert len(lines) == 1, f"expected exactly one line, got {lines!r}"
    return lines[0]


def exit_code(server: Server, timeout: float) -> int:
    code = server.wait_exit(timeout)
    assert server.wait_log("Server stopped", timeout=5)["exit_code"] == code
    return code


def errors(server: Server) -> list[dict[str, Any]]:
    return [r for r in server.records() if r.get("level") == "ERROR"]


# -- 1. a running server ------------------------------------------------------------------------

def test_endpoints_of_a_running_two_worker_server(server_factory: Any) -> None:
    server = server_factory(*STATUS).wait_ready()
    pids = worker_set(server, 2)
    assert server.count_log("The status server listens beyond this host") == 0

    assert answer(server, "/healthz") == {"status": "alive", "state": "running"}
    assert answer(server, "/readyz") == {"ready": True, "state": "running", "generation": 1,
                                         "reloading": False}
    made = 7
    for _ in range(made):
        assert get(server.port, "/").body == b"hello\n"
    # Workers report after each request (and when /status asks): wait for the last reports.
    snap = status_when(server, lambda s: sum(w["requests_served"] for w in s["workers"]) >= made
                       and s["active_connections"] == 0 and in_flight(s) == 0,
                       f"the workers to report {made} requests served and nothing open")
    assert sum(w["requests_served"] for w in snap["workers"]) == made, snap

    assert set(snap) >= TOP_KEYS, set(snap) ^ TOP_KEYS
    assert snap["ok"] is True and snap["ready"] is True and snap["paused"] is False
    assert snap["state"] == "running" and snap["generation"] == 1
    assert snap["pid"] == server.pid
    assert snap["version"] == forkserve.__version__
    assert snap["worker_class"] == "sync"
    assert 0 < time.time() - snap["started"] < 120, snap["started"]
    assert snap["uptime"] >= 0
    assert (snap["active_connections"], snap["in_flight_requests"], snap["background_tasks"]) \
        == (0, 0, 0), snap
    workers = snap["workers"]
    assert len(workers) == 2, workers
    assert {w["pid"] for w in workers} == pids
    assert sorted(w["worker_id"] for w in workers) == [1, 2]
    for w in workers:
        assert set(w) >= WORKER_KEYS, set(w) ^ WORKER_KEYS
        assert w["state"] == "running" and w["booted"] is True and w["generation"] == 1, w
        assert w["rss_bytes"] > 0, w
        assert w["age"] >= 0 and w["seconds_since_heartbeat"] >= 0, w
        assert (w["in_flight_requests"], w["active_connections"], w["background_tasks"]) \
            == (0, 0, 0), w

    later = status(server)
    assert later["uptime"] >= snap["uptime"]
    assert later["started"] == snap["started"]

    metrics = fetch(server.status_port, "/metrics")
    assert metrics.status == 200 and metrics.body, metrics.body[:200]

    server.signal(signal.SIGTERM)
    assert exit_code(server, 10) == 0
    assert errors(server) == [], server.log_text()


# -- 2. readiness while booting -----------------------------------------------------------------

def test_readyz_fails_while_booting_then_passes(server_factory: Any, gates: Any) -> None:
    gate = gates("boot")  # the worker's import waits on it: still booting until released
    server = server_factory(*STATUS, app="tests.apps.slow_boot:app", workers=1,
                            env={"SLOW_BOOT_FIFO": str(gate.path)})
    server.wait_log("Spawned worker")
    gate.wait_entered()  # the import is waiting on the gate
    assert server.count_log("Server ready") == 0
    assert answer(server, "/readyz", 503) == {"ready": False, "state": "booting",
                                              "generation": 1, "reloading": False}
    assert answer(server, "/healthz") == {"status": "alive", "state": "booting"}
    snap = status(server)
    assert snap["state"] == "booting" and snap["ready"] is False, snap
    assert [(w["state"], w["booted"]) for w in snap["workers"]] == [("booting", False)], snap

    gate.release()
    server.wait_log("Server ready")
    assert answer(server, "/readyz") == {"ready": True, "state": "running", "generation": 1,
                                         "reloading": False}
    assert [w["state"] for w in status(server)["workers"]] == ["running"]
    assert get(server.port, "/").body == b"hello\n"


# -- 3. lameduck: readiness fails before accepting stops ----------------------------------------

def test_readyz_fails_at_term_while_lameduck_still_serves(server_factory: Any) -> None:
    server = server_factory(*STATUS, "--lameduck", "3").wait_ready()
    assert answer(server, "/readyz")["ready"] is True
    server.signal(signal.SIGTERM)
    server.wait_log("Received shutdown signal", state="lameduck")
    body = answer(server, "/readyz", 503)
    assert body == {"ready": False, "state": "lameduck", "generation": 1, "reloading": False}
    assert answer(server, "/healthz") == {"status": "alive", "state": "lameduck"}
    # Readiness already fails, and the main port still accepts and serves a new connection.
    response = get(server.port, "/")
    assert response.status == 200 and response.body == b"hello\n"
    assert server.count_log("Stopped accepting") == 0, \
        "the lameduck ended before the request: the test proves nothing"
    assert server.proc.poll() is None
    server.wait_log("Stopped accepting", timeout=10)
    assert exit_code(server, 10) == 0
    assert refused(server.port) and refused(server.status_port)



@pytest.mark.parametrize("worker_class", ["sync", "thread", "gevent"])
def test_a_probe_accepted_before_the_exit_is_answered_not_reset(server_factory: Any,
                                                                worker_class: str) -> None:
    """A balancer's check in flight as the server exits (seen under load at an -sf
    --reuse-port handoff: a probe accepted by the instance that left the port was reset when
    its arbiter exited with the request unread): the status port closes, and the probe still
    gets its answer."""
    server = server_factory(*STATUS, "-k", worker_class).wait_ready()
    port = server.status_port
    with socket.create_connection(("127.0.0.1", port), timeout=10) as held:
        held.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\n")  # (its head's end comes later)
        # Accepted now: the status server takes its queue in order, and a later connection
        # is answered.
        assert answer(server, "/healthz")["status"] == "alive"
        server.signal(signal.SIGTERM)
        wait_for(lambda: refused(port), 10, "the status port to close")
        assert server.proc.poll() is None, "the arbiter did not wait for the probe it held"
        held.sendall(b"\r\n")
        data = read_to_close(held, 10)
    status, _, body = parse_head(data)
    assert status == 503, data  # (stopped: not ready, but answered)
    assert json.loads(body)["ready"] is False
    assert exit_code(server, 10) == 0

# -- 4. the whole drain -------------------------------------------------------------------------

def test_status_answers_through_the_drain_with_falling_counters(server_factory: Any, gates: Any,
                                                                tmp_path: Path) -> None:
    """Three requests in flight in one thread worker and a background task: after TERM,
    releasing the requests one by one shows 3 -> 2 -> 1 -> 0 in flight on /status, which keeps
    answering (the background task holds the drain) until the server exits; then the port
    refuses."""
    server = server_factory(*STATUS, "-k", "thread", "--threads", "4", app="tests.apps.drain:app",
                            workers=1).wait_ready()
    task = gates("task")
    submitted = get(server.port, f"/background?fifo={task.path}&out={tmp_path / 'out'}")
    assert submitted.status == 200 and submitted.body == b"submitted"
    task.wait_entered()
    held = []
    for i in range(3):
        gate = gates(f"g{i}")
        held.append((gate, send_get(server.port, f"/held?fifo={gate.path}&size=10")))
        gate.wait_entered()
    try:
        snap = status_when(server, lambda s: in_flight(s) == 3 and s["background_tasks"] == 1,
                           "3 requests and 1 background task in flight")
        assert snap["state"] == "running"
        watch = StatusWatch(server.status_port).start()
        wait_for(lambda: watch.count() >= 1, 10, "the /status poller's first answer")

        server.signal(signal.SIGTERM)
        server.wait_log("Received shutdown signal")
        # The worker is "stopping" once signalled, "draining" once it took the stop.
        snap = status_when(server, lambda s: s["state"] == "draining"
                           and [w["state"] for w in s["workers"]] == ["draining"],
                           "the server and its worker draining")
        assert in_flight(snap) == 3, snap
        assert answer(server, "/readyz", 503)["state"] == "draining"
        assert answer(server, "/healthz") == {"status": "alive", "state": "draining"}

        seen = [in_flight(snap)]
        for n, (gate, sock) in enumerate(held, 1):
            gate.release()
            with sock:
                response = read_response(sock)
                assert response.status == 200 and response.body == b"x" * 10
            snap = status_when(server, lambda s, left=3 - n: in_flight(s) == left,
                               f"{3 - n} requests in flight")
            assert snap["state"] == "draining", snap
            seen.append(in_flight(snap))
        assert seen == [3, 2, 1, 0]

        # Every request is done: the background task holds the drain, and /status still answers.
        snap = status_when(server, lambda s: s["active_connections"] == 0, "no connection left")
        assert snap["state"] == "draining" and snap["background_tasks"] == 1, snap
        assert server.proc.poll() is None
        assert watch.running(), f"the /status poller stopped early: {watch.end!r}"
    finally:
        for gate, sock in held:
            gate.release()
            sock.close()
    last_release = time.monotonic()
    task.release()
    assert exit_code(server, 10) == 0
    watch.join(10)  # ends when the port refuses
    assert refused(server.status_port)
    # The poller saw only answers until the end (a connection still queued when the listener
    # closed is reset: only after the last release), the counters never rose, and the states
    # went forward only.
    assert isinstance(watch.end, ConnectionRefusedError), repr(watch.end)
    assert all(when > last_release for when, _ in watch.dropped), watch.dropped
    snapshots = watch.snapshots()
    counts = [in_flight(s) for s in snapshots]
    assert counts[0] == 3 and counts == sorted(counts, reverse=True), counts
    # ("stopped": a probe the status server accepted before its listener closed, answered
    # after the last worker left: Arbiter.shutdown closes the status server last.)
    order = ["running", "draining", "flushing", "stopped"]
    states = [s["state"] for s in snapshots]
    assert set(states) <= set(order), states
    assert [order.index(s) for s in states] == sorted(order.index(s) for s in states), states
    assert "draining" in states and states[-1] in ("draining", "flushing", "stopped"), states
    server.wait_log("All connections drained")


# -- 5. every worker busy ---------------------------------------------------------------------

def test_status_answers_while_every_worker_is_busy(server_factory: Any, gates: Any) -> None:
    server = server_factory(*STATUS).wait_ready()
    pids = worker_set(server, 2)
    held = [gates(f"g{i}") for i in range(2)]
    socks = []
    try:
        for gate in held:
            socks.append(send_get(server.port, gate.route))
            gate.wait_entered()
        # Two sync workers, each inside the app: nobody but the arbiter can answer.
        started = time.monotonic()
        snap = status(server, timeout=2.0)
        assert time.monotonic() - started < 2.0
        assert snap["state"] == "running" and len(snap["workers"]) == 2, snap
        assert answer(server, "/healthz", timeout=2.0)["state"] == "running"
        assert answer(server, "/readyz", timeout=2.0)["ready"] is True
        assert fetch(server.status_port, "/metrics", timeout=2.0).status == 200
        snap = status_when(server, lambda s: in_flight(s) == 2, "2 requests in flight")
        assert {w["pid"]: w["in_flight_requests"] for w in snap["workers"]} == \
            {pid: 1 for pid in pids}, snap
    finally:
        for gate in held:
            gate.release()
    for sock in socks:
        with sock:
            assert read_response(sock).body == b"released"
    status_when(server, lambda s: in_flight(s) == 0, "nothing in flight")


# -- 6. the protocol ----------------------------------------------------------------------------

def test_unknown_path_method_head_and_malformed_requests(server_factory: Any) -> None:
    server = server_factory(*STATUS).wait_ready()
    port = server.status_port

    missing = fetch(port, "/nope")
    assert missing.status == 404 and missing.headers["content-type"] == JSON
    assert "error" in json.loads(missing.body)

    for method in ("POST", "PUT", "DELETE", "OPTIONS"):
        response = exchange(port, f"{method} /status HTTP/1.1\r\nHost: s\r\n"
                                  "Content-Length: 0\r\n\r\n".encode())
        assert response.status == 405, (method, response.status, response.body)

    for path in ("/healthz", "/status", "/readyz"):
        head = fetch(port, path, method="HEAD")
        assert head.status == 200, (path, head.status)
        assert head.body == b"", (path, head.body)
        assert head.headers["content-type"] == JSON
        assert int(head.headers["content-length"]) > 0
    # /healthz is the same answer twice: HEAD announces the length GET sends.
    full = fetch(port, "/healthz")
    assert int(fetch(port, "/healthz", method="HEAD").headers["content-length"]) == len(full.body)

    for garbage in (b"GARBAGE\x01 / HTTP/1.1\r\n\r\n", b"\x00\x01\x02\r\n\r\n",
                    b"GET /healthz HTTP/1.1\r\nNo colon here\r\n\r\n",
                    b"GET /healthz HTTP/9.9\r\n\r\n"):
        response = exchange(port, garbage)
        assert response.status == 400, (garbage, response.status, response.body)

    # Silent clients and one that sends half a request do not hold the others up.
    silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(5)]
    half = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        half.sendall(b"GET /healthz HTTP/1.1\r\nHo")
        started = time.monotonic()
        assert fetch(port, "/healthz", timeout=2.0).status == 200
        assert fetch(port, "/readyz", timeout=2.0).status == 200
        assert time.monotonic() - started < 2.0
        half.sendall(b"st: s\r\n\r\n")  # the rest: it is answered too
        response = parse(read_to_close(half, 5))
        assert response.status == 200 and json.loads(response.body)["status"] == "alive"
    finally:
        for sock in [*silent, half]:
            sock.close()
    assert get(server.port, "/").status == 200  # the main port was never involved


def test_only_the_first_of_pipelined_requests_is_answered(server_factory: Any) -> None:
    server = server_factory(*STATUS).wait_ready()
    port = server.status_port
    response = exchange(port, b"GET /healthz HTTP/1.1\r\nHost: s\r\n\r\n"
                              b"GET /readyz HTTP/1.1\r\nHost: s\r\n\r\n")
    assert response.status == 200, (response.status, response.body)
    assert json.loads(response.body) == {"status": "alive", "state": "running"}
    response = exchange(port, b"GET /healthz HTTP/1.1\r\nHost: s\r\n\r\n"
                              b"POST /x HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
    assert response.status == 200, (response.status, response.body)


# -- 7. workers never hold the status sockets ----------------------------------------------------

def test_workers_do_not_hold_the_status_listener_or_its_clients(server_factory: Any) -> None:
    server = server_factory(*STATUS, app="tests.apps.status:app").wait_ready()
    pids = worker_set(server, 2)
    main_inode = listener_inode(server.port)
    status_inode = listener_inode(server.status_port)
    arbiter = socket_inodes(server.pid)
    assert {main_inode, status_inode} <= arbiter, (main_inode, status_inode, arbiter)
    for pid in pids:
        held = socket_inodes(pid)
        assert main_inode in held, f"worker {pid} lacks the main listener: the check is blind"
        assert status_inode not in held, f"worker {pid} holds the status listener"

    # A status client the arbiter accepted (silent, so it stays open) while a HUP forks new
    # workers: they must not hold it either. The status server drops a silent client after its
    # HEAD_TIMEOUT (2 s); on a loaded machine the fork may come later than that, which proves
    # nothing, so the precondition (accepted and still open at the fork) is set up again, at
    # most three times; the check itself is never retried.
    checked = False
    for attempt in range(3):
        before = socket_inodes(server.pid)
        with socket.create_connection(("127.0.0.1", server.status_port), timeout=5):
            accepted_at = time.monotonic()
            # Accepted: the one new socket among the arbiter's descriptors.
            (client_inode,) = wait_for(lambda: socket_inodes(server.pid) - before, 5,
                                       "the arbiter to accept the status client")
            server.signal(signal.SIGHUP)
            new = set(wait_for(lambda: (w := set(server.workers()) - pids) and len(w) == 2 and w,
                               10, "two new workers"))
            server.wait_log("Reload complete")  # booted: whatever a worker closes is closed now
            pids = pids | new  # every worker seen so far: the next HUP's are the ones not in it
            if client_inode not in socket_inodes(server.pid):
                print(f"attempt {attempt}: the silent client was dropped "
                      f"{time.monotonic() - accepted_at:.1f}s after it was accepted, before the "
                      "fork could be checked; again")
                continue
            for pid in new:
                held = socket_inodes(pid)
                assert main_inode in held, f"worker {pid} lacks the main listener: the check is blind"
                assert status_inode not in held, f"worker {pid} holds the status listener"
                assert client_inode not in held, f"worker {pid} holds a status client connection"
            checked = True
            break
    assert checked, "three times the status client was dropped before the fork: nothing checked"


# -- 8. configuration and bind errors -----------------------------------------------------------

@pytest.mark.parametrize("value", ["unix:/tmp/x", "fd://3", "127.0.0.1:70000", "127.0.0.1:port"])
def test_bad_status_bind_exits_2_with_one_line(value: str) -> None:
    result = forkserve_cli("-w", "1", "-b", "127.0.0.1:0", "--status-bind", value,
                           "tests.apps.basic:app")
    assert result.returncode == USAGE, (result.stdout, result.stderr)
    assert "--status-bind" in one_line(result.stderr)
    assert result.stdout == ""


def test_status_port_in_use_exits_1_with_one_line() -> None:
    with socket.socket() as taken:  # no SO_REUSEPORT: nobody else can bind it
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = forkserve_cli("-w", "1", "-b", "127.0.0.1:0", "--status-bind",
                               f"127.0.0.1:{port}", "tests.apps.basic:app")
    assert result.returncode == 1, (result.stdout, result.stderr)
    line = one_line(result.stderr)
    assert f"127.0.0.1:{port}" in line and "status" in line and "in use" in line, line


def test_status_bind_beyond_loopback_warns(server_factory: Any) -> None:
    server = server_factory("--status-bind", "0.0.0.0:0").wait_ready()
    record = server.wait_log("The status server listens beyond this host")
    assert record["level"] == "WARNING" and record["status_bind"] == "0.0.0.0:0", record
    assert answer(server, "/healthz")["status"] == "alive"


# -- 9. USR2 in-place upgrade -------------------------------------------------------------------

def test_status_port_survives_usr2_upgrade(server_factory: Any) -> None:
    server = server_factory(*STATUS).wait_ready()
    port = server.status_port
    old = worker_set(server, 2)
    before = status(server)
    assert (before["pid"], before["generation"]) == (server.pid, 1)
    watch = StatusWatch(port).start()
    try:
        wait_for(lambda: watch.count() >= 1, 10, "the /status poller's first answer")
        server.signal(signal.SIGUSR2)
        server.wait_log("Upgrade complete", timeout=20)
        assert server.count_log("Upgrade: re-executing") == 1
        assert server.proc.poll() is None, "the arbiter's process exited: not an in-place upgrade"
        new = set(wait_for(lambda: (w := set(server.workers())) and len(w) == 2 and not w & old
                           and w, 15, f"the old workers {old} to be replaced"))
        count = watch.count()
        wait_for(lambda: watch.count() > count or not watch.running(), 10,
                 "a /status answer after the upgrade")
    finally:
        watch.stop()
    # The same listener all along: bound once, answering before, during and after the exec;
    # never refused, never silent, nothing dropped (the old image answers what it accepted).
    assert watch.end is None, f"/status failed during the upgrade: {watch.end!r}"
    assert not watch.dropped, watch.dropped
    assert server.count_log("Status server listening") == 1, server.log_text()
    assert server.status_port == port
    snapshots = watch.snapshots()
    assert {s["pid"] for s in snapshots} == {server.pid}
    generations = [s["generation"] for s in snapshots]
    assert generations == sorted(generations) and generations[0] == 1, generations
    after = status_when(server, lambda s: {w["pid"] for w in s["workers"]} == new,
                        "only the new workers in /status")
    assert (after["pid"], after["generation"], after["state"]) == (server.pid, 2, "running")
    assert {w["generation"] for w in after["workers"]} == {2}
    assert answer(server, "/readyz") == {"ready": True, "state": "running", "generation": 2,
                                         "reloading": False}
    server.signal(signal.SIGTERM)
    assert exit_code(server, 10) == 0


def test_status_client_accepted_before_usr2_exec_is_answered(server_factory: Any, gates: Any,
                                                             tmp_path: Path) -> None:
    """A status client the old image accepted, its request head still arriving, is answered
    (not dropped with the old image's loop): the stand-in forked at the exec takes it over,
    its half-read request too, and the exec goes on at once. The upgrade's check waits on a
    gate (its import of the app), so the client is accepted while the check runs and the
    exec follows the gate's release at once: the client's HEAD_TIMEOUT counts from its accept,
    never from the USR2, however long the check takes on a loaded machine."""
    server, gate, boot = usr2_with_its_check_held(server_factory, gates, tmp_path, *STATUS)
    port = server.status_port
    before = socket_inodes(server.pid)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
        accepted_at = time.monotonic()
        client.sendall(b"GET /healthz HTTP/1.1\r\n")  # the rest comes after the exec
        # Accepted: a new socket among the arbiter's descriptors (nothing else opens one now;
        # reading /proc/net/tcp instead took seconds beside a loaded suite's TIME_WAITs).
        wait_for(lambda: socket_inodes(server.pid) - before, 5,
                 "the arbiter to accept the status client")
        gate.release()
        boot.unlink()  # the new image's workers boot at once
        # The old image execs now; its stand-in answers the requests it had accepted, the
        # rest of this one arriving after the exec.
        server.wait_log("Upgrade: the status stand-in answers the requests in progress",
                        timeout=20, clients=1)
        server.wait_log("Upgrade: re-executing", timeout=20)
        if time.monotonic() - accepted_at > HEAD_TIMEOUT * 0.75:
            pytest.skip("the check's exit came later than the status client's head timeout")
        try:
            client.sendall(b"Host: s\r\n\r\n")
            response = parse(read_to_close(client, 5))
        finally:
            # Whatever happened to that connection, the port itself was handed over.
            server.wait_log("Upgrade complete", timeout=20)
            assert answer(server, "/healthz")["state"] == "running"
        assert response.status == 200 and json.loads(response.body)["status"] == "alive"
        # Answered by the stand-in, not the new image (which answers only after it stops).
        assert server.wait_log("Upgrade: the status stand-in stopped", timeout=20)["answered"] >= 1


# -- 10. HUP reload: ready throughout, the old generation serving while the new one boots --------

def test_readyz_stays_ready_while_a_reload_generation_boots(server_factory: Any, gates: Any,
                                                            tmp_path: Path) -> None:
    """Readiness means "send me traffic" (issue 10): the old generation serves while the new
    one boots, so /readyz stays 200; ``reloading`` tells operators a reload is under way."""
    boot = tmp_path / "boot"  # absent: the first generation boots at once
    server = server_factory(*STATUS, app="tests.apps.status:app", workers=1,
                            env={"STATUS_BOOT_GATE": str(boot)}).wait_ready()
    (old,) = worker_set(server, 1)
    assert answer(server, "/readyz")["ready"] is True
    gate = gates("boot")  # now the next generation's import waits on it
    server.signal(signal.SIGHUP)
    server.wait_log("Reloading: starting a new generation")
    gate.wait_entered()
    assert server.count_log("Reload complete") == 0
    assert answer(server, "/readyz") == {"ready": True, "state": "running",
                                         "generation": 2, "reloading": True}
    assert answer(server, "/healthz")["state"] == "running"
    snap = status(server)
    assert snap["ready"] is True and snap["generation"] == 2, snap
    assert [(w["generation"], w["state"]) for w in snap["workers"]] == \
        [(1, "running"), (2, "booting")], snap
    assert int(get(server.port, "/pid").body) == old  # the old generation still serves

    gate.release()
    server.wait_log("Reload complete")
    assert answer(server, "/readyz") == {"ready": True, "state": "running", "generation": 2,
                                         "reloading": False}
    (new,) = worker_set(server, 1)
    assert new != old and int(get(server.port, "/pid").body) == new


def test_pause_frees_the_status_port_and_resume_takes_it_back(server_factory: Any) -> None:
    """TTOU is the handoff's "let the successor bind": the status port is freed with the
    others (a successor binds it; nothing answers ready meanwhile), TTIN binds it again."""
    server = server_factory(*STATUS).wait_ready()
    port = server.status_port
    server.signal(signal.SIGTTOU)
    server.wait_log("Paused: not listening")
    assert refused(port)
    with socket.socket() as successor:  # what a successor started with -sf would do
        successor.bind(("127.0.0.1", port))
    server.signal(signal.SIGTTIN)
    server.wait_log("Resumed: listening again")
    # Ready from the first booted worker of the resumed generation on; "reloading" until all
    # of them have booted and the paused ones are retired.
    code, body = wait_for(lambda: (r := readyz(server))[0] == 200 and not r[1]["reloading"] and r,
                          10, "/readyz to pass once the resumed generation booted")
    assert body == {"ready": True, "state": "running", "generation": 2, "reloading": False}
    assert get(server.port, "/").status == 200


@pytest.mark.parametrize("worker_class", ["sync", "thread", "gevent"])
def test_resume_with_the_status_port_taken_still_boots_its_workers(server_factory: Any,
                                                                   worker_class: str) -> None:
    """TTIN while another process holds the status port: the server resumes without its
    status server (logged), and the resumed generation boots and serves. Its gevent workers
    used to crash at once: they were handed the closed listener's fd (-1) to close, and
    gevent's os.close raises ValueError for it, so the paused workers stayed the only ones and
    the reopened port was served by nobody."""
    server = server_factory(*STATUS, "-k", worker_class).wait_ready()
    before = set(server.workers())
    server.signal(signal.SIGTTOU)
    server.wait_log("Paused: not listening")
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", server.status_port))
        squatter.listen(1)
        server.signal(signal.SIGTTIN)
        server.wait_log("Resume: cannot bind the status server again")
        server.wait_log("Reload complete")  # the resumed generation booted
    wait_for(lambda: len(w := set(server.workers())) == 2 and not w & before, 15,
             "the resumed generation's two workers, the paused ones gone")
    assert get(server.port, "/").status == 200
    crashes = [r for r in errors(server) if "crashed" in r["message"] or "boot" in r["message"]]
    assert crashes == [], server.log_text()


# -- 11. hardening: nothing a client sends, or does not send, stops the arbiter -------------------

def test_targets_the_url_parser_refuses_are_400_and_the_arbiter_lives(server_factory: Any) -> None:
    """llhttp takes these request targets whole (``h:80`` aside: llhttp refuses it itself),
    httptools.parse_url does not: each is a 400, and nothing reaches the arbiter's loop."""
    server = server_factory(*STATUS).wait_ready()
    port = server.status_port
    for target in (b"http://h:70000/", b"h:80", b"http:///x", b"http://h:99999999/status"):
        response = exchange(port, b"GET " + target + b" HTTP/1.1\r\nHost: s\r\n\r\n")
        assert response.status == 400, (target, response.status, response.body)
        assert server.proc.poll() is None, f"the arbiter died on {target!r}\n{server.log_text()}"
    assert answer(server, "/healthz") == {"status": "alive", "state": "running"}
    assert answer(server, "/readyz")["ready"] is True
    assert get(server.port, "/").body == b"hello\n"
    assert errors(server) == [], server.log_text()


def eof_times(socks: list[socket.socket], timeout: float) -> dict[int, float]:
    """When (monotonic, as seen here) the server closed each of ``socks``, by index, waiting up
    to ``timeout`` for them all (0: only what is closed already). Data instead of a close
    fails: these connections never sent a request."""
    deadline = time.monotonic() + timeout
    pending = dict(enumerate(socks))
    seen: dict[int, float] = {}
    while pending:
        remaining = max(deadline - time.monotonic(), 0.0)
        readable, _, _ = select.select(list(pending.values()), [], [], remaining)
        now = time.monotonic()
        for sock in readable:
            index = next(i for i, s in pending.items() if s is sock)
            try:
                data = sock.recv(1024)
            except ConnectionResetError:
                data = b""
            assert data == b"", f"a silent connection was sent {data!r}"
            seen[index] = now
            del pending[index]
        if remaining == 0.0:
            break
    return seen


def test_idle_connections_cannot_lock_the_status_server_out(server_factory: Any) -> None:
    """70 connections that never send a byte, for 64 places: the longest idle are closed to
    make room, so /healthz is answered at once; the others are closed at the head timeout."""
    server = server_factory(*STATUS).wait_ready()
    port = server.status_port
    count = MAX_CLIENTS + 6
    idle: list[socket.socket] = []
    try:
        started = time.monotonic()
        for _ in range(count):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        asked = time.monotonic()
        assert asked - started < 1.0, \
            "opening the connections took over 1 s: the test proves nothing"
        response = fetch(port, "/healthz", timeout=1.0)
        assert response.status == 200 and json.loads(response.body)["status"] == "alive"
        assert time.monotonic() - asked < 1.0

        # One place each for the 70 and /healthz: the 7 oldest were closed to make room. A
        # connection is accepted after ``started``, so a close before started + HEAD_TIMEOUT
        # cannot be the head timeout: it is the making of room.
        evicted = count + 1 - MAX_CLIENTS
        closed = eof_times(idle, started + HEAD_TIMEOUT + 3.0 - time.monotonic())
        assert len(closed) == count, f"still open 5 s after they were opened: " \
            f"{sorted(set(range(count)) - set(closed))}"
        early = sorted(i for i, when in closed.items() if when < started + HEAD_TIMEOUT)
        assert early == list(range(evicted)), early
        # The rest: closed by the head timeout (2 s after the accept), within 5 s.
        late = [closed[i] - started for i in range(evicted, count)]
        assert min(late) >= HEAD_TIMEOUT and max(late) < 5.0, (min(late), max(late))
    finally:
        for sock in idle:
            sock.close()
    assert answer(server, "/healthz", timeout=1.0)["state"] == "running"
    assert errors(server) == [], server.log_text()


# -- 12. a worker that cannot answer SIGWINCH does not hold up the loop --------------------------

def timed_fetch(port: int, path: str, barrier: threading.Barrier,
                results: list[tuple[str, float, float, Response | BaseException]]) -> None:
    barrier.wait(10)
    began = time.monotonic()
    try:
        outcome: Response | BaseException = fetch(port, path, timeout=5.0)
    except (OSError, AssertionError) as exc:
        outcome = exc
    results.append((path, began, time.monotonic(), outcome))


def test_status_and_metrics_do_not_wait_for_a_worker_stuck_in_c(server_factory: Any,
                                                                 tmp_path: Path) -> None:
    """The one sync worker is inside a 2.5 s C call: SIGWINCH's Python handler cannot run, so
    its numbers never come. 20 /metrics share one 0.1 s wait for them, /healthz waits for
    nothing, and all are answered long before the call ends."""
    server = server_factory(*STATUS, app="tests.apps.status:app", workers=1).wait_ready()
    (busy,) = worker_set(server, 1)
    marker = tmp_path / "spinning"
    results: list[tuple[str, float, float, Response | BaseException]] = []
    with send_get(server.port, f"/spin?seconds=2.5&marker={marker}", timeout=20) as spin:
        wait_for(marker.exists, 10, "the worker to start its long C call")
        paths = ["/healthz"] + ["/metrics"] * 20
        barrier = threading.Barrier(len(paths))
        threads = [threading.Thread(target=timed_fetch, args=(server.status_port, path, barrier,
                                                              results), daemon=True)
                   for path in paths]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert not [t for t in threads if t.is_alive()], "a status request is stuck"
        snap = status(server, timeout=2.0)
        asked_last = time.monotonic()
        call = json.loads(read_response(spin, timeout=20).body)

    assert len(results) == len(paths)
    failed = [(path, outcome) for path, _, _, outcome in results
              if not isinstance(outcome, Response) or outcome.status != 200]
    assert not failed, failed
    took: dict[str, list[float]] = {path: [] for path in paths}
    for path, began, ended, outcome in results:
        took[path].append(ended - began)
        if path == "/metrics":
            assert isinstance(outcome, Response) and f'pid="{busy}"'.encode() in outcome.body
    assert took["/healthz"][0] < 0.5, took["/healthz"]
    assert max(took["/metrics"]) < 2.0, sorted(took["/metrics"])
    # Every answer came while the worker was still inside the call: nobody waited for it.
    assert max(ended for _, _, ended, _ in results) < asked_last < call["end"], (call, asked_last)
    assert call["end"] - call["start"] > 1.0, call  # a call that short proves little
    assert [(w["pid"], w["state"], w["booted"]) for w in snap["workers"]] == \
        [(busy, "running", True)], snap
    assert get(server.port, "/pid").body == str(busy).encode()  # the worker lives on
    assert errors(server) == [], server.log_text()


def test_status_waiting_for_numbers_is_answered_when_the_control_socket_refreshed_them(
        server_factory: Any, ctl_dir: Path) -> None:
    """A /status waits for the workers' numbers; a control-socket status that comes meanwhile
    waits for the same numbers in place and finishes the refresh. The waiting /status must
    still be answered, not dropped at its deadline with no response (seen in CI: the status
    watchers by url and by control socket started together). The worker is stopped, so the
    arbiter's ask (SIGWINCH) stays pending in it: the sign that the /status is waiting."""
    path = ctl_dir / "ctl.sock"
    server = server_factory(*STATUS, "--control-socket", str(path), workers=1).wait_ready()
    wait_for(path.exists, 5, f"the control socket {path}")
    (worker,) = worker_set(server, 1)
    os.kill(worker, signal.SIGSTOP)
    try:
        with socket.create_connection(("127.0.0.1", server.status_port), timeout=10) as sock:
            sock.sendall(b"GET /status HTTP/1.1\r\nHost: status\r\n\r\n")
            wait_for(lambda: signal_pending(worker, signal.SIGWINCH), 10,
                     "the arbiter to ask the worker for its numbers")
            answer, _ = request(str(path), "status", timeout=10)
            assert answer["ok"] and answer["workers"][0]["pid"] == worker, answer
            response = parse(read_to_close(sock, 10))
    finally:
        os.kill(worker, signal.SIGCONT)
    assert response.status == 200, response
    assert json.loads(response.body)["workers"][0]["pid"] == worker, response.body
    assert get(server.port, "/pid").body == str(worker).encode()
    assert errors(server) == [], server.log_text()


# -- 13. readiness needs a worker of the generation up -------------------------------------------

def test_readyz_fails_while_no_worker_can_boot(server_factory: Any, tmp_path: Path) -> None:
    """The one worker is killed and its replacements cannot import the app: retried with
    back-off, the instance is alive (/healthz) but not ready until a worker boots again."""
    refuse = tmp_path / "refuse"  # absent: the first worker boots
    server = server_factory(*STATUS, app="tests.apps.status:app", workers=1,
                            env={"STATUS_REFUSE_FILE": str(refuse)}).wait_ready()
    (old,) = worker_set(server, 1)
    assert answer(server, "/readyz")["ready"] is True
    refuse.touch()  # from now on a worker's import fails
    os.kill(old, signal.SIGKILL)
    first = server.wait_log("failed to boot")
    assert "retrying in 0.5s" in first["message"], first

    def unready() -> None:
        assert answer(server, "/readyz", 503) == {"ready": False, "state": "running",
                                                  "generation": 1, "reloading": False}
        assert answer(server, "/healthz") == {"status": "alive", "state": "running"}
        snap = status(server)
        assert snap["state"] == "running" and snap["ready"] is False, snap
        assert not [w for w in snap["workers"] if w["booted"]], snap

    unready()
    # Retried, slower: still failing, still not ready.
    wait_for(lambda: server.count_log("failed to boot") >= 2, 10, "a second boot failure")
    second = [r for r in server.records() if "failed to boot" in r.get("message", "")][1]
    assert "retrying in 1s" in second["message"], second
    unready()
    assert server.proc.poll() is None

    refuse.unlink()
    wait_for(lambda: readyz(server)[0] == 200, 10, "/readyz to pass once a worker booted")
    assert answer(server, "/readyz") == {"ready": True, "state": "running", "generation": 1,
                                         "reloading": False}
    (new,) = worker_set(server, 1)
    assert new != old and get(server.port, "/pid").body == str(new).encode()
    assert server.count_log("Server ready") == 1


# -- 14. -sf handoff on the same status port ------------------------------------------------------

def test_sf_handoff_moves_the_status_port_to_the_successor(server_factory: Any,
                                                           gates: Any) -> None:
    """No --reuse-port: B cannot bind A's ports, asks A to pause (TTOU frees the main and the
    status port), binds both and serves; the status port answers for B while A, holding a
    request, drains; A then exits 0."""
    old = server_factory(*STATUS).wait_ready()
    status_port = old.status_port
    gate = gates()
    with send_get(old.port, gate.route) as held:
        gate.wait_entered()
        new = server_factory("tests.apps.basic:app", "--status-bind", f"127.0.0.1:{status_port}",
                             "-sf", str(old.pid), app="", bind=f"127.0.0.1:{old.port}")
        new.wait_log("Address in use; asking the old instance(s) to pause listening",
                     pids=str(old.pid))
        old.wait_log("Paused: not listening")
        new.wait_ready()
        assert new.status_port == status_port
        old.wait_log("Received shutdown signal")
        # A drains (the held request), and the status port is B's.
        assert old.proc.poll() is None, "the old instance exited: the check proves nothing"
        assert answer(new, "/readyz") == {"ready": True, "state": "running", "generation": 1,
                                          "reloading": False}
        # One listener on the status port, B's: A let go of it (not shared by SO_REUSEPORT).
        inode = listener_inode(status_port)
        assert inode in socket_inodes(new.pid) and inode not in socket_inodes(old.pid)
        for _ in range(10):  # fresh connections: any one could have gone to a shared port
            snap = status(new)
            assert snap["pid"] == new.pid, snap
        assert {w["pid"] for w in snap["workers"]} == set(worker_set(new, 2))
        assert old.proc.poll() is None, "the old instance exited: the check proves nothing"
        gate.release()
        response = read_response(held)
        assert response.status == 200 and response.body == b"released"
    assert exit_code(old, 20) == 0
    assert errors(old) == [], old.log_text()
    assert int(get(new.port, "/pid").body) in set(new.workers())
    assert answer(new, "/status")["pid"] == new.pid
    assert errors(new) == [], new.log_text()


# -- 15. USR2 with a status port that cannot be bound --------------------------------------------

def test_usr2_to_a_taken_status_port_upgrades_without_the_status_server(server_factory: Any,
                                                                        tmp_path: Path) -> None:
    """The new configuration's status port is taken: the upgrade goes through without the
    status server (logged), rather than take the serving instance down."""
    config = tmp_path / "forkserve.yaml"
    config.write_text("status_bind: 127.0.0.1:0\n")
    server = server_factory("-c", str(config)).wait_ready()
    old_status = server.status_port
    assert answer(server, "/readyz")["generation"] == 1
    old = worker_set(server, 2)
    with socket.socket() as taken:  # no SO_REUSEPORT: nobody else can bind it
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config.write_text(f"status_bind: 127.0.0.1:{port}\n")
        server.signal(signal.SIGUSR2)
        record = server.wait_log("cannot bind the status server", timeout=20)
        assert record["level"] == "ERROR", record
        assert f"127.0.0.1:{port}" in record["message"] and "serving without it" in \
            record["message"], record
        server.wait_log("Upgrade complete", timeout=20, generation=2)
        assert server.proc.poll() is None, "the arbiter's process exited: not an in-place upgrade"
        assert server.count_log("Upgrade: re-executing") == 1
        assert server.wait_log("Upgrade: re-executing")["pid"] == server.pid
        server.wait_log("Server ready", generation=2)
        new = set(wait_for(lambda: (w := set(server.workers())) and len(w) == 2 and not w & old
                           and w, 15, f"the old workers {old} to be replaced"))
        assert int(get(server.port, "/pid").body) in new
        assert refused(old_status), "the old status port still answers after it was changed"
        assert server.count_log("Status server listening") == 1, server.log_text()
    assert server.proc.poll() is None
    server.signal(signal.SIGTERM)
    assert exit_code(server, 10) == 0


def test_usr2_keeps_a_status_listener_bound_by_host_name(server_factory: Any) -> None:
    """--status-bind localhost:PORT: the upgraded image recognises the inherited 127.0.0.1
    socket as the same address and keeps it (rebinding would drop its queued clients)."""
    server = server_factory("--status-bind", "localhost:0").wait_ready()
    port = server.status_port
    server.signal(signal.SIGUSR2)
    server.wait_log("Upgrade complete", timeout=30)
    assert server.count_log("Status server listening") == 1, server.log_text()
    assert answer(server, "/healthz")["state"] == "running"
    assert server.status_port == port
