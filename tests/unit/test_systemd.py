"""forkserve.systemd against real AF_UNIX datagram sockets and real fds (no mocks).

Each test binds its own receiving socket (a path in tmp_path, or an abstract ``@name``) and
passes it as ``NOTIFY_SOCKET`` in a plain dict, so nothing touches ``os.environ``.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from forkserve.systemd import (Notifier, activation_env_vars, listen_fds, status_line)

RECV_TIMEOUT = 5.0


class Receiver:
    def __init__(self, sock: socket.socket, env_value: str) -> None:
        self.sock = sock
        self.env_value = env_value
        sock.settimeout(RECV_TIMEOUT)

    def recv(self) -> str:
        return self.sock.recv(65536).decode()

    def nothing_pending(self) -> bool:
        self.sock.setblocking(False)
        try:
            self.sock.recv(65536)
        except BlockingIOError:
            return True
        finally:
            self.sock.settimeout(RECV_TIMEOUT)
        return False


@pytest.fixture
def path_receiver(tmp_path: Path) -> Iterator[Receiver]:
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        yield Receiver(sock, str(path))


@pytest.fixture
def abstract_receiver() -> Iterator[Receiver]:
    name = f"forkserve-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        yield Receiver(sock, "@" + name)


@pytest.fixture(params=["path", "abstract"])
def receiver(request: pytest.FixtureRequest) -> Receiver:
    return request.getfixturevalue(f"{request.param}_receiver")  # type: ignore[no-any-return]


def notifier(receiver: Receiver, **extra: str) -> Notifier:
    return Notifier({"NOTIFY_SOCKET": receiver.env_value, **extra})


# -- sd_notify ------------------------------------------------------------------------------

def test_ready(receiver: Receiver) -> None:
    n = notifier(receiver)
    assert n.enabled
    assert n.ready() is True
    assert receiver.recv() == f"READY=1\nMAINPID={os.getpid()}"
    assert n.ready("serving on 127.0.0.1:8000") is True
    assert receiver.recv() == f"READY=1\nSTATUS=serving on 127.0.0.1:8000\nMAINPID={os.getpid()}"


def test_reloading_carries_the_monotonic_clock(receiver: Receiver) -> None:
    n = notifier(receiver)
    before = time.monotonic_ns() // 1000
    assert n.reloading() is True
    after = time.monotonic_ns() // 1000
    lines = receiver.recv().split("\n")
    assert lines[0] == "RELOADING=1"
    assert len(lines) == 2 and lines[1].startswith("MONOTONIC_USEC=")
    usec = int(lines[1].removeprefix("MONOTONIC_USEC="))
    assert before <= usec <= after


def test_reloading_with_a_status(receiver: Receiver) -> None:
    notifier(receiver).reloading("reloading: generation 2")
    lines = receiver.recv().split("\n")
    assert lines[0] == "RELOADING=1" and lines[1].startswith("MONOTONIC_USEC=")
    assert lines[2:] == ["STATUS=reloading: generation 2"]


def test_stopping_status_and_watchdog(receiver: Receiver) -> None:
    n = notifier(receiver)
    assert n.stopping() is True
    assert receiver.recv() == "STOPPING=1"
    assert n.stopping("draining: 1 in flight") is True
    assert receiver.recv() == "STOPPING=1\nSTATUS=draining: 1 in flight"
    assert n.status("running: 0 in flight") is True
    assert receiver.recv() == "STATUS=running: 0 in flight"
    assert n.watchdog() is True
    assert receiver.recv() == "WATCHDOG=1"
    assert n.send("A=1", "B=2") is True
    assert receiver.recv() == "A=1\nB=2"
    assert receiver.nothing_pending()


def test_a_status_never_spans_lines(receiver: Receiver) -> None:
    # A newline would let the text inject its own KEY= assignment (READY=1 here).
    notifier(receiver).status("line one\nREADY=1")
    assert receiver.recv() == "STATUS=line one READY=1"


def test_the_environment_is_left_alone(receiver: Receiver) -> None:
    env = {"NOTIFY_SOCKET": receiver.env_value, "WATCHDOG_USEC": "1000000"}
    n = Notifier(env)
    n.ready()
    receiver.recv()
    assert env == {"NOTIFY_SOCKET": receiver.env_value, "WATCHDOG_USEC": "1000000"}


def test_no_descriptor_is_held_between_messages(receiver: Receiver) -> None:
    before = set(os.listdir("/proc/self/fd"))
    n = notifier(receiver)
    n.ready()
    receiver.recv()
    assert set(os.listdir("/proc/self/fd")) == before


@pytest.mark.parametrize("value", [None, "", "relative/path", "vsock:2:1234"])
def test_disabled_without_a_usable_notify_socket(value: str | None) -> None:
    env = {} if value is None else {"NOTIFY_SOCKET": value}
    n = Notifier(env)
    assert not n.enabled
    assert n.ready() is False
    assert n.reloading() is False
    assert n.stopping() is False
    assert n.status("x") is False
    assert n.watchdog() is False


def test_send_failure_returns_false(tmp_path: Path) -> None:
    path = tmp_path / "gone"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    n = Notifier({"NOTIFY_SOCKET": str(path)})
    sock.close()
    path.unlink()
    assert n.enabled
    assert n.ready() is False
    assert n.watchdog() is False
    # A path that exists but nobody receives on it (ECONNREFUSED), and an abstract name
    # nobody bound.
    stale = tmp_path / "stale"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as bound:
        bound.bind(str(stale))
    assert Notifier({"NOTIFY_SOCKET": str(stale)}).status("x") is False
    assert Notifier({"NOTIFY_SOCKET": f"@forkserve-nobody-{uuid.uuid4().hex}"}).status("x") is False


def test_a_full_receive_queue_does_not_block(tmp_path: Path) -> None:
    path = tmp_path / "full"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        n = Notifier({"NOTIFY_SOCKET": str(path)})
        results = set()
        deadline = time.monotonic() + 10
        # The receiver never reads: its queue fills and sending must fail at once, not block.
        while False not in results:
            assert time.monotonic() < deadline, "sending never failed on a full queue"
            results.add(n.send("X=" + "y" * 1000))
        assert True in results


# -- watchdog interval ---------------------------------------------------------------------

@pytest.mark.parametrize(("env", "expected"), [
    ({}, None),
    ({"WATCHDOG_USEC": "400000"}, 0.2),
    ({"WATCHDOG_USEC": "30000000"}, 15.0),
    ({"WATCHDOG_USEC": "400000", "WATCHDOG_PID": str(os.getpid())}, 0.2),
    ({"WATCHDOG_USEC": "400000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),
    ({"WATCHDOG_USEC": "400000", "WATCHDOG_PID": "garbage"}, None),
    ({"WATCHDOG_USEC": "400000", "WATCHDOG_PID": ""}, None),
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "-5"}, None),
    ({"WATCHDOG_USEC": "soon"}, None),
    ({"WATCHDOG_PID": str(os.getpid())}, None),
])
def test_watchdog_interval(env: dict[str, str], expected: float | None) -> None:
    n = Notifier({"NOTIFY_SOCKET": "/nonexistent/notify", **env})
    if expected is None:
        assert n.watchdog_interval is None
    else:
        assert n.watchdog_interval == pytest.approx(expected)


def test_watchdog_pid_is_compared_when_asked() -> None:
    """A forked child holding the arbiter's Notifier must not ping in its name."""
    n = Notifier({"WATCHDOG_USEC": "400000", "WATCHDOG_PID": str(os.getpid())})
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave at once
        try:
            os.write(write_fd, b"none" if n.watchdog_interval is None else b"set")
        finally:
            os._exit(0)
    os.close(write_fd)
    try:
        answer = os.read(read_fd, 16)
    finally:
        os.close(read_fd)
        os.waitpid(pid, 0)
    assert answer == b"none"
    assert n.watchdog_interval == pytest.approx(0.2)


# -- status text -----------------------------------------------------------------------------

def test_status_line() -> None:
    totals = {"active_connections": 2, "in_flight_requests": 1, "background_tasks": 0, "workers": 2}
    assert status_line("draining", totals) == (
        "draining: 1 in flight, 2 connections, 0 background tasks")


# -- socket activation -------------------------------------------------------------------------

def in_child(env: dict[str, str], fds: int = 2) -> dict[str, Any]:
    """Call ``listen_fds(env, pid)`` in a forked child that has listening sockets at fds 3..
    (``fds`` of them) and nothing at the fd after them, as a socket-activated process would.

    A child, because pytest's own capture lives on low fds: moving them in the test process
    breaks it. The child reports over a pipe parked at a high fd and exits without cleanup.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read_end)
            out = fcntl.fcntl(write_end, fcntl.F_DUPFD_CLOEXEC, 100)
            for fd in range(3, 3 + fds + 1):
                if fd != out:
                    try:
                        os.close(fd)
                    except OSError:
                        continue  # was not open: that is what we want
            for fd in range(3, 3 + fds):
                made = socket.socket()  # lands at the lowest free fd: at or below ``fd``
                made.bind(("127.0.0.1", 0))
                made.listen()
                got = made.detach()
                if got != fd:
                    os.dup2(got, fd)
                    os.close(got)
                os.set_inheritable(fd, True)  # as an exec'd process receives it
            env = {k: v.format(pid=os.getpid()) for k, v in env.items()}
            result = {"fds": listen_fds(env, os.getpid()),
                      "inheritable": [os.get_inheritable(fd) for fd in range(3, 3 + fds)]}
            os.write(out, json.dumps(result).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([read_end], [], [], RECV_TIMEOUT)
            assert ready, "the child did not answer"
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_end)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    result = json.loads(b"".join(chunks))
    result["fds"] = [tuple(pair) for pair in result["fds"]]
    return result  # type: ignore[no-any-return]


def test_listen_fds_for_this_pid() -> None:
    env = {"LISTEN_PID": "{pid}", "LISTEN_FDS": "2", "LISTEN_FDNAMES": "http:admin"}
    result = in_child(env)
    assert result["fds"] == [(3, "http"), (4, "admin")]
    assert result["inheritable"] == [False, False], "adopted fds are made close-on-exec"


def test_listen_fds_names_are_optional() -> None:
    base = {"LISTEN_PID": "{pid}", "LISTEN_FDS": "2"}
    assert in_child(base)["fds"] == [(3, ""), (4, "")]
    assert in_child({**base, "LISTEN_FDNAMES": "http"})["fds"] == [(3, "http"), (4, "")]
    assert in_child({**base, "LISTEN_FDNAMES": "a:b:c"})["fds"] == [(3, "a"), (4, "b")]
    assert in_child({**base, "LISTEN_FDS": "1"})["fds"] == [(3, "")]


def test_listen_fds_for_another_pid() -> None:
    env = {"LISTEN_PID": "1{pid}", "LISTEN_FDS": "2"}
    result = in_child(env)
    assert result["fds"] == []
    assert result["inheritable"] == [True, True], "fds that are not ours are left alone"


@pytest.mark.parametrize("env", [
    {},
    {"LISTEN_FDS": "1"},
    {"LISTEN_PID": "{pid}"},
    {"LISTEN_PID": "{pid}", "LISTEN_FDS": "0"},
    {"LISTEN_PID": "{pid}", "LISTEN_FDS": "-1"},
    {"LISTEN_PID": "{pid}", "LISTEN_FDS": "two"},
    {"LISTEN_PID": "{pid}", "LISTEN_FDS": " 1"},
    {"LISTEN_PID": "{pid}", "LISTEN_FDS": "1_0"},
    {"LISTEN_PID": "{pid}", "LISTEN_FDS": ""},
    {"LISTEN_PID": "", "LISTEN_FDS": "1"},
    {"LISTEN_PID": "me", "LISTEN_FDS": "1"},
    {"LISTEN_PID": "+{pid}", "LISTEN_FDS": "1"},
    {"LISTEN_PID": "0", "LISTEN_FDS": "1"},
])
def test_listen_fds_garbage(env: dict[str, str]) -> None:
    assert in_child(env)["fds"] == []


def test_listen_fds_with_an_fd_that_is_not_open() -> None:
    # Sockets at 3 and 4, nothing at 5: a claim of three fds is not believed at all.
    assert in_child({"LISTEN_PID": "{pid}", "LISTEN_FDS": "3"})["fds"] == []


def test_activation_env_vars() -> None:
    assert set(activation_env_vars()) == {"LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"}
