"""The stop's grace for a connection waiting on its client (forkserve.workers.pipeline.stop_grace_end)."""

from __future__ import annotations

import socket
import time
from typing import Any, Iterator

import pytest

from forkserve.http.parser import Limits
from forkserve.workers.connection import Connection
from forkserve.workers.pipeline import KEEPALIVE_CLOSE_GRACE, NEW_CONNECTION_GRACE, stop_grace_end


@pytest.fixture
def connection() -> Iterator[object]:
    socks: list[socket.socket] = []

    def make(served: int, idle_since: float) -> Connection:
        a, b = socket.socketpair()
        socks.extend((a, b))
        conn = Connection(a, ("127.0.0.1", "1"), Limits(), 1.0)
        conn.served = served
        conn.idle_since = idle_since
        return conn
    yield make
    for sock in socks:
        sock.close()


def test_a_keepalive_connection_quiet_since_before_the_stop_gets_the_grace_from_the_stop(connection: Any) -> None:
    """Idle for long when the stop came (a balancer that had marked us down leaves its pooled
    connections idle, then picks them up again as the resume retires us): closing it at once
    would race the request the balancer sends on it right then."""
    stop = 1000.0
    conn = connection(served=3, idle_since=stop - 60.0)
    assert stop_grace_end(conn, stop) == stop + KEEPALIVE_CLOSE_GRACE


def test_a_keepalive_connection_answered_after_the_stop_counts_from_its_response(connection: Any) -> None:
    stop = 1000.0
    conn = connection(served=3, idle_since=stop + 2.0)
    assert stop_grace_end(conn, stop) == stop + 2.0 + KEEPALIVE_CLOSE_GRACE


def test_a_silent_new_connection_gets_the_short_grace_from_now(connection: Any) -> None:
    conn = connection(served=0, idle_since=0.0)
    before = time.monotonic()
    end = stop_grace_end(conn, 0.0)
    assert before + NEW_CONNECTION_GRACE <= end <= time.monotonic() + NEW_CONNECTION_GRACE
