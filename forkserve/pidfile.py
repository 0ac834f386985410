"""The pidfile: written atomically, removed only by the process that wrote it."""

from __future__ import annotations

import os


class Pidfile:
    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        self.pid = 0

    def write(self) -> None:
        self.pid = os.getpid()
        directory = os.path.dirname(self.path)
        import tempfile  # (only with --pid: 300 KiB of modules in every worker otherwise)

        fd, tmp = tempfile.mkstemp(prefix=".forkserve-pid-", dir=directory)
        try:
            os.write(fd, f"{self.pid}\n".encode())
            os.fchmod(fd, 0o644)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)  # readers never see a half-written file

    def remove(self) -> None:
        """Remove the file if it still names us (a successor may have replaced it)."""
        try:
            with open(self.path, encoding="ascii") as fh:
                owner = int(fh.read().strip() or 0)
        except (OSError, ValueError):
            return
        if owner == self.pid == os.getpid():
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                return
