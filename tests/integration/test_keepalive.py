"""Persistent connections and pipelining in the sync worker, against a real server process.

The sync worker keeps a connection alive only while nobody else waits (ARCHITECTURE.md): these
tests check both halves, that a lone client keeps its connection and that many keep-alive
clients never wait for each other's idle timeout.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.harness import Server
from tests.integration.test_http import RawClient, get, post, post_chunked


def test_http11_serves_several_requests_on_one_connection(server: Server) -> None:
    with RawClient.connect(server.port) as client:
        pids = set()
        for _ in range(5):
            client.send(get("/pid"))
            response = client.read_response()
            assert response.status == 200
            assert not response.has_token("Connection", "close"), response
            pids.add(response.body)
        assert len(pids) == 1, "one connection is served by one worker"
        client.send(get("/", close=True))
        last = client.read_response()
        assert last.has_token("Connection", "close")
        client.assert_closed()


def test_http10_keep_alive_with_content_length(server: Server) -> None:
    with RawClient.connect(server.port) as client:
        client.send(post("/echo", b"first", "Connection: keep-alive", version="1.0"))
        response = client.read_response()
        assert response.body == b"first"
        assert response.header("Content-Length") == "5"
        assert response.has_token("Connection", "keep-alive"), response
        client.send(get("/", "Connection: keep-alive", version="1.0"))
        again = client.read_response()
        assert again.body == b"hello\n"
        assert again.has_token("Connection", "keep-alive"), again
        # Without the keep-alive token an HTTP/1.0 request ends the connection.
        client.send(get("/", version="1.0"))
        last = client.read_response()
        assert last.body == b"hello\n"
        assert last.has_token("Connection", "close")
        client.assert_closed()


def test_http10_without_keep_alive_is_closed(server: Server) -> None:
    with RawClient.connect(server.port) as client:
        client.send(get("/", version="1.0"))
        response = client.read_response()
        assert response.body == b"hello\n"
        assert response.has_token("Connection", "close")
        client.assert_closed()


def test_idle_connection_closed_after_keepalive(server_factory: type[Server]) -> None:
    server = server_factory("--keepalive", "1").wait_ready()
    with RawClient.connect(server.port, timeout=5) as client:
        client.send(get("/"))
        assert client.read_response().status == 200
        started = time.monotonic()
        client.assert_closed()  # fails if the server holds the connection past 5 s
        elapsed = time.monotonic() - started
    assert 0.7 <= elapsed < 3.0, f"idle connection closed after {elapsed:.2f}s with --keepalive 1"


def test_keepalive_0_announces_close(server_factory: type[Server]) -> None:
    """RFC 9112 §9.6: a server that will not keep the connection MUST send ``close``."""
    server = server_factory("--keepalive", "0").wait_ready()
    with RawClient.connect(server.port) as client:
        client.send(get("/") + get("/"))
        response = client.read_response()
        assert response.has_token("Connection", "close"), response
        client.assert_closed()


def test_newcomer_is_not_dropped_when_the_idle_client_speaks_too(server_factory: type[Server]) -> None:
    """The worker holds client A's idle keep-alive connection. A newcomer B connects and
    sends a request, and A sends its next one, both before the worker looks again (it is
    stopped meanwhile with SIGSTOP, so both are certainly there when it wakes): both must
    get their response; B must not be accepted and then dropped."""
    server = server_factory(workers=1).wait_ready()  # type: ignore[call-arg]
    (worker,) = server.workers()
    with RawClient.connect(server.port) as a:
        a.send(get("/pid"))
        assert a.read_response().body == str(worker).encode()
        os.kill(worker, signal.SIGSTOP)
        try:
            b = RawClient.connect(server.port)
            b.send(get("/", close=True))
            a.send(get("/pid", close=True))
        finally:
            os.kill(worker, signal.SIGCONT)
        with b:
            response_b = b.read_response()
            assert response_b.body == b"hello\n"
        assert a.read_response().body == str(worker).encode()
        a.assert_closed()


@pytest.mark.parametrize("first", [get("/", close=True), get("/", version="1.0")])
def test_data_after_a_closing_request_is_ignored(server: Server, first: bytes) -> None:
    """RFC 9112 §9.6: after a request with ``close`` the server answers it, closes, and does
    not process what follows; the valid request must not be answered 400 because of it."""
    with RawClient.connect(server.port) as client:
        client.send(first + get("/pid"))
        response = client.read_response()
        assert (response.status, response.body) == (200, b"hello\n"), response
        assert response.has_token("Connection", "close")
        client.assert_closed()


# -- 2. Pipelining -------------------------------------------------------------------------

def test_pipelined_requests_are_answered_in_order(server: Server) -> None:
    with RawClient.connect(server.port) as client:
        client.send(get("/pid") + post("/echo", b"posted body") + get("/?third")
                    + post_chunked("/echo", b"chunked ", b"body") + get("/chunked")
                    + get("/write", close=True))
        pid = client.read_response()
        assert pid.status == 200 and pid.body.isdigit()
        assert client.read_response().body == b"posted body"
        assert client.read_response().body == b"hello\n"
        assert client.read_response().body == b"chunked body"
        assert client.read_response().body == b"one two three"
        last = client.read_response()
        assert last.body == b"written and returned"
        assert last.has_token("Connection", "close")
        client.assert_closed()


def test_many_pipelined_requests_in_one_send(server: Server) -> None:
    requests_ = [post("/echo", f"body {i}".encode()) if i % 2 else get(f"/?n={i}")
                 for i in range(40)]
    with RawClient.connect(server.port) as client:
        client.send(b"".join(requests_) + get("/", close=True))
        for i in range(40):
            expected = f"body {i}".encode() if i % 2 else b"hello\n"
            assert client.read_response().body == expected, f"response {i}"
        assert client.read_response().body == b"hello\n"
        client.assert_closed()


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_reuses_the_connection(server: Server) -> None:
    result = subprocess.run(
        ["curl", "-sS", "--http1.1", "--max-time", "10", "-w", "%{http_code} %{num_connects}\n",
         "-o", "/dev/null", "-o", "/dev/null", "-o", "/dev/null",
         server.url + "/", server.url + "/pid", server.url + "/chunked"],
        capture_output=True, timeout=20)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().split("\n")[:3] == ["200 1", "200 0", "200 0"]


# -- 11. Keep-alive never starves anyone ---------------------------------------------------

def test_keepalive_clients_never_wait_for_each_other(server_factory: type[Server]) -> None:
    """50 keep-alive sessions on 2 sync workers with --keepalive 5: if a worker sat on an idle
    connection until its keep-alive expired, the others would wait 5 s per turn."""
    server = server_factory("--keepalive", "5", workers=2).wait_ready()
    url = server.url
    clients, per_client = 50, 4
    barrier = threading.Barrier(clients, timeout=10)

    def client(index: int) -> list[int]:
        statuses = []
        with requests.Session() as session:
            barrier.wait()
            for n in range(per_client):
                response = session.get(f"{url}/?client={index}&n={n}", timeout=10)
                statuses.append(response.status_code)
                assert response.content == b"hello\n"
        return statuses

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        results = list(pool.map(client, range(clients)))
    elapsed = time.monotonic() - started
    assert results == [[200] * per_client] * clients
    assert elapsed < 4.0, f"{clients} keep-alive clients took {elapsed:.2f}s"


# -- 12. A long computation does not cut the next keep-alive wait short ----------------------

@pytest.mark.parametrize("worker_class", ["sync", "thread", "gevent"])
def test_keepalive_counts_from_the_response_after_a_long_computation(
        server_factory: type[Server], worker_class: str, tmp_path: Path) -> None:
    """A request that computes for longer than --keepalive (never yielding: a gevent worker's
    loop is held the whole time), then one pipelined behind it: the connection is kept alive
    for --keepalive from the second response, and its next request, sent at once, is
    answered. (A gevent keep-alive timer started from the loop's time at the start of that
    long turn once fired at once and closed the connection under the client.)"""
    server = server_factory("-k", worker_class, "--keepalive", "1", app="tests.apps.limits:app",
                            workers=1).wait_ready()
    out = tmp_path / "out"
    with RawClient.connect(server.port, timeout=10) as client:
        client.send(get(f"/slow?how=busy&seconds=1.5&out={out}") + get("/"))
        assert client.read_response().body == b"finished: no timeout"
        second = client.read_response()
        assert second.status == 200 and not second.has_token("Connection", "close")
        # The connection stays open well within --keepalive (a client that comes back a moment
        # later finds it): nothing arrives, not even the EOF, for half of it.
        client.sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            client.sock.recv(1)
        client.sock.settimeout(10)
        for _ in range(3):
            client.send(get("/"))
            response = client.read_response()
            assert response.status == 200, response


# -- 13. A short --keepalive holds under load, on every worker class --------------------------

@pytest.mark.parametrize("worker_class", ["sync", "thread", "gevent"])
def test_short_keepalive_ends_every_idle_connection_on_time(
        server_factory: type[Server], worker_class: str) -> None:
    """--keepalive 0.25, shorter than a worker's heartbeat (1 s), and 20 clients that each
    send requests back to back (each sent the moment the last response is read), then stop
    (1 on the sync worker, which gives keep-alive up while another client waits for it):
    every connection, and then a lone client's, is closed about --keepalive after its last
    response, not at the worker's next heartbeat: a loop that learns of a kept-alive
    connection only when it wakes (a thread worker whose request threads re-armed it
    themselves, one such change measured) misses the deadline by up to a heartbeat."""
    server = server_factory("-k", worker_class, "--keepalive", "0.25", workers=2).wait_ready()

    def client(_: int) -> float:
        with RawClient.connect(server.port, timeout=10) as raw:
            for _ in range(30):
                raw.send(get("/"))
                response = raw.read_response()
                assert response.status == 200, response
                assert not response.has_token("Connection", "close"), response
            last = time.monotonic()
            raw.assert_closed()
            return time.monotonic() - last

    clients = 1 if worker_class == "sync" else 20
    with ThreadPoolExecutor(clients) as pool:
        idle = sorted(pool.map(client, range(clients)))
    idle.append(client(0))  # then a lone one: no other connection's deadline wakes its worker
    # Never before --keepalive (less a little clock slack); with the poll loop asleep for a
    # heartbeat, a connection went idle for up to 1 s. 0.85 s leaves a loaded machine room.
    assert min(idle) >= 0.2 and max(idle) < 0.85, f"idle connections closed after {idle}"
