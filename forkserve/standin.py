"""The status stand-in: a child of the arbiter that answers on the status listener while an
in-place upgrade execs (see forkserve.arbiter.upgrade, which forks it).

Imports: the status server, the reactor and the standard library only.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from forkserve.reactor import Callback, Reactor
from forkserve.status import POLLIN, Answer, StatusServer


# -- the status stand-in (a child of the arbiter, during an in-place upgrade's exec) -------------
# Between the old image's execve and the new image's status server, nobody would accept on the
# status listener (Python start-up, imports, config: 150-500 ms, seconds under load): a
# balancer's checks time out and it takes the only instance out while its workers serve
# (issue 10). The stand-in, forked just before the exec, answers meanwhile from what the old
# image knew at that moment. It holds only the status listener, the alive pipe's read end and
# the log: never the main listeners, the counter pipe or the control socket.

STAND_IN_LIFETIME = 10.0  # seconds: a new image that never comes must not leave it running
STAND_IN_FINISH = 1.0  # seconds its accepted requests get once it is told to stop
RETRY_AFTER = (("Retry-After", "1"),)


OPENMETRICS_PATH = "/metrics (OpenMetrics)"  # the stand-in's key for that format's answer


def run_stand_in(sock: socket.socket, wakeup_fd: int, alive_fd: int,
                 answers: dict[str, Answer], log: Any, adopted: StatusServer | None = None,
                 lifetime: float = STAND_IN_LIFETIME) -> int:
    """Answer ``answers`` by path (anything else 503 with Retry-After) on ``sock``, and the
    clients the arbiter had accepted (``adopted``: its status server, as forked), until a
    byte arrives on ``wakeup_fd`` (SIGTERM from the new image: its own status server listens
    now), ``alive_fd`` ends (the arbiter is gone) or ``lifetime`` passes. Then stop accepting —
    what is queued stays in the listener for the new image — answer what was accepted (bounded
    by STAND_IN_FINISH) and return the exit code. One request per connection, as StatusServer."""
    answered = 0
    fallback: Answer = (503, "text/plain; charset=utf-8", b"upgrading; retry shortly\n",
                        RETRY_AFTER)

    def handler(method: str, path: str, headers: dict[bytes, bytes]) -> Answer:
        nonlocal answered
        answered += 1
        if path == "/metrics" and b"application/openmetrics-text" in headers.get(b"accept", b""):
            path = OPENMETRICS_PATH
        return answers.get(path, fallback)

    reactor = Reactor()
    server = StatusServer(sock, reactor, handler, log)
    if adopted is not None:
        server.adopt(adopted.clients, adopted.waiting)
    reason = ""

    def stop(why: str) -> Callback:
        def stopped(fd: int, events: int) -> None:
            nonlocal reason
            reason = reason or why
        return stopped
    reactor.add(wakeup_fd, POLLIN, stop("the new image's status server listens"))
    reactor.add(alive_fd, POLLIN, stop("the arbiter is gone"))  # nobody writes: any event ends it
    deadline = time.monotonic() + lifetime
    finish_by: float | None = None  # set once told to stop: the accepted clients' bound
    while True:
        now = time.monotonic()
        if finish_by is None and (reason or now >= deadline):
            reason = reason or "its lifetime is over"
            reactor.remove(wakeup_fd)  # (both stay readable: watched on, they would spin)
            reactor.remove(alive_fd)
            server.stop_listening()  # our copy only: the new image holds the listener and its queue
            finish_by = now + STAND_IN_FINISH
        if finish_by is not None and (not server.clients or now >= finish_by):
            break
        until = deadline if finish_by is None else finish_by
        client_deadline = server.next_deadline()
        if client_deadline is not None:
            until = min(until, client_deadline)
        reactor.dispatch(reactor.wait(until - now))
        server.expire(time.monotonic())
    server.close()  # what is left past the bound
    log.info("Upgrade: the status stand-in stopped", reason=reason, answered=answered)
    return 0
