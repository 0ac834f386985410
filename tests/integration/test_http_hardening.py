"""HTTP hardening (issue 13) through a real server, on every worker class, 2 workers, 127.0.0.1.

What a client can make grow is refused within a bound (the 64 MiB trailer probe) or served
with bounded memory (10,000 pipelined requests on one connection, a 100 MiB upload); the
request-line limit at its exact boundary; and the conformance cases of the parser's corpus,
seen from a client. Memory is the serving worker's own: its pid comes from ``/pid`` on the
same connection, its peak from ``VmHWM`` in /proc (a peak, so growth that came and went is
seen too). Every wait is a socket timeout or a bounded join; nothing waits on a sleep.

The app (``tests.apps.hardening``) runs behind wsgiref's PEP 3333 validator.
"""

from __future__ import annotations

import json
import socket
import threading
from typing import Iterator

import pytest

from tests.harness import Server
from tests.integration.test_http import RawClient, assert_refused, get, post

WORKER_CLASSES = ["sync", "thread", "gevent"]
APP = "tests.apps.hardening:app"
MIB = 1 << 20
# How much a worker's peak RSS may grow while it serves one of the big probes. Before the
# fix the 64 MiB trailer grew it by 109 MiB; what is bounded stays within a few reads.
RSS_BOUND = 24 * MIB
CHUNKED = "Transfer-Encoding: chunked"


@pytest.fixture(params=WORKER_CLASSES)
def server(request: pytest.FixtureRequest, server_factory: type[Server]) -> Server:
    """A fresh server per test: the memory probes need a worker no other test has grown."""
    return server_factory("-k", request.param, app=APP).wait_ready()  # type: ignore[call-arg]


def memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) of a process, in bytes."""
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        fields = dict(line.split(":", 1) for line in fh if line.startswith("Vm"))
    return {name: int(fields[name].split()[0]) * 1024 for name in ("VmRSS", "VmHWM")}


def worker_of(client: RawClient) -> int:
    """The pid of the worker serving this (kept-alive) connection."""
    client.send(get("/pid"))
    response = client.read_response()
    assert response.status == 200, response
    return int(response.body)


class Sender(threading.Thread):
    """Sends ``pieces`` on a socket until they run out or the server stops taking them, while
    the test reads the responses (both directions must flow, or both buffers fill)."""

    def __init__(self, sock: socket.socket, pieces: Iterator[bytes]) -> None:
        super().__init__(daemon=True)
        self.sock, self.pieces = sock, pieces
        self.sent = 0
        self.error: OSError | None = None

    def run(self) -> None:
        try:
            for piece in self.pieces:
                self.sock.sendall(piece)
                self.sent += len(piece)
        except OSError as exc:  # the server refused and closed: the point of some probes
            self.error = exc

    def finish(self, timeout: float = 30.0) -> None:
        self.join(timeout)
        assert not self.is_alive(), f"the sender is stuck after {self.sent} bytes"


def repeat(block: bytes, total: int) -> Iterator[bytes]:
    for _ in range(total // len(block)):
        yield block


# -- bounded input ------------------------------------------------------------------------------

def test_64_mib_trailer_is_refused_within_a_bound(server: Server) -> None:
    """Before: not refused at all, +109 MiB RSS and 30 s of CPU in the worker."""
    with RawClient.connect(server.port, timeout=10) as client:
        pid = worker_of(client)
        before = memory(pid)
        client.send(get("/upload", CHUNKED, method="POST") + b"1\r\nx\r\n0\r\nX-Endless: ")
        sender = Sender(client.sock, repeat(b"e" * 65536, 64 * MIB))
        sender.start()
        response = client.read_response()
        assert response.status == 431, response
        assert response.has_token("Connection", "close"), response
        sender.finish()
        after = memory(pid)
    # The server stopped reading and closed long before the 64 MiB were sent (what was sent
    # is what the socket buffers on both sides took, and a lingering close's 256 KiB).
    assert sender.error is not None and sender.sent < 32 * MIB, sender.sent
    assert after["VmHWM"] - before["VmHWM"] < RSS_BOUND, (before, after)


def test_10000_pipelined_requests_on_one_connection(server: Server) -> None:
    count = 10_000
    with RawClient.connect(server.port, timeout=20) as client:
        pid = worker_of(client)
        before = memory(pid)
        batch = get("/") * 500
        pieces = iter([batch] * (count // 500 - 1) + [get("/") * 499 + get("/", close=True)])
        sender = Sender(client.sock, pieces)
        sender.start()
        statuses = [client.read_response().status for _ in range(count)]
        client.assert_closed()
        sender.finish()
        after = memory(pid)
    assert sender.error is None
    assert statuses == [200] * count
    assert after["VmHWM"] - before["VmHWM"] < RSS_BOUND, (before, after)


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_100_mib_upload_is_streamed(server: Server, framing: str) -> None:
    size = 100 * MIB
    block = b"u" * 65536
    with RawClient.connect(server.port, timeout=20) as client:
        pid = worker_of(client)
        before = memory(pid)
        if framing == "chunked":
            head = get("/upload", CHUNKED, method="POST")
            frame = b"%x\r\n%s\r\n" % (len(block), block)
            pieces = iter([head, *repeat(frame, size // len(block) * len(frame)), b"0\r\n\r\n"])
        else:
            pieces = iter([get("/upload", f"Content-Length: {size}", method="POST"),
                           *repeat(block, size)])
        sender = Sender(client.sock, pieces)
        sender.start()
        response = client.read_response()
        sender.finish()
        after = memory(pid)
    assert sender.error is None
    assert response.status == 200 and int(response.body) == size, response
    assert after["VmHWM"] - before["VmHWM"] < RSS_BOUND, (before, after)


# -- the request line ---------------------------------------------------------------------------

def request_line(length: int) -> bytes:
    """A GET whose request line (method SP target SP version, no CRLF) is ``length`` bytes."""
    target = "/" + "a" * (length - len("GET / HTTP/1.1"))
    return get(target)


def test_request_line_limit_boundary(server: Server) -> None:
    """--limit-request-line (8,190 by default) limits the whole line, as documented; before,
    only the target was counted and lines of up to 8,203 bytes were served."""
    with RawClient.connect(server.port) as client:
        client.send(request_line(8190))
        assert client.read_response().status == 200
        client.send(request_line(8191))
        assert_refused(client, 414)


# -- conformance --------------------------------------------------------------------------------

def test_options_asterisk_reaches_the_app_with_a_valid_environ(server: Server) -> None:
    """A 500 before: PATH_INFO "*" fails PEP 3333 (wsgiref's validator). Now PATH_INFO is
    empty and RAW_URI tells the app it was asterisk-form."""
    with RawClient.connect(server.port) as client:
        client.send(get("*", method="OPTIONS"))
        response = client.read_response()
    assert response.status == 200, response
    seen = json.loads(response.body)
    assert seen["REQUEST_METHOD"] == "OPTIONS"
    assert seen["PATH_INFO"] == ""
    assert seen["RAW_URI"] == "*"


REFUSED = {
    "get-asterisk": (get("*"), 400),
    "asterisk-and-a-path": (get("*/x"), 400),
    "options-double-asterisk": (get("**", method="OPTIONS"), 400),
    "options-asterisk-dot": (get("*.x", method="OPTIONS"), 400),
    "host-with-space": (b"GET / HTTP/1.1\r\nHost: a b\r\n\r\n", 400),
    "host-with-userinfo": (b"GET / HTTP/1.1\r\nHost: user@example.com\r\n\r\n", 400),
    "host-bad-port": (b"GET / HTTP/1.1\r\nHost: example.com:8o\r\n\r\n", 400),
    "host-bad-ipv6": (b"GET / HTTP/1.1\r\nHost: [12345::]\r\n\r\n", 400),
    "te-on-http-1.0": (get("/upload", CHUNKED, method="POST", version="1.0", body=b"0\r\n\r\n"), 400),
    "two-content-types": (post("/upload", b"{}", "Content-Type: text/plain",
                               "Content-Type: application/json"), 400),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_conformance_refusals(server: Server, case: str) -> None:
    data, status = REFUSED[case]
    with RawClient.connect(server.port) as client:
        client.send(data)
        assert_refused(client, status)


@pytest.mark.parametrize("field", ["Host: other", "Content-Type: text/html",
                                   "Authorization: Basic eDp5"])
def test_a_forbidden_trailer_field_is_refused(server: Server, field: str) -> None:
    """RFC 9110 §6.5.1. The head was good, so the app runs; reading the body ends in 400."""
    with RawClient.connect(server.port) as client:
        client.send(get("/upload", CHUNKED, method="POST")
                    + b"2\r\nok\r\n0\r\n" + field.encode() + b"\r\n\r\n")
        assert_refused(client, 400)


def test_ows_in_transfer_encoding_and_bws_in_chunk_extensions_are_accepted(server: Server) -> None:
    """RFC 9112 §5.1 (OWS around a field value) and §7.1.1 (BWS before ";")."""
    with RawClient.connect(server.port) as client:
        client.send(get("/upload", "Transfer-Encoding: \t chunked  ", method="POST")
                    + b"5 ;ext=1\r\nhello\r\n6\t;a;b=\"x y\"\r\n world\r\n0\r\n"
                    + b"X-Checksum: 1\r\n\r\n")
        response = client.read_response()
    assert response.status == 200, response
    assert response.body == b"11"


def test_valid_host_forms_are_served(server: Server) -> None:
    hosts = ["example.com", "127.0.0.1:8080", "[::1]:8000", "[2001:db8::1]", "a:", ""]
    with RawClient.connect(server.port) as client:
        for host in hosts:
            client.send(f"GET /environ HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            response = client.read_response()
            assert response.status == 200, (host, response)
            assert json.loads(response.body)["HTTP_HOST"] == host


# -- what the fuzzers found -------------------------------------------------------------------

@pytest.fixture(params=WORKER_CLASSES)
def basic(request: pytest.FixtureRequest, server_factory: type[Server]) -> Server:
    """tests.apps.basic (its /raise, /block and /header-control routes)."""
    return server_factory("-k", request.param).wait_ready()  # type: ignore[call-arg]


HEAD_ANSWERS = {
    "bad-host": (b"HEAD / HTTP/1.1\r\nHost: a b\r\n\r\n", 400),
    "field-too-large": (get("/", "X-Big: " + "y" * 9000, method="HEAD"), 431),
    "app-raised": (get("/raise", method="HEAD"), 500),
    "control-character-in-a-response-field": (get("/header-control", method="HEAD"), 500),
}


@pytest.mark.parametrize("case", sorted(HEAD_ANSWERS))
def test_answers_to_head_have_no_body(basic: Server, case: str) -> None:
    """RFC 9110 §9.3.2: a refusal or a 500 in answer to HEAD has the fields and no body (a
    client would read the body as its next response)."""
    data, status = HEAD_ANSWERS[case]
    with RawClient.connect(basic.port) as client:
        client.send(data)
        response = client.read_response(method="HEAD")
        assert response.status == status, response
        assert response.has_token("Connection", "close")
        client.assert_closed()


def test_a_control_character_in_a_response_field_is_a_500(basic: Server) -> None:
    """RFC 9110 §5.5: no control character but HTAB in a field value; the app's field never
    reaches the client."""
    with RawClient.connect(basic.port) as client:
        client.send(get("/header-control"))
        response = client.read_response()
    assert response.status == 500, response
    assert response.header("X-Ctl") is None


def test_a_request_pipelined_behind_a_close_is_not_reset(basic: Server, gates) -> None:  # type: ignore[no-untyped-def]
    """The first request asks to close; the second arrives while the app runs the first, so
    the server has not read it when it closes. Closing on unread bytes sends RST, which can
    cost the client the response it is reading: the server half-closes and drains instead,
    and the client reads the whole answer, then a clean end."""
    gate = gates()
    with RawClient.connect(basic.port) as client:
        client.send(get(gate.route, "Connection: close"))
        gate.wait_entered()
        client.send(get("/pid") * 4)
        gate.release()
        response = client.read_response()
        assert response.status == 200, response
        assert response.has_token("Connection", "close")
        tail = client.buf
        while True:
            data = client.sock.recv(65536)  # a ConnectionResetError here is the bug
            if not data:
                break
            tail += data
        assert tail == b"", f"bytes after the last response: {tail!r}"
