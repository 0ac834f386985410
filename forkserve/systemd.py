"""systemd integration: ``sd_notify`` messages and socket activation (``LISTEN_FDS``).

Owns: the notify protocol (one ``KEY=VALUE`` per line in one datagram to ``$NOTIFY_SOCKET``)
and reading the socket-activation variables. It decides nothing: the arbiter says *when*
(ready, reloading, stopping, a status, a watchdog ping); this module only knows *how*.

Must not import anything but the standard library: no forkserve module (the arbiter imports
this one), and never libsystemd or a binding of it. The protocol is a few lines; see
sd_notify(3) and sd_listen_fds(3).

# -- runs in the arbiter's loop ----------------------------------------------------------------
Only there: never in a signal handler and never in a worker. Sending is non-blocking and never
raises, so a vanished or full notify socket cannot stall or crash the loop.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Mapping

SD_LISTEN_FDS_START = 3  # sd_listen_fds(3): passed sockets start at fd 3, in order
ACTIVATION_ENV_VARS = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


def _positive_int(value: str | None) -> int | None:
    """A strictly positive decimal integer, or None. Stricter than ``int()``, which would also
    take ``" 12"``, ``"+12"`` and ``"1_2"``: systemd only ever writes plain digits."""
    if not value or not value.isascii() or not value.isdigit():
        return None
    number = int(value)
    return number if number > 0 else None


def _one_line(text: str) -> str:
    """A value can not span lines: a newline would start a new ``KEY=`` assignment."""
    return " ".join(text.splitlines())


def _address(value: str | None) -> bytes | None:
    """``$NOTIFY_SOCKET`` as a socket address: an absolute path, or ``@name`` for a name in the
    abstract namespace (a leading NUL byte). Anything else (unset, empty, relative, or the
    ``vsock:`` form of systemd >= 254 that we do not speak) disables notification."""
    if not value:
        return None
    if value.startswith("@"):
        return b"\0" + os.fsencode(value[1:])
    if value.startswith("/"):
        return os.fsencode(value)
    return None


class Notifier:
    """Tells the service manager what the arbiter is doing, if ``$NOTIFY_SOCKET`` asks it to.

    The environment is only read, never changed: ``NOTIFY_SOCKET`` and ``WATCHDOG_*`` stay in
    ``os.environ`` because an in-place re-exec (USR2) keeps the PID and must go on notifying.
    Workers inherit the variables but never construct a Notifier; ``NotifyAccess=main`` would
    drop their messages anyway.

    Every message opens its own socket and closes it, as libsystemd does: no descriptor is held
    between messages, so none leaks into forked workers or across exec.
    """

    def __init__(self, environ: Mapping[str, str]) -> None:
        self._address = _address(environ.get("NOTIFY_SOCKET"))
        self._watchdog_usec = _positive_int(environ.get("WATCHDOG_USEC"))
        watchdog_pid = environ.get("WATCHDOG_PID")
        # Set but unreadable is not "unset": the pings were meant for some specific process,
        # and we cannot tell that it is us (sd_watchdog_enabled treats it as an error).
        self._watchdog_pid: int | None = (
            None if watchdog_pid is None else (_positive_int(watchdog_pid) or -1))

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def send(self, *lines: str) -> bool:
        """Send ``KEY=VALUE`` lines as one datagram. True if the datagram was sent; False if
        notification is off or sending failed (the manager went away, its queue is full, we
        are out of descriptors). Never raises, never blocks, never logs: the caller decides
        whether a lost message matters."""
        if self._address is None or not lines:
            return False
        data = "\n".join(lines).encode("utf-8", "replace")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.setblocking(False)
                sock.sendto(data, self._address)
        except OSError:
            return False
        return True

    def ready(self, status: str = "") -> bool:
        """Start-up, or a reload, is complete. ``MAINPID`` names us as the main process, which
        matters when forkserve was not started by the manager directly (a wrapper script)."""
        lines = ["READY=1"]
        if status:
            lines.append(f"STATUS={_one_line(status)}")
        lines.append(f"MAINPID={os.getpid()}")
        return self.send(*lines)

    def reloading(self, status: str = "") -> bool:
        """A reload (HUP) or upgrade (USR2) begins; ``ready()`` must follow when it is over.

        ``MONOTONIC_USEC`` is what ``Type=notify-reload`` (systemd >= 253) uses to match this
        message to the reload it asked for; older managers ignore it."""
        monotonic_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        lines = ["RELOADING=1", f"MONOTONIC_USEC={monotonic_usec}"]
        if status:
            lines.append(f"STATUS={_one_line(status)}")
        return self.send(*lines)

    def stopping(self, status: str = "") -> bool:
        """The drain begins: the manager shows "deactivating" instead of "active"."""
        lines = ["STOPPING=1"]
        if status:
            lines.append(f"STATUS={_one_line(status)}")
        return self.send(*lines)

    def status(self, text: str) -> bool:
        """A free-form, one-line status, shown by ``systemctl status``."""
        return self.send(f"STATUS={_one_line(text)}")

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between ``WATCHDOG=1`` pings: half of ``WATCHDOG_USEC`` (what sd_watchdog_enabled(3)
        recommends), or None when no watchdog is asked of this process. ``WATCHDOG_PID``, when
        set, must be our PID: it is compared now, not at construction, so a forked child that
        kept the object would not ping in the arbiter's name."""
        if self._watchdog_usec is None:
            return None
        if self._watchdog_pid is not None and self._watchdog_pid != os.getpid():
            return None
        return self._watchdog_usec / 2 / 1e6

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")


def status_line(state: str, totals: Mapping[str, int]) -> str:
    """The ``STATUS=`` text for a state and the arbiter's counter totals, e.g.
    ``draining: 1 in flight, 2 connections, 0 background tasks``."""
    return (f"{state}: {totals.get('in_flight_requests', 0)} in flight, "
            f"{totals.get('active_connections', 0)} connections, "
            f"{totals.get('background_tasks', 0)} background tasks")


def listen_fds(environ: Mapping[str, str], pid: int) -> list[tuple[int, str]]:
    """The sockets the service manager passed us (socket activation): ``[(fd, name), ...]``.

    They are fds 3, 4, ... ``3 + LISTEN_FDS - 1``, but only when ``LISTEN_PID`` is ``pid``:
    the variables are inherited by children that were not meant to take the sockets. Names
    come from ``LISTEN_FDNAMES`` (colon-separated, ``FileDescriptorName=`` in the .socket unit);
    a missing name is ``""`` and extra names are ignored, because a name is only a label and
    the sockets are real.

    Returns ``[]`` when activation is not for us, and also when the values are invalid: a
    ``LISTEN_PID`` or ``LISTEN_FDS`` that is not a plain positive decimal number, or an fd in
    the range that is not open. The caller then binds ``--bind`` as usual; if the manager did
    hold the port, that bind fails with a clear error instead of us adopting a wrong fd.

    The fds are made close-on-exec, so a program the application runs does not inherit the
    listening sockets; an in-place re-exec passes them on explicitly. Whether each one is a
    listening stream socket is checked where sockets are adopted (:mod:`forkserve.sockets`).
    """
    listen_pid = _positive_int(environ.get("LISTEN_PID"))
    count = _positive_int(environ.get("LISTEN_FDS"))
    if listen_pid is None or count is None or listen_pid != pid:
        return []
    fds = list(range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + count))
    try:
        for fd in fds:
            os.set_inheritable(fd, False)
    except OSError:
        return []
    raw_names = environ.get("LISTEN_FDNAMES")
    names = raw_names.split(":") if raw_names is not None else []
    names += [""] * (count - len(names))
    return list(zip(fds, names[:count]))


def activation_env_vars() -> tuple[str, ...]:
    """The variables to remove from ``os.environ`` once the sockets are adopted. An in-place
    re-exec keeps our PID, so a ``LISTEN_PID`` left behind would match again in the new image
    and make it take fds 3... that by then are something else."""
    return ACTIVATION_ENV_VARS
