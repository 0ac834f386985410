"""Behind a proxy: only a trusted peer's X-Forwarded-Proto / Forwarded headers change the scheme
(and, with --forwarded-for, the client's address, in the environ and the access log). On every
worker class, under concurrent keep-alive load from trusted and untrusted peers at once (the
untrusted ones connect from 127.0.0.2: loopback is all of 127.0.0.0/8), and behind a real
HAProxy that sets the headers as deployments do."""

from __future__ import annotations

import http.client
import json
import shutil
import signal
import socket
import threading
from pathlib import Path
from typing import Any

import pytest


WORKER_CLASSES = ["sync", "thread", "gevent"]
CLIENTS = 4  # per kind of peer
REQUESTS = 25  # per client, on one keep-alive connection


def environs(port: int, source: str, headers: dict[str, str], count: int = REQUESTS,
             host: str = "127.0.0.1") -> list[dict[str, Any]]:
    """``count`` requests for /environ on one keep-alive connection from ``source``."""
    conn = http.client.HTTPConnection(host, port, timeout=10, source_address=(source, 0))
    seen = []
    try:
        for _ in range(count):
            conn.request("GET", "/environ", headers=headers)
            response = conn.getresponse()
            body = response.read()
            assert response.status == 200, (response.status, body)
            seen.append(json.loads(body))
    finally:
        conn.close()
    return seen


def in_parallel(jobs: list[tuple[Any, ...]]) -> list[list[dict[str, Any]]]:
    """Each job (source, headers, ...) on a thread of its own, all at once; their results."""
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException] = []

    def run(i: int, job: tuple[Any, ...]) -> None:
        try:
            results[i] = environs(*job)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(i, job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]
    assert all(not t.is_alive() for t in threads), "a client still running after 60 s"
    return results


def access_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_only_a_trusted_peer_is_believed(server_factory: Any, tmp_path: Path,
                                         worker_class: str) -> None:
    log = tmp_path / "access.log"
    server = server_factory("-k", worker_class, "--forwarded-allow-ips", "127.0.0.1",
                            "--forwarded-for", "--access-log", str(log),
                            "--access-log-format", "json").wait_ready()
    fake = {"X-Forwarded-Proto": "https", "X-Forwarded-For": "203.0.113.66"}
    jobs = []
    for i in range(CLIENTS):
        jobs.append((server.port, "127.0.0.1", {"X-Forwarded-Proto": "https",
                                                "X-Forwarded-For": f"198.51.100.1, 203.0.113.{i}"}))
        jobs.append((server.port, "127.0.0.2", fake))  # not a trusted proxy: a faker
    results = in_parallel(jobs)
    for (_, source, _), seen in zip(jobs, results):
        for env in seen:
            if source == "127.0.0.1":
                assert env["wsgi.url_scheme"] == "https", env
                assert env["REMOTE_ADDR"].startswith("203.0.113.") and env["REMOTE_PORT"] == "0"
                assert env["forkserve.peer_addr"] == "127.0.0.1"
            else:
                assert env["wsgi.url_scheme"] == "http", env
                assert env["REMOTE_ADDR"] == "127.0.0.2" and "forkserve.peer_addr" not in env
    server.signal(signal.SIGTERM)
    assert server.wait_exit() == 0
    by_client: dict[str, int] = {}
    for line in access_lines(log):
        by_client[line["remote_addr"]] = by_client.get(line["remote_addr"], 0) + 1
    assert by_client == {**{f"203.0.113.{i}": REQUESTS for i in range(CLIENTS)},
                         "127.0.0.2": CLIENTS * REQUESTS}, by_client


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_by_default_only_loopback_is_trusted_and_the_address_is_opt_in(
        server_factory: Any, worker_class: str) -> None:
    """As gunicorn: a local nginx's X-Forwarded-Proto is believed with no setting at all;
    REMOTE_ADDR stays the peer's unless --forwarded-for."""
    server = server_factory("-k", worker_class).wait_ready()
    headers = {"X-Forwarded-Proto": "https", "X-Forwarded-For": "203.0.113.5"}
    local, remote = in_parallel([(server.port, "127.0.0.1", headers),
                                 (server.port, "127.0.0.2", headers)])
    assert {(e["wsgi.url_scheme"], e["REMOTE_ADDR"]) for e in local} == {("https", "127.0.0.1")}
    assert {(e["wsgi.url_scheme"], e["REMOTE_ADDR"]) for e in remote} == {("http", "127.0.0.2")}


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_a_unix_socket_peer_is_trusted(server_factory: Any, ctl_dir: Path,
                                       worker_class: str) -> None:
    """nginx on the same host, through a unix socket: trusted whatever the allow list."""
    path = ctl_dir / "app.sock"
    server_factory("-k", worker_class, "--forwarded-allow-ips", "10.9.9.9",
                   bind=f"unix:{path}").wait_ready()

    class UnixConnection(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(10)
            self.sock.connect(str(path))
    conn = UnixConnection("localhost")
    try:
        for _ in range(10):
            conn.request("GET", "/environ", headers={"X-Forwarded-Ssl": "on"})
            assert json.loads(conn.getresponse().read())["wsgi.url_scheme"] == "https"
    finally:
        conn.close()


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed")
@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_behind_a_real_haproxy_terminating_tls(server_factory: Any, ctl_dir: Path,
                                               worker_class: str) -> None:
    """HAProxy as a TLS terminator is configured: ``option forwardfor`` and
    ``X-Forwarded-Proto: https`` set on every request. Clients from 127.0.0.3 (to HAProxy);
    the app sees https and, with --forwarded-for, 127.0.0.3, never HAProxy's address."""
    from bench.lifecycle_servers import Procs

    server = server_factory("-k", worker_class, "--status-bind", "127.0.0.1:0",
                            "--forwarded-for").wait_ready()
    procs = Procs(ctl_dir)
    try:
        front = procs.haproxy(server.port, server.status_port, frontend=(
            "    option forwardfor\n"
            "    http-request set-header X-Forwarded-Proto https\n"), served="/")
        # A client's own forged header is overwritten (set-header) or precedes HAProxy's hop.
        forged = {"X-Forwarded-Proto": "http", "X-Forwarded-For": "6.6.6.6"}
        results = in_parallel([(front, "127.0.0.3", forged if i % 2 else {}) for i in range(CLIENTS)])
    finally:
        procs.close()
    seen = [env for result in results for env in result]
    assert len(seen) == CLIENTS * REQUESTS
    assert {(e["wsgi.url_scheme"], e["REMOTE_ADDR"], e["forkserve.peer_addr"]) for e in seen} == \
        {("https", "127.0.0.3", "127.0.0.1")}


# -- the PROXY protocol ---------------------------------------------------------------------------
def proxied(port: int, source: str, preamble: bytes, count: int = REQUESTS) -> list[dict[str, Any]]:
    """``count`` requests for /environ, kept alive as the server allows; each connection
    begins with ``preamble`` (a PROXY header, or nothing), as a balancer's do. (A sync
    worker answers Connection: close while others wait: then a new connection.)"""
    from tests.harness import read_response

    seen: list[dict[str, Any]] = []
    while len(seen) < count:
        with socket.create_connection(("127.0.0.1", port), timeout=10,
                                      source_address=(source, 0)) as sock:
            sock.sendall(preamble)
            while len(seen) < count:
                sock.sendall(b"GET /environ HTTP/1.1\r\nHost: p\r\n\r\n")
                response = read_response(sock)
                assert response.status == 200, response
                seen.append(json.loads(response.body))
                if response.headers.get("connection", "").lower() == "close":
                    break
    return seen


V1 = b"PROXY TCP4 203.0.113.10 127.0.0.1 51000 80\r\n"
V2 = (b"\r\n\r\n\x00\r\nQUIT\n\x21\x11\x00\x0c" + bytes([203, 0, 113, 20, 127, 0, 0, 1])
      + (52000).to_bytes(2, "big") + (80).to_bytes(2, "big"))


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_proxy_protocol_from_a_trusted_peer_only(server_factory: Any, worker_class: str) -> None:
    server = server_factory("-k", worker_class, "--proxy-protocol",
                            "--forwarded-allow-ips", "127.0.0.1").wait_ready()
    results: dict[str, list[dict[str, Any]]] = {}
    errors: list[BaseException] = []

    def run(name: str, preamble: bytes) -> None:
        try:
            results[name] = proxied(server.port, "127.0.0.1", preamble)
        except BaseException as exc:  # reported in the test's thread
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(f"{kind}{i}", preamble))
               for i in range(CLIENTS)
               for kind, preamble in (("v1-", V1), ("v2-", V2), ("plain-", b""))]
    for t in threads:
        t.start()
    # Meanwhile an untrusted peer tries it: closed, with no answer; the others go on.
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10,
                                      source_address=("127.0.0.2", 0)) as faker:
            faker.sendall(V1 + b"GET /environ HTTP/1.1\r\nHost: p\r\n\r\n")
            assert faker.recv(100) == b""
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]
    for name, seen in results.items():
        expected = {"v1": ("203.0.113.10", "51000", "127.0.0.1"),
                    "v2": ("203.0.113.20", "52000", "127.0.0.1"),
                    "plain": ("127.0.0.1", None, None)}[name.split("-")[0]]
        for env in seen:
            got = (env["REMOTE_ADDR"], env["REMOTE_PORT"] if expected[1] else None,
                   env.get("forkserve.peer_addr"))
            assert got == expected, (name, env)
    assert len(results) == 3 * CLIENTS
    refused = server.wait_log("PROXY protocol header refused; connection closed")
    assert "not a trusted proxy" in refused["reason"]
    # At most a line per worker per interval, each counting the refusals it stands for (the
    # first refusal of each worker is logged at once; 3 fakers on 2 workers: 1 or 2 lines).
    lines = [r for r in server.records() if r.get("message", "").startswith("PROXY protocol")]
    assert 1 <= len(lines) <= 2 and len({r["worker"] for r in lines}) == len(lines), lines


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed")
@pytest.mark.parametrize("version", ["send-proxy", "send-proxy-v2"])
@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_behind_haproxy_sending_the_proxy_protocol(server_factory: Any, ctl_dir: Path,
                                                   worker_class: str, version: str) -> None:
    """An L4 balancer's view: HAProxy (``send-proxy`` or ``send-proxy-v2`` on its server line,
    keep-alive to us) in front; clients from 127.0.0.3; the app sees 127.0.0.3."""
    from bench.lifecycle_servers import Procs

    server = server_factory("-k", worker_class, "--status-bind", "127.0.0.1:0",
                            "--proxy-protocol").wait_ready()
    procs = Procs(ctl_dir)
    try:
        front = procs.haproxy(server.port, server.status_port, served="/", server_options=version)
        results = in_parallel([(front, "127.0.0.3", {}) for _ in range(CLIENTS)])
    finally:
        procs.close()
    seen = [env for result in results for env in result]
    assert len(seen) == CLIENTS * REQUESTS
    assert {(e["REMOTE_ADDR"], e["forkserve.peer_addr"]) for e in seen} == {("127.0.0.3", "127.0.0.1")}
    assert server.count_log("PROXY protocol header refused") == 0
