"""Structured error/lifecycle log, shared by the arbiter and the workers.

Owns: the one log line format (text for people, JSON for machines), level filtering and
reopening the file on USR1, and how every log file of ours is opened (``open_append``: the
arbiter checks the workers' files with it before forking). Imports only the standard library.

Why not :mod:`logging`: its module-level locks are a known hazard across ``fork()`` and its
formatting machinery costs more than we want on any path. Each record here is one
``os.write`` of one line on an ``O_APPEND`` descriptor, so lines from the arbiter and every
worker never interleave mid-line (up to PIPE_BUF bytes, which every lifecycle line is).
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from typing import Any

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
_NAMES = {10: "DEBUG", 20: "INFO", 30: "WARNING", 40: "ERROR", 50: "CRITICAL"}
# How every log file is opened, here and by the workers' sinks (forkserve.telemetry opens
# its files with the same flags and mode; a unit test keeps them equal).
APPEND_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
FILE_MODE = 0o644


def open_append(path: str) -> int:
    return os.open(path, APPEND_FLAGS, FILE_MODE)


def probe_append(path: str, keep: bool = True) -> None:
    """Open ``path`` as a worker will open it (append, create: as the arbiter's user, which
    is the worker's before it drops privileges) and close it; raises ``OSError``. So a log
    file that cannot be opened is one line before forking, not a traceback per worker per
    boot. ``keep`` False (--check): a file this call created is removed again."""
    try:
        fd = os.open(path, APPEND_FLAGS | os.O_EXCL, FILE_MODE)
        created = True
    except FileExistsError:  # (a symlink too, dangling or not: opened below, through it)
        fd = open_append(path)
        created = False
    os.close(fd)
    if created and not keep:
        os.unlink(path)


def open_error(path: str, exc: OSError) -> str:
    """Why ``path`` cannot be opened, for the one error line (a missing directory named)."""
    parent = os.path.dirname(os.path.abspath(path))
    if exc.errno == errno.ENOENT and not os.path.isdir(parent):
        return f"{exc.strerror} (no directory {parent})"
    if exc.errno == errno.EISDIR:
        return f"{exc.strerror} (give the path of a file in it)"
    return exc.strerror or str(exc)


class Log:
    """A line-oriented logger writing to a path or to stderr (``-``)."""

    def __init__(self, target: str = "-", level: str = "info", fmt: str = "text") -> None:
        self.target = target
        self.threshold = LEVELS[level]
        self.json = fmt == "json"
        self.fd = -1
        self._owns_fd = False
        # Lines a failing write dropped (a full disk): there is nowhere to report that but
        # this log, so they are counted, and told once a write succeeds again.
        self.lost = 0
        self.lost_error = ""
        self.open()

    # -- file handling ---------------------------------------------------------------
    def open(self) -> None:
        if self.target in ("-", ""):
            self.fd = sys.stderr.fileno()
            self._owns_fd = False
        else:
            self.fd = open_append(self.target)
            self._owns_fd = True

    def reopen(self) -> None:
        """USR1: logrotate moved the file away; open the path anew, then drop the old fd.
        Also the moment an operator who freed a full disk expects the losses told."""
        if not self._owns_fd:
            return
        old = self.fd
        self.open()
        os.close(old)
        self.report_lost()

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
        if self._write(line) and self.lost:
            self.report_lost()

    def _write(self, line: str) -> bool:
        data = (line + "\n").encode("utf-8", "backslashreplace")
        try:
            while data:
                written = os.write(self.fd, data)
                if written <= 0:  # never spin on a descriptor that takes nothing
                    raise OSError(errno.EIO, "the log took no bytes")
                data = data[written:]
        except OSError as exc:
            # A log that cannot be written must never take the server down (EPIPE on a
            # closed stderr, ENOSPC): the line is dropped, and counted.
            self.lost += 1
            self.lost_error = exc.strerror or str(exc)
            return False
        return True

    def report_lost(self) -> None:
        """Tell, in this log, how many lines it lost since the last time it could write
        (nothing when none were, or when it still cannot)."""
        if not self.lost:
            return
        lost, error = self.lost, self.lost_error
        self.lost = 0
        self.log(40, f"The error log could not be written ({error}); {lost} line(s) lost",
                 {"lost_lines": lost})
        if self.lost:  # this line failed too: the count stands, for the next write to tell
            self.lost = lost

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
