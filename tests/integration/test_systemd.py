"""systemd integration against real ``python -m forkserve`` processes: sd_notify messages read
from a real unix datagram socket set as ``NOTIFY_SOCKET``, and socket activation with sockets
really passed as fds 3.. (by a small launcher, and by ``systemd-socket-activate``).

Every wait is bounded: datagrams are received with a deadline, logs through the harness.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import requests

from tests.harness import DEFAULT_TIMEOUT, ROOT, Server, read_response, wait_for

SYSTEMD_ENV = {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_PID", "LISTEN_FDS",
               "LISTEN_FDNAMES"}
SOCKET_ACTIVATE = shutil.which("systemd-socket-activate") or "/usr/bin/systemd-socket-activate"


# -- sd_notify ------------------------------------------------------------------------------------

class NotifyReceiver:
    """The service manager's end of ``NOTIFY_SOCKET``: a datagram socket bound in tmp_path.
    Every message received is kept, in order, parsed into ``KEY=VALUE`` fields."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: list[tuple[float, dict[str, str]]] = []  # (time received, fields)

    def wait(self, key: str, value: str | re.Pattern[str] | None = None, after: int = 0,
             timeout: float = DEFAULT_TIMEOUT) -> int:
        """The index of the first message from ``after`` on that has ``key``, equal to
        ``value`` (a string) or matching it (a compiled pattern) if given."""
        deadline = time.monotonic() + timeout
        index = after
        while True:
            while index < len(self.messages):
                fields = self.messages[index][1]
                if key in fields and (value is None or (
                        value.search(fields[key]) if isinstance(value, re.Pattern)
                        else fields[key] == value)):
                    return index
                index += 1
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {key}={value or '*'!s} message within {timeout}s "
                                     f"(after #{after}); got {self.fields()}")
            self.sock.settimeout(remaining)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue  # the deadline check above ends the wait
            fields = dict(line.split("=", 1) for line in data.decode().split("\n") if line)
            self.messages.append((time.monotonic(), fields))

    def fields(self, index: int | None = None) -> Any:
        if index is None:
            return [m[1] for m in self.messages]
        return self.messages[index][1]

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notify(tmp_path: Path) -> Iterator[NotifyReceiver]:
    receiver = NotifyReceiver(tmp_path / "notify")
    yield receiver
    receiver.close()


def start_notified(server_factory: Any, notify: NotifyReceiver, **env: str) -> Server:
    return server_factory(env={"NOTIFY_SOCKET": str(notify.path), **env})  # type: ignore[no-any-return]


def test_ready_once_the_workers_serve(server_factory: Any, notify: NotifyReceiver) -> None:
    server = start_notified(server_factory, notify)
    ready = notify.wait("READY", "1")
    assert notify.fields(ready)["MAINPID"] == str(server.pid)
    # READY=1 comes after boot: the log says so, and a request is served at once.
    server.wait_log("Server ready")
    assert requests.get(f"{server.url}/", timeout=10).status_code == 200
    assert not any("RELOADING" in f or "STOPPING" in f for f in notify.fields()[:ready + 1])
    assert not any("WATCHDOG" in f for f in notify.fields()), "no watchdog was asked for"


def test_reload_is_reloading_then_ready(server_factory: Any, notify: NotifyReceiver) -> None:
    server = start_notified(server_factory, notify)
    first = notify.wait("READY", "1")
    server.wait_ready()
    before = time.monotonic_ns() // 1000
    server.signal(signal.SIGHUP)
    reloading = notify.wait("RELOADING", "1", after=first + 1)
    received = time.monotonic_ns() // 1000
    fields = notify.fields(reloading)
    # CLOCK_MONOTONIC is system-wide: the server's clock reading falls between ours.
    assert before <= int(fields["MONOTONIC_USEC"]) <= received, fields
    again = notify.wait("READY", "1", after=reloading + 1)
    assert notify.fields(again)["MAINPID"] == str(server.pid)
    server.wait_log("Reload complete")
    assert requests.get(f"{server.url}/", timeout=10).status_code == 200


def test_term_is_stopping_with_drain_status(server_factory: Any, notify: NotifyReceiver,
                                            gates: Any) -> None:
    server = start_notified(server_factory, notify)
    ready = notify.wait("READY", "1")
    server.wait_ready()
    gate = gates("held")
    result: dict[str, Any] = {}

    def held_request() -> None:
        try:
            result["status"] = requests.get(f"{server.url}{gate.route}",
                                            timeout=DEFAULT_TIMEOUT).status_code
        except requests.RequestException as exc:
            result["status"] = exc

    client = threading.Thread(target=held_request, daemon=True)
    client.start()
    gate.wait_entered()
    server.signal(signal.SIGTERM)
    stopping = notify.wait("STOPPING", "1", after=ready + 1)
    # The drain's STATUS= lines carry the counters: the held request is in flight.
    notify.wait("STATUS", re.compile(r"\b1 in flight\b"), after=stopping)
    gate.release()
    client.join(DEFAULT_TIMEOUT)
    assert result.get("status") == 200, result
    assert server.wait_exit() == 0
    assert not any(f.get("READY") == "1" for f in notify.fields()[stopping:])


def test_watchdog_pings_repeatedly(server_factory: Any, notify: NotifyReceiver) -> None:
    server = start_notified(server_factory, notify, WATCHDOG_USEC="400000")  # a ping every 0.2 s
    notify.wait("READY", "1")
    first = notify.wait("WATCHDOG", "1")
    second = notify.wait("WATCHDOG", "1", after=first + 1, timeout=5)
    third = notify.wait("WATCHDOG", "1", after=second + 1, timeout=5)
    # Periodic, not a burst: three pings 0.2 s apart span about 0.4 s.
    span = notify.messages[third][0] - notify.messages[first][0]
    assert span >= 0.2, f"three pings within {span:.3f}s"
    server.signal(signal.SIGTERM)
    assert server.wait_exit() == 0


# -- socket activation ----------------------------------------------------------------------------

class LaunchedServer(Server):
    """A forkserve started through a launcher that ends by exec'ing it in the same process,
    as the service manager does: the PID, the process group and the log readers of
    :class:`Server` all still apply. Only the command differs from ``Server.__init__``."""

    def __init__(self, launcher: list[str], forkserve_args: list[str],
                 env: dict[str, str] | None = None, pass_fds: tuple[int, ...] = ()) -> None:
        # Whatever systemd may have given the test run itself is not for this server.
        base_env = {k: v for k, v in os.environ.items() if k not in SYSTEMD_ENV}
        self._launch([*launcher, *forkserve_args], base_env, env, ROOT, pass_fds)


@pytest.fixture
def launched() -> Iterator[list[LaunchedServer]]:
    """Servers appended here are killed and checked for orphans at teardown."""
    servers: list[LaunchedServer] = []
    yield servers
    for server in servers:
        server.close()


# What systemd does between fork and exec, in Python: the socket goes to fd 3, LISTEN_PID names
# the process that is about to become forkserve, and exec keeps that PID.
LAUNCHER = """
import os, sys
fd, listen_pid = int(sys.argv[1]), sys.argv[2]
if fd != 3:
    os.dup2(fd, 3)
    os.close(fd)
os.set_inheritable(3, True)
os.environ.update(LISTEN_PID=listen_pid or str(os.getpid()), LISTEN_FDS="1", LISTEN_FDNAMES="http")
os.execv(sys.executable, [sys.executable, "-m", "forkserve", *sys.argv[3:]])
"""

FORKSERVE_ARGS = ["-w", "2", "--log-format", "json", "-b", "127.0.0.1:0", "tests.apps.basic:app"]


def launch_with_socket(launched: list[LaunchedServer], listen_pid: str = "") -> tuple[LaunchedServer, int]:
    """Start forkserve with a TCP listening socket of ours as fd 3; return it and that port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        port = sock.getsockname()[1]
        server = LaunchedServer([sys.executable, "-c", LAUNCHER, str(sock.fileno()), listen_pid],
                                FORKSERVE_ARGS, pass_fds=(sock.fileno(),))
        launched.append(server)
    # Our copy is closed: from here on only the server holds the socket.
    return server, port


def test_socket_activation_adopts_the_passed_socket(launched: list[LaunchedServer]) -> None:
    server, port = launch_with_socket(launched)
    server.wait_ready()
    record = server.wait_log("Starting forkserve")
    # The passed socket is the only listener: -b 127.0.0.1:0 was not bound.
    assert record["listening"] == f"127.0.0.1:{port}", record
    assert server.port == port
    response = requests.get(f"http://127.0.0.1:{port}/", timeout=10)
    assert response.status_code == 200
    server.signal(signal.SIGTERM)
    assert server.wait_exit() == 0


def test_socket_activation_for_another_pid_is_ignored(launched: list[LaunchedServer]) -> None:
    # LISTEN_PID names a different process (the variables were inherited, not meant for us):
    # forkserve binds --bind as usual and leaves fd 3 alone.
    server, port = launch_with_socket(launched, listen_pid="1")
    server.wait_ready()
    record = server.wait_log("Starting forkserve")
    assert "," not in record["listening"] and server.port != port, record
    assert requests.get(f"{server.url}/", timeout=10).status_code == 200
    server.signal(signal.SIGTERM)
    assert server.wait_exit() == 0


@pytest.mark.skipif(not os.access(SOCKET_ACTIVATE, os.X_OK),
                    reason="systemd-socket-activate is not installed (Debian package: systemd)")
def test_systemd_socket_activate(launched: list[LaunchedServer], tmp_path: Path) -> None:
    """The real tool: it binds, waits for the first connection, then execs forkserve with the
    socket as fd 3 (the same PID). It refuses port 0, so the socket is a unix one in tmp_path,
    which also checks that forkserve leaves a passed socket's path to its owner."""
    path = tmp_path / "http.sock"
    launcher = [SOCKET_ACTIVATE, "--listen", str(path), "--fdname=http",
                # It passes on only TERM, PATH, USER and HOME, plus what -E names.
                "-E", f"PYTHONPATH={ROOT}", sys.executable, "-m", "forkserve"]
    server = LaunchedServer(launcher, FORKSERVE_ARGS)
    launched.append(server)

    def connected() -> socket.socket | None:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            client.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            client.close()  # not bound, or bound but not listening yet
            return None
        return client

    # This first connection is what makes systemd-socket-activate start forkserve; it waits
    # in the accept queue while forkserve boots, and is served then.
    with wait_for(connected, what=f"systemd-socket-activate listening on {path}") as client:
        client.sendall(b"GET / HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
        response = read_response(client, timeout=DEFAULT_TIMEOUT)
    assert response.status == 200
    server.wait_ready()
    record = server.wait_log("Starting forkserve")
    assert record["listening"] == f"unix:{path}", record
    server.signal(signal.SIGTERM)
    assert server.wait_exit() == 0
    assert path.exists(), "forkserve removed the socket path it was passed; its owner made it"
