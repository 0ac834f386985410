"""HTTP/1.1 behaviour of the sync worker, seen from real clients of a real server process.

Raw sockets are used wherever the bytes matter (framing, interim responses, refusals); every
socket has a timeout and every wait ends on an event (a byte, EOF, a log line, a file's
content), never on a sleep. ``RawClient`` below is the one raw HTTP/1.1 reader, shared by
``test_keepalive.py`` and ``test_wsgi.py``.

Requests the server must refuse are sent to ``tests.apps.http:app``, which records every call
in a file: an empty record proves the request never reached the application.
"""

from __future__ import annotations

import email.utils
import hashlib
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import requests

from tests.harness import Server, wait_for

CRLF = b"\r\n"


# -- a raw HTTP/1.1 client ---------------------------------------------------------------------

class RawResponse:
    def __init__(self, status: int, reason: str, headers: list[tuple[str, str]], body: bytes,
                 raw_body: bytes, raw: bytes) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self.body = body  # de-chunked
        self.raw_body = raw_body  # as framed on the wire
        self.raw = raw  # the whole response as received

    def header(self, name: str) -> str | None:
        values = [v for n, v in self.headers if n.lower() == name.lower()]
        return ", ".join(values) if values else None

    def has_token(self, name: str, token: str) -> bool:
        value = self.header(name) or ""
        return token.lower() in (t.strip().lower() for t in value.split(","))

    def __repr__(self) -> str:
        return f"<RawResponse {self.status} {self.raw[:400]!r}>"


class RawClient:
    """One connection; reads exactly what each response's framing says (RFC 9112 §6.3)."""

    def __init__(self, sock: socket.socket, timeout: float = 5.0) -> None:
        sock.settimeout(timeout)
        self.sock = sock
        self.buf = b""
        self._raw: list[bytes] = []

    @classmethod
    def connect(cls, port: int, host: str = "127.0.0.1", timeout: float = 5.0) -> "RawClient":
        return cls(socket.create_connection((host, port), timeout=timeout), timeout)

    def __enter__(self) -> "RawClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise EOFError(f"the server closed the connection; unparsed: {self.buf!r}")
        self.buf += data

    def _take(self, size: int) -> bytes:
        while len(self.buf) < size:
            self._fill()
        data, self.buf = self.buf[:size], self.buf[size:]
        self._raw.append(data)
        return data

    def _line(self) -> bytes:
        while CRLF not in self.buf:
            self._fill()
        line, _, self.buf = self.buf.partition(CRLF)
        self._raw.append(line + CRLF)
        return line

    def read_head(self) -> RawResponse:
        """The status line and header fields of the next response; the body is left unread."""
        self._raw = []
        status_line = self._line().decode("latin-1")
        match = re.fullmatch(r"HTTP/1\.[01] (\d{3}) ?(.*)", status_line)
        assert match, f"not a status line: {status_line!r}"
        status = int(match.group(1))
        headers = []
        while True:
            line = self._line()
            if not line:
                break
            name, sep, value = line.decode("latin-1").partition(":")
            assert sep and name == name.strip(), f"bad header line {line!r}"
            headers.append((name, value.strip()))
        return RawResponse(status, match.group(2), headers, b"", b"", b"".join(self._raw))

    def read_chunk(self) -> bytes:
        """One chunk of a chunked body (b"" for the last one, whose CRLF is consumed too)."""
        size = int(self._line().split(b";")[0], 16)
        if size == 0:
            while self._line():  # trailer section, then the empty line
                pass
            return b""
        data = self._take(size)
        assert self._take(2) == CRLF, "chunk data not followed by CRLF"
        return data

    def read_response(self, method: str = "GET") -> RawResponse:
        """The next response, interim (1xx) ones included."""
        response = self.read_head()
        status = response.status
        body = raw_body = b""
        if method == "HEAD" or status < 200 or status in (204, 304):
            pass
        elif response.has_token("Transfer-Encoding", "chunked"):
            pieces, start = [], len(self._raw)
            while True:
                piece = self.read_chunk()
                if not piece:
                    break
                pieces.append(piece)
            body, raw_body = b"".join(pieces), b"".join(self._raw[start:])
        elif response.header("Content-Length") is not None:
            body = raw_body = self._take(int(response.header("Content-Length")))
        else:
            body = raw_body = self.read_to_close()
        response.body, response.raw_body, response.raw = body, raw_body, b"".join(self._raw)
        return response

    def read_final(self, method: str = "GET") -> RawResponse:
        """The next final response; interim 1xx responses before it are skipped."""
        while True:
            response = self.read_response(method)
            if response.status >= 200:
                return response

    def read_to_close(self) -> bytes:
        """Everything until the server closes. Fails if it does not within the timeout."""
        chunks = [self.buf]
        self.buf = b""
        while True:
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                break
            except socket.timeout:
                raise AssertionError(f"the server did not close; so far {b''.join(chunks)!r}") from None
            if not data:
                break
            chunks.append(data)
        data = b"".join(chunks)
        self._raw.append(data)
        return data

    def assert_closed(self) -> None:
        """The server closes the connection and sends nothing more."""
        extra = self.read_to_close()
        assert extra == b"", f"unexpected bytes after the last response: {extra!r}"


def get(path: str, *extra: str, method: str = "GET", version: str = "1.1", body: bytes = b"",
        close: bool = False) -> bytes:
    """A request's bytes. ``extra`` are header lines; Host is added on HTTP/1.1."""
    lines = [f"{method} {path} HTTP/{version}"]
    if version == "1.1":
        lines.append("Host: test")
    lines += extra
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def post(path: str, body: bytes, *extra: str, version: str = "1.1", close: bool = False) -> bytes:
    return get(path, f"Content-Length: {len(body)}", *extra, method="POST", version=version,
               body=body, close=close)


def chunked_body(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces if p) + b"0\r\n\r\n"


def post_chunked(path: str, *pieces: bytes, close: bool = False) -> bytes:
    return get(path, "Transfer-Encoding: chunked", method="POST", body=chunked_body(*pieces),
               close=close)


def start_recorded(server_factory: type[Server], tmp_path: Path, *args: str,
                   **kwargs: object) -> tuple[Server, Path]:
    """A server running tests.apps.http:app, which records each call in the returned file."""
    record = tmp_path / "app-calls.log"
    server = server_factory(*args, app="tests.apps.http:app",  # type: ignore[call-arg]
                            env={"FORKSERVE_TEST_RECORD": str(record)}, **kwargs)
    return server.wait_ready(), record


def app_calls(record: Path) -> list[str]:
    return record.read_text().splitlines() if record.exists() else []


def assert_refused(client: RawClient, status: int) -> RawResponse:
    """The server answered ``status`` itself, announced and did the close."""
    response = client.read_response()
    assert response.status == status, response
    assert response.has_token("Connection", "close"), response
    client.assert_closed()
    return response


# -- 4. Expect: 100-continue -------------------------------------------------------------------

@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_100_continue_is_sent_when_the_app_reads_the_body(server: Server, framing: str) -> None:
    if framing == "content-length":
        head = get("/echo", "Content-Length: 5", "Expect: 100-continue", method="POST")
        body = b"hello"
    else:
        head = get("/echo", "Transfer-Encoding: chunked", "Expect: 100-continue", method="POST")
        body = chunked_body(b"hel", b"lo")
    with RawClient.connect(server.port) as client:
        client.send(head)
        interim = client.read_response()
        assert interim.status == 100, interim
        assert interim.raw == b"HTTP/1.1 100 Continue\r\n\r\n"
        client.send(body)
        final = client.read_response()
        assert (final.status, final.body) == (200, b"hello")
        assert not final.has_token("Connection", "close")
        # The exchange completed normally: the connection serves the next request.
        client.send(get("/", close=True))
        assert client.read_response().body == b"hello\n"
        client.assert_closed()


@pytest.fixture
def app_decides(server_factory: type[Server]) -> Server:
    """--body-buffer 0: the app is called on the head, and decides about 100 Continue."""
    return server_factory("--body-buffer", "0").wait_ready()  # type: ignore[call-arg]


@pytest.mark.parametrize("worker_class", ["sync", "thread"])
def test_the_poller_sends_100_continue_and_gathers_the_body(server_factory: type[Server],
                                                            worker_class: str) -> None:
    """With --body-buffer (the default), the sync and thread workers gather a body before
    the app is called, an Expect: 100-continue one too: the poller answers 100 itself, as
    nginx does, so a client that then sends its body slowly holds no worker or thread."""
    server = server_factory("-k", worker_class).wait_ready()  # type: ignore[call-arg]
    with RawClient.connect(server.port) as client:
        client.send(get("/echo", "Content-Length: 5", "Expect: 100-continue", method="POST"))
        assert client.read_head().status == 100
        client.send(b"hello")
        response = client.read_response()
        assert response.status == 200, response
        assert response.body == b"hello"


def test_no_100_continue_when_the_app_never_reads_the_body(app_decides: Server) -> None:
    server = app_decides
    with RawClient.connect(server.port) as client:
        client.send(get("/ignore-body", "Content-Length: 5", "Expect: 100-continue", method="POST"))
        response = client.read_response()
        assert response.status == 200, "a 100 Continue was sent for a body nobody reads"
        assert response.body == b"ignored"
        # The body may or may not follow: the connection cannot be reused.
        client.assert_closed()


def test_final_response_without_reading_the_body_announces_the_close(app_decides: Server) -> None:
    """RFC 9110 §10.1.1: a server that answers before reading the body SHOULD say whether it
    will close; forkserve does close, so the response must carry ``Connection: close``."""
    server = app_decides
    with RawClient.connect(server.port) as client:
        client.send(get("/ignore-body", "Content-Length: 5", "Expect: 100-continue", method="POST"))
        response = client.read_response()
        assert response.status == 200
        client.assert_closed()
        assert response.has_token("Connection", "close"), response


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_expect_100_continue_upload(server: Server, tmp_path: Path) -> None:
    data = os.urandom(300_000)
    upload, out = tmp_path / "upload.bin", tmp_path / "out.bin"
    upload.write_bytes(data)
    result = subprocess.run(
        ["curl", "-sS", "-v", "--http1.1", "--max-time", "10", "-H", "Expect: 100-continue",
         "--data-binary", f"@{upload}", "-o", str(out), server.url + "/echo"],
        capture_output=True, timeout=20)
    assert result.returncode == 0, result.stderr.decode()
    assert "HTTP/1.1 100 Continue" in result.stderr.decode()
    assert out.read_bytes() == data


# -- 5. Response framing -------------------------------------------------------------------

def test_content_length_from_the_app_is_used(server: Server) -> None:
    with RawClient.connect(server.port) as client:
        client.send(get("/", close=True))
        response = client.read_response()
        assert response.header("Content-Length") == "6"
        assert response.header("Transfer-Encoding") is None
        assert response.body == b"hello\n"
        client.assert_closed()


def test_chunked_when_the_app_gives_no_length_on_http11(server: Server) -> None:
    with RawClient.connect(server.port) as client:
        client.send(get("/chunked") + get("/", close=True))
        response = client.read_response()
        assert response.header("Content-Length") is None
        assert response.header("Transfer-Encoding") == "chunked"
        assert response.raw_body == b"4\r\none \r\n4\r\ntwo \r\n5\r\nthree\r\n0\r\n\r\n"
        assert not response.has_token("Connection", "close")
        # The last chunk ends the message: the pipelined request is answered next.
        assert client.read_response().body == b"hello\n"
        client.assert_closed()


@pytest.mark.parametrize("extra", [(), ("Connection: keep-alive",)])
def test_close_delimited_on_http10(server: Server, extra: tuple[str, ...]) -> None:
    with RawClient.connect(server.port) as client:
        client.send(get("/chunked", *extra, version="1.0"))
        response = client.read_response()
        assert response.header("Transfer-Encoding") is None, "chunked sent to an HTTP/1.0 client"
        assert response.header("Content-Length") is None
        assert response.has_token("Connection", "close")
        assert response.body == b"one two three"  # read to the close


def test_write_callable(server: Server) -> None:
    response = requests.get(server.url + "/write", timeout=5)
    assert response.status_code == 200
    assert response.content == b"written and returned"


def test_head_gets_the_headers_but_no_body(server: Server) -> None:
    with RawClient.connect(server.port) as client:
        client.send(get("/", method="HEAD") + get("/chunked", method="HEAD")
                    + get("/", close=True))
        head = client.read_response("HEAD")
        assert head.status == 200
        assert head.header("Content-Length") == "6"  # what GET would say
        streamed = client.read_response("HEAD")
        assert streamed.status == 200
        assert streamed.header("Transfer-Encoding") is None
        # Had a body (or a last chunk) been sent for either HEAD, this would not parse.
        final = client.read_response()
        assert final.body == b"hello\n"
        client.assert_closed()


@pytest.mark.parametrize("code", [204, 304])
def test_no_body_statuses(server: Server, code: int) -> None:
    with RawClient.connect(server.port) as client:
        client.send(get(f"/status?code={code}") + get("/", close=True))
        response = client.read_response()
        assert response.status == code
        assert response.header("Transfer-Encoding") is None
        if code == 204:
            assert response.header("Content-Length") is None  # RFC 9110 §8.6: MUST NOT
        assert client.read_response().body == b"hello\n", "the no-body response sent a body"
        client.assert_closed()


@pytest.mark.parametrize("code", [100, 101, 103])
def test_app_1xx_status_is_not_sent_as_the_whole_response(server: Server, code: int) -> None:
    """A client treats a 1xx as interim and waits for the final response: if the server
    frames the app's 1xx as a complete response and keeps the connection, the client takes
    the answer to its *next* request for the answer to this one (response desync)."""
    with RawClient.connect(server.port) as client:
        client.send(get(f"/status?code={code}") + get("/", close=True))
        try:
            first_final = client.read_final()
        except EOFError:
            return  # the server gave up on the connection: no desync either
        assert not (first_final.status == 200 and first_final.body == b"hello\n"), (
            f"the response to GET / was delivered as the final response to the {code} request")


def test_date_and_server_headers(server: Server) -> None:
    with RawClient.connect(server.port) as client:
        client.send(get("/") + get("/chunked") + get("/raise", close=True))
        for expected in (200, 200, 500):
            response = client.read_response()
            assert response.status == expected
            assert response.header("Server") == "forkserve"
            date = email.utils.parsedate_to_datetime(response.header("Date") or "")
            assert abs(date.timestamp() - time.time()) < 60
            assert (response.header("Date") or "").endswith(" GMT")


# -- 6. wsgi.file_wrapper ------------------------------------------------------------------

@pytest.fixture
def big_file(tmp_path: Path) -> tuple[Path, bytes]:
    data = os.urandom(3 * 1024 * 1024 + 13)
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    return path, data


def test_file_wrapper_serves_a_large_file(server: Server, big_file: tuple[Path, bytes]) -> None:
    path, data = big_file
    response = requests.get(server.url + "/file", params={"path": str(path)}, timeout=10)
    assert response.status_code == 200
    assert response.headers["Content-Length"] == str(len(data))
    assert "Transfer-Encoding" not in response.headers
    assert hashlib.sha256(response.content).hexdigest() == hashlib.sha256(data).hexdigest()


def test_file_wrapper_twice_on_one_connection(server: Server, big_file: tuple[Path, bytes]) -> None:
    path, data = big_file
    with RawClient.connect(server.port) as client:
        client.send(get(f"/file?path={path}") + get(f"/file?path={path}", close=True))
        for _ in range(2):
            response = client.read_response()
            assert response.header("Content-Length") == str(len(data))
            assert response.body == data
        client.assert_closed()


def test_file_wrapper_head(server: Server, big_file: tuple[Path, bytes]) -> None:
    """HEAD: no body, and the same Content-Length GET sends (RFC 9110 §9.3.2: the server
    SHOULD send the same fields; this length is known before any byte is sent)."""
    path, data = big_file
    with RawClient.connect(server.port) as client:
        client.send(get(f"/file?path={path}", method="HEAD") + get("/", close=True))
        head = client.read_response("HEAD")
        assert head.status == 200
        assert head.header("Transfer-Encoding") is None
        # No file bytes were sent: the next response follows the head at once.
        assert client.read_response().body == b"hello\n"
        client.assert_closed()
        assert head.header("Content-Length") == str(len(data)), head


# -- 7. Limits -----------------------------------------------------------------------------

LIMIT_ARGS = ("--limit-request-line", "200", "--limit-request-fields", "10",
              "--limit-request-field-size", "200", "--limit-request-body", "100")


@pytest.fixture
def limited(server_factory: type[Server], tmp_path: Path) -> tuple[Server, Path]:
    return start_recorded(server_factory, tmp_path, *LIMIT_ARGS)


LIMIT_CASES = {
    "line": (get("/" + "a" * 300), 414),
    "fields": (get("/", *[f"X-Field-{i}: y" for i in range(10)]), 431),  # with Host: 11
    "field-size": (get("/", "X-Big: " + "y" * 300), 431),
    "body-content-length": (post("/echo", b"z" * 101), 413),
    "body-chunked": (post_chunked("/echo", b"z" * 60, b"z" * 41), 413),
}


@pytest.mark.parametrize("case", sorted(LIMIT_CASES))
def test_limits_are_refused_before_the_app(limited: tuple[Server, Path], case: str) -> None:
    server, record = limited
    data, status = LIMIT_CASES[case]
    with RawClient.connect(server.port) as client:
        client.send(data)
        assert_refused(client, status)
    assert app_calls(record) == []


def test_requests_at_the_limits_are_served(limited: tuple[Server, Path]) -> None:
    """The control for the test above: the same server serves requests just within limits."""
    server, record = limited
    with RawClient.connect(server.port) as client:
        client.send(get("/" + "a" * 150) + get("/", *[f"X-Field-{i}: y" for i in range(9)])
                    + get("/", "X-Big: " + "y" * 150) + post("/echo", b"z" * 100)
                    + post_chunked("/echo", b"z" * 60, b"z" * 40, close=True))
        statuses = [client.read_response().status for _ in range(5)]
        client.assert_closed()
    assert statuses == [404, 200, 200, 200, 200]
    assert app_calls(record) == ["GET /" + "a" * 150, "GET /", "GET /", "POST /echo", "POST /echo"]


def test_chunked_body_over_the_limit_before_the_app_is_called(limited: tuple[Server, Path]) -> None:
    """A chunked body cannot be judged from its head, but one that outgrows the limit within
    --body-buffer is refused before the app is ever called."""
    server, record = limited
    with RawClient.connect(server.port) as client:
        client.send(get("/echo", "Transfer-Encoding: chunked", method="POST"))
        client.send(chunked_body(b"z" * 101))
        assert_refused(client, 413)
    assert app_calls(record) == []


def test_chunked_body_over_the_limit_while_the_app_reads_it(server_factory: type[Server],
                                                            tmp_path: Path) -> None:
    """With --body-buffer 0 the app is called on the head alone: then wsgi.input raises and
    the client gets 413 (no response had started)."""
    server, record = start_recorded(server_factory, tmp_path, *LIMIT_ARGS, "--body-buffer", "0")
    with RawClient.connect(server.port) as client:
        client.send(get("/echo", "Transfer-Encoding: chunked", method="POST"))
        wait_for(lambda: app_calls(record) == ["POST /echo"], 5, "the app to be called")
        client.send(chunked_body(b"z" * 101))
        assert_refused(client, 413)


def test_slow_head_gets_408_after_header_timeout(server_factory: type[Server]) -> None:
    server = server_factory("--header-timeout", "1").wait_ready()
    with RawClient.connect(server.port, timeout=5) as client:
        started = time.monotonic()
        client.send(b"GET / HTTP/1.1\r\nHost: te")
        try:
            response = client.read_response()
        except EOFError:
            response = None
        elapsed = time.monotonic() - started
    if response is not None:
        assert response.status == 408
        assert response.has_token("Connection", "close")
    assert 0.7 <= elapsed < 3.0, f"answered after {elapsed:.2f}s with --header-timeout 1"


def test_trickled_head_does_not_extend_header_timeout(server_factory: type[Server]) -> None:
    """Slowloris: a byte every 0.2 s must not keep a worker beyond --header-timeout."""
    server = server_factory("--header-timeout", "1").wait_ready()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    with sock:
        sock.sendall(b"GET / HTTP/1.1\r\n")
        started = time.monotonic()
        sock.settimeout(0.2)  # pacing: wait up to 0.2 s for an answer, else one more byte
        answer = b""
        while time.monotonic() - started < 5:
            try:
                answer = sock.recv(65536)
                break
            except socket.timeout:
                try:
                    sock.sendall(b"X")
                except (BrokenPipeError, ConnectionResetError):
                    break  # closed by the server
            except ConnectionResetError:
                break  # closed by the server while more bytes were on their way
        elapsed = time.monotonic() - started
    assert elapsed < 2.5, f"the head took {elapsed:.2f}s, past --header-timeout 1"
    assert answer == b"" or answer.startswith(b"HTTP/1.1 408 "), answer


# -- 8. Malformed requests -----------------------------------------------------------------

MALFORMED = {
    "tls-client-hello": (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 32 + b"\r\n\r\n", 400),
    "binary-garbage": (b"\x00\x01\x02\x03garbage\r\n\r\n", 400),
    "cl-and-te": (get("/echo", "Content-Length: 3", "Transfer-Encoding: chunked", method="POST",
                      body=b"3\r\nabc\r\n0\r\n\r\n"), 400),
    "two-content-lengths": (get("/echo", "Content-Length: 3", "Content-Length: 4", method="POST",
                                body=b"abcd"), 400),
    "bad-content-length": (get("/echo", "Content-Length: +3", method="POST", body=b"abc"), 400),
    "te-gzip": (get("/echo", "Transfer-Encoding: gzip", method="POST", body=b"abc"), 501),
    "te-gzip-chunked": (get("/echo", "Transfer-Encoding: gzip, chunked", method="POST",
                            body=b"0\r\n\r\n"), 501),
    "no-host": (b"GET / HTTP/1.1\r\n\r\n", 400),
    "two-hosts": (get("/", "Host: other"), 400),
    "http-2.0": (b"GET / HTTP/2.0\r\nHost: test\r\n\r\n", 505),
    "header-without-colon": (get("/", "Bad Header"), 400),
    "obs-fold": (get("/", "X-A: a", " b"), 400),
    "bare-lf": (b"GET / HTTP/1.1\nHost: test\n\n", 400),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_requests_never_reach_the_app(server_factory: type[Server], tmp_path: Path,
                                               case: str) -> None:
    server, record = start_recorded(server_factory, tmp_path, workers=1)
    data, status = MALFORMED[case]
    with RawClient.connect(server.port) as client:
        client.send(data)
        assert_refused(client, status)
    assert app_calls(record) == []
    # The control: the same server does call the app for a valid request.
    assert requests.get(server.url + "/", timeout=5).status_code == 200
    assert app_calls(record) == ["GET /"]


def test_malformed_request_after_a_good_one_on_the_same_connection(
        server_factory: type[Server], tmp_path: Path) -> None:
    server, record = start_recorded(server_factory, tmp_path)
    with RawClient.connect(server.port) as client:
        client.send(get("/") + get("/echo", "Content-Length: 3", "Content-Length: 4",
                                   method="POST", body=b"abcd"))
        assert client.read_response().body == b"hello\n"
        assert_refused(client, 400)
    assert app_calls(record) == ["GET /"]


# -- 12. Access log ------------------------------------------------------------------------

ACCESS_LINE = re.compile(
    r'(?P<remote>\S+) - - \[\d{2}/\w{3}/\d{4}:\d{2}:\d{2}:\d{2} \+0000\] '
    r'"(?P<method>\S+) (?P<target>\S+) (?P<protocol>HTTP/1\.[01])" (?P<status>\d{3}) '
    r'(?P<size>\d+|-) "(?P<referer>[^"]*)" "(?P<agent>[^"]*)" (?P<duration>\d+\.\d+) (?P<request_id>\S+)')


def test_access_log_combined_format(server_factory: type[Server], tmp_path: Path) -> None:
    log = tmp_path / "access.log"
    server = server_factory("--access-log", str(log)).wait_ready()
    with requests.Session() as session:
        session.headers["User-Agent"] = "forkserve-tests/1.0"
        assert session.get(server.url + "/?q=1", headers={"Referer": "http://ref.example/"},
                           timeout=5).status_code == 200
        assert session.post(server.url + "/echo", data=b"x" * 1234, timeout=5).status_code == 200
        assert session.get(server.url + "/missing", timeout=5).status_code == 404
        assert session.head(server.url + "/", timeout=5).status_code == 200

    def lines() -> list[str]:
        return log.read_text().splitlines() if log.exists() else []
    wait_for(lambda: len(lines()) >= 4, 5, f"4 access-log lines in {log}")
    entries = [ACCESS_LINE.fullmatch(line) for line in lines()]
    assert all(entries), lines()
    got = [(m["method"], m["target"], m["protocol"], m["status"], m["size"]) for m in entries]
    assert got == [("GET", "/?q=1", "HTTP/1.1", "200", "6"),
                   ("POST", "/echo", "HTTP/1.1", "200", "1234"),
                   ("GET", "/missing", "HTTP/1.1", "404", "10"),
                   ("HEAD", "/", "HTTP/1.1", "200", "-")]
    assert {m["remote"] for m in entries} == {"127.0.0.1"}
    assert {m["agent"] for m in entries} == {"forkserve-tests/1.0"}
    assert [m["referer"] for m in entries] == ["http://ref.example/", "-", "-", "-"]
    assert all(0 <= float(m["duration"]) < 5 for m in entries)


# -- 13. Other listeners ---------------------------------------------------------------------

def test_unix_socket_bind(server_factory: type[Server], tmp_path: Path) -> None:
    path = tmp_path / "fs.sock"
    if len(str(path)) > 100:
        pytest.skip(f"{path} is too long for a unix socket address")
    server = server_factory("-b", f"unix:{path}", bind=None).wait_ready()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(str(path))
    with RawClient(sock) as client:
        client.send(get("/") + get("/echo", "Content-Length: 4", method="POST", body=b"unix")
                    + get("/", close=True))
        assert client.read_response().body == b"hello\n"
        assert client.read_response().body == b"unix"
        assert client.read_response().body == b"hello\n"
        client.assert_closed()
    assert "unix:" in server.wait_log("Starting forkserve")["listening"]


def _ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="cannot bind ::1 on this machine")
def test_ipv6_bind(server_factory: type[Server]) -> None:
    server = server_factory(bind="[::1]:0").wait_ready()
    with RawClient.connect(server.port, host="::1") as client:
        client.send(get("/environ", close=True))
        response = client.read_response()
        assert response.status == 200
        assert b'"REMOTE_ADDR": "::1"' in response.body
        client.assert_closed()
