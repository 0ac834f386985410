"""The status stand-in: a child of the arbiter that answers on the status listener while an
in-place upgrade execs (see forkserve.arbiter.upgrade, which forks it).

Imports: the status server and the standard library only.
"""

from __future__ import annotations

import select
import socket
import time
from typing import Any

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
                 answers: dict[str, Answer], log: Any,
                 lifetime: float = STAND_IN_LIFETIME) -> int:
    """Answer ``answers`` by path (anything else 503 with Retry-After) on ``sock`` until a byte
    arrives on ``wakeup_fd`` (SIGTERM from the new image: its own status server listens now),
    ``alive_fd`` ends (the arbiter is gone) or ``lifetime`` passes. Then stop accepting — what
    is queued stays in the listener for the new image — answer what was accepted (bounded by
    STAND_IN_FINISH) and return the exit code. One request per connection, as StatusServer."""
    answered = 0
    fallback: Answer = (503, "text/plain; charset=utf-8", b"upgrading; retry shortly\n",
                        RETRY_AFTER)

    def handler(method: str, path: str, headers: dict[bytes, bytes]) -> Answer:
        nonlocal answered
        answered += 1
        if path == "/metrics" and b"application/openmetrics-text" in headers.get(b"accept", b""):
            path = OPENMETRICS_PATH
        return answers.get(path, fallback)

    poller = select.poll()
    server = StatusServer(sock, poller, handler, log)
    poller.register(wakeup_fd, POLLIN)
    poller.register(alive_fd, POLLIN)  # nobody writes: any event is its end (POLLHUP)
    deadline = time.monotonic() + lifetime
    reason = "its lifetime is over"
    while True:
        now = time.monotonic()
        if now >= deadline:
            break
        client_deadline = server.next_deadline()
        until = deadline if client_deadline is None else min(deadline, client_deadline)
        ready = poller.poll(max(until - now, 0.0) * 1000.0 + 1)
        fds = {fd for fd, _ in ready}
        if wakeup_fd in fds:
            reason = "the new image's status server listens"
            break
        if alive_fd in fds:
            reason = "the arbiter is gone"
            break
        server.serve(ready, time.monotonic())
    server.stop_listening()  # our copy only: the new image holds the listener and its queue
    server.finish(time.monotonic() + STAND_IN_FINISH)
    log.info("Upgrade: the status stand-in stopped", reason=reason, answered=answered)
    return 0
