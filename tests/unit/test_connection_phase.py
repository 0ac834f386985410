"""A connection's phases (forkserve.workers.connection.Phase), changed only by its own methods,
and the pipeline's policy for a wait on a client that a signal, the stop or the cancel
interrupts (forkserve.workers.pipeline.Pipeline.interrupted). Over a socketpair: no fork, no
server."""

from __future__ import annotations

import gc
import os
import socket
import time
import weakref
from typing import Any

import pytest

from forkserve.context import RequestCancelled
from forkserve.http import HTTPError
from forkserve.workers.base import WorkerEvent, WorkerState
from forkserve.workers.connection import Abandoned, Connection, Phase, Timeout
from forkserve.workers.pipeline import NEW_CONNECTION_GRACE

HEAD = b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n"


def soon(seconds: float = 0.05) -> float:
    return time.monotonic() + seconds


class FakeExchange:
    """Connection.begin only keeps the exchange; read_body asks it of Expect: 100-continue."""

    class request:
        expect_continue = False


def test_a_closed_connections_parser_is_freed_without_the_cyclic_collector(pair: Any) -> None:
    """llhttp's parser holds the RequestParser's bound methods: closing the connection lets
    go of it, so the parser goes with the connection, not at some later collection (a cycle
    per connection, which piled up in long-lived workers)."""
    conn, client = pair()
    client.sendall(HEAD)
    assert conn.read_head(soon(1.0)) is not None
    conn.begin(FakeExchange())  # type: ignore[arg-type]
    conn.end_request()
    parser = weakref.ref(conn.parser)
    conn.close()
    gc.disable()
    try:
        del conn
        assert parser() is None
    finally:
        gc.enable()


def test_a_request_moves_through_the_phases(pair: Any) -> None:
    conn, client = pair()
    assert conn.phase is Phase.IDLE and not conn.in_request
    client.sendall(HEAD)
    request = conn.read_head(soon(1.0))
    assert request is not None and request.target == b"/a"
    assert conn.phase is Phase.HEAD and conn.received
    conn.begin(FakeExchange())  # type: ignore[arg-type]
    assert conn.phase is Phase.REQUEST and conn.in_request
    before = time.monotonic()
    conn.end_request()
    assert conn.phase is Phase.IDLE and conn.exchange is None
    assert conn.served == 1 and conn.idle_since >= before
    conn.close()
    assert conn.phase is Phase.CLOSED and conn.closed
    conn.end_request()  # a late end (a cancelled thread) does not reopen it
    assert conn.phase is Phase.CLOSED


def test_a_silent_client_times_out_awaiting_and_a_partial_head_counts_as_received(pair: Any) -> None:
    conn, client = pair()
    with pytest.raises(Timeout):
        conn.read_head(soon())
    assert conn.phase is Phase.AWAITING and not conn.received and conn.awaiting_request
    client.sendall(HEAD[:10])
    with pytest.raises(Timeout):
        conn.read_head(soon())
    assert conn.phase is Phase.HEAD and conn.received and not conn.awaiting_request


def test_a_pipelined_request_is_read_without_waiting(pair: Any) -> None:
    conn, client = pair()
    client.sendall(HEAD + HEAD)
    conn.read_head(soon(1.0))
    conn.begin(FakeExchange())  # type: ignore[arg-type]
    assert conn.discard_body(NO_BODY)  # type: ignore[arg-type]  # the first has no body: its end is taken
    conn.end_request()
    assert conn.events  # the second is parsed already
    assert conn.read_head(time.monotonic()) is not None  # deadline now: no wait happens
    assert conn.phase is Phase.HEAD


class NO_BODY:
    has_body = False


def test_a_bad_head_is_raised_from_read_head_with_the_phase_saying_received(pair: Any) -> None:
    conn, client = pair()
    client.sendall(b"GET / HTTP/1.1\r\nBad Header\r\n\r\n")
    with pytest.raises(HTTPError) as caught:
        conn.read_head(soon(1.0))
    assert caught.value.status == 400 and conn.received


def test_a_stop_cutoff_ends_only_the_wait_for_a_first_byte(pair: Any) -> None:
    conn, client = pair()
    conn.cut_off(time.monotonic())
    with pytest.raises(Abandoned):
        conn.read_head(soon(1.0))
    # Inside a request (a body read, a slow reader) the cutoff does not apply: the wait runs
    # to its own deadline.
    client.sendall(HEAD)
    conn.read_head(soon(1.0))
    conn.cut_off(time.monotonic())
    conn.begin(FakeExchange())  # type: ignore[arg-type]
    with pytest.raises(Timeout):
        conn.recv(soon())


def test_release_ends_the_output_for_the_client(pair: Any) -> None:
    conn, client = pair()
    conn.release()
    assert conn.released and conn.output_ended
    client.settimeout(1.0)
    assert client.recv(10) == b""  # the client sees the end at once


def test_should_close_is_the_workers_own(pair: Any) -> None:
    conn, _ = pair(should_close=lambda: True)
    assert conn.should_close() is True
    plain, _ = pair()
    assert plain.should_close() is False


# -- the pipeline's interrupt policy (the ``worker`` fixture: tests/unit/conftest.py) ---------


@pytest.mark.parametrize("kind", ["sync", "thread", "gevent"])
def test_running_a_wait_goes_on(worker: Any, pair: Any, kind: str) -> None:
    w = worker(stop_pipes=kind != "sync", kills_requests=kind == "gevent")
    conn, _ = pair()
    assert w.interrupted(conn) is False and conn.cutoff is None


@pytest.mark.parametrize("kind", ["sync", "thread", "gevent"])
def test_stopping_a_wait_for_a_first_byte_gets_the_grace(worker: Any, pair: Any, kind: str) -> None:
    w = worker(stop_pipes=kind != "sync", kills_requests=kind == "gevent")
    conn, _ = pair()
    with pytest.raises(Timeout):
        conn.read_head(time.monotonic())  # leaves it awaiting, as a wait interrupted is
    w._enter(WorkerEvent.STOP)
    before = time.monotonic()
    assert w.interrupted(conn) is False
    assert conn.cutoff is not None
    assert before + NEW_CONNECTION_GRACE <= conn.cutoff <= time.monotonic() + NEW_CONNECTION_GRACE
    first = conn.cutoff
    w.interrupted(conn)
    assert conn.cutoff == first  # one grace per wait, not renewed by every wake-up


@pytest.mark.parametrize("state", [WorkerEvent.CANCEL, WorkerEvent.HALT])
@pytest.mark.parametrize("kind", ["sync", "thread", "gevent"])
def test_at_the_deadline_a_wait_for_a_head_is_given_up(worker: Any, pair: Any, kind: str,
                                                       state: WorkerEvent) -> None:
    w = worker(stop_pipes=kind != "sync", kills_requests=kind == "gevent")
    conn, _ = pair()
    w._enter(state)
    assert w.interrupted(conn) is True


@pytest.mark.parametrize("kind", ["sync", "thread"])
def test_at_the_deadline_a_wait_inside_a_request_is_cancelled(worker: Any, pair: Any,
                                                              kind: str) -> None:
    """A body read or a slow send: RequestCancelled, a BaseException an app's `except
    Exception` around its body read cannot swallow."""
    w = worker(stop_pipes=kind != "sync")
    conn, _ = pair()
    conn.begin(FakeExchange())  # type: ignore[arg-type]
    w._enter(WorkerEvent.CANCEL)
    with pytest.raises(RequestCancelled):
        w.interrupted(conn)


def test_gevent_leaves_a_request_to_its_greenlets_kill(worker: Any, pair: Any) -> None:
    w = worker(stop_pipes=True, kills_requests=True)
    conn, _ = pair()
    conn.begin(FakeExchange())  # type: ignore[arg-type]
    w._enter(WorkerEvent.CANCEL)
    assert w.interrupted(conn) is False


def test_the_stop_pipes_are_watched_in_turn_never_twice(worker: Any, pair: Any) -> None:
    w = worker(stop_pipes=True)
    conn = w.open_connection(*_fresh(pair))
    assert conn.interrupt_fd == w.stop_r
    w.interrupted(conn)
    assert conn.interrupt_fd == w.cancel_r
    w.interrupted(conn)
    assert conn.interrupt_fd == -1  # both stay readable: watching one again would spin
    conn.close()


def _fresh(pair: Any) -> tuple[socket.socket, tuple[str, int]]:
    conn, _ = pair()
    return conn.sock.dup(), ("127.0.0.1", 5)


def test_a_stop_signalled_before_the_pipes_exist_is_written_when_they_open(worker: Any) -> None:
    """A TERM while the app loads (gevent's handlers are in place by then)."""
    w = worker(stop_pipes=False)
    w.stop_pipes = True
    w.signal_stop(cancel=True)
    assert w.stop_signalled and w.cancel_signalled
    w._open_stop_pipes()
    assert os.read(w.stop_r, 10) == b"\0" and os.read(w.cancel_r, 10) == b"\0"


def test_sync_waits_watch_the_signal_pipe_and_read_it(worker: Any, pair: Any) -> None:
    w = worker(stop_pipes=False)
    sock, addr = _fresh(pair)
    conn = w.open_connection(sock, addr)
    assert conn.interrupt_fd == w.wakeup_r and conn.remote == ("127.0.0.1", "5")
    os.write(w.wakeup_w, b"\x0f")
    assert w.interrupted(conn) is False
    with pytest.raises(BlockingIOError):
        os.read(w.wakeup_r, 1)  # drained: the handlers' signal bytes are read by the policy
    assert w.state is WorkerState.RUNNING
    conn.close()


# -- how much a read asks for ----------------------------------------------------------------

def test_reads_ask_for_8_kib_until_one_fills_it_then_64_kib(pair: Any) -> None:
    """A request of a few hundred bytes never makes a 64 KiB buffer (each read allocates what
    it asks for: the C heap fragmented under load); a large head or body gets large reads
    once one read came full, for the rest of the connection."""
    from forkserve.workers.connection import FIRST_READS, RECV_SIZE
    conn, client = pair()
    client.sendall(HEAD)
    assert conn.read_head(soon(1)) is not None
    assert conn.read_size == FIRST_READS
    body = b"x" * (2 * RECV_SIZE)  # (within a socketpair's buffer: sent before any read)
    client.sendall(b"POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
                   + body)
    conn.parser.take_end()
    request = conn.read_head(soon(1))
    assert request is not None and request.content_length == len(body)
    assert conn.read_size == RECV_SIZE  # (the head's read came full: the body's pieces were)
    got = b""
    while len(got) < len(body):
        got += conn.read_body()
    assert got == body
