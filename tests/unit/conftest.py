"""Fixtures of the unit tests."""

from __future__ import annotations

import os
import socket
from typing import Any, Callable, Iterator

import pytest

from forkserve.config import parse_args, resolve
from forkserve.http import Limits
from forkserve.logs import Log
from forkserve.workers.base import WorkerEvent, WorkerSettings
from forkserve.workers.connection import Connection
from forkserve.workers.pipeline import Pipeline


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


class Policy(Pipeline):
    """A pipeline with the knobs a test sets; nothing is served."""

    def should_close(self) -> bool:
        return False


@pytest.fixture
def worker() -> Iterator[Callable[..., Policy]]:
    """``worker(**knobs)``: a booted pipeline in this process (its HTTP state set up, its
    signal pipe open), the class attributes in ``knobs`` (stop_pipes, kills_requests,
    closes_at_once...) set on it first."""
    made: list[Policy] = []
    counter_r, counter_w = os.pipe()
    config = resolve(parse_args(["tests.apps.basic:app"], "test")[0], {})

    def make(**knobs: Any) -> Policy:
        worker = Policy(1, 1, WorkerSettings.of(config), [], counter_w, -1, Log("-"), None, [])
        for name, value in knobs.items():
            assert hasattr(Pipeline, name), name
            setattr(worker, name, value)
        worker.wakeup_r, worker.wakeup_w = os.pipe2(os.O_NONBLOCK)
        worker.setup_http()
        worker._enter(WorkerEvent.BOOTED)
        made.append(worker)
        return worker
    yield make
    for w in made:
        for fd in (w.wakeup_r, w.wakeup_w, w.stop_r, w.stop_w, w.cancel_r, w.cancel_w):
            if fd >= 0:
                os.close(fd)
    os.close(counter_r)
    os.close(counter_w)
