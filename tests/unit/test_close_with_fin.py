"""A response that ends its connection goes out with the FIN in one segment: what
``Connection.send_last(..., close_next=True)`` does to the socket (real TCP on 127.0.0.1: the
kernel's count of bytes not yet sent, SIOCOUTQNSD, says whether the response was held for the
close), and when the pipeline asks for it (``Pipeline._run_app``): never where code of the
app's could run between the send and the close, and never where the client may still send.

A response held by mistake would not hang (the kernel sends a held segment after ~200 ms), it
would be slow: a timing test would be a flaky one, so these look at the decision and at the
socket's queue instead.
"""

from __future__ import annotations

import fcntl
import socket
import struct
from typing import Any, Callable, Iterator

import pytest

from forkserve.context import RequestContext
from forkserve.http import Limits, Request
from forkserve.workers.connection import Connection
from forkserve.wsgi import Exchange

SIOCOUTQNSD = 0x894B  # <linux/sockios.h>: bytes in the send queue not yet sent
RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"


def unsent(sock: socket.socket) -> int:
    return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), SIOCOUTQNSD, b"\0" * 4))[0])


@pytest.fixture
def tcp_pair() -> Iterator[Callable[[], tuple[Connection, socket.socket]]]:
    """A Connection over the server end of a real TCP connection on 127.0.0.1 (MSG_MORE is
    TCP's), as a sync worker makes it (defer_writes), and the client end."""
    listener = socket.create_server(("127.0.0.1", 0))
    made: list[socket.socket] = [listener]

    def make() -> tuple[Connection, socket.socket]:
        client = socket.create_connection(listener.getsockname(), timeout=10)
        ours, _ = listener.accept()
        made.extend((client, ours))
        return Connection(ours, ("127.0.0.1", "40000"), Limits(), 1.0, defer_writes=True), client
    yield make
    for sock in made:
        sock.close()


def read_to_end(client: socket.socket) -> bytes:
    data = b""
    while True:
        piece = client.recv(65536)
        if not piece:
            return data
        data += piece


def test_a_response_that_closes_next_waits_for_the_fin(tcp_pair: Any) -> None:
    conn, client = tcp_pair()
    conn.send_last(RESPONSE, close_next=True)
    assert unsent(conn.sock) == len(RESPONSE)  # held: it goes with the FIN
    conn.close()
    assert read_to_end(client) == RESPONSE  # all of it, then the end


def test_any_other_response_goes_at_once(tcp_pair: Any) -> None:
    conn, client = tcp_pair()
    conn.send_last(RESPONSE)
    assert unsent(conn.sock) == 0
    assert client.recv(65536) == RESPONSE  # before any close
    conn.close()
    assert client.recv(65536) == b""


# -- when the pipeline asks for it -----------------------------------------------------------------

class Recorder:
    """The transport side of an Exchange: what send_last was told."""

    continue_sent = False

    def __init__(self) -> None:
        self.close_next: list[bool] = []

    def send(self, data: bytes) -> None:
        raise AssertionError("a whole body goes through send_last")

    def send_last(self, data: bytes, close_next: bool = False) -> None:
        self.close_next.append(close_next)

    def should_close(self) -> bool:
        return False


def hello(environ: dict[str, Any], start_response: Any) -> Any:
    start_response("200 OK", [("Content-Length", "2")])
    return [b"ok"]


def run(worker: Any, *, keep_alive: bool = False, upgrade: bool = False,
        shutdown_function: bool = False, app: Any = hello) -> bool:
    """One request through _run_app: what send_last was told of the close."""
    request = Request("GET", b"/", "1.1", [], keep_alive, None, False, False)
    request.upgrade = upgrade
    transport = Recorder()
    exchange = Exchange(transport, request, worker.dates, worker.heads)  # type: ignore[arg-type]
    context = RequestContext(lambda: None)
    if shutdown_function:
        context.functions = [(print, (), {})]
    worker.app = app
    worker._run_app(exchange, {}, context)
    assert len(transport.close_next) == 1
    return transport.close_next[0]


def test_the_client_that_asked_to_close_gets_its_fin_with_the_response(worker: Any) -> None:
    assert run(worker(closes_at_once=True)) is True


@pytest.mark.parametrize("case", [
    "keep_alive",  # the server closes on a client that may send its next request meanwhile
    "upgrade",  # an Upgrade request's close is the server's, not the client's
    "shutdown_function",  # app code runs between the send and the close
])
def test_not_where_the_close_may_not_follow_at_once(worker: Any, case: str) -> None:
    assert run(worker(closes_at_once=True), **{case: True}) is False


def test_not_where_a_request_hook_runs_after_the_response(worker: Any) -> None:
    w = worker(closes_at_once=True)
    w.request_hooks = True
    assert run(w) is False


def test_not_on_a_worker_whose_close_may_wait(worker: Any) -> None:
    """Thread and gevent workers: the GIL or another greenlet may come between."""
    assert run(worker(closes_at_once=False)) is False


def test_not_for_a_response_the_app_closes_itself(worker: Any) -> None:
    """An iterable with close() (a generator, a framework's response) runs app code after the
    body: it is not the one-send path at all, and nothing is held."""
    def streamed(environ: dict[str, Any], start_response: Any) -> Any:
        start_response("200 OK", [("Content-Length", "2")])
        yield b"ok"
    w = worker(closes_at_once=True)
    request = Request("GET", b"/", "1.1", [], False, None, False, False)
    transport = Recorder()
    sent: list[bytes] = []
    transport.send = sent.append  # type: ignore[method-assign]
    exchange = Exchange(transport, request, w.dates, w.heads)  # type: ignore[arg-type]
    w.app = streamed
    w._run_app(exchange, {}, RequestContext(lambda: None))
    assert transport.close_next == [] and sent  # written with send(), never held
