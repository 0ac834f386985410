"""Signal plumbing: handlers that only record, a wakeup pipe the loop polls, fork hygiene.

Owns: installing handlers, reading which signals arrived, blocking signals across fork() and
execve(). Imports only the standard library.

Blocking across execve (issue 10): an in-place upgrade blocks the handled signals before it
execs; the mask and the pending signals survive execve, so a signal sent meanwhile waits in the
kernel instead of killing the new image with its default action before it has handlers.
:class:`SignalQueue` unblocks them only once its handlers are installed.

# -- runs in a signal handler ------------------------------------------------------------------
Nothing of ours does: the Python handler we install is empty. CPython's C-level handler writes
the signal number as one byte to the wakeup fd (``signal.set_wakeup_fd``); the loop reads those
bytes and dispatches. So there is no logging, locking or I/O in any handler.
"""

from __future__ import annotations

import ctypes
import os
import signal
from types import FrameType
from typing import Iterable, Iterator


def _recorded(signum: int, frame: FrameType | None) -> None:
    """Intentionally empty: the wakeup fd already carries the signal number to the loop."""
    return None


class SignalQueue:
    def __init__(self, signals: Iterable[int]) -> None:
        self.read_fd, self.write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        self.signals = tuple(signals)
        self.pending: list[int] = []  # read from the pipe, not yet handed to the loop
        for signum in self.signals:
            signal.signal(signum, _recorded)
        # Only now that the handlers exist: after an in-place upgrade these signals arrive
        # blocked (see block()), and whatever was sent during the exec is delivered here, to
        # the wakeup pipe. On a fresh start this changes nothing.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self.signals)

    def fileno(self) -> int:
        return self.read_fd

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.read_fd, 512)
            except BlockingIOError:
                return
            if not data:
                return
            self.pending.extend(data)

    def drain(self) -> Iterator[int]:
        """The signals received so far, in order, one at a time: what is not yet taken when
        the loop stops iterating (an exec in the middle of a batch) stays in ``pending``."""
        self._read()
        while self.pending:
            yield self.pending.pop(0)

    def undelivered(self) -> list[int]:
        """Everything received and not yet handed out (the pipe included), now taken: what an
        exec must carry over (the pipe is close-on-exec)."""
        self._read()
        taken, self.pending = self.pending, []
        return taken

    def replay(self, signums: Iterable[int]) -> None:
        """Signals received by someone else (the image we replaced, or before a failed exec):
        queued as if they had arrived here, waking the loop."""
        data = bytes(signums)
        if data:
            os.write(self.write_fd, data)


# What the arbiter handles (blocked across an upgrade's exec: they reach the new image).
ARBITER_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGUSR1,
                   signal.SIGUSR2, signal.SIGCHLD, signal.SIGTTIN, signal.SIGTTOU)
ALL = set(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP}


def fork_with_signals_blocked() -> int:
    """fork() with every signal blocked, so none lands in the child before it has reset its
    handlers. The child must call :func:`unblock` once it has installed its own."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, ALL)
    pid = os.fork()
    if pid != 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    return pid


def block(signals: Iterable[int]) -> set[int]:
    """Block ``signals`` (they stay pending until unblocked, across execve too); returns the
    mask before, for :func:`set_mask`."""
    return signal.pthread_sigmask(signal.SIG_BLOCK, signals)


def set_mask(mask: Iterable[int]) -> None:
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def reset_in_child(signals: Iterable[int]) -> None:
    signal.set_wakeup_fd(-1)
    for signum in signals:
        signal.signal(signum, signal.SIG_DFL)


def stand_in_signals(inherited: Iterable[int], wake_on: Iterable[int],
                     ignore: Iterable[int]) -> int:
    """A small forked helper's own signal state (the upgrade's status stand-in), from scratch:
    the ``inherited`` handlers back to their defaults, ``wake_on`` recorded on a new wakeup
    pipe (returned: its read end), ``ignore`` ignored; then everything unblocked (the fork
    blocked all of them, and the exec's block of the arbiter's set is the parent's business)."""
    reset_in_child(inherited)
    read_fd, write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    for signum in wake_on:
        signal.signal(signum, _recorded)
    for signum in ignore:
        signal.signal(signum, signal.SIG_IGN)
    unblock()
    return read_fd


def unblock() -> None:
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def on_parent_death(signum: int) -> bool:
    """Have the kernel send ``signum`` to this process the moment its parent dies (Linux
    ``prctl(PR_SET_PDEATHSIG)``): a worker busy in a request, which polls nothing, learns of
    its arbiter's death at once. A change of credentials clears it (prctl(2)): call it after
    dropping privileges. False where the call does not exist."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
