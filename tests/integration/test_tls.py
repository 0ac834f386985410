"""HTTPS served by forkserve itself (issue 12), on every worker class: keep-alive under load with
`requests` and curl, sendfile falling back to reads, a handshake bounded by the header timeout
(a silent or plain-HTTP client cannot hold a sync worker), the drain, certificates rotated by
HUP (a bad new one keeps the old), client certificates, and one-line errors. Certificates are
made per test by trustme (never a key in the repository)."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import ssl
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import requests
import trustme

from tests.harness import read_response, wait_for

WORKER_CLASSES = ["sync", "thread", "gevent"]
CLIENTS, REQUESTS = 4, 25


class Certs:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = trustme.CA()
        self.ca_pem = root / "ca.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_pem))
        self.server_pem = root / "server.pem"
        self.issue(self.server_pem)

    def issue(self, path: Path) -> bytes:
        """A server certificate (and key) for 127.0.0.1 at ``path``; its DER, to recognise it."""
        cert = self.ca.issue_cert("127.0.0.1", "localhost")
        cert.private_key_and_cert_chain_pem.write_to_path(str(path))
        return ssl.PEM_cert_to_DER_cert(cert.cert_chain_pems[0].bytes().decode())

    def mismatched(self) -> tuple[Path, Path]:
        """A certificate chain and the key of another certificate."""
        one, other = self.ca.issue_cert("127.0.0.1"), self.ca.issue_cert("127.0.0.1")
        chain, key = self.root / "chain.pem", self.root / "other-key.pem"
        for blob in one.cert_chain_pems:
            with chain.open("ab") as fh:
                fh.write(blob.bytes())
        other.private_key_pem.write_to_path(str(key))
        return chain, key

    def client(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca_pem))
        return context


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    return Certs(tmp_path)


def tls_get(port: int, context: ssl.SSLContext, path: str = "/") -> tuple[Any, bytes]:
    """One request on a new TLS connection: (the response, the server certificate's DER)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".encode())
            return read_response(sock), sock.getpeercert(binary_form=True) or b""


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_https_keepalive_under_load(server_factory: Any, certs: Certs, tmp_path: Path,
                                    worker_class: str) -> None:
    server = server_factory("-k", worker_class, "--certfile", str(certs.server_pem)).wait_ready()
    url = f"https://127.0.0.1:{server.port}"
    blob = tmp_path / "blob.bin"
    blob.write_bytes(bytes(range(256)) * 4096)  # 1 MiB: sendfile's path, through TLS
    failures: list[BaseException] = []
    seen: list[str] = []

    def client() -> None:
        try:
            with requests.Session() as session:
                for i in range(REQUESTS):
                    if i % 5 == 4:
                        r = session.get(f"{url}/file", params={"path": str(blob)},
                                        verify=str(certs.ca_pem), timeout=10)
                        assert r.status_code == 200 and r.content == blob.read_bytes()
                    else:
                        r = session.get(f"{url}/environ", verify=str(certs.ca_pem), timeout=10)
                        assert r.status_code == 200
                        seen.append(r.json()["wsgi.url_scheme"])
        except BaseException as exc:  # reported in the test's thread
            failures.append(exc)
    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures, failures[:3]
    assert seen == ["https"] * (CLIENTS * REQUESTS * 4 // 5)
    if shutil.which("curl"):
        out = subprocess.run(["curl", "-sS", "--cacert", str(certs.ca_pem), "--http1.1",
                              f"{url}/", f"{url}/"], capture_output=True, timeout=20)
        assert out.returncode == 0 and out.stdout == b"hello\nhello\n", out.stderr
    # ALPN: http/1.1 chosen from what the client offers; TLS 1.2 at least (the floor itself:
    # tests/unit/test_tls.py, since Python will not make a TLS 1.1 client without a warning).
    context = certs.client()
    context.set_alpn_protocols(["h2", "http/1.1"])
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
            assert sock.selected_alpn_protocol() == "http/1.1"
            assert sock.version() in ("TLSv1.2", "TLSv1.3")


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_a_silent_or_plain_client_cannot_hold_a_worker(server_factory: Any, certs: Certs,
                                                       worker_class: str) -> None:
    """One worker, --header-timeout 1: a client that never says hello and one that speaks plain
    HTTP to the HTTPS port are ended (the handshake runs within the header timeout), and a
    real client is served meanwhile or right after."""
    server = server_factory("-k", worker_class, "--certfile", str(certs.server_pem),
                            "--header-timeout", "1", workers=1).wait_ready()
    silent = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    plain = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    try:
        plain.sendall(b"GET / HTTP/1.1\r\nHost: p\r\n\r\n")
        response, _ = tls_get(server.port, certs.client())
        assert response.status == 200 and response.body == b"hello\n"
        assert_ended(plain)
        assert_ended(silent)  # at the header timeout, not held
    finally:
        silent.close()
        plain.close()


def assert_ended(sock: socket.socket) -> None:
    """The server closed it within 10 s (an EOF, maybe after a TLS alert, or a reset for its
    unread bytes); a connection still held raises socket.timeout here."""
    sock.settimeout(10)
    try:
        while sock.recv(4096):
            continue
    except ConnectionResetError:
        return


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_a_tls_request_in_flight_is_finished_by_the_drain(server_factory: Any, certs: Certs,
                                                          gates: Any, worker_class: str) -> None:
    server = server_factory("-k", worker_class, "--certfile", str(certs.server_pem)).wait_ready()
    gate = gates()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:
        with certs.client().wrap_socket(raw, server_hostname="127.0.0.1") as sock:
            sock.sendall(f"GET {gate.route} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
            gate.wait_entered()
            server.signal(signal.SIGTERM)
            server.wait_log("Received shutdown signal")
            gate.release()
            response = read_response(sock)
    assert response.status == 200 and response.body == b"released"
    assert response.headers.get("connection") == "close"
    assert server.wait_exit() == 0


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_hup_rotates_the_certificate_and_a_bad_one_keeps_the_old(server_factory: Any,
                                                                 certs: Certs,
                                                                 worker_class: str) -> None:
    pem = certs.root / "live.pem"
    first = certs.issue(pem)
    server = server_factory("-k", worker_class, "--certfile", str(pem)).wait_ready()
    assert tls_get(server.port, certs.client())[1] == first
    second = certs.issue(pem)
    server.signal(signal.SIGHUP)
    server.wait_log("Reload complete")
    wait_for(lambda: tls_get(server.port, certs.client())[1] == second, 10,
             "new connections to get the rotated certificate")
    pem.write_text("not a certificate\n")
    server.signal(signal.SIGHUP)
    error = server.wait_log("Reload: the new TLS certificate or key does not load")
    assert "not a PEM certificate" in error["error"]
    server.wait_log("Reload complete", generation=3)
    for _ in range(5):
        response, der = tls_get(server.port, certs.client())
        assert response.status == 200 and der == second


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_client_certificates_when_required(server_factory: Any, certs: Certs,
                                           worker_class: str) -> None:
    server = server_factory("-k", worker_class, "--certfile", str(certs.server_pem),
                            "--ca-certs", str(certs.ca_pem), "--cert-reqs", "required").wait_ready()
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        response, _ = tls_get(server.port, certs.client(), "/environ")
        assert response.status != 200  # (TLS 1.3 reports the refusal at the first read)
        raise ConnectionError(response.status)
    context = certs.client()
    client_cert = certs.ca.issue_cert("client@example.org")
    client_cert.private_key_and_cert_chain_pem.write_to_path(str(certs.root / "client.pem"))
    context.load_cert_chain(str(certs.root / "client.pem"))
    response, _ = tls_get(server.port, context, "/environ")
    assert response.status == 200
    peer = json.loads(response.body)["forkserve.peer_cert"]
    assert "client@example.org" in json.dumps(peer)


@pytest.mark.parametrize("args, message", [
    (["--certfile", "/nonexistent/server.pem"], "cannot read /nonexistent/server.pem: no such file"),
    (["--certfile", "{ca}"], "not a PEM certificate or key"),  # a certificate without its key
    (["--certfile", "{chain}", "--keyfile", "{key}"], "the key does not match the certificate"),
    (["--certfile", "{server}", "--cert-reqs", "required"], "--cert-reqs required needs --ca-certs"),
    (["--certfile", "{server}", "--ciphers", "NO-SUCH-CIPHER"], "no cipher matches"),
])
def test_a_bad_tls_setting_is_one_line_and_exit_2(certs: Certs, args: list[str], message: str) -> None:
    from tests.integration.test_cli import forkserve

    chain, key = certs.mismatched()
    argv = [a.format(ca=certs.ca_pem, server=certs.server_pem, chain=chain, key=key) for a in args]
    result = forkserve("--check", *argv, "tests.apps.basic:app")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("forkserve: error: ") and message in lines[0], lines


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_usr2_upgrade_while_clients_keep_asking(server_factory: Any, certs: Certs,
                                                worker_class: str) -> None:
    """The new image reads the certificate itself; keep-alive and new TLS clients meanwhile get
    every answer (none lost to the upgrade)."""
    server = server_factory("-k", worker_class, "--certfile", str(certs.server_pem)).wait_ready()
    url = f"https://127.0.0.1:{server.port}/"
    stop = threading.Event()
    answered: list[int] = []
    failures: list[BaseException] = []

    def client(keepalive: bool) -> None:
        session = requests.Session()
        try:
            while not stop.is_set():
                if not keepalive:
                    session.close()
                r = session.get(url, verify=str(certs.ca_pem), timeout=10)
                assert r.status_code == 200 and r.content == b"hello\n", r
                answered.append(1)
        except BaseException as exc:  # reported in the test's thread
            failures.append(exc)
        finally:
            session.close()
    threads = [threading.Thread(target=client, args=(i % 2 == 0,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(answered) >= 50 or failures, 20, "50 answers before the upgrade")
        server.signal(signal.SIGUSR2)
        server.wait_log("Upgrade complete", timeout=60)
        before = len(answered)
        wait_for(lambda: len(answered) >= before + 50 or failures, 20, "50 answers after it")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not failures, failures[:3]


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_a_tls_client_queued_past_the_deadline_gets_an_answer_over_tls(
        server_factory: Any, certs: Certs, gates: Any, worker_class: str) -> None:
    """The only worker is busy until the drain deadline; a TLS client queued meanwhile gets a
    real HTTP answer through TLS (a 503, or a 200 where a free thread served it), never a
    plaintext 503 it cannot read, nor a reset."""
    server = server_factory("-k", worker_class, "--certfile", str(certs.server_pem),
                            "--drain-timeout", "1", "--cancel-grace", "2", workers=1).wait_ready()
    gate = gates()
    outcome: list[Any] = []

    def queued_client(raw: socket.socket) -> None:
        try:
            with certs.client().wrap_socket(raw, server_hostname="127.0.0.1") as sock:
                sock.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
                outcome.append(read_response(sock).status)
        except BaseException as exc:  # reported in the test's thread
            outcome.append(exc)
    raw = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    busy = certs.client().wrap_socket(raw, server_hostname="127.0.0.1")
    try:
        busy.sendall(f"GET {gate.route} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
        gate.wait_entered()
        # In the listen queue before the TERM (connect() returns once the kernel queued it);
        # its handshake, which no free worker answers yet, goes on in a thread.
        queued = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        waiter = threading.Thread(target=queued_client, args=(queued,))
        waiter.start()
        server.signal(signal.SIGTERM)
        server.wait_log("Received shutdown signal")
        waiter.join(20)
        assert not waiter.is_alive() and outcome and outcome[0] in (200, 503), outcome
    finally:
        busy.close()
        gate.release()
    server.wait_exit(15)
