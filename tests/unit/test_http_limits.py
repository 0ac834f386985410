"""The request limits of forkserve.http.parser, as input grows: every part of a request a client
can make grow is refused within a bound of bytes, memory and work, however it is split.

The corpus (test_http_corpus.py) holds the small cases; these are the ones that need size: a
64 MiB trailer section, the default limits at their exact boundary, a field sent a byte at a
time. Memory is measured with tracemalloc (the bytes httptools joins a field from are Python
objects, so they are traced); work is bounded by counting the bytes fed before the refusal,
not by timing it.
"""

from __future__ import annotations

import tracemalloc
from typing import Iterator

import pytest

from forkserve.http import END, HTTPError, Limits, Request, RequestParser
from forkserve.http import parser as parser_module
from tests.http import taken

READ = 65536  # what a worker reads at a time (forkserve.workers.connection.RECV_SIZE)
MIB = 1 << 20
CHUNKED_HEAD = b"POST /up HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"


def endless(prefix: bytes, filler: bytes, total: int, piece: int = READ) -> Iterator[bytes]:
    """``prefix``, then ``filler`` repeated up to ``total`` bytes, in reads of ``piece``."""
    yield prefix
    block = (filler * (piece // len(filler) + 1))[:piece]
    for _ in range(total // piece):
        yield block


def feed_until_refused(parser: RequestParser, pieces: Iterator[bytes]) -> tuple[HTTPError, int]:
    """Feed until the parser refuses; the error and how many bytes it took."""
    fed = 0
    for piece in pieces:
        fed += len(piece)
        try:
            parser.feed(piece)
        except HTTPError as exc:
            return exc, fed
    raise AssertionError(f"{fed} bytes fed and never refused")


# -- the 64 MiB trailer probe ---------------------------------------------------------------------

@pytest.mark.parametrize(("name", "prefix", "filler", "status"), [
    ("trailer value", CHUNKED_HEAD + b"1\r\nx\r\n0\r\nX-Endless: ", b"e", 431),
    ("trailer name", CHUNKED_HEAD + b"0\r\nX-", b"n", 431),
    ("trailer OWS", CHUNKED_HEAD + b"0\r\nX-Endless:", b" ", 431),
    ("chunk extension", CHUNKED_HEAD + b"1;ext=", b"e", 400),
    ("header value", b"GET / HTTP/1.1\r\nHost: a\r\nX-Endless: ", b"v", 431),
    ("request target", b"GET /", b"t", 414),
])
def test_a_line_that_never_ends_is_refused_within_one_read(name: str, prefix: bytes, filler: bytes,
                                                           status: int) -> None:
    """Before, one chunked request with a 64 MiB trailer was not refused at all: +109 MiB RSS
    and 30 s of CPU (httptools joins a field's spans with bytes +=, one per read)."""
    limits = Limits()
    parser = RequestParser(limits)
    tracemalloc.start()
    try:
        error, fed = feed_until_refused(parser, endless(prefix, filler, 64 * MIB))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert error.status == status, f"{name}: {error.status} {error.reason}"
    # Refused at most one read past the line bound: a few reads, not 1,024.
    assert fed <= len(prefix) + limits.line + READ, f"{name}: refused after {fed} bytes"
    assert peak < 2 * MIB, f"{name}: {peak} bytes allocated at the peak"


@pytest.mark.parametrize("name", ["trailer value", "header value", "chunk extension"])
def test_a_line_sent_a_byte_at_a_time_is_refused_at_the_bound(name: str) -> None:
    """A read of one byte at a time (a slow client) is where the join would be quadratic; the
    measure is exact then: the byte past Limits.line is refused."""
    limits = Limits(request_line=64, field_size=64)
    prefix = {"trailer value": CHUNKED_HEAD + b"0\r\nX: ",
              "header value": b"GET / HTTP/1.1\r\nHost: a\r\nX: ",
              "chunk extension": CHUNKED_HEAD + b"1;e="}[name]
    parser = RequestParser(limits)
    parser.feed(prefix)
    line = len(prefix) - prefix.rfind(b"\n") - 1
    with pytest.raises(HTTPError):
        for _ in range(limits.line * 4):
            line += 1
            parser.feed(b"a")
    assert line == limits.line + 1  # the first byte past the bound


def test_the_line_bound_and_the_head_bound() -> None:
    limits = Limits()
    assert limits.line == 8194  # the longer of the two line limits, with room for CR and ": "
    assert limits.head == 827_624  # request line, 100 fields of 8,190 bytes, CRLFs
    assert Limits(request_line=100, field_size=20000).line == 20004


def test_a_head_of_many_full_fields_is_refused_at_the_head_bound() -> None:
    limits = Limits(fields=1000, field_size=100)  # the count would allow it, the total not
    parser = RequestParser(Limits(fields=limits.fields, field_size=limits.field_size))
    field = b"X-F: " + b"v" * 90 + b"\r\n"
    pieces = endless(b"GET / HTTP/1.1\r\nHost: a\r\n", field, 4 * MIB, piece=len(field) * 64)
    error, fed = feed_until_refused(parser, pieces)
    assert error.status == 431
    assert fed <= limits.head + len(field) * 64


# -- trailers ---------------------------------------------------------------------------------

def trailers(count: int, size: int = 10) -> bytes:
    return b"".join(b"T%d: %s\r\n" % (i, b"v" * size) for i in range(count))


def test_trailer_fields_count_with_the_head_fields() -> None:
    # Host and Transfer-Encoding are two of the four; two trailers fit, three do not.
    ok = RequestParser(Limits(fields=4))
    ok.feed(CHUNKED_HEAD + b"1\r\nx\r\n0\r\n" + trailers(2) + b"\r\n")
    events = taken(ok)
    assert [type(e) for e in events] == [Request, bytes, type(END)]
    refused = RequestParser(Limits(fields=4))
    with pytest.raises(HTTPError) as info:
        refused.feed(CHUNKED_HEAD + b"1\r\nx\r\n0\r\n" + trailers(3) + b"\r\n")
    assert info.value.status == 431


def test_many_small_trailers_are_refused_at_the_field_count() -> None:
    limits = Limits()
    parser = RequestParser(limits)
    field = b"T: v\r\n"
    error, fed = feed_until_refused(parser, endless(CHUNKED_HEAD + b"0\r\n", field, 64 * MIB))
    assert error.status == 431
    assert fed <= len(CHUNKED_HEAD) + 3 + (limits.fields + 1) * len(field) + READ


@pytest.mark.parametrize("field", [b"Host", b"Content-Length", b"Transfer-Encoding", b"Trailer",
                                   b"Content-Type", b"Authorization", b"Cache-Control", b"If-Match",
                                   b"Range", b"Expect", b"TE", b"Connection", b"content-encoding"])
def test_fields_a_trailer_must_not_carry_are_refused(field: bytes) -> None:
    parser = RequestParser(Limits())
    with pytest.raises(HTTPError) as info:
        parser.feed(CHUNKED_HEAD + b"0\r\n" + field + b": x\r\n\r\n")
    assert info.value.status == 400
    assert END not in taken(parser)


def test_other_trailers_are_accepted_and_not_headers() -> None:
    parser = RequestParser(Limits())
    parser.feed(CHUNKED_HEAD + b"2\r\nok\r\n0\r\nX-Checksum: abc\r\nServer-Timing: db;dur=5\r\n\r\n")
    head, body, end = taken(parser)
    assert isinstance(head, Request) and body == b"ok" and end is END
    assert [name for name, _ in head.headers] == [b"Host", b"Transfer-Encoding"]


# -- the request line ---------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["GET", "POST", "OPTIONS", "PROPFIND"])
def test_the_whole_request_line_is_limited_at_the_default(method: str) -> None:
    """limit_request_line (8,190) counts method SP target SP version without the CRLF, as
    gunicorn's does; before, only the target was counted (lines up to 8,203 bytes passed)."""
    limit = Limits().request_line

    def line(length: int) -> bytes:
        target = b"/" + b"a" * (length - len(method) - 2 - len(b"HTTP/1.1") - 1)
        data = method.encode() + b" " + target + b" HTTP/1.1"
        assert len(data) == length
        return data + b"\r\nHost: a\r\n\r\n"

    ok = RequestParser(Limits())
    ok.feed(line(limit))
    head = taken(ok)[0]
    assert isinstance(head, Request) and head.method == method
    for split in (None, 1000, 1):
        refused = RequestParser(Limits())
        data = line(limit + 1)
        pieces = [data] if split is None else [data[i:i + split] for i in range(0, len(data), split)]
        with pytest.raises(HTTPError) as info:
            for piece in pieces:
                refused.feed(piece)
        assert info.value.status == 414, split


# -- what a kept-alive parser remembers between requests ------------------------------------------

def test_a_valid_host_on_a_connection_does_not_let_a_bad_one_through() -> None:
    """The Host check is skipped for a Host an earlier request had (it passed); any other
    Host is checked again."""
    parser = RequestParser(Limits())
    for _ in range(2):
        parser.feed(b"GET / HTTP/1.1\r\nHost: example.com:8080\r\n\r\n")
        head = parser.next_event()
        assert isinstance(head, Request) and parser.next_event() is END
    with pytest.raises(HTTPError) as refused:
        parser.feed(b"GET / HTTP/1.1\r\nHost: exa mple.com\r\n\r\n")
    assert refused.value.status == 400


def test_the_hosts_found_valid_are_shared_by_connections_and_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A new connection's parser skips the Host check for a Host another connection's passed
    (the same names come on every Connection: close request); the hosts kept are bounded in
    count and length, and a bad Host is refused whatever is kept."""
    kept: set[bytes] = set()
    monkeypatch.setattr(parser_module, "_VALID_HOSTS", kept)

    def served(host: bytes) -> None:
        parser = RequestParser(Limits())
        parser.feed(b"GET / HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")
        head = parser.next_event()
        assert isinstance(head, Request) and parser.next_event() is END

    served(b"example.com:8080")
    assert kept == {b"example.com:8080"}
    checks: list[bytes] = []

    def checked(value: bytes) -> bool:
        checks.append(value)
        return True

    monkeypatch.setattr(parser_module, "_valid_host", checked)
    served(b"example.com:8080")
    assert checks == []  # (the second connection did not check it again)
    monkeypatch.undo()
    monkeypatch.setattr(parser_module, "_VALID_HOSTS", kept)
    served(b"a" * (parser_module.HOST_KEPT_BYTES + 1))
    for n in range(parser_module.HOSTS_KEPT * 2):
        served(b"host-%d.example" % n)
    assert len(kept) == parser_module.HOSTS_KEPT
    assert all(len(host) <= parser_module.HOST_KEPT_BYTES for host in kept)
    for bad in (b"exa mple.com", b"a@b", b"[::zz]"):
        with pytest.raises(HTTPError) as refused:
            served(bad)
        assert refused.value.status == 400
    assert not kept & {b"exa mple.com", b"a@b", b"[::zz]"}


@pytest.mark.parametrize("method", ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS",
                                    "PROPFIND", "PURGE"])
def test_a_method_is_the_str_it_was_sent_as(method: str) -> None:
    parser = RequestParser(Limits())
    parser.feed(f"{method} / HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n".encode())
    head = parser.next_event()
    assert isinstance(head, Request) and head.method == method and type(head.method) is str


def test_carriage_returns_between_requests_are_still_bounded() -> None:
    """A read that ends at a request's end skips the line measure; CRs after it (llhttp takes
    them before the next request) still count as an unfinished line."""
    parser = RequestParser(Limits())
    error, fed = feed_until_refused(parser, endless(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n", b"\r",
                                                    4 * MIB, piece=4096))
    assert error.status == 431 and fed < Limits().line + 2 * 4096
