"""--defer-accept: a TCP connection reaches a worker once its first bytes have come.

With it, the kernel keeps a connection whose client has sent nothing yet half-open on its
side (SYN-RECV: the client's handshake ACK is set aside, Linux's TCP_DEFER_ACCEPT) until data
comes, or until about that many seconds have passed; then a worker accepts it as any other.
Seen from outside: the server's end of each connection in /proc/net/tcp, SYN-RECV while the
client is silent, ESTABLISHED once it has sent (or, without the flag, at once), and every
request answered, under a load of Connection: close clients (the case it is for), through
TERM and an upgrade. What it is for, one wake-up per connection instead of two, is measured
by hand and noted in bench/RESULTS.md, not asserted here.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import time
from typing import Any, Iterator

import pytest

from tests.harness import Server, read_response, wait_for
from tests.load import Load

EVERY_CLASS = {"sync": (), "thread": ("-k", "thread", "--threads", "4"), "gevent": ("-k", "gevent")}
by_every_class = pytest.mark.parametrize("worker_class", list(EVERY_CLASS))

ESTABLISHED, SYN_RECV = "01", "03"  # /proc/net/tcp's state codes
SILENT = 5
REQUEST = b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"


def server_ends(port: int, client_ports: set[int]) -> dict[int, str]:
    """The state of the server's end of each connection from ``client_ports`` to ``port``
    (/proc/net/tcp; a half-open one deferred in the kernel is listed there too)."""
    states = {}
    with open("/proc/net/tcp", encoding="ascii") as table:
        next(table)
        for line in table:
            local, remote, state = line.split()[1:4]
            if int(local.split(":")[1], 16) == port and int(remote.split(":")[1], 16) in client_ports:
                states[int(remote.split(":")[1], 16)] = state
    return states


@contextlib.contextmanager
def silent_clients(port: int) -> Iterator[tuple[list[socket.socket], set[int]]]:
    """Clients that connect and send nothing (yet), and their ports; closed on the way out."""
    socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(SILENT)]
    try:
        yield socks, {sock.getsockname()[1] for sock in socks}
    finally:
        for sock in socks:
            sock.close()


def wait_ends(server: Server, ports: set[int], state: str, timeout: float, what: str) -> None:
    """Until the server's end of every connection from ``ports`` is in ``state``."""
    wait_for(lambda: server_ends(server.port, ports) == dict.fromkeys(ports, state), timeout,
             lambda: f"{what}: {server_ends(server.port, ports)}")


def under_load(server: Server, requests: int = 200) -> Load:
    """16 Connection: close clients, running once they have had ``requests`` responses."""
    load = Load(server.port, threads=16, seconds=60).start()
    load.wait_requests(requests, timeout=30)
    return load


@by_every_class
def test_a_silent_client_waits_in_the_kernel_until_it_sends(server_factory: Any,
                                                            worker_class: str) -> None:
    server = server_factory("--defer-accept", "30", *EVERY_CLASS[worker_class]).wait_ready()
    load = under_load(server)
    try:
        with silent_clients(server.port) as (socks, ports):
            # Every silent client's connect() returned, and the server's end of each is
            # half-open: no worker has it, however busy the load keeps them accepting.
            wait_ends(server, ports, SYN_RECV, 10, "deferred")
            load.wait_requests(200, timeout=30)
            assert server_ends(server.port, ports) == dict.fromkeys(ports, SYN_RECV)
            for sock in socks:
                sock.sendall(REQUEST)
            for sock in socks:
                response = read_response(sock)
                assert response.status == 200, response.status
    finally:
        load.stop()
    assert load.failures == [], load.failures[:5]


def test_without_it_a_silent_client_is_accepted_at_once(server_factory: Any) -> None:
    server = server_factory(*EVERY_CLASS["thread"]).wait_ready()
    with silent_clients(server.port) as (_, ports):
        wait_ends(server, ports, ESTABLISHED, 10, "accepted")


def test_a_client_silent_longer_than_that_is_accepted(server_factory: Any) -> None:
    """After the deferral, a worker takes the connection and --header-timeout applies: the
    client is answered if it sends in time."""
    server = server_factory("--defer-accept", "1", "--header-timeout", "30").wait_ready()
    with silent_clients(server.port) as (socks, ports):
        wait_ends(server, ports, ESTABLISHED, 15, "accepted after the deferral")
        for sock in socks:
            sock.sendall(REQUEST)
            assert read_response(sock).status == 200


WITH_AND_WITHOUT = pytest.mark.parametrize("flag", [("--defer-accept", "1"), ()],
                                           ids=["deferred", "not-deferred"])


@by_every_class
@WITH_AND_WITHOUT
def test_every_request_is_answered_through_a_stop(server_factory: Any, worker_class: str, flag: Any) -> None:
    """TERM under load: what was sent before the listener closed is answered; later clients
    are refused, never accepted and reset."""
    server = server_factory(*flag, *EVERY_CLASS[worker_class]).wait_ready()
    load = under_load(server)
    stopped = time.monotonic()
    server.signal(signal.SIGTERM)
    assert server.wait_exit() == 0
    load.stop()
    assert load.successes > 200
    assert load.failures_except("refused", stopped) == [], load.summary()


@by_every_class
@WITH_AND_WITHOUT
def test_every_request_is_answered_through_pauses(server_factory: Any, worker_class: str,
                                                  flag: Any) -> None:
    """TTOU (the port let go, as for a handoff) and TTIN, three times under load: a client
    is refused while paused, never accepted and reset."""
    server = server_factory(*flag, *EVERY_CLASS[worker_class]).wait_ready()
    load = under_load(server)
    try:
        for n in range(1, 4):
            server.signal(signal.SIGTTOU)
            wait_for(lambda: server.count_log("Paused: not listening") >= n, 30, f"pause {n}")
            server.signal(signal.SIGTTIN)
            wait_for(lambda: server.count_log("Resumed: listening again") >= n, 30, f"resume {n}")
            # The resumed generation serves before the next pause. (Waiting only until the
            # first refusal, the next TTOU came while the new workers still booted, and under
            # load their boot held the port's SYNs dropped for seconds, pause after pause,
            # until a client's 5 s connect timed out between its SYN retransmissions.)
            load.wait_requests(100, timeout=30, allowed="refused")
    finally:
        load.stop()
    assert load.failures_except("refused", 0) == [], load.summary()


def test_an_upgrade_keeps_it(server_factory: Any) -> None:
    """USR2: the new arbiter inherits the listener, which stays deferred, with no request lost."""
    server = server_factory("--defer-accept", "30", *EVERY_CLASS["thread"]).wait_ready()
    load = under_load(server)
    try:
        server.signal(signal.SIGUSR2)
        server.wait_log("Upgrade complete", timeout=60)
        load.wait_requests(200, timeout=30)
        with silent_clients(server.port) as (_, ports):
            wait_ends(server, ports, SYN_RECV, 10, "deferred after the upgrade")
    finally:
        load.stop()
    assert load.failures == [], load.failures[:5]


def test_it_needs_a_number_of_seconds(server_factory: Any) -> None:
    server = server_factory("--defer-accept", "-1")
    assert server.wait_exit() != 0
    assert "--defer-accept" in server.log_text()
