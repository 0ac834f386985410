"""wsgi.Input (``wsgi.input``) over a fake transport: read, readline, readlines, iteration, and
b"" past the end. The transport hands out body pieces, then b"" for ever."""

from __future__ import annotations

import pytest

from forkserve.wsgi import Input


class FakeTransport:
    """Only ``read_body`` is used by Input; anything else would be a bug in the test."""

    def __init__(self, *pieces: bytes) -> None:
        assert all(pieces), "a piece may not be empty: b'' means end of body"
        self.pieces = list(pieces)
        self.calls = 0
        self.calls_after_end = 0

    def read_body(self) -> bytes:
        self.calls += 1
        if self.pieces:
            return self.pieces.pop(0)
        self.calls_after_end += 1
        return b""


def make(*pieces: bytes) -> tuple[Input, FakeTransport]:
    transport = FakeTransport(*pieces)
    return Input(transport), transport  # type: ignore[arg-type]


# -- read ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [-1, None])
def test_read_all(size: int | None) -> None:
    stream, transport = make(b"hello ", b"wor", b"ld\n", b"\x00\xff")
    assert stream.read(size) == b"hello world\n\x00\xff"
    assert stream.finished
    assert stream.read() == b""
    assert stream.read(10) == b""
    assert transport.calls_after_end == 1, "the transport was asked again after its end"


def test_read_sized_across_pieces() -> None:
    stream, transport = make(b"abc", b"defgh", b"ij")
    assert stream.read(2) == b"ab"
    assert transport.calls == 1
    assert stream.read(4) == b"cdef"
    assert transport.calls == 2
    assert stream.read(0) == b""
    assert stream.read(100) == b"ghij"
    assert stream.finished
    assert stream.read(1) == b""
    assert stream.read() == b""
    assert transport.calls_after_end == 1


def test_read_does_not_pull_more_than_it_needs() -> None:
    stream, transport = make(b"abcdef", b"gh")
    assert stream.read(3) == b"abc"
    assert stream.read(3) == b"def"
    assert transport.calls == 1
    assert not stream.finished
    assert stream.read() == b"gh"
    assert stream.finished


def test_read_byte_by_byte() -> None:
    data = b"one\r\ntwo\n"
    stream, _ = make(*[data[i:i + 1] for i in range(len(data))])
    assert b"".join(iter(lambda: stream.read(1), b"")) == data
    assert stream.read(1) == b""


# -- readline -----------------------------------------------------------------------------------

def test_readline_across_pieces() -> None:
    stream, transport = make(b"ab", b"c\nde", b"f\n", b"tail")
    assert stream.readline() == b"abc\n"
    assert stream.readline() == b"def\n"
    assert stream.readline() == b"tail"
    assert stream.readline() == b""
    assert stream.readline() == b""
    assert transport.calls_after_end == 1


def test_readline_none_is_unlimited() -> None:
    stream, _ = make(b"first line\nsecond")
    assert stream.readline(None) == b"first line\n"
    assert stream.readline(None) == b"second"


def test_readline_with_a_size() -> None:
    stream, _ = make(b"hello\nworld", b"!\n")
    assert stream.readline(3) == b"hel"
    assert stream.readline(3) == b"lo\n"
    assert stream.readline(0) == b""
    assert stream.readline(6) == b"world!"
    assert stream.readline(6) == b"\n"
    assert stream.readline(6) == b""


def test_readline_size_waits_for_enough_bytes() -> None:
    stream, transport = make(b"a", b"b", b"c", b"d\n")
    assert stream.readline(3) == b"abc"
    assert transport.calls == 3
    assert stream.readline(3) == b"d\n"


def test_readline_size_longer_than_the_line() -> None:
    stream, _ = make(b"ab\ncd\n")
    assert stream.readline(10) == b"ab\n"
    assert stream.readline(3) == b"cd\n"


def test_readline_a_long_line_in_one_byte_pieces() -> None:
    line = b"x" * 500 + b"\n"
    stream, _ = make(*[line[i:i + 1] for i in range(len(line))], b"rest")
    assert stream.readline() == line
    assert stream.readline() == b"rest"


def test_readline_keeps_crlf_and_splits_on_lf_only() -> None:
    stream, _ = make(b"a\r\nb\rc\n")
    assert stream.readline() == b"a\r\n"
    assert stream.readline() == b"b\rc\n"


def test_read_and_readline_mixed() -> None:
    stream, _ = make(b"line1\nli", b"ne2\nrest of body")
    assert stream.read(2) == b"li"
    assert stream.readline() == b"ne1\n"
    assert stream.read(4) == b"line"
    assert stream.readline() == b"2\n"
    assert stream.read() == b"rest of body"
    assert stream.readline() == b""


# -- readlines and iteration --------------------------------------------------------------------

def test_readlines() -> None:
    stream, _ = make(b"a\nbb\n", b"ccc\nd")
    assert stream.readlines() == [b"a\n", b"bb\n", b"ccc\n", b"d"]
    assert stream.readlines() == []


def test_readlines_hint_stops_once_reached() -> None:
    stream, _ = make(b"a\nbb\nccc\nd")
    assert stream.readlines(4) == [b"a\n", b"bb\n"]  # 2 bytes, then 5 >= 4
    assert stream.readlines(1) == [b"ccc\n"]
    assert stream.readlines(0) == [b"d"]


def test_iteration() -> None:
    stream, _ = make(b"x\ny", b"\nz")
    assert iter(stream) is stream
    assert list(stream) == [b"x\n", b"y\n", b"z"]
    assert list(stream) == []
    with pytest.raises(StopIteration):
        next(stream)


def test_iteration_of_an_empty_body() -> None:
    stream, transport = make()
    assert list(stream) == []
    assert stream.finished
    assert transport.calls == 1


# -- no transport (no body) ---------------------------------------------------------------------

def test_no_transport_is_an_empty_finished_body() -> None:
    stream = Input(None)
    assert stream.finished
    assert stream.read() == b""
    assert stream.read(5) == b""
    assert stream.readline() == b""
    assert stream.readline(5) == b""
    assert stream.readlines() == []
    assert list(stream) == []
