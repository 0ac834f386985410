"""Structured error/lifecycle log, shared by the arbiter and the workers.

Owns: the one log line format (text for people, JSON for machines), level filtering and
reopening the file on USR1. Imports only the standard library.

Why not :mod:`logging`: its module-level locks are a known hazard across ``fork()`` and its
formatting machinery costs more than we want on any path. Each record here is one
``os.write`` of one line on an ``O_APPEND`` descriptor, so lines from the arbiter and every
worker never interleave mid-line (up to PIPE_BUF bytes, which every lifecycle line is).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
_NAMES = {10: "DEBUG", 20: "INFO", 30: "WARNING", 40: "ERROR", 50: "CRITICAL"}


class Log:
    """A line-oriented logger writing to a path or to stderr (``-``)."""

    def __init__(self, target: str = "-", level: str = "info", fmt: str = "text") -> None:
        self.target = target
        self.threshold = LEVELS[level]
        self.json = fmt == "json"
        self.fd = -1
        self._owns_fd = False
        self.open()

    # -- file handling ---------------------------------------------------------------
    def open(self) -> None:
        if self.target in ("-", ""):
            self.fd = sys.stderr.fileno()
            self._owns_fd = False
        else:
            self.fd = os.open(self.target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            self._owns_fd = True

    def reopen(self) -> None:
        """USR1: logrotate moved the file away; open the path anew, then drop the old fd."""
        if not self._owns_fd:
            return
        old = self.fd
        self.open()
        os.close(old)

    def configure(self, level: str, fmt: str) -> None:
        self.threshold = LEVELS[level]
        self.json = fmt == "json"

    # -- records -----------------------------------------------------------------------
    def enabled(self, level: int) -> bool:
        return level >= self.threshold

    def log(self, level: int, message: str, fields: dict[str, Any]) -> None:
        if level < self.threshold or self.fd < 0:
            return
        now = time.time()
        if self.json:
            record: dict[str, Any] = {
                "time": _iso(now),
                "level": _NAMES[level],
                "message": message,
                "pid": os.getpid(),
            }
            record.update(fields)
            line = json.dumps(record, default=str, separators=(",", ":"))
        else:
            extra = "".join(f" {k}={_text_value(v)}" for k, v in fields.items())
            line = f"[{_iso(now)}] [{os.getpid()}] [{_NAMES[level]}] {message}{extra}"
        self.write_line(line)

    def write_line(self, line: str) -> None:
        data = (line + "\n").encode("utf-8", "backslashreplace")
        try:
            while data:
                written = os.write(self.fd, data)
                data = data[written:]
        except OSError:
            # A log that cannot be written must never take the server down (EPIPE on a
            # closed stderr, ENOSPC). There is nowhere left to report it.
            return

    def debug(self, message: str, **fields: Any) -> None:
        if self.threshold <= 10:
            self.log(10, message, fields)

    def info(self, message: str, **fields: Any) -> None:
        if self.threshold <= 20:
            self.log(20, message, fields)

    def warning(self, message: str, **fields: Any) -> None:
        self.log(30, message, fields)

    def error(self, message: str, **fields: Any) -> None:
        self.log(40, message, fields)

    def exception(self, message: str, exc: BaseException, **fields: Any) -> None:
        """An error line with the traceback: folded into one JSON field, or indented text."""
        import traceback

        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
        if self.json:
            self.log(40, message, {**fields, "traceback": tb})
        else:
            self.log(40, message + "\n" + tb, fields)


def _iso(now: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"


def _text_value(value: Any) -> str:
    text = str(value)
    return json.dumps(text) if (" " in text or not text) else text
