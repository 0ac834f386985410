"""Signal plumbing: handlers that only record, a wakeup pipe the loop polls, fork hygiene.

Owns: installing handlers, reading which signals arrived, blocking signals across fork().
Imports only the standard library.

# -- runs in a signal handler ------------------------------------------------------------------
Nothing of ours does: the Python handler we install is empty. CPython's C-level handler writes
the signal number as one byte to the wakeup fd (``signal.set_wakeup_fd``); the loop reads those
bytes and dispatches. So there is no logging, locking or I/O in any handler.
"""

from __future__ import annotations

import os
import signal
from types import FrameType
from typing import Iterable


def _recorded(signum: int, frame: FrameType | None) -> None:
    """Intentionally empty: the wakeup fd already carries the signal number to the loop."""
    return None


class SignalQueue:
    def __init__(self, signals: Iterable[int]) -> None:
        self.read_fd, self.write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        self.signals = tuple(signals)
        for signum in self.signals:
            signal.signal(signum, _recorded)

    def fileno(self) -> int:
        return self.read_fd

    def drain(self) -> list[int]:
        """The signals received since the last call, in order."""
        received: list[int] = []
        while True:
            try:
                data = os.read(self.read_fd, 512)
            except BlockingIOError:
                return received
            if not data:
                return received
            received.extend(data)

    def close(self) -> None:
        signal.set_wakeup_fd(-1)
        for signum in self.signals:
            signal.signal(signum, signal.SIG_DFL)
        os.close(self.read_fd)
        os.close(self.write_fd)


ALL = set(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP}


def fork_with_signals_blocked() -> int:
    """fork() with every signal blocked, so none lands in the child before it has reset its
    handlers. The child must call :func:`unblock` once it has installed its own."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, ALL)
    pid = os.fork()
    if pid != 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    return pid


def reset_in_child(signals: Iterable[int]) -> None:
    signal.set_wakeup_fd(-1)
    for signum in signals:
        signal.signal(signum, signal.SIG_DFL)


def unblock() -> None:
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
