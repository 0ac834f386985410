"""The access log: one line per request, as Apache's combined format (plus the duration), as
JSON, or as a template of named fields.

Lines are buffered in the worker and written in one ``write`` when the worker is about to wait
for work (so an idle server's log is current) or when the buffer passes 64 KiB (so a busy one
does one write per many requests). ``O_APPEND`` keeps lines from different workers whole.
Nothing is formatted at all when the access log is off: the worker does not create a sink.

USR1 reopens the file (logrotate): what is buffered goes to the old file first, then the new
file takes every later line; a lock keeps a request thread's flush from writing to a descriptor
being swapped, so no line is lost or written twice.

A write that fails (a full disk) drops its lines and serving goes on; the loss is counted and
told at a bounded rate (:mod:`forkserve.telemetry.losses`).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time

from forkserve.telemetry.losses import ErrorSink, LostLines, write_all

FLUSH_AT = 65536
REQUEST_ID_MAX = 200  # longer incoming X-Request-ID values are replaced, not logged

class AccessLog:
    def __init__(self, target: str, fmt: str = "combined", errors: ErrorSink | None = None) -> None:
        self.target = target
        self.losses = LostLines(f"access log {target}", errors)
        self.fmt = fmt
        self.template = None if fmt in ("combined", "json") else fmt + "\n"
        self.fd = -1
        self._owns_fd = False
        self._lines: list[str] = []
        self._size = 0
        self._stamp = (-1, "")  # (second, its text): one tuple, so request threads never mix them
        self._iso = (-1, "")  # the same for ISO 8601, without the milliseconds
        self._lock = threading.Lock()  # flush and reopen; emitting needs none (list.append)
        self.pid = os.getpid()
        self.open()

    def open(self) -> None:
        if self.target == "-":
            self.fd = sys.stdout.fileno()
            self._owns_fd = False
        else:
            # As forkserve.logs.open_append (the arbiter's check before forking opens it so).
            self.fd = os.open(self.target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            self._owns_fd = True

    def timestamp(self, when: float) -> str:
        second = int(when)
        cached = self._stamp
        if cached[0] == second:
            return cached[1]
        text = time.strftime("%d/%b/%Y:%H:%M:%S +0000", time.gmtime(when))
        self._stamp = (second, text)
        return text

    def iso(self, when: float) -> str:
        second = int(when)
        cached = self._iso
        if cached[0] != second:
            cached = self._iso = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(when)))
        return f"{cached[1]}.{int(when % 1 * 1000):03d}Z"

    def request(self, remote: str, method: str, target: str, protocol: str, status: int,
                size: int, referer: str | None, agent: str | None, started: float,
                duration: float, request_id: str) -> None:
        if self.fmt == "combined":
            line = (f'{remote} - - [{self.timestamp(started)}] "{method} {_quote(target)} '
                    f'{protocol}" {status} {size if size else "-"} "{_quote(referer or "-")}" '
                    f'"{_quote(agent or "-")}" {duration:.6f} {_quote(request_id)}\n')
        else:
            # The names are forkserve.config.ACCESS_LOG_FIELDS (a test keeps them equal).
            path, _, query = target.partition("?")
            fields = {
                "time": self.timestamp(started), "time_iso": self.iso(started),
                "remote_addr": remote, "method": method, "path": path, "query": query,
                "target": target, "protocol": protocol, "status": status, "bytes": size,
                "duration_us": int(duration * 1e6), "duration": f"{duration:.6f}",
                "referer": referer or "-", "user_agent": agent or "-",
                "request_id": request_id, "pid": self.pid,
            }
            if self.template is None:
                fields["duration"] = round(duration, 6)
                line = _JSON(fields) + "\n"
            else:
                # The text fields, quoted: from the locals, whose type (str) mypy knows.
                fields.update(path=_quote(path), query=_quote(query), target=_quote(target),
                              referer=_quote(referer or "-"), user_agent=_quote(agent or "-"),
                              request_id=_quote(request_id), method=_quote(method))
                line = self.template.format_map(fields)
        self.emit(line)

    def emit(self, line: str) -> None:
        self._lines.append(line)
        self._size += len(line)
        if self._size >= FLUSH_AT:
            self.flush()

    def flush(self) -> None:
        if not self._lines:
            return
        with self._lock:
            self._write_out()

    def flush_from_handler(self) -> None:
        """``flush`` from a signal handler (a worker whose arbiter died): the thread it
        interrupted may be inside ``flush`` holding the lock, so it waits for the lock only
        briefly and leaves the lines unwritten rather than hang (a hung worker would keep the
        port)."""
        if self._lines and self._lock.acquire(timeout=0.2):
            try:
                self._write_out()
            finally:
                self._lock.release()

    def _write_out(self) -> None:
        # Swapped, not cleared: request threads may emit while this runs.
        lines, self._lines = self._lines, []
        self._size = 0
        if not lines:
            return
        data = "".join(lines).encode("utf-8", "backslashreplace")
        try:
            write_all(self.fd, data)
        except OSError as exc:
            # Serving goes on; the lines are gone (a partly written batch counts whole).
            self.losses.failed(len(lines), exc)
            return
        self.losses.succeeded()

    def reopen(self) -> None:
        with self._lock:
            self._write_out()  # what was logged before the rotation goes to the old file
            if self._owns_fd:
                old = self.fd
                self.open()
                os.close(old)

    def close(self) -> None:
        with self._lock:
            self._write_out()
            if self._owns_fd:
                os.close(self.fd)
            self.fd = -1


class RequestIds:
    """X-Request-ID: the client's (or its proxy's) when it is sane, else a new one.

    Generated ids are a random per-worker prefix plus a counter: unique across workers and
    restarts without a call to the random source per request.
    """

    def __init__(self) -> None:
        self.prefix = os.urandom(8).hex()
        self.counter = itertools.count(1)  # next() is atomic: request threads share it

    def take(self, incoming: str | None) -> str:
        if incoming and len(incoming) <= REQUEST_ID_MAX and incoming.isprintable() \
                and " " not in incoming and '"' not in incoming:
            return incoming
        return f"{self.prefix}-{next(self.counter):x}"


def _quote(text: str) -> str:
    """Escape what would break the line's format or a terminal (CVE-style log injection)."""
    if text.isprintable() and '"' not in text and "\\" not in text:
        return text
    return "".join(c if c.isprintable() and c not in '"\\' else repr(c)[1:-1] if c != '"' else '\\"'
                   for c in text)


# ASCII only: a client's C1 controls or U+2028 never split or colour a JSON line.
_JSON = json.JSONEncoder(separators=(",", ":")).encode

__all__ = ["AccessLog", "RequestIds"]
