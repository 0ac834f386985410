"""Two questions the hot path asks the kernel: ``Connection.sent_more`` (are there bytes from
the client we have not read? then a close lingers, so that it does not reset the connection
under the response) and ``drain_pipe`` (read a wake-up pipe empty, stopping at a short read
rather than at BlockingIOError). Real TCP on 127.0.0.1 and real pipes.

What each must answer is the contract: bytes waiting are "more", a bare FIN is not (a client
that read its response and closed has nothing a close could reset), a reset or a closed socket
is not; a pipe holding any number of bytes, or none, is left empty.
"""

from __future__ import annotations

import os
import select
import socket
import struct
from typing import Any, Callable, Iterator

import pytest

from forkserve.http import Limits
from forkserve.workers.base import drain_pipe
from forkserve.workers.connection import Connection

WAIT = 10.0  # seconds a poll waits for bytes sent on loopback to arrive (they take microseconds)


@pytest.fixture
def tcp_pair() -> Iterator[Callable[[], tuple[Connection, socket.socket]]]:
    listener = socket.create_server(("127.0.0.1", 0))
    made: list[socket.socket] = [listener]

    def make() -> tuple[Connection, socket.socket]:
        client = socket.create_connection(listener.getsockname(), timeout=WAIT)
        ours, _ = listener.accept()
        made.extend((client, ours))
        return Connection(ours, ("127.0.0.1", "40000"), Limits(), 1.0), client
    yield make
    for sock in made:
        sock.close()


def arrived(conn: Connection) -> None:
    """Wait (bounded) until the server end is readable: the client's bytes or FIN are here."""
    poller = select.poll()
    poller.register(conn.fd, select.POLLIN)
    assert poller.poll(WAIT * 1000), "nothing arrived"


def test_nothing_sent_is_nothing_unread(tcp_pair: Any) -> None:
    conn, _ = tcp_pair()
    assert conn.sent_more() is False


def test_bytes_the_client_sent_are_unread_until_read(tcp_pair: Any) -> None:
    conn, client = tcp_pair()
    client.sendall(b"GET /next HTTP/1.1\r\n")
    arrived(conn)
    assert conn.sent_more() is True
    assert conn.sent_more() is True  # (asking reads nothing)
    got = b""
    while len(got) < 20:
        got += conn.sock.recv(100)
    assert got == b"GET /next HTTP/1.1\r\n"
    assert conn.sent_more() is False


def test_a_bare_fin_is_not_more(tcp_pair: Any) -> None:
    conn, client = tcp_pair()
    client.shutdown(socket.SHUT_WR)
    arrived(conn)
    assert conn.sent_more() is False


def test_bytes_before_the_fin_are_more(tcp_pair: Any) -> None:
    conn, client = tcp_pair()
    client.sendall(b"x" * 3000)
    client.shutdown(socket.SHUT_WR)
    arrived(conn)
    assert conn.sent_more() is True


def test_a_reset_connection_or_a_closed_socket_is_not_more(tcp_pair: Any) -> None:
    conn, client = tcp_pair()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close: RST
    client.close()
    arrived(conn)
    assert conn.sent_more() is False
    conn.sock.close()
    assert conn.sent_more() is False  # (its descriptor is gone: EBADF, nothing to keep)


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 8192, 20000])
def test_drain_pipe_leaves_the_pipe_empty(size: int) -> None:
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if size:
            os.write(w, b"\0" * size)
        drain_pipe(r)
        with pytest.raises(BlockingIOError):
            os.read(r, 1)
        os.write(w, b"\0")  # still a working pipe: the next byte is drained as well
        drain_pipe(r)
        with pytest.raises(BlockingIOError):
            os.read(r, 1)
    finally:
        os.close(r)
        os.close(w)
