"""forkserve.counters: the record codec (encode/Decoder) and the worker-side Writer."""

from __future__ import annotations

import fcntl
import os
import select
from typing import Iterator

import pytest

from forkserve.counters import MAX_TEXT, RECORD_SIZE, Decoder, Kind, Record, Writer, encode

PIPE_BUF = select.PIPE_BUF

RECORDS = [
    Record(Kind.BOOTED, 1, 4242),
    Record(Kind.SNAPSHOT, 7, 31337, active_connections=3, in_flight_requests=2,
           background_tasks=1, requests_served=123456),
    Record(Kind.BOOT_ERROR, 2, 99, text="ImportError: No module named 'myapp'\nTraceback ..."),
    Record(Kind.RETIRING, 65535, 2**31 - 1, active_connections=2**32 - 1,
           in_flight_requests=2**32 - 1, background_tasks=2**32 - 1, requests_served=2**64 - 1,
           text="max-requests reached (caf\xe9, \u2713, \U0001f600)"),
    Record(Kind.SNAPSHOT, 0, 1),
]


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    read_fd, write_fd = os.pipe()
    yield read_fd, write_fd
    os.close(read_fd)
    os.close(write_fd)


def test_a_record_is_atomic_on_a_pipe() -> None:
    # Writes up to PIPE_BUF are atomic: records from different workers never interleave.
    assert RECORD_SIZE + MAX_TEXT <= PIPE_BUF
    longest = encode(Record(Kind.BOOT_ERROR, 1, 1, text="\u2713" * 5000))
    assert len(longest) <= RECORD_SIZE + MAX_TEXT


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: f"{r.kind.name}-{r.worker_id}")
def test_roundtrip(record: Record) -> None:
    data = encode(record)
    assert len(data) == RECORD_SIZE + len(record.text.encode("utf-8"))
    assert Decoder().feed(data) == [record]


def test_many_records_in_one_feed() -> None:
    data = b"".join(encode(record) for record in RECORDS)
    assert Decoder().feed(data) == RECORDS


def test_a_record_split_across_two_feeds_at_every_offset() -> None:
    pair = [RECORDS[2], RECORDS[3]]  # both carry text
    data = b"".join(encode(record) for record in pair)
    for offset in range(len(data) + 1):
        decoder = Decoder()
        first = decoder.feed(data[:offset])
        second = decoder.feed(data[offset:])
        assert first + second == pair, f"split at byte {offset}"
        assert decoder.feed(b"") == []


def test_byte_by_byte() -> None:
    data = b"".join(encode(record) for record in RECORDS)
    decoder = Decoder()
    got: list[Record] = []
    for index in range(len(data)):
        got += decoder.feed(data[index:index + 1])
    assert got == RECORDS


def test_a_partial_record_waits() -> None:
    decoder = Decoder()
    data = encode(RECORDS[2])
    assert decoder.feed(data[:RECORD_SIZE - 1]) == []
    assert decoder.feed(data[RECORD_SIZE - 1:RECORD_SIZE + 3]) == []  # fixed part, text pending
    assert decoder.feed(data[RECORD_SIZE + 3:]) == [RECORDS[2]]


def test_text_is_cut_to_max_text() -> None:
    record = Record(Kind.BOOT_ERROR, 3, 77, text="e" * (MAX_TEXT + 500))
    data = encode(record)
    assert len(data) == RECORD_SIZE + MAX_TEXT
    (decoded,) = Decoder().feed(data + encode(RECORDS[0]))[:1]
    assert decoded.text == "e" * MAX_TEXT
    assert (decoded.kind, decoded.worker_id, decoded.pid) == (Kind.BOOT_ERROR, 3, 77)


def test_cut_text_still_frames_the_next_record() -> None:
    # 3-byte characters: the cut lands inside one. The record stays well framed.
    long_text = Record(Kind.RETIRING, 1, 2, text="\u20ac" * 1000)
    records = Decoder().feed(encode(long_text) + encode(RECORDS[1]))
    assert len(records) == 2
    assert records[0].text.startswith("\u20ac" * (MAX_TEXT // 3))
    assert records[1] == RECORDS[1]


# -- Writer -------------------------------------------------------------------------------------

def test_writer_sends_its_counters(pipe: tuple[int, int]) -> None:
    read_fd, write_fd = pipe
    writer = Writer(write_fd, 5)
    writer.send(Kind.BOOTED)
    writer.active_connections = 4
    writer.in_flight_requests = 3
    writer.background_tasks = 2
    writer.requests_served = 1000
    writer.snapshot()
    writer.send(Kind.RETIRING, "max-requests")
    records = Decoder().feed(os.read(read_fd, 65536))
    pid = os.getpid()
    assert records == [
        Record(Kind.BOOTED, 5, pid),
        Record(Kind.SNAPSHOT, 5, pid, 4, 3, 2, 1000),
        Record(Kind.RETIRING, 5, pid, 4, 3, 2, 1000, "max-requests"),
    ]


def test_writer_drops_a_snapshot_when_the_pipe_is_full(pipe: tuple[int, int]) -> None:
    read_fd, write_fd = pipe
    flags = fcntl.fcntl(write_fd, fcntl.F_GETFL)
    fcntl.fcntl(write_fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
    filler = encode(Record(Kind.SNAPSHOT, 1, 1))
    written = 0
    while True:
        try:
            written += os.write(write_fd, filler)
        except BlockingIOError:
            break
    writer = Writer(write_fd, 1)
    writer.requests_served = 77
    writer.snapshot()  # must not raise and must not block
    data = b""
    while len(data) < written:
        data += os.read(read_fd, 65536)
    assert len(data) == written
    assert all(record.requests_served == 0 for record in Decoder().feed(data))


def test_writer_ignores_a_gone_arbiter() -> None:
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    try:
        Writer(write_fd, 1).snapshot()  # BrokenPipeError is swallowed
    finally:
        os.close(write_fd)
