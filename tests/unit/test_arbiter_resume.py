"""A TTIN's bind that finds the port taken: wait for our own paused workers (bounded), give
up on anyone else after a short grace, and tell a close the kernel has not finished from
someone else."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from forkserve.arbiter import Arbiter, handoff
from forkserve.arbiter.handoff import RELEASE_GRACE, RESUME_RETRY
from forkserve.config import parse_args, resolve
from forkserve.lifecycle import Pause
from forkserve.logs import Log
from forkserve.sockets import socket_inode, still_listening


@pytest.fixture
def paused(tmp_path: Path, monkeypatch: Any) -> Any:
    cli, _ = parse_args(["--drain-timeout", "10", "tests.apps.basic:app"], "test")
    a = Arbiter(resolve(cli, {}), cli, [], Log("-", "critical"))
    a.pause_state, a.paused_inodes = Pause.PAUSED, [4242]
    held = {"value": True}
    monkeypatch.setattr(handoff, "holds_inode", lambda pid, inode: held["value"])
    monkeypatch.setattr(handoff, "still_listening", lambda inodes: False)
    a.workers[1] = object()  # type: ignore[assignment]  (only its pid is looked at)
    return a, held


def test_a_port_someone_else_holds_fails_after_the_short_grace(paused: Any) -> None:
    """Not held by our workers at the first failed bind: they may have let it go just after
    it (a TTIN just after a TTOU, on a loaded machine), so binds go on for RELEASE_GRACE."""
    a, held = paused
    held["value"] = False
    assert a.resume_waits(100.0) is True, "perhaps let go a moment ago: try again"
    assert a.resume_retry_at == pytest.approx(100.0 + RESUME_RETRY)
    assert a.resume_waits(100.0 + RELEASE_GRACE / 2) is True
    assert a.resume_waits(100.0 + RELEASE_GRACE) is False and a.resume_retry_at is None


def test_our_paused_workers_are_waited_for_then_a_short_grace(paused: Any) -> None:
    a, held = paused
    assert a.resume_waits(100.0) is True
    assert a.resume_retry_at == pytest.approx(100.0 + RESUME_RETRY)
    assert a.resume_waits(103.0) is True, "still held: wait on"
    held["value"] = False  # they let it go, but the bind failed again
    assert a.resume_waits(104.0) is True, "a close the kernel has not finished: try again"
    assert a.resume_waits(104.0 + RELEASE_GRACE / 2) is True
    assert a.resume_waits(104.0 + RELEASE_GRACE) is False, "someone else has it: give up"
    assert a.resume_retry_at is None


def test_the_wait_is_bounded_by_the_drain_timeout(paused: Any) -> None:
    a, _ = paused
    assert a.resume_waits(100.0) is True
    assert a.resume_waits(109.9) is True
    assert a.resume_waits(110.0) is False and a.resume_retry_at is None


def test_still_listening_sees_a_listener_by_its_inode() -> None:
    sock = socket.create_server(("127.0.0.1", 0))
    inode = socket_inode(sock)
    assert still_listening([inode])
    sock.close()
    assert not still_listening([inode])
    assert not still_listening([])
