"""The client's socket handed to an app that takes its connection over (wsgi.ClientSocket, the
``gunicorn.socket`` / ``werkzeug.socket`` of a WebSocket upgrade) and what taking it does to
the connection (Connection.take_over, cut, close). Over a socketpair: no fork, no server.
The servers themselves: tests/integration/test_websockets.py."""

from __future__ import annotations

import socket
import threading
from typing import Any, NoReturn

import pytest

from forkserve.http import Request
from forkserve.wsgi import CheckedHeads, ClientSocket, Exchange, UpgradeRefused


class Dates:
    def get(self) -> bytes:
        return b"D"


def upgrade_exchange(conn: Any) -> Exchange:
    request = Request("GET", b"/ws", "1.1", [(b"Upgrade", b"websocket")], False, None, False,
                      False)
    exchange = Exchange(conn, request, Dates(), CheckedHeads())  # type: ignore[arg-type]
    conn.begin(exchange)
    return exchange


def test_looking_the_socket_up_does_not_take_the_connection(pair: Any) -> None:
    conn, _ = pair()
    raw = ClientSocket(conn)
    assert raw.family == socket.AF_UNIX and raw.getsockname() == conn.sock.getsockname()
    assert raw._closed is False  # (a private name, as a debugger or repr() may look up)
    assert getattr(raw, "__html__", None) is None  # (a template engine's probe)
    assert not conn.taken and not conn.sock.getblocking()


def test_the_first_io_takes_the_connection_and_drops_the_servers_output(pair: Any) -> None:
    conn, client = pair()
    exchange = upgrade_exchange(conn)
    raw = ClientSocket(conn)
    raw.sendall(b"HTTP/1.1 101 Switching Protocols\r\n\r\n")  # the app's own answer
    assert conn.taken and conn.sock.getblocking()  # blocking: the app's library reads it so
    assert raw.fileno() == conn.fd
    # What a framework still hands the server after the app's handshake goes nowhere.
    exchange.start_response("200 OK", [("Content-Type", "text/plain")])
    exchange.write(b"ignored")
    exchange.send_whole(b"ignored")
    exchange.finish()
    assert exchange.close and not exchange.headers_sent
    client.settimeout(1)
    assert client.recv(100) == b"HTTP/1.1 101 Switching Protocols\r\n\r\n"
    conn.end_request()
    conn.close()
    assert client.recv(100) == b""  # closed after the app, nothing of ours before


def test_refused_where_the_worker_cannot_serve_it(pair: Any) -> None:
    conn, _ = pair()

    def refuse() -> NoReturn:
        raise UpgradeRefused("one connection at a time")

    raw = ClientSocket(conn, refuse)
    with pytest.raises(UpgradeRefused, match="one connection at a time"):
        raw.send(b"HTTP/1.1 101 Switching Protocols\r\n\r\n")
    assert not conn.taken and raw.getpeername() is not None


def test_cut_wakes_a_thread_of_the_app_blocked_in_recv(pair: Any) -> None:
    """The drain deadline: the taken socket is shut down, so the app's reader (a WebSocket
    library's thread) sees EOF, and the client sees the end; the fd stays the app's."""
    conn, client = pair()
    upgrade_exchange(conn)
    raw = ClientSocket(conn)
    raw.setblocking(True)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(raw.recv(100)))
    reader.start()
    conn.cut()
    reader.join(5)
    assert got == [b""] and conn.sock.fileno() >= 0
    client.settimeout(1)
    assert client.recv(100) == b""


def test_closing_a_socket_the_app_closed_itself_is_harmless(pair: Any) -> None:
    conn, _ = pair()
    upgrade_exchange(conn)
    ClientSocket(conn).close()  # simple-websocket does, once the close handshake is over
    conn.cut()
    conn.close()
    assert conn.closed
