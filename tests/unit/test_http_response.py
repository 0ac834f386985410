"""forkserve.http.response: header and status validation, chunk framing, the Date header and
the server's own small responses."""

from __future__ import annotations

import datetime
import re
from email.utils import formatdate, parsedate_to_datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forkserve.http import END, Limits, RequestParser, response
from forkserve.http.response import (CONTINUE, LAST_CHUNK, DateCache, check_header, chunk,
                                     parse_status, reason_phrase, simple_response)
from tests.http import taken

# RFC 7231 §7.1.1.1 IMF-fixdate, e.g. "Sun, 06 Nov 1994 08:49:37 GMT".
IMF_FIXDATE = re.compile(
    rb"(Mon|Tue|Wed|Thu|Fri|Sat|Sun), [0-3][0-9] "
    rb"(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) [0-9]{4} "
    rb"[0-2][0-9]:[0-5][0-9]:[0-6][0-9] GMT")


class FixedClock:
    def __init__(self, now: float) -> None:
        self.now = now
        self.calls = 0

    def time(self) -> float:
        self.calls += 1
        return self.now


# -- check_header -------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "value"), [
    ("Content-Type", "text/plain; charset=utf-8"),
    ("X-Custom_1", "a b\tc"),
    ("!#$%&'*+-.^_`|~09AZaz", "every tchar in the name"),
    ("X-Empty", ""),
    ("Set-Cookie", "a=1; Path=/; HttpOnly"),
    ("X-Latin", "caf\xe9"),
])
def test_check_header_accepts(name: str, value: str) -> None:
    assert check_header(name, value) is None


@pytest.mark.parametrize("name", [
    "", "Bad Name", "X:Y", "X-A\r\nX-B", "X\n", "X\r", "X\x00", "(x)", "X/Y", "X@Y", "X,Y",
    "X;Y", "X=Y", '"X"', "X{Y}", "X[Y]", "X\\Y", "X?", "\xc4rger", "X\t", " X", "X ",
])
def test_check_header_rejects_names(name: str) -> None:
    with pytest.raises(ValueError):
        check_header(name, "value")


@pytest.mark.parametrize("value", [
    "a\rb", "a\nb", "a\x00b", "ok\r\nSet-Cookie: session=stolen", "trailing\r\n", "\n",
    "x\r\n\r\n<html>injected body",
])
def test_check_header_rejects_values(value: str) -> None:
    with pytest.raises(ValueError):
        check_header("X-Test", value)


@pytest.mark.parametrize("value", ["\u2713", "\u20ac10", "caf\xe9 \U0001f600"])
def test_check_header_rejects_values_outside_latin_1(value: str) -> None:
    # PEP 3333: status and header strings "must either be ISO-8859-1 characters, or use
    # RFC 2047 MIME encoding"; the head is encoded latin-1, so anything else cannot be sent.
    with pytest.raises(ValueError):
        check_header("X-Test", value)


class Text(str):
    pass


@pytest.mark.parametrize(("name", "value"), [
    (b"X-Bytes", "v"), ("X-Bytes", b"v"), (None, "v"), ("X", None), ("X", 1), (1, "v"),
    (Text("X"), "v"), ("X", Text("v")), ("X", ["v"]),
])
def test_check_header_rejects_types(name: object, value: object) -> None:
    with pytest.raises(TypeError):
        check_header(name, value)


# -- parse_status -------------------------------------------------------------------------------

@pytest.mark.parametrize(("status", "code"), [
    ("200 OK", 200), ("404 Not Found", 404), ("100 Continue", 100), ("599 Custom Thing", 599),
    ("204 ", 204), ("418 I'm a teapot", 418), ("999 Whatever", 999), ("301 Moved \xe9", 301),
])
def test_parse_status_accepts(status: str, code: int) -> None:
    assert parse_status(status) == code


@pytest.mark.parametrize("status", [
    "", "200", "200OK", "OK 200", "20 OK", "2000 OK", "200\tOK", "200 OK\r\nX-Injected: 1",
    "200 OK\n", "200 OK\r", "200 O\x00K", "099 Too Low", "000 Zero", "abc OK", "-20 OK", " 200 OK",
    "2x0 OK", "+20 OK",
])
def test_parse_status_rejects(status: str) -> None:
    with pytest.raises(ValueError):
        parse_status(status)


@pytest.mark.parametrize("status", [
    "\u0662\u0660\u0660 OK",  # Arabic-Indic digits: str.isdigit() is true, int() gives 200
    "\uff12\uff10\uff10 OK",  # full-width digits
    "200 \u2713",  # a reason phrase that cannot be encoded latin-1
])
def test_parse_status_rejects_what_cannot_go_on_the_wire(status: str) -> None:
    # The status line is encoded latin-1 (http.response.response_head); a status that parses
    # here but cannot be encoded fails later, far from the app's start_response call.
    with pytest.raises(ValueError):
        parse_status(status)


@pytest.mark.parametrize("status", [200, b"200 OK", None, ("200", "OK")])
def test_parse_status_rejects_types(status: object) -> None:
    with pytest.raises(TypeError):
        parse_status(status)


def test_reason_phrase() -> None:
    assert reason_phrase(404) == "Not Found"
    assert reason_phrase(503) == "Service Unavailable"
    assert reason_phrase(799) == "Unknown"


# -- chunk framing ------------------------------------------------------------------------------

@pytest.mark.parametrize(("data", "framed"), [
    (b"hello", b"5\r\nhello\r\n"),
    (b"x", b"1\r\nx\r\n"),
    (b"\r\n", b"2\r\n\r\n\r\n"),
    (b"a" * 15, b"f\r\n" + b"a" * 15 + b"\r\n"),
    (b"a" * 16, b"10\r\n" + b"a" * 16 + b"\r\n"),
    (b"b" * 255, b"ff\r\n" + b"b" * 255 + b"\r\n"),
    (b"c" * 4096, b"1000\r\n" + b"c" * 4096 + b"\r\n"),
])
def test_chunk(data: bytes, framed: bytes) -> None:
    assert chunk(data) == framed


def test_constants() -> None:
    assert LAST_CHUNK == b"0\r\n\r\n"
    assert CONTINUE == b"HTTP/1.1 100 Continue\r\n\r\n"


def test_chunks_decode_back_through_the_request_parser() -> None:
    pieces = [b"first", b"\r\n", bytes(range(256)), b"x" * 70000]
    body = b"".join(chunk(piece) for piece in pieces) + LAST_CHUNK
    head = b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    parser = RequestParser(Limits())
    parser.feed(head + body)
    events = taken(parser)
    assert events[-1] is END
    assert b"".join(events[1:-1]) == b"".join(pieces)


# -- DateCache ----------------------------------------------------------------------------------

def test_date_is_an_rfc_7231_imf_fixdate_for_now() -> None:
    value = DateCache().get()
    assert type(value) is bytes
    assert IMF_FIXDATE.fullmatch(value), value
    now = datetime.datetime.now(datetime.timezone.utc)
    assert abs((parsedate_to_datetime(value.decode("ascii")) - now).total_seconds()) < 5


@pytest.mark.parametrize(("now", "text"), [
    (784111777.0, b"Sun, 06 Nov 1994 08:49:37 GMT"),  # the example in RFC 7231 §7.1.1.1
    (0.0, b"Thu, 01 Jan 1970 00:00:00 GMT"),
    (951782400.5, b"Tue, 29 Feb 2000 00:00:00 GMT"),
    (1704067199.999, b"Sun, 31 Dec 2023 23:59:59 GMT"),
])
def test_date_format(monkeypatch: pytest.MonkeyPatch, now: float, text: bytes) -> None:
    monkeypatch.setattr(response, "time", FixedClock(now))
    assert DateCache().get() == text


@settings(max_examples=500, deadline=None)
@given(st.floats(min_value=0, max_value=253402300799, allow_nan=False))
def test_http_date_is_what_email_utils_writes(seconds: float) -> None:
    # The stdlib's formatter is the reference; ours exists only not to import email.
    assert response.http_date(seconds) == formatdate(int(seconds), usegmt=True).encode("ascii")


def test_date_is_formatted_once_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FixedClock(784111777.0)
    formatted: list[float] = []
    real = response.http_date

    def counting_http_date(seconds: float) -> bytes:
        formatted.append(seconds)
        return real(seconds)

    monkeypatch.setattr(response, "time", clock)
    monkeypatch.setattr(response, "http_date", counting_http_date)
    dates = DateCache()
    first = dates.get()
    clock.now = 784111777.999
    assert dates.get() == first
    assert len(formatted) == 1
    clock.now = 784111778.0
    assert dates.get() == b"Sun, 06 Nov 1994 08:49:38 GMT"
    assert len(formatted) == 2


# -- simple_response ----------------------------------------------------------------------------

def split_response(data: bytes) -> tuple[bytes, list[tuple[bytes, bytes]], bytes]:
    head, sep, body = data.partition(b"\r\n\r\n")
    assert sep, "no blank line after the head"
    lines = head.split(b"\r\n")
    assert not any(b"\n" in line or b"\r" in line for line in lines), "bare CR or LF in the head"
    fields = []
    for line in lines[1:]:
        name, colon, value = line.partition(b": ")
        assert colon, f"malformed field line {line!r}"
        fields.append((name, value))
    return lines[0], fields, body


def test_simple_response_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(response, "time", FixedClock(784111777.0))
    data = simple_response(400, "Bad Request", DateCache())
    status, fields, body = split_response(data)
    assert status == b"HTTP/1.1 400 Bad Request"
    assert body == b"400 Bad Request\n"
    assert fields == [
        (b"Date", b"Sun, 06 Nov 1994 08:49:37 GMT"),
        (b"Server", b"forkserve"),
        (b"Content-Type", b"text/plain; charset=utf-8"),
        (b"Content-Length", b"16"),
        (b"Connection", b"close"),
    ]


def test_simple_response_keep_alive_extra_and_body() -> None:
    body = "d\xe9j\xe0 vu\n".encode("utf-8")
    data = simple_response(503, "Service Unavailable", DateCache(), body=body, close=False,
                           extra=b"Retry-After: 5\r\n")
    status, fields, got = split_response(data)
    assert status == b"HTTP/1.1 503 Service Unavailable"
    assert got == body
    names = [name for name, _ in fields]
    assert b"Connection" not in names
    assert dict(fields)[b"Content-Length"] == str(len(body)).encode()
    assert dict(fields)[b"Retry-After"] == b"5"
    assert IMF_FIXDATE.fullmatch(dict(fields)[b"Date"])


def test_simple_response_empty_body() -> None:
    status, fields, body = split_response(simple_response(413, "Content Too Large", DateCache(), body=b""))
    assert status == b"HTTP/1.1 413 Content Too Large"
    assert body == b""
    assert dict(fields)[b"Content-Length"] == b"0"
