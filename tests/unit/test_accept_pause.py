"""accept() ran out of descriptors (EMFILE), so accepting pauses for a moment
(``Pipeline.accept_paused_for``). A running worker's loop leaves its listeners out of its poll
meanwhile: ``accept_from`` says "nobody" at once. A worker that is about to close its copy of
the listener (stopping, or paused by TTOU) empties the queue first; there, "nobody" would
end the emptying and the close could reset the clients still queued, so it waits out the
pause and looks again. Real sockets on 127.0.0.1; the pause is set as the EMFILE would set it.
"""

from __future__ import annotations

import socket
import time
from typing import Any, Iterator

import pytest

from forkserve.sockets import Listener
from forkserve.workers.base import WorkerEvent

PAUSE = 0.2  # seconds left of the accept pause when the worker looks (and waits it out)
LONG_PAUSE = 5.0  # one a running worker must not wait out (a bound no loaded machine reaches)


@pytest.fixture
def queued() -> Iterator[tuple[Listener, socket.socket]]:
    """A non-blocking listener (as a worker's are) with one client in its accept queue."""
    sock = socket.create_server(("127.0.0.1", 0))
    sock.setblocking(False)
    client = socket.create_connection(sock.getsockname(), timeout=10)
    yield Listener(sock, "127.0.0.1:0"), client
    client.close()
    sock.close()


def test_a_running_worker_skips_its_listener_while_accepting_is_paused(
        worker: Any, queued: tuple[Listener, socket.socket]) -> None:
    listener, client = queued
    w = worker()
    w.accept_resumes = time.monotonic() + LONG_PAUSE
    started = time.monotonic()
    assert w.accept_from(listener) is None
    assert time.monotonic() - started < LONG_PAUSE  # not waited out: the loop goes on serving
    # Once the pause is over the client is taken (it waited in the queue meanwhile).
    w.accept_resumes = time.monotonic() - 0.001
    accepted = w.accept_from(listener)
    assert accepted is not None
    accepted[0].close()


@pytest.mark.parametrize("why", ["paused", "stopping"])
def test_a_worker_emptying_its_queue_waits_out_the_pause(
        worker: Any, queued: tuple[Listener, socket.socket], why: str) -> None:
    listener, client = queued
    w = worker()
    if why == "paused":
        w.pause_requested = True  # TTOU: still RUNNING, the queue is served, then closed
    else:
        w._enter(WorkerEvent.STOP)
    w.accept_resumes = time.monotonic() + PAUSE
    accepted = w.accept_from(listener)
    assert accepted is not None, "the queued client was given up (closing would reset it)"
    assert time.monotonic() >= w.accept_resumes  # it did wait for the pause to end
    sock, _ = accepted
    with sock:
        sock.setblocking(True)
        client.sendall(b"ping")
        assert sock.recv(4) == b"ping"  # the very client that was queued
