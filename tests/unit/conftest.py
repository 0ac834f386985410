"""Fixtures of the unit tests."""

from __future__ import annotations

import socket
from typing import Any, Callable, Iterator

import pytest

from forkserve.http import Limits
from forkserve.workers.connection import Connection


@pytest.fixture
def pair() -> Iterator[Callable[..., tuple[Connection, socket.socket]]]:
    """``pair(**kwargs)``: a Connection (kwargs as its constructor's) over one end of a
    socketpair, its peer ("127.0.0.1", "40000"), and the other end to play the client."""
    socks: list[socket.socket] = []

    def make(**kwargs: Any) -> tuple[Connection, socket.socket]:
        ours, client = socket.socketpair()
        socks.extend((ours, client))
        return Connection(ours, ("127.0.0.1", "40000"), Limits(), 1.0, **kwargs), client
    yield make
    for sock in socks:
        sock.close()
