"""Hostile and broken surroundings, on every worker class (issue 13): the arbiter killed under
a busy worker, descriptors exhausted, slow and silent clients.

Real ``python -m forkserve`` process groups with 2 workers on 127.0.0.1, real sockets, real
signals. Every wait is bounded and synchronised on an event (a request inside the app, a log
line, a process gone), never on a sleep. CPU use is read from /proc.
"""

from __future__ import annotations

import os
import resource
import socket
import threading
import time
from typing import Any, Iterator

import pytest

from tests.harness import (Server, get, process_group, read_head, read_response, send_get,
                           wait_for, wait_for_threads, worker_set)

WORKER_CLASSES = ["sync", "thread", "gevent"]


@pytest.fixture(autouse=True)
def _many_descriptors() -> None:
    """The attackers below hold hundreds of sockets in this process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < min(hard, 4096):
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))


def start(server_factory: Any, worker_class: str, *args: str) -> Server:
    server = server_factory("-k", worker_class, *args)
    return server.wait_ready()  # type: ignore[no-any-return]


def cpu_seconds(pids: list[int]) -> float:
    """User plus system CPU time of the processes, in seconds (/proc/PID/stat)."""
    ticks = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def can_bind(port: int) -> bool:
    """Could a new instance listen on the port now (as a server does: SO_REUSEADDR)?"""
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        probe.bind(("127.0.0.1", port))
        probe.listen(1)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def connections(port: int, count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        socks.append(sock)
    return socks


@pytest.fixture
def held() -> Iterator[list[socket.socket]]:
    """Sockets a test holds open; closed at teardown, whatever happened."""
    socks: list[socket.socket] = []
    yield socks
    for sock in socks:
        sock.close()


# -- the arbiter's death --------------------------------------------------------------------

@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
@pytest.mark.parametrize("route", ["/block", "/block-holding-log-locks"],
                         ids=["in-app", "holding-log-locks"])
def test_workers_leave_within_a_second_of_the_arbiters_death_mid_request(
        server_factory: Any, gates: Any, worker_class: str, route: str,
        held: list[socket.socket]) -> None:
    """kill -9 of the arbiter while a request is inside the app: nobody enforces --timeout any
    more, so the request is cut and every worker is gone within a second; the port is free
    for a new instance at once (the arbiter's successor would otherwise fail with "Address
    already in use" for as long as the request ran). Also when the request holds logging's
    locks (a greenlet or thread stopped inside one, as the parent-death signal may find it):
    the worker's last line takes none."""
    server = start(server_factory, worker_class)
    port = server.port
    workers = worker_set(server, 2)
    gate = gates()
    client = send_get(port, gate.route.replace("/block", route, 1))
    held.append(client)
    gate.wait_entered()
    os.kill(server.pid, 9)
    killed = time.monotonic()
    wait_for(lambda: not process_group(server.pid), 5.0,
             lambda: f"workers {workers} to leave; left: {process_group(server.pid)}")
    gone_after = time.monotonic() - killed
    wait_for(lambda: can_bind(port), 5.0, f"port {port} to be free")
    assert gone_after < 1.0, f"workers outlived the arbiter by {gone_after:.2f}s"
    # (The line is written before the worker exits; the harness' reader may not have it yet.)
    wait_for(lambda: "Arbiter is gone; worker exiting now" in server.log_text(), 5.0,
             lambda: f"the worker's last line; log: {server.log_text()}")


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_workers_leave_within_a_second_of_the_arbiters_death_stuck_sending(
        server_factory: Any, worker_class: str, held: list[socket.socket]) -> None:
    """The same with the request stuck writing to a client that stopped reading (a 50 MB
    response, of which the client read only the head)."""
    server = start(server_factory, worker_class)
    port = server.port
    worker_set(server, 2)
    sock = send_get(port, "/big?size=50000000", close=False)
    held.append(sock)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    status, _, _ = read_head(sock)
    assert status == 200
    os.kill(server.pid, 9)
    killed = time.monotonic()
    wait_for(lambda: not process_group(server.pid), 5.0, "the workers to leave")
    gone_after = time.monotonic() - killed
    wait_for(lambda: can_bind(port), 5.0, f"port {port} to be free")
    assert gone_after < 1.0, f"workers outlived the arbiter by {gone_after:.2f}s"


# -- descriptors exhausted ------------------------------------------------------------------

@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_out_of_descriptors_the_accept_loop_backs_off_and_recovers(
        server_factory: Any, worker_class: str, held: list[socket.socket]) -> None:
    """Each worker limited to 64 descriptors while 200 clients connect and stay silent: the
    workers that run out stop accepting for a moment at a time instead of spinning on the
    listener (CPU stays near 0, one log line per interval, not one per try), go on serving
    the connections they hold, and take new clients again once descriptors are free."""
    server = start(server_factory, worker_class, "--header-timeout", "60", "--keepalive", "60")
    port = server.port
    workers = sorted(worker_set(server, 2))
    # A kept-alive connection each worker already holds, served before and during the flood.
    regulars: list[tuple[socket.socket, int]] = []
    for _ in range(50):
        sock = send_get(port, "/pid", close=False)
        response = read_response(sock)
        assert response.status == 200
        if response.headers.get("connection") == "close":  # (a sync worker keeps one alive)
            sock.close()
            continue
        held.append(sock)
        regulars.append((sock, int(response.body)))
        if {pid for _, pid in regulars} == set(workers):
            break
    for pid in workers:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (64, 64))
    held.extend(connections(port, 200))
    wait_for(lambda: server.count_log("accept() failed") >= 1, 10.0,
             lambda: f"a worker to run out of descriptors\n{server.log_text()}")
    before = cpu_seconds(workers)
    started = time.monotonic()
    for sock, _ in regulars:
        sock.sendall(b"GET /pid HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock, timeout=5.0).status == 200  # open connections still served
    wait_for(lambda: time.monotonic() - started >= 2.0, 5.0, "two seconds of exhaustion")
    used = cpu_seconds(workers) - before
    elapsed = time.monotonic() - started
    assert used < 0.25 * elapsed, f"workers used {used:.2f}s CPU in {elapsed:.2f}s exhausted"
    failures = server.count_log("accept() failed")
    assert failures <= 2, f"{failures} accept() lines in {elapsed:.1f}s (one per interval)"
    # Descriptors free again: new clients are accepted and answered.
    for sock in held[len(regulars):]:
        sock.close()
    del held[len(regulars):]
    assert get(port, "/", timeout=5.0).status == 200


# -- slow and silent clients ----------------------------------------------------------------

class Attackers(threading.Thread):
    """``count`` connections that send ``opening`` and then one more byte each ``every``
    seconds (slowloris), or nothing at all (``every`` None): a server that gives each of them
    a thread or a worker has nothing left for anyone else."""

    def __init__(self, port: int, count: int, opening: bytes, every: float | None) -> None:
        super().__init__(daemon=True)
        self.socks = []
        for _ in range(count):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.setblocking(False)
            if opening:
                sock.send(opening)
            self.socks.append(sock)
        self.every = every
        self.stopped = threading.Event()
        self.start()

    def run(self) -> None:
        while self.every is not None and not self.stopped.wait(self.every):
            for sock in self.socks:
                try:
                    sock.send(b"a")
                except OSError:
                    continue  # closed by the server (its timeout): it stays closed

    def close(self) -> None:
        self.stopped.set()
        self.join(10)
        for sock in self.socks:
            sock.close()


@pytest.fixture
def attackers() -> Iterator[Any]:
    made: list[Attackers] = []

    def make(*args: Any) -> Attackers:
        attack = Attackers(*args)
        made.append(attack)
        return attack

    yield make
    for attack in made:
        attack.close()


def legitimate_latencies(port: int, seconds: float, every: float = 0.1) -> list[float]:
    """A request each ``every`` seconds for ``seconds``, on a new connection each: how long
    each took to be answered (a failure fails the test)."""
    latencies = []
    pace = threading.Event()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        began = time.monotonic()
        response = get(port, "/", timeout=10.0)
        assert response.status == 200
        latencies.append(time.monotonic() - began)
        pace.wait(every)  # the pace of the load, not a synchronisation
    return latencies


SLOW_HEAD = b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: "
SLOW_BODY = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n"
# The same, asking for 100 Continue first (which once got a worker or thread at the head).
SLOW_EXPECT = (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n"
               b"Expect: 100-continue\r\n\r\n")


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
@pytest.mark.parametrize("opening, every", [(SLOW_HEAD, 0.5), (SLOW_BODY, 0.5),
                                            (SLOW_EXPECT, 0.5), (b"", None)],
                         ids=["slowloris-head", "slow-body", "slow-body-expect", "silent"])
def test_slow_and_silent_clients_do_not_hold_up_anyone(
        server_factory: Any, attackers: Any, worker_class: str, opening: bytes,
        every: float | None) -> None:
    """200 connections that send a request head (or body) a byte at a time, or nothing: the
    legitimate requests made meanwhile are each answered within a second."""
    server = start(server_factory, worker_class)
    attackers(server.port, 200, opening, every)
    latencies = legitimate_latencies(server.port, 3.0)
    assert max(latencies) < 1.0, f"slowest of {len(latencies)}: {max(latencies):.2f}s"


class NonReaders:
    """``count`` clients that ask for a big response and never read it."""

    def __init__(self, port: int, count: int, size: int, path: str = "/big") -> None:
        self.socks = []
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
            sock.connect(("127.0.0.1", port))
            sock.sendall(f"GET {path}?size={size} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            self.socks.append(sock)

    def wait_answered(self, timeout: float = 15.0) -> "NonReaders":
        """Until each has the first bytes of its response in its receive buffer (peeked, not
        read): the server has taken every request and is holding its unread rest, the state
        under test. Without this the first legitimate request raced the server making ten
        16 MB bodies: one such request of a loaded suite (two suites of two processes each on
        2 cores) took 1.3 s, the next sixteen under 2 ms."""
        deadline = time.monotonic() + timeout
        for sock in self.socks:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            assert sock.recv(1, socket.MSG_PEEK), "the server closed a non-reader's connection"
        return self

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


@pytest.mark.parametrize("worker_class, path", [
    (worker_class, path) for path in ("/big", "/big-stream") for worker_class in WORKER_CLASSES
    # A sync worker writes a streamed response itself: one that is not read holds it until
    # --header-timeout (README: Security).
    if not (worker_class == "sync" and path == "/big-stream")])
def test_clients_that_stop_reading_do_not_hold_up_anyone(server_factory: Any,
                                                         worker_class: str, path: str) -> None:
    """10 clients ask for a 16 MB response each and read none of it (more than 2 workers
    times 4 threads): the legitimate requests made meanwhile are each answered within a
    second. A whole response's rest is written by the sync and thread workers' poll loops; a
    streamed one's thread parks and a spare thread takes its place (the sync worker: a
    streamed one holds the worker that writes it, so that cell shows the design's limit only
    for whole responses)."""
    server = start(server_factory, worker_class)
    readers = NonReaders(server.port, 10, 16_000_000, path)
    try:
        readers.wait_answered()
        latencies = legitimate_latencies(server.port, 3.0)
    finally:
        readers.close()
    assert max(latencies) < 1.0, f"slowest of {len(latencies)}: {max(latencies):.2f}s"


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
@pytest.mark.parametrize("path", ["/big", "/big-stream"], ids=["whole", "streamed"])
def test_a_response_left_to_the_loop_reaches_a_slow_reader_whole(server_factory: Any,
                                                                 worker_class: str,
                                                                 path: str) -> None:
    """The rest of a response whose client paused (a whole one the thread left to the poll
    loop, a streamed one whose thread parked) arrives complete and in order, and the
    connection serves the next (pipelined) request after it."""
    server = start(server_factory, worker_class)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    with sock:
        sock.sendall(f"GET {path}?size=8000000 HTTP/1.1\r\nHost: x\r\n\r\n"
                     "GET /pid HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        # Slow at first (the thread has long moved on), then as fast as it comes.
        first = sock.recv(1000)
        pace = threading.Event()
        pace.wait(0.5)
        rest = read_response_after(sock, first)
        assert rest[0].status == 200 and rest[0].body == b"x" * 8_000_000
        assert rest[1].status == 200 and int(rest[1].body) in server.workers()


def thread_count(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise AssertionError(f"no Threads line for {pid}")


def test_spare_threads_stand_in_for_parked_ones_and_retire_after(server_factory: Any) -> None:
    """Thread worker: each request thread parked on a client that does not read its streamed
    response gets a spare (the process has more threads while they are parked), and the
    spares leave once those clients are gone (back to the count it started with)."""
    server = start(server_factory, "thread", "--threads", "2")
    pids = sorted(worker_set(server, 2))
    for _ in range(4):
        assert get(server.port, "/").status == 200
    # The baseline once each worker runs its poll loop and both request threads: a baseline
    # read while one was still starting them is never seen again (seen under two suites in
    # parallel: the wait below for the count to come back timed out).
    for pid in pids:
        wait_for_threads(pid, 3)
    before = {pid: thread_count(pid) for pid in pids}
    readers = NonReaders(server.port, 6, 16_000_000, "/big-stream")
    try:
        wait_for(lambda: sum(thread_count(pid) - before[pid] for pid in pids) >= 4, timeout=10)
        latencies = legitimate_latencies(server.port, 1.0)
        assert max(latencies) < 1.0, f"slowest of {len(latencies)}: {max(latencies):.2f}s"
    finally:
        readers.close()
    wait_for(lambda: all(thread_count(pid) == before[pid] for pid in pids), timeout=15)
    for _ in range(4):
        assert get(server.port, "/").status == 200


def read_response_after(sock: socket.socket, data: bytes) -> list[Any]:
    """The two responses on ``sock``, ``data`` being what was already read of them."""
    from tests.harness import Response, parse_head
    sock.settimeout(10)
    responses = []
    while len(responses) < 2:
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        status, headers, data = parse_head(data)
        size = int(headers["content-length"])
        while len(data) < size:
            chunk = sock.recv(1 << 20)
            assert chunk, "closed before the end of the body"
            data += chunk
        responses.append(Response(status, headers, data[:size]))
        data = data[size:]
    return responses
