"""The control socket's server never blocks the arbiter's loop: an answer bigger than the
socket takes at once is sent as the client makes room, polled for, and a client that never
reads is dropped at its deadline. Real unix sockets and a real reactor (the arbiter's one
poll), no fork."""

from __future__ import annotations

import json
import select
import socket
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest

from forkserve.control import ControlServer
from forkserve.reactor import Reactor


@pytest.fixture
def short_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="fs-", dir="/tmp") as path:
        yield Path(path)


def serve_one(short_dir: Path, answer: dict[str, Any]
              ) -> tuple[Reactor, ControlServer, socket.socket, int]:
    reactor = Reactor()
    server = ControlServer(str(short_dir / "ctl"), lambda name, arg: (answer, []), reactor)
    assert server.fileno() in reactor
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(server.path)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    reactor.dispatch(reactor.wait(5.0))  # the listener's callback accepts it
    (fd,) = server.clients
    assert fd in reactor
    server.clients[fd][0].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    client.sendall(b"status\n")
    assert select.select([fd], [], [], 5)[0], "the command to arrive"
    return reactor, server, client, fd


def test_a_big_answer_is_sent_as_the_client_reads(short_dir: Path) -> None:
    answer = {"ok": True, "blob": "x" * 1_000_000}
    reactor, server, client, fd = serve_one(short_dir, answer)
    with client:
        reactor.dispatch(reactor.wait(0))
        assert fd in server.answers, "a megabyte does not fit at once: nothing may block"
        assert server.wants(fd) == select.POLLOUT
        received = b""
        client.settimeout(5)
        while not received.endswith(b"\n"):
            received += client.recv(65536)
            reactor.dispatch(reactor.wait(0))  # POLLOUT: the callback sends what fits
        assert fd not in server.clients and fd not in reactor, "answered whole: the client is done"
        assert json.loads(received) == answer
    server.close()
    assert server.fileno() not in reactor


def test_a_client_that_never_reads_is_dropped_at_its_deadline(short_dir: Path) -> None:
    reactor, server, client, fd = serve_one(short_dir, {"ok": True, "blob": "x" * 1_000_000})
    with client:
        reactor.dispatch(reactor.wait(0))
        assert fd in server.answers
        deadline = server.clients[fd][2]
        server.expire(deadline - 0.1)
        assert fd in server.clients
        server.expire(deadline)
        assert not server.clients and not server.answers and fd not in reactor
    server.close()
