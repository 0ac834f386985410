"""What a telemetry sink does when its file cannot be written (a full disk, a closed pipe):
serving goes on, the lines are dropped and counted, and the loss is told without flooding.

Owns: ``LostLines``, the count and the schedule of its reports: the first failure at once,
then at most one line per ``REPORT_INTERVAL`` per sink (so per worker) with the lines lost
since the previous report, and one line when writes succeed again with the lines lost in all.
A busy worker on a full disk fails on every flush: one line per failure (what the sinks did
before) is a flood of the error log, hundreds of lines a second.

Imports only the standard library (the reports go to whatever ``error(message, **fields)``
the worker gives: its error log; by default, a plain line on stderr).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Protocol

REPORT_INTERVAL = 10.0  # seconds between two reports of the same failing sink


class ErrorSink(Protocol):
    def error(self, message: str, **fields: Any) -> None: ...


class StderrLine:
    """The default report: one plain line on standard error (``forkserve: ...``)."""

    def error(self, message: str, **fields: Any) -> None:
        extra = "".join(f" {k}={v}" for k, v in fields.items())
        data = f"forkserve: {message}{extra}\n".encode("utf-8", "backslashreplace")
        try:
            os.write(2, data)
        except OSError:
            return  # stderr itself is gone: nowhere left to tell (the count goes on)


class LostLines:
    """One sink's failing writes. ``failed`` and ``succeeded`` are called after each write
    (by whichever thread flushed); the lock keeps the counts whole between request threads."""

    def __init__(self, what: str, report: ErrorSink | None = None,
                 interval: float = REPORT_INTERVAL) -> None:
        self.what = what  # "access log /var/log/app/access.log"
        self.report: ErrorSink = report if report is not None else StderrLine()
        self.interval = interval
        self.since_report = 0  # lines lost since the last report
        self.total = 0  # lines lost since writes began to fail (0: writes succeed)
        self.next_report = 0.0  # monotonic: no report before, unless writes recover
        self._lock = threading.Lock()

    def failed(self, lines: int, exc: OSError) -> None:
        error = exc.strerror or str(exc)
        with self._lock:
            self.since_report += lines
            self.total += lines
            now = time.monotonic()
            if now < self.next_report:
                return
            self.next_report = now + self.interval
            lost, total, self.since_report = self.since_report, self.total, 0
        self.report.error(f"Cannot write the {self.what} ({error}); {lost} line(s) lost since "
                          f"the last report, {total} in all; serving goes on, next report in "
                          f"{self.interval:g}s at the earliest", lost_lines=lost,
                          lost_total=total, error=error)

    def succeeded(self) -> None:
        if not self.total:  # the usual case: no lock taken
            return
        with self._lock:
            total, self.total, self.since_report, self.next_report = self.total, 0, 0, 0.0
        if total:
            self.report.error(f"The {self.what} is written again; {total} line(s) were lost "
                              "while it could not be", lost_total=total)


def write_all(fd: int, data: bytes) -> None:
    """All of ``data`` to ``fd``, or OSError: a descriptor that takes nothing (a write of 0)
    fails too, never spins."""
    while data:
        written = os.write(fd, data)
        if written <= 0:
            raise OSError(0, "the file took no bytes")
        data = data[written:]
