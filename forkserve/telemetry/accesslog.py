"""The access log: one line per request, Apache combined format plus the duration.

Lines are buffered in the worker and written in one ``write`` when the worker is about to wait
for work (so an idle server's log is current) or when the buffer passes 64 KiB (so a busy one
does one write per many requests). ``O_APPEND`` keeps lines from different workers whole.
Nothing is formatted at all when the access log is off: the worker does not create a sink.
"""

from __future__ import annotations

import os
import sys
import time

FLUSH_AT = 65536


class AccessLog:
    def __init__(self, target: str) -> None:
        self.target = target
        self.fd = -1
        self._owns_fd = False
        self._lines: list[str] = []
        self._size = 0
        self._second = -1
        self._stamp = ""
        self.open()

    def open(self) -> None:
        if self.target == "-":
            self.fd = sys.stdout.fileno()
            self._owns_fd = False
        else:
            self.fd = os.open(self.target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            self._owns_fd = True

    def timestamp(self, when: float) -> str:
        second = int(when)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime("%d/%b/%Y:%H:%M:%S +0000", time.gmtime(when))
        return self._stamp

    def request(self, remote: str, method: str, target: str, protocol: str, status: int,
                size: int, referer: str | None, agent: str | None, started: float,
                duration: float) -> None:
        line = (f'{remote} - - [{self.timestamp(started)}] "{method} {_quote(target)} {protocol}" '
                f'{status} {size if size else "-"} "{_quote(referer or "-")}" '
                f'"{_quote(agent or "-")}" {duration:.6f}\n')
        self.emit(line)

    def emit(self, line: str) -> None:
        self._lines.append(line)
        self._size += len(line)
        if self._size >= FLUSH_AT:
            self.flush()

    def flush(self) -> None:
        if not self._lines:
            return
        # Swapped, not cleared: request threads may emit while this runs.
        lines, self._lines = self._lines, []
        self._size = 0
        data = "".join(lines).encode("utf-8", "backslashreplace")
        try:
            while data:
                written = os.write(self.fd, data)
                data = data[written:]
        except OSError as exc:
            # Report once on stderr; there is no better place, and serving must go on.
            sys.stderr.write(f"forkserve: access log {self.target}: {exc.strerror}\n")

    def reopen(self) -> None:
        self.flush()
        if self._owns_fd:
            old = self.fd
            self.open()
            os.close(old)

    def close(self) -> None:
        self.flush()
        if self._owns_fd:
            os.close(self.fd)
        self.fd = -1


def _quote(text: str) -> str:
    """Escape what would break the line's format or a terminal (CVE-style log injection)."""
    if text.isprintable() and '"' not in text and "\\" not in text:
        return text
    return "".join(c if c.isprintable() and c not in '"\\' else repr(c)[1:-1] if c != '"' else '\\"'
                   for c in text)
