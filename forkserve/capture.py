"""--capture-output, the arbiter's side: a pipe per worker whose write end becomes the worker's
fd 1 and 2; the arbiter's loop reads it and logs each line as a record with the worker's pid.

Owns: the pipes, their buffers of partial lines, the split of over-long lines. Imports only the
standard library (the log is duck-typed: ``output(line, pid)``).

Why the arbiter reads: a worker ends with ``os._exit`` (and may be killed), so a reader thread
in the worker would lose its last lines; the pipe keeps them until the arbiter has read them,
and the arbiter reads until end of file (every write end closed), after the worker is gone.
Why a pipe per worker: a line must carry its writer's pid, and one pipe's writers are one.

Blocking: the write end stays blocking (a print() that raised BlockingIOError would break the
app), so a worker waits only when the pipe's buffer is full: ``PIPE_SIZE`` bytes unread (1 MiB
where the kernel allows, else its default 64 KiB), which the arbiter's loop, woken on every
write, drains at once unless it is itself stuck.

# -- runs in the loop (a reactor callback); nothing here runs in a signal handler.
"""

from __future__ import annotations

import fcntl
import os
import select
import sys
from typing import Any

LINE_MAX = 16384  # longer lines are split in records of this many bytes
PIPE_SIZE = 1 << 20
READ_SIZE = 65536
ROUND_READS = 16  # reads per wake-up of the loop (1 MiB), then the loop's other work
_SETPIPE = getattr(fcntl, "F_SETPIPE_SZ", 1031)


class Output:
    """One worker's pipe: what it wrote that is not a whole line yet."""

    def __init__(self, fd: int, pid: int) -> None:
        self.fd = fd
        self.pid = pid
        self.partial = b""


class OutputCapture:
    def __init__(self, reactor: Any, log: Any) -> None:
        self.reactor = reactor
        self.log = log
        self.outputs: dict[int, Output] = {}  # by read descriptor

    def pipe(self) -> tuple[int, int]:
        """A new worker's pipe: (read end, write end), neither inherited by anyone else."""
        r, w = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(r, False)
        try:
            fcntl.fcntl(w, _SETPIPE, PIPE_SIZE)
        except OSError:
            # The kernel's default (64 KiB) then: over /proc/sys/fs/pipe-max-size, or no such call.
            return r, w
        return r, w

    def read_fds(self) -> list[int]:
        """Every worker's read end: what a new worker must close."""
        return list(self.outputs)

    def watch(self, r: int, pid: int) -> None:
        self.outputs[r] = Output(r, pid)
        self.reactor.add(r, select.POLLIN, self._readable)

    def _readable(self, fd: int, events: int) -> None:
        output = self.outputs.get(fd)
        if output is not None:
            self._read(output, ROUND_READS)

    def _read(self, output: Output, reads: int = 1 << 30) -> bool:
        """Read what is there (at most ``reads`` times: a worker printing without end must not
        hold the loop); at end of file tell the partial line, stop watching, close. True when
        the pipe is done with."""
        for _ in range(reads):
            try:
                data = os.read(output.fd, READ_SIZE)
            except BlockingIOError:
                return False
            except OSError:
                data = b""
            if not data:
                if output.partial:
                    self._tell(output, output.partial)
                    output.partial = b""
                self.reactor.remove(output.fd)
                os.close(output.fd)
                del self.outputs[output.fd]
                return True
            self._split(output, output.partial + data)
        return False

    def _split(self, output: Output, data: bytes) -> None:
        start = 0
        while True:
            end = data.find(b"\n", start)
            if end < 0:
                break
            self._tell(output, data[start:end])
            start = end + 1
        rest = data[start:]
        while len(rest) >= LINE_MAX:
            self._tell(output, rest[:LINE_MAX])
            rest = rest[LINE_MAX:]
        output.partial = rest

    def _tell(self, output: Output, line: bytes) -> None:
        while len(line) > LINE_MAX:
            self._tell(output, line[:LINE_MAX])
            line = line[LINE_MAX:]
        text = line.decode("utf-8", "backslashreplace")
        if text.endswith("\r"):
            text = text[:-1]
        self.log.output(text, output.pid)

    def gone(self, pid: int) -> None:
        """The worker was reaped: what it wrote is read now (before the line that says it
        exited); the pipe closes at end of file (a child it left may still hold it)."""
        for output in [o for o in self.outputs.values() if o.pid == pid]:
            self._read(output, ROUND_READS)

    def close(self) -> None:
        """The arbiter stops: read what is left, whoever still holds a write end."""
        for output in list(self.outputs.values()):
            if not self._read(output, ROUND_READS):
                if output.partial:
                    self._tell(output, output.partial)
                self.reactor.remove(output.fd)
                os.close(output.fd)
                del self.outputs[output.fd]


def flush_std_streams() -> None:
    """What ``sys.stdout``/``sys.stderr`` buffer, written now: in the arbiter before a fork
    (so no child holds a copy), in a worker before ``os._exit`` (its last partial print()
    line, which --capture-output then tells at the pipe's end)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError, RuntimeError):
            continue
