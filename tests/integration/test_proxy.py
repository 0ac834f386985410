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
