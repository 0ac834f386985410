"""forkserve.http.writers and the head builder: framing chosen per status, method and version,
chunk framing and its end, a body longer or shorter than its Content-Length, responses with
no body; and the typed parser events with their private queue. Fork-free, no sockets."""

from __future__ import annotations

import pytest

from forkserve.http import END, EndOfMessage, HTTPError, Limits, Request, RequestParser
from forkserve.http.response import CONNECTION_CLOSE, LAST_CHUNK, response_head
from forkserve.http.writers import (BodyWriter, ChunkedWriter, CloseDelimitedWriter,
                                    ContentLengthWriter, NoBodyWriter, body_writer)
from tests.http import taken

# -- choosing the framing ---------------------------------------------------------------------


@pytest.mark.parametrize(("status", "method", "version", "declared", "known", "exact", "kind",
                          "header"), [
    # A length the app declared wins; else one the server knows; else chunked on 1.1 ...
    (200, "GET", "1.1", 5, None, False, ContentLengthWriter, b"Content-Length: 5\r\n"),
    (200, "GET", "1.1", 5, 9, False, ContentLengthWriter, b"Content-Length: 5\r\n"),
    (200, "GET", "1.1", None, 9, False, ContentLengthWriter, b"Content-Length: 9\r\n"),
    (200, "GET", "1.1", None, 0, False, ContentLengthWriter, b"Content-Length: 0\r\n"),
    (200, "POST", "1.1", None, None, False, ChunkedWriter, b"Transfer-Encoding: chunked\r\n"),
    # ... and delimited by the close on 1.0 (RFC 9112 §6.3).
    (200, "GET", "1.0", None, None, False, CloseDelimitedWriter, b""),
    (200, "GET", "1.0", 3, None, False, ContentLengthWriter, b"Content-Length: 3\r\n"),
    # HEAD: no body; the head announces the app's length, or a file's (exact), never a guess.
    (200, "HEAD", "1.1", 5, None, False, NoBodyWriter, b"Content-Length: 5\r\n"),
    (200, "HEAD", "1.1", None, 9, False, NoBodyWriter, b""),
    (200, "HEAD", "1.1", None, 9, True, NoBodyWriter, b"Content-Length: 9\r\n"),
    (200, "HEAD", "1.1", 4, 9, True, NoBodyWriter, b"Content-Length: 4\r\n"),
    (200, "HEAD", "1.0", None, None, False, NoBodyWriter, b""),
    # 204 and 304 never carry a body nor a Content-Length (RFC 9110 §6.4.1, §8.6).
    (204, "GET", "1.1", 5, None, False, NoBodyWriter, b""),
    (304, "GET", "1.1", None, 9, True, NoBodyWriter, b""),
    (204, "HEAD", "1.0", 5, 9, True, NoBodyWriter, b""),
    (404, "GET", "1.1", None, None, False, ChunkedWriter, b"Transfer-Encoding: chunked\r\n"),
])
def test_body_writer_chooses_the_framing(status: int, method: str, version: str,
                                         declared: int | None, known: int | None, exact: bool,
                                         kind: type[BodyWriter], header: bytes) -> None:
    writer = body_writer(status, method, version, declared, known, exact)
    assert type(writer) is kind
    assert writer.header == header
    assert writer.closes is (kind is CloseDelimitedWriter)
    assert (writer.sent, writer.broken) == (0, False)


# -- the writers ------------------------------------------------------------------------------

def test_chunked_frames_each_piece_and_ends_with_the_last_chunk() -> None:
    writer = ChunkedWriter()
    assert writer.frame(b"hello") == b"5\r\nhello\r\n"
    assert writer.frame(b"x" * 16) == b"10\r\n" + b"x" * 16 + b"\r\n"
    assert writer.frame(b"") == b""  # an empty chunk would end the body early
    assert writer.end() == LAST_CHUNK == b"0\r\n\r\n"
    assert (writer.sent, writer.broken) == (21, False)


def test_chunked_body_decodes_back_through_the_request_parser() -> None:
    writer = ChunkedWriter()
    pieces = [b"first", b"\r\n", bytes(range(256)), b"y" * 70000]
    body = b"".join(writer.frame(piece) for piece in pieces) + writer.end()
    parser = RequestParser(Limits())
    parser.feed(b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
    assert type(parser.next_event()) is Request
    data = b""
    while (event := parser.next_event()) is not END:
        assert type(event) is bytes
        data += event
    assert data == b"".join(pieces)


def test_close_delimited_passes_pieces_through() -> None:
    writer = CloseDelimitedWriter()
    assert writer.frame(b"abc") == b"abc"
    assert writer.frame(b"de") == b"de"
    assert writer.end() == b""
    assert (writer.sent, writer.broken, writer.closes) == (5, False, True)


def test_content_length_exact() -> None:
    writer = ContentLengthWriter(5)
    assert writer.frame(b"hel") == b"hel"
    assert writer.frame(b"lo") == b"lo"
    assert writer.end() == b""
    assert (writer.sent, writer.broken) == (5, False)


def test_content_length_too_long_sends_what_was_promised_and_breaks() -> None:
    writer = ContentLengthWriter(4)
    assert writer.frame(b"abc") == b"abc"
    assert writer.frame(b"defg") == b"d"
    assert writer.broken
    assert writer.frame(b"more") == b""  # nothing past the length, ever
    assert writer.end() == b""
    assert (writer.sent, writer.broken) == (4, True)


def test_content_length_too_short_breaks_at_the_end() -> None:
    writer = ContentLengthWriter(10)
    assert writer.frame(b"abc") == b"abc"
    assert not writer.broken
    assert writer.end() == b""
    assert (writer.sent, writer.broken) == (3, True)


def test_content_length_zero() -> None:
    writer = ContentLengthWriter(0)
    assert writer.end() == b""
    assert (writer.sent, writer.broken) == (0, False)
    assert writer.frame(b"x") == b""
    assert writer.broken


@pytest.mark.parametrize("length", [None, 0, 7])
def test_no_body_drops_everything_and_never_breaks(length: int | None) -> None:
    writer = NoBodyWriter(length)
    assert writer.frame(b"ignored") == b""
    assert writer.end() == b""
    assert (writer.sent, writer.broken, writer.closes) == (0, False, False)


@pytest.mark.parametrize(("length", "body", "framed", "broken"), [
    (5, b"hello", b"hello", False),
    (3, b"hello", b"hel", True),  # too long: cut at the length
    (9, b"hello", b"hello", True),  # too short
    (0, b"", b"", False),
])
def test_content_length_whole_is_frame_then_end(length: int, body: bytes, framed: bytes,
                                                broken: bool) -> None:
    whole, pieces = ContentLengthWriter(length), ContentLengthWriter(length)
    assert whole.whole(body) == framed == pieces.frame(body) + pieces.end()
    assert (whole.sent, whole.broken) == (pieces.sent, pieces.broken) == (len(framed), broken)


@pytest.mark.parametrize("writer", [ChunkedWriter(), CloseDelimitedWriter(), NoBodyWriter(3)])
def test_whole_of_the_other_writers(writer: BodyWriter) -> None:
    expected = {ChunkedWriter: b"2\r\nhi\r\n0\r\n\r\n", CloseDelimitedWriter: b"hi",
                NoBodyWriter: b""}[type(writer)]
    assert writer.whole(b"hi") == expected
    assert not writer.broken


# -- the head builder -------------------------------------------------------------------------

def test_response_head_serialises_status_headers_fields_and_body() -> None:
    data = response_head("200 OK", [("Content-Type", "text/plain"), ("X-A", "caf\xe9")],
                         (b"Content-Length: 2\r\n", CONNECTION_CLOSE), b"hi")
    assert data == (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX-A: caf\xe9\r\n"
                    b"Content-Length: 2\r\nConnection: close\r\n\r\nhi")


def test_response_head_alone() -> None:
    assert response_head("204 No Content", ()) == b"HTTP/1.1 204 No Content\r\n\r\n"


def test_response_head_refuses_text_that_is_not_latin_1() -> None:
    with pytest.raises(UnicodeEncodeError):
        response_head("200 OK", [("X", "\u2713")])


# -- typed parser events and the private queue ------------------------------------------------

def test_events_are_typed_and_taken_in_order() -> None:
    parser = RequestParser(Limits())
    assert parser.next_event() is None and parser.peek_event() is None
    parser.feed(b"POST /a HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\nabc"
                b"GET /b HTTP/1.1\r\nHost: h\r\n\r\n")
    assert parser.pending() == 5
    head = parser.peek_event()
    assert isinstance(head, Request) and head.target == b"/a"
    assert parser.pending() == 5  # peeking takes nothing
    events = taken(parser)
    assert [type(e) for e in events] == [Request, bytes, EndOfMessage, Request, EndOfMessage]
    assert events[1] == b"abc"
    assert events[2] is END and events[4] is END and repr(END) == "END"
    assert parser.pending() == 0
    assert not hasattr(parser, "events")


def test_take_end_takes_only_an_end() -> None:
    parser = RequestParser(Limits())
    assert not parser.take_end()
    parser.feed(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
    assert not parser.take_end()  # the head comes first
    assert isinstance(parser.next_event(), Request)
    assert parser.take_end()
    assert parser.pending() == 0


def test_fail_raises_when_no_request_is_complete() -> None:
    parser = RequestParser(Limits())
    parser.feed(b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\nab")
    error = HTTPError(413, "Request body too large")
    with pytest.raises(HTTPError) as caught:
        parser.fail(error)
    assert caught.value is error


def test_fail_queues_the_error_after_the_complete_requests_and_drops_the_rest() -> None:
    parser = RequestParser(Limits(body=4))
    data = (b"GET /one HTTP/1.1\r\nHost: h\r\n\r\n"
            b"POST /two HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"3\r\nabc\r\n3\r\ndef\r\n0\r\n\r\n")
    with pytest.raises(HTTPError) as caught:
        parser.feed(data)
    assert caught.value.status == 413
    parser.fail(caught.value)
    events = taken(parser)
    assert [type(e) for e in events] == [Request, EndOfMessage, HTTPError]
    assert events[-1] is caught.value  # no part of /two is left to reach the app
