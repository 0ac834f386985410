"""forkserve.wsgi.Exchange over a fake transport: the bytes each kind of response puts on the
wire (Content-Length, chunked, close-delimited, none), when the connection closes after it, and
what a body longer or shorter than its Content-Length does. Fork-free, no sockets."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest

from forkserve.http import Request
from forkserve.wsgi import AppError, CheckedHeads, Exchange, FileWrapper

TAIL = b"Date: D\r\nServer: forkserve\r\n\r\n"


class FakeTransport:
    def __init__(self, close: bool = False) -> None:
        self.continue_sent = False
        self.sent: list[bytes] = []
        self.files: list[tuple[int, int, int]] = []
        self.close = close
        self.close_next: list[bool] = []

    def send(self, data: bytes) -> None:
        self.sent.append(data)

    def send_last(self, data: bytes, close_next: bool = False) -> None:
        self.sent.append(data)  # (a worker may write the rest of a whole response itself)
        self.close_next.append(close_next)

    def sendfile(self, fileno: int, offset: int, count: int) -> int:
        self.files.append((fileno, offset, count))
        return count

    def read_body(self) -> bytes:
        return b""

    def should_close(self) -> bool:
        return self.close


class Dates:
    def get(self) -> bytes:
        return b"D"


def exchange(method: str = "GET", version: str = "1.1", keep_alive: bool = True,
             should_close: bool = False, content_length: int | None = None,
             expect_continue: bool = False) -> tuple[Exchange, FakeTransport]:
    request = Request(method, b"/", version, [], keep_alive, content_length, False, expect_continue)
    transport = FakeTransport(should_close)
    return Exchange(transport, request, Dates(), CheckedHeads()), transport  # type: ignore[arg-type]


def start(ex: Exchange, status: str = "200 OK", length: int | None = None,
          *headers: tuple[str, str]) -> None:
    fields = [("Content-Type", "text/plain"), *headers]
    if length is not None:
        fields.append(("Content-Length", str(length)))
    ex.start_response(status, fields)


HEAD_200 = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"


def test_whole_body_with_the_apps_length_is_one_send() -> None:
    ex, t = exchange()
    start(ex, length=5)
    ex.send_whole(b"hello")
    assert t.sent == [HEAD_200 + b"Content-Length: 5\r\n" + TAIL + b"hello"]
    assert (ex.close, ex.sent, ex.framing_broken, ex.finished) == (False, 5, False, True)


def test_whole_body_gets_its_length() -> None:
    ex, t = exchange()
    start(ex)
    ex.send_whole(b"hi")
    assert t.sent == [HEAD_200 + b"Content-Length: 2\r\n" + TAIL + b"hi"]


def test_a_stream_without_a_length_is_chunked_on_1_1() -> None:
    ex, t = exchange()
    start(ex)
    for piece in (b"", b"ab", b"", b"cde"):
        ex.write(piece)
    ex.finish()
    assert t.sent == [HEAD_200 + b"Transfer-Encoding: chunked\r\n" + TAIL + b"2\r\nab\r\n",
                      b"3\r\ncde\r\n", b"0\r\n\r\n"]
    assert (ex.close, ex.sent, ex.framing_broken) == (False, 5, False)


def test_a_stream_without_a_length_is_close_delimited_on_1_0() -> None:
    ex, t = exchange(version="1.0")
    start(ex)
    ex.write(b"ab")
    ex.write(b"cd")
    ex.finish()
    assert t.sent == [HEAD_200 + b"Connection: close\r\n" + TAIL + b"ab", b"cd"]
    assert (ex.close, ex.sent) == (True, 4)


def test_1_0_keep_alive_says_so() -> None:
    ex, t = exchange(version="1.0")
    start(ex, length=2)
    ex.send_whole(b"ok")
    assert t.sent == [HEAD_200 + b"Content-Length: 2\r\nConnection: keep-alive\r\n" + TAIL + b"ok"]
    assert not ex.close


@pytest.mark.parametrize(("kwargs", "headers"), [
    ({"keep_alive": False}, ()),
    ({"should_close": True}, ()),
    ({}, (("Connection", "close"),)),
    ({"content_length": 3, "expect_continue": True}, ()),  # the body was never asked for
])
def test_connection_close(kwargs: dict[str, Any], headers: tuple[tuple[str, str], ...]) -> None:
    ex, t = exchange(**kwargs)
    start(ex, "200 OK", None, *headers)
    ex.send_whole(b"x")
    assert t.sent == [HEAD_200 + b"Content-Length: 1\r\nConnection: close\r\n" + TAIL + b"x"]
    assert ex.close


def test_a_stream_longer_than_its_length_is_cut_and_closes() -> None:
    ex, t = exchange()
    start(ex, length=3)
    ex.write(b"ab")
    ex.write(b"cdef")
    ex.write(b"gh")
    assert ex.framing_broken
    ex.finish()
    # The head went before the app wrote too much: it does not say close; the close does.
    assert t.sent == [HEAD_200 + b"Content-Length: 3\r\n" + TAIL + b"ab", b"c"]
    assert (ex.close, ex.sent, ex.framing_broken, ex.content_length) == (True, 3, True, 3)


def test_a_whole_body_longer_than_its_length_is_cut_and_closes() -> None:
    ex, t = exchange()
    start(ex, length=3)
    ex.send_whole(b"abcdef")
    assert t.sent == [HEAD_200 + b"Content-Length: 3\r\n" + TAIL + b"abc"]
    assert (ex.close, ex.sent, ex.framing_broken) == (True, 3, True)


def test_a_body_shorter_than_its_length_closes() -> None:
    ex, t = exchange()
    start(ex, length=10)
    ex.write(b"abc")
    assert not ex.framing_broken
    ex.finish()
    assert t.sent == [HEAD_200 + b"Content-Length: 10\r\n" + TAIL + b"abc"]
    assert (ex.close, ex.sent, ex.framing_broken) == (True, 3, True)


def test_an_empty_body_with_a_length_closes() -> None:
    ex, t = exchange()
    start(ex, length=5)
    ex.finish()
    assert t.sent == [HEAD_200 + b"Content-Length: 5\r\n" + TAIL]
    assert (ex.close, ex.sent, ex.framing_broken) == (True, 0, True)


def test_an_empty_body_without_a_length() -> None:
    ex, t = exchange()
    start(ex)
    ex.finish()
    assert t.sent == [HEAD_200 + b"Content-Length: 0\r\n" + TAIL]
    assert (ex.close, ex.framing_broken) == (False, False)


@pytest.mark.parametrize(("length", "field"), [(None, b""), (5, b"Content-Length: 5\r\n")])
def test_head_sends_no_body(length: int | None, field: bytes) -> None:
    ex, t = exchange("HEAD")
    start(ex, length=length)
    ex.send_whole(b"hello")
    assert t.sent == [HEAD_200 + field + TAIL]
    assert (ex.close, ex.sent, ex.framing_broken) == (False, 0, False)


def test_head_of_a_stream_sends_the_head_only() -> None:
    ex, t = exchange("HEAD")
    start(ex)
    ex.write(b"hello")
    ex.write(b"more")
    ex.finish()
    assert t.sent == [HEAD_200 + TAIL]
    assert (ex.close, ex.sent) == (False, 0)


@pytest.mark.parametrize("status", ["204 No Content", "304 Not Modified"])
def test_204_and_304_carry_no_body_and_no_length(status: str) -> None:
    ex, t = exchange()
    start(ex, status, 5)
    ex.send_whole(b"hello")
    assert t.sent == [b"HTTP/1.1 " + status.encode() + b"\r\nContent-Type: text/plain\r\n" + TAIL]
    assert (ex.close, ex.sent, ex.framing_broken) == (False, 0, False)


def test_finish_without_start_response() -> None:
    ex, t = exchange()
    with pytest.raises(AppError):
        ex.finish()
    assert t.sent == []


def test_write_after_the_head_then_send_whole() -> None:
    ex, t = exchange()
    start(ex)
    ex.write(b"ab")
    ex.send_whole(b"cd")
    assert t.sent == [HEAD_200 + b"Transfer-Encoding: chunked\r\n" + TAIL + b"2\r\nab\r\n",
                      b"2\r\ncd\r\n", b"0\r\n\r\n"]


@pytest.mark.parametrize(("method", "length", "field", "sendfile"), [
    ("GET", None, b"Content-Length: 6\r\n", True),
    ("GET", 4, b"Content-Length: 4\r\n", True),
    ("HEAD", None, b"Content-Length: 6\r\n", False),  # a file's length is exact: HEAD says it
])
def test_send_file(method: str, length: int | None, field: bytes, sendfile: bool) -> None:
    ex, t = exchange(method)
    start(ex, length=length)
    with tempfile.TemporaryFile() as f:
        f.write(b"abcdef")
        f.seek(0)
        assert ex.send_file(FileWrapper(f))
        size = 6 if length is None else length
        assert t.sent == [HEAD_200 + field + TAIL]
        assert t.files == ([(f.fileno(), 0, size)] if sendfile else [])
        assert ex.sent == (size if sendfile else 0)
        assert f.tell() == (size if sendfile else 0)
    assert not ex.close


# -- the worker's CheckedHeads: start_response checks a status and headers list once -----------

def shared_exchange(heads: CheckedHeads, method: str = "GET") -> tuple[Exchange, FakeTransport]:
    request = Request(method, b"/", "1.1", [], True, None, False, False)
    transport = FakeTransport(False)
    return Exchange(transport, request, Dates(), heads), transport  # type: ignore[arg-type]


def test_the_same_headers_again_are_one_lookup_with_the_same_response() -> None:
    heads = CheckedHeads()
    sent = []
    for _ in range(3):
        ex, t = shared_exchange(heads)
        # New list, tuples and strings each time, as an app builds them: equal by value.
        ex.start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(2))])
        ex.send_whole(b"ok")
        sent.append(t.sent)
        assert (ex.status_code, ex.content_length, ex.close) == (200, 2, False)
    assert len(heads) == 1
    assert sent[0] == sent[1] == sent[2] == [HEAD_200 + b"Content-Length: 2\r\n" + TAIL + b"ok"]


@pytest.mark.parametrize(("status", "headers", "error"), [
    ("200 OK", [("X-Bad", "a\r\nInjected: 1")], ValueError),
    ("200 OK", [("Bad Name", "x")], ValueError),
    ("200 OK", [["Content-Type", "text/plain"]], TypeError),  # a list: unhashable, still checked
    ("200 OK", [("Content-Type",)], TypeError),
    ("200 OK", [("Content-Type", b"text/plain")], TypeError),
    ("200 OK", [("Content-Length", "x")], ValueError),
    ("2000 OK", [], ValueError),
    ("103 Early Hints", [], AppError),
    (b"200 OK", [], TypeError),
])
def test_what_fails_the_check_is_never_kept(status: Any, headers: Any, error: type) -> None:
    heads = CheckedHeads()
    for _ in range(2):  # the second time too: nothing was kept that could let it through
        ex, t = shared_exchange(heads)
        with pytest.raises(error):
            ex.start_response(status, headers)
        assert ex.status is None
    assert len(heads) == 0


def test_a_kept_check_keeps_what_it_found() -> None:
    """Hop-by-hop fields dropped, an app's close and an event stream: the same on a hit."""
    heads = CheckedHeads()
    fields = [("Content-Type", "text/event-stream"), ("Connection", "close"),
              ("Transfer-Encoding", "chunked")]
    for _ in range(2):
        ex, t = shared_exchange(heads)
        ex.start_response("200 OK", list(fields))
        ex.write(b"data: 1\n\n")
        assert (ex.event_stream, ex.close, ex.headers) == (
            True, True, (("Content-Type", "text/event-stream"),))
        # (the server's own framing: the app's Transfer-Encoding is not passed on)
        assert t.sent == [b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                          b"Transfer-Encoding: chunked\r\nConnection: close\r\n" + TAIL
                          + b"9\r\ndata: 1\n\n\r\n"]
    assert len(heads) == 1


def test_heads_differing_in_any_value_are_checked_apart() -> None:
    heads = CheckedHeads()
    for status, value in [("200 OK", "a"), ("200 OK", "b"), ("404 Not Found", "a")]:
        ex, t = shared_exchange(heads)
        ex.start_response(status, [("X-V", value)])
        ex.send_whole(b"")
        assert t.sent[0].startswith(f"HTTP/1.1 {status}\r\nX-V: {value}\r\n".encode())
    assert len(heads) == 3


def test_checked_heads_are_bounded() -> None:
    """An app whose headers differ every time (an ETag) refills it, never grows it."""
    heads = CheckedHeads()
    for n in range(CheckedHeads.LIMIT * 3):
        ex, _ = shared_exchange(heads)
        ex.start_response("200 OK", [("ETag", f'"{n}"')])
        assert len(heads) <= CheckedHeads.LIMIT


@pytest.mark.parametrize(("keep_alive", "held"), [(False, True), (True, False)])
def test_a_whole_body_waits_for_the_close_only_if_it_ends_the_connection(keep_alive: bool,
                                                                          held: bool) -> None:
    """send_whole(close_next=True): the caller closes right after; the transport is told so
    only when this response ends the connection (see Connection.send_last)."""
    ex, t = exchange(keep_alive=keep_alive)
    start(ex, length=2)
    ex.send_whole(b"ok", close_next=True)
    assert t.close_next == [held] and ex.close is held
