"""PEP 3333 in the sync worker: request bodies through wsgi.input, the environ, misbehaving
applications, and wsgiref's validator, against a real server process."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import requests

from tests.harness import Server, wait_for
from tests.integration.test_http import (RawClient, app_calls, chunked_body, get, post,
                                         post_chunked, start_recorded)


@pytest.fixture
def recorded(server_factory: type[Server], tmp_path: Path) -> tuple[Server, Path]:
    return start_recorded(server_factory, tmp_path)


# -- 3. Request bodies ---------------------------------------------------------------------

def test_content_length_body_reaches_the_app(server: Server) -> None:
    data = os.urandom(1024 * 1024 + 3)
    response = requests.post(server.url + "/echo", data=data, timeout=10)
    assert response.status_code == 200
    assert response.content == data


def test_chunked_body_reaches_the_app(server: Server) -> None:
    pieces = [b"a", os.urandom(100_000), b"", b"tail"]
    with RawClient.connect(server.port) as client:
        client.send(post_chunked("/echo", *pieces) + get("/", close=True))
        assert client.read_response().body == b"".join(pieces)
        assert client.read_response().body == b"hello\n"
        client.assert_closed()


def test_requests_generator_body_is_sent_chunked(server: Server) -> None:
    response = requests.post(server.url + "/echo", data=iter([b"gen", b"er", b"ated"]), timeout=5)
    assert response.content == b"generated"


def test_body_lines_across_chunk_boundaries(server: Server) -> None:
    with RawClient.connect(server.port) as client:
        client.send(post_chunked("/echo-lines", b"a\nb", b"b\ncc", b"c\n", b"no newline", close=True))
        response = client.read_response()
        assert json.loads(response.body) == ["a\n", "bb\n", "ccc\n", "no newline"]


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
@pytest.mark.parametrize("worker_class", ["sync", "thread", "gevent"])
def test_body_is_streamed_to_the_app(server_factory: type[Server], tmp_path: Path,
                                     framing: str, worker_class: str) -> None:
    """The app echoes each line as it reads it: the client sends the second line only after
    it has the echo of the first, so a server that buffered the whole body first would hang
    here (and the read would time out). The sync and thread workers do buffer a small body
    by default (--body-buffer): an app that needs this runs with --body-buffer 0."""
    args = ("-k", worker_class) + (("--body-buffer", "0") if worker_class != "gevent" else ())
    server, _ = start_recorded(server_factory, tmp_path, *args)
    first, second = b"line one\n", b"line two\n"
    with RawClient.connect(server.port, timeout=5) as client:
        if framing == "content-length":
            client.send(get("/echo-stream", f"Content-Length: {len(first + second)}",
                            method="POST") + first)
        else:
            client.send(get("/echo-stream", "Transfer-Encoding: chunked", method="POST")
                        + b"%x\r\n%s\r\n" % (len(first), first))
        head = client.read_head()
        assert head.status == 200
        assert head.header("Transfer-Encoding") == "chunked"
        assert client.read_chunk() == first
        client.send(second if framing == "content-length" else chunked_body(second))
        assert client.read_chunk() == second
        assert client.read_chunk() == b""


@pytest.mark.parametrize("kind", ["content-length", "chunked", "no-body"])
def test_reading_past_the_end_returns_empty(server_factory: type[Server], tmp_path: Path,
                                            kind: str) -> None:
    server, record = start_recorded(server_factory, tmp_path)
    if kind == "content-length":
        request = post("/read-past-end", b"abc")
    elif kind == "chunked":
        request = post_chunked("/read-past-end", b"a", b"bc")
    else:
        request = get("/read-past-end")
    with RawClient.connect(server.port) as client:
        # The next request is already there: reading past the end must not take its bytes.
        client.send(request + get("/", close=True))
        result = json.loads(client.read_response().body)
        assert result == {"body": "" if kind == "no-body" else "abc",
                          "after": {"read()": "", "read(5)": "", "readline()": "", "readlines()": []}}
        assert client.read_response().body == b"hello\n"
        client.assert_closed()
    assert app_calls(record) == [f"{'GET' if kind == 'no-body' else 'POST'} /read-past-end", "GET /"]


SMUGGLED = get("/smuggled")  # a whole request, sent as a body: it must never be parsed as one

UNREAD_BODY_CASES = {
    "read-some-content-length": (post("/read-some?n=2", SMUGGLED), b"GE"),
    "read-some-chunked": (post_chunked("/read-some?n=2", SMUGGLED[:10], SMUGGLED[10:]), b"GE"),
    "ignore-body-content-length": (post("/ignore-body", SMUGGLED), b"ignored"),
    "ignore-body-chunked": (post_chunked("/ignore-body", SMUGGLED[:10], SMUGGLED[10:]), b"ignored"),
}


@pytest.mark.parametrize("case", sorted(UNREAD_BODY_CASES))
def test_unread_body_is_discarded_before_the_next_request(recorded: tuple[Server, Path],
                                                          case: str) -> None:
    server, record = recorded
    request, expected = UNREAD_BODY_CASES[case]
    path = request.split(b" ")[1].split(b"?")[0].decode()
    with RawClient.connect(server.port) as client:
        client.send(request + get("/", "X-Next: yes") + get("/pid", close=True))
        first = client.read_response()
        assert first.body == expected
        assert not first.has_token("Connection", "close")  # a small rest is read and dropped
        assert client.read_response().body == b"hello\n"
        assert client.read_response().body.isdigit()
        client.assert_closed()
    assert app_calls(record) == [f"POST {path}", "GET /", "GET /pid"]


@pytest.mark.parametrize("worker_class", ["sync", "thread", "gevent"])
def test_unread_body_still_arriving_after_the_response(server_factory: type[Server],
                                                       tmp_path: Path, worker_class: str) -> None:
    """The app answers without reading a body it got part of (--body-buffer 0: called on
    the head); the rest, sent after the answer, is read and dropped, never parsed."""
    server, record = start_recorded(server_factory, tmp_path, "-k", worker_class,
                                    "--body-buffer", "0")
    body = b"x" * 1000 + SMUGGLED
    sent = 100
    with RawClient.connect(server.port) as client:
        client.send(post("/ignore-body", body)[:-len(body) + sent])
        assert client.read_response().body == b"ignored"
        client.send(body[sent:] + get("/pid", close=True))
        assert client.read_response().body.isdigit()
        client.assert_closed()
    assert app_calls(record) == ["POST /ignore-body", "GET /pid"]


def test_environ(server: Server) -> None:
    response = requests.get(server.url + "/environ", params={"q": "1 2"},
                            headers={"X-Custom": "v", "X-Under_score": "dropped",
                                     "Content-Type": "text/x-test"}, timeout=5)
    environ = response.json()
    assert environ["wsgi.input_terminated"] is True
    assert environ["wsgi.version"] == [1, 0]
    assert environ["wsgi.url_scheme"] == "http"
    assert environ["wsgi.multiprocess"] is True
    assert environ["REQUEST_METHOD"] == "GET"
    assert environ["PATH_INFO"] == "/environ"
    assert environ["QUERY_STRING"] == "q=1+2"
    assert environ["SERVER_PROTOCOL"] == "HTTP/1.1"
    assert environ["SERVER_PORT"] == str(server.port)
    assert environ["REMOTE_ADDR"] == "127.0.0.1"
    assert environ["HTTP_X_CUSTOM"] == "v"
    assert environ["CONTENT_TYPE"] == "text/x-test"
    assert "HTTP_CONTENT_TYPE" not in environ
    assert not any("UNDER" in key for key in environ), "a header with _ reached the environ"


def test_path_info_is_percent_decoded(recorded: tuple[Server, Path]) -> None:
    server, record = recorded
    with RawClient.connect(server.port) as client:
        client.send(get("/a%20b/%C3%A9", close=True))
        assert client.read_response().status == 404
    # PATH_INFO holds the decoded bytes as latin-1 (PEP 3333); the record re-encodes them.
    assert app_calls(record) == ["GET /a b/\u00e9"]


# -- 9. Misbehaving applications -----------------------------------------------------------

@pytest.fixture
def one_worker(server_factory: type[Server]) -> Server:
    """One worker, so /pid before and after tells whether it survived."""
    return server_factory(workers=1).wait_ready()  # type: ignore[call-arg]


def worker_pid(server: Server) -> bytes:
    # Connection: close, so that the worker is not left holding an idle connection.
    with RawClient.connect(server.port) as client:
        client.send(get("/pid", close=True))
        return client.read_response().body


def traceback_of(server: Server, target: str) -> str:
    record = server.wait_log(f"Error handling request GET {target}", timeout=5)
    assert record["level"] == "ERROR"
    return str(record.get("traceback", ""))


@pytest.mark.parametrize("route, error", [
    ("/raise", "RuntimeError: the app failed on purpose"),
    ("/no-start-response", "did not call start_response"),
    ("/return-str", "not bytes"),
    ("/header-injection", "invalid header value"),
    ("/bad-header-name", "invalid header name"),
])
def test_app_error_before_the_response_gives_500(one_worker: Server, route: str, error: str) -> None:
    pid, workers = worker_pid(one_worker), one_worker.workers()
    with RawClient.connect(one_worker.port) as client:
        # The pipelined request must not be answered: after a 500 the connection closes.
        client.send(get(route) + get("/pid"))
        response = client.read_response()
        assert response.status == 500, response
        assert response.has_token("Connection", "close")
        client.assert_closed()
    assert b"pwned" not in response.raw and b"X-Evil" not in response.raw
    assert b"never started" not in response.raw and b"a str" not in response.raw
    assert error in traceback_of(one_worker, route)
    assert worker_pid(one_worker) == pid
    assert one_worker.workers() == workers


def test_app_error_after_headers_truncates_and_closes(one_worker: Server) -> None:
    pid = worker_pid(one_worker)
    with RawClient.connect(one_worker.port) as client:
        client.send(get("/raise-after-headers") + get("/pid"))
        head = client.read_head()
        assert head.status == 200
        assert head.header("Transfer-Encoding") == "chunked"
        assert client.read_chunk() == b"partial"
        # No last chunk and never a second response: the client sees the truncation.
        client.assert_closed()
    assert "failed mid-body" in traceback_of(one_worker, "/raise-after-headers")
    assert worker_pid(one_worker) == pid


def test_app_body_longer_than_its_content_length(one_worker: Server) -> None:
    pid = worker_pid(one_worker)
    with RawClient.connect(one_worker.port) as client:
        client.send(get("/too-long") + get("/pid"))
        response = client.read_response()
        assert response.header("Content-Length") == "5"
        assert response.body == b"01234"
        # The extra bytes are neither sent nor followed by another response.
        client.assert_closed()
    assert worker_pid(one_worker) == pid


def test_app_body_shorter_than_its_content_length(one_worker: Server) -> None:
    pid = worker_pid(one_worker)
    with RawClient.connect(one_worker.port) as client:
        client.send(get("/too-short") + get("/pid"))
        head = client.read_head()
        assert head.header("Content-Length") == "10"
        assert client.read_to_close() == b"01234"
    assert worker_pid(one_worker) == pid


@pytest.mark.parametrize("route", ["/too-long", "/too-short"])
def test_content_length_mismatch_is_logged(one_worker: Server, route: str) -> None:
    """A truncated response is an application bug the operator must be able to see."""
    with RawClient.connect(one_worker.port) as client:
        client.send(get(route))
        client.read_to_close()

    def logged() -> bool:
        return any(record.get("level") in ("ERROR", "WARNING") and route in json.dumps(record)
                   for record in one_worker.records())
    wait_for(logged, 3, lambda: f"an error record about {route}\n{one_worker.log_text()}")


# -- 10. PEP 3333 validation (wsgiref.validate) --------------------------------------------

def test_wsgiref_validator_finds_nothing(server_factory: type[Server]) -> None:
    """``tests.apps.basic:validated`` wraps the app in wsgiref's validator, which raises
    AssertionError on any violation by the server, and warns on some; PYTHONWARNINGS=error
    makes those warnings errors too. Any of them would reach the error log as a traceback."""
    server = server_factory(app="tests.apps.basic:validated",  # type: ignore[call-arg]
                            env={"PYTHONWARNINGS": "error"}).wait_ready()
    url = server.url
    with requests.Session() as session:
        get_ = session.get(url + "/", timeout=5)
        assert (get_.status_code, get_.content) == (200, b"ok")
        echo = session.post(url + "/echo", data=b"validated body", timeout=5)
        assert (echo.status_code, echo.content) == (200, b"validated body")
        stream = session.get(url + "/stream", timeout=5)
        assert (stream.status_code, stream.content) == (200, b"abc")
        lines = session.post(url + "/lines", data=b"one\ntwo\nthree\n", timeout=5)
        assert (lines.status_code, lines.content) == (200, b"one\ntwo\n")
        head = session.head(url + "/", timeout=5)
        assert (head.status_code, head.content) == (200, b"")
        head_stream = session.head(url + "/stream", timeout=5)
        assert (head_stream.status_code, head_stream.content) == (200, b"")
    with RawClient.connect(server.port) as client:
        client.send(get("/", version="1.0"))
        assert client.read_response().body == b"ok"  # close-delimited
        client.assert_closed()
    with RawClient.connect(server.port) as client:
        client.send(post_chunked("/lines", b"x\ny", b"\nz\n", close=True))
        assert client.read_response().body == b"x\ny\n"
    # The app writes one line to wsgi.errors for each request to "/": three of them.
    wait_for(lambda: server.log_text().count("validated request") == 3, 5,
             lambda: f"three wsgi.errors lines\n{server.log_text()}")
    bad = [r for r in server.records() if r.get("level") in ("ERROR", "CRITICAL", "WARNING")]
    assert bad == []
    text = server.log_text()
    assert "Traceback" not in text and "Warning" not in text and "Error" not in text, text
