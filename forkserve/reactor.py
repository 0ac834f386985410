"""The arbiter's one poll: each descriptor registered with the callback that handles it.

Owns: which descriptors the loop watches, for which events, and who handles each. The arbiter
(its signal pipe and counter pipe), the status server and the control socket register here;
the loop blocks in ``wait`` until the earliest deadline, does its own round (signals,
counters, reaping), then ``dispatch``es what was ready to the owners' callbacks. Nobody else
polls, and no raw poller is handed around: an owner knows the reactor, not the other owners.
The status stand-in, a child of its own, runs its own reactor.

Callbacks run in the loop, must not block, and must tolerate a spurious wake (a descriptor
closed by an earlier callback of the same round and its number taken by a new one): all
their I/O is non-blocking.

Imports only the standard library.
"""

from __future__ import annotations

import select
from typing import Callable

Callback = Callable[[int, int], None]  # (fd, the events poll reported)
# A wait with no deadline still wakes hourly; and poll() overflows past ~24 days (a
# --drain-timeout of 1e7 is legal).
MAX_POLL_MS = 3_600_000.0


class Reactor:
    def __init__(self) -> None:
        self._poll = select.poll()
        self._callbacks: dict[int, Callback] = {}

    def add(self, fd: int, events: int, callback: Callback) -> None:
        self._poll.register(fd, events)
        self._callbacks[fd] = callback

    def modify(self, fd: int, events: int) -> None:
        """Watch ``fd`` for other events (0: only its hang-up and errors)."""
        self._poll.modify(fd, events)

    def remove(self, fd: int) -> None:
        """Before ``fd`` is closed: its number may belong to someone else next."""
        del self._callbacks[fd]
        self._poll.unregister(fd)

    def __contains__(self, fd: int) -> bool:
        return fd in self._callbacks

    def wait(self, timeout: float | None) -> list[tuple[int, int]]:
        """Block until something is ready or ``timeout`` seconds pass (None: no deadline)."""
        ms = MAX_POLL_MS if timeout is None else min(max(timeout, 0.0) * 1000.0 + 1, MAX_POLL_MS)
        return self._poll.poll(ms)

    def dispatch(self, ready: list[tuple[int, int]]) -> None:
        for fd, events in ready:
            callback = self._callbacks.get(fd)
            if callback is not None:  # else removed by an earlier callback of this round
                callback(fd, events)
