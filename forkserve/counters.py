"""The counter pipe: the only contract the workers and the arbiter share.

Owns: the record codec, the worker-side writer and the arbiter-side reader, and the worker
exit codes. Imports only the standard library.

Each worker writes fixed-size binary records to one pipe that the arbiter reads. A record is
far below PIPE_BUF (4096 on Linux), so every write is atomic and records from different workers
never interleave. A record carries *absolute* values (connections, in-flight requests,
background tasks, requests served), never deltas: a worker that dies takes its numbers with it
and nothing drifts. Every record is also a heartbeat. The pipe's ends are non-blocking: a worker
never waits on the arbiter; if the pipe is ever full a snapshot is dropped and the next one,
being absolute, makes up for it.

Like Puma's ``PIPE_*`` records (``lib/puma/const.rb``), but binary snapshots.
"""

from __future__ import annotations

import enum
import os
import struct
from dataclasses import dataclass


class Kind(enum.IntEnum):
    BOOTED = 1  # the app is loaded, the worker is accepting
    SNAPSHOT = 2  # counters + heartbeat
    BOOT_ERROR = 3  # loading the app failed; followed by an error text
    RETIRING = 4  # the worker is leaving on its own; its text is retiring_text(reason, ...)
    DRAINING = 5  # the worker took the stop: from now on it reports every counter change


class ExitCode(enum.IntEnum):
    """Process exit codes, for the arbiter and for the workers."""

    OK = 0
    ERROR = 1  # anything else (e.g. an address that cannot be bound)
    USAGE = 2  # bad usage or configuration
    WORKER_BOOT_ERROR = 3  # a worker died while booting
    APP_LOAD_ERROR = 4  # the application could not be imported: do not restart blindly


# kind, worker id, pid, active connections, in-flight requests, background tasks,
# requests served, text length (the text, if any, follows the fixed part).
_RECORD = struct.Struct("<BxHiIIIQH")
RECORD_SIZE = _RECORD.size
MAX_TEXT = 1024  # keeps every record far below PIPE_BUF


@dataclass
class Record:
    kind: Kind
    worker_id: int
    pid: int
    active_connections: int = 0
    in_flight_requests: int = 0
    background_tasks: int = 0
    requests_served: int = 0
    text: str = ""


def encode(record: Record) -> bytes:
    text = record.text.encode("utf-8", "replace")[:MAX_TEXT]
    return _RECORD.pack(record.kind, record.worker_id, record.pid, record.active_connections,
                        record.in_flight_requests, record.background_tasks,
                        record.requests_served, len(text)) + text


class Decoder:
    """Arbiter side: bytes from the pipe in, whole records out (a read may end mid-record)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[Record]:
        buffer = self._buffer + data
        records = []
        offset = 0
        while len(buffer) - offset >= RECORD_SIZE:
            kind, wid, pid, conns, inflight, bg, served, text_len = _RECORD.unpack_from(buffer, offset)
            end = offset + RECORD_SIZE + text_len
            if end > len(buffer):
                break
            text = buffer[offset + RECORD_SIZE:end].decode("utf-8", "replace")
            records.append(Record(Kind(kind), wid, pid, conns, inflight, bg, served, text))
            offset = end
        self._buffer = buffer[offset:]
        return records


# Why a worker leaves on its own (a RETIRING record's reason): the limit it reached.
RETIRE_REASONS = ("max-requests", "max-rss", "max-lifetime")


def retiring_text(reason: str, description: str) -> str:
    """A RETIRING record's text: the reason (one of RETIRE_REASONS), a tab, and what the
    arbiter logs of it (the figure: requests served, the RSS, the age)."""
    return f"{reason}\t{description}"


def retiring_reason(text: str) -> tuple[str, str]:
    """(reason, description) of a RETIRING record's text (no reason: max-requests)."""
    reason, tab, description = text.partition("\t")
    return (reason, description) if tab else ("max-requests", text)


class Writer:
    """Worker side: the counters this worker owns and the pipe they are reported on."""

    __slots__ = ("fd", "worker_id", "pid", "active_connections", "in_flight_requests",
                 "background_tasks", "requests_served")

    def __init__(self, fd: int, worker_id: int) -> None:
        self.fd = fd
        self.worker_id = worker_id
        self.pid = os.getpid()
        self.active_connections = 0
        self.in_flight_requests = 0
        self.background_tasks = 0
        self.requests_served = 0

    def send(self, kind: Kind, text: str = "") -> bool:
        """One atomic write; False when the pipe was full (the caller may send it again)."""
        data = encode(Record(kind, self.worker_id, self.pid, self.active_connections,
                             self.in_flight_requests, self.background_tasks,
                             self.requests_served, text))
        try:
            os.write(self.fd, data)
        except BlockingIOError:
            return False  # pipe full: a later absolute snapshot supersedes this one
        except BrokenPipeError:
            return False  # the arbiter is gone; the parent-death pipe tells the worker to leave
        return True

    def snapshot(self) -> None:
        self.send(Kind.SNAPSHOT)

    def draining(self) -> bool:
        return self.send(Kind.DRAINING)
