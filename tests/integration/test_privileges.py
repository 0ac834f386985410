"""Dropped privileges (issue 12), run as root (CI is): the arbiter binds and opens its files
as root and stays root; every worker runs as --user/--group before the app is imported, on
every worker class, under load; a unix socket gets --bind-mode and --bind-group before it
listens; metrics still work (their directory is the workers'); a USR1 whose new file the
worker may not open costs an error line, never a worker."""

from __future__ import annotations

import json
import os
import pwd
import signal
import socket
import stat
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.harness import wait_for, worker_set
from tests.load import Load

WORKER_CLASSES = ["sync", "thread", "gevent"]
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dropping privileges needs root")


def ids(pid: int) -> dict[str, list[int]]:
    """Uid, Gid (real, effective, saved, fs) and Groups of a process, from /proc."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, values = line.partition(":")
        if name in ("Uid", "Gid", "Groups"):
            found[name] = [int(v) for v in values.split()]
    return found


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_workers_run_as_the_user_and_the_arbiter_stays_root(server_factory: Any, ctl_dir: Path,
                                                           tmp_path: Path, worker_class: str) -> None:
    nobody = pwd.getpwnam("nobody")
    sock_path = ctl_dir / "app.sock"
    access = tmp_path / "access.log"  # in a directory only root may enter (pytest's tmp)
    server = server_factory("-k", worker_class, "--user", "nobody", "--group", str(nobody.pw_gid),
                            "-b", f"unix:{sock_path}", "--bind-mode", "660",
                            "--bind-group", str(nobody.pw_gid), "--umask", "027",
                            "--status-bind", "127.0.0.1:0", "--access-log", str(access),
                            app="tests.apps.identity:app").wait_ready()
    assert ids(server.pid)["Uid"] == [0, 0, 0, 0]
    for pid in worker_set(server, 2):
        assert ids(pid) == {"Uid": [nobody.pw_uid] * 4, "Gid": [nobody.pw_gid] * 4,
                            "Groups": [nobody.pw_gid]}, pid
    info = os.stat(sock_path)
    assert stat.S_IMODE(info.st_mode) == 0o660 and info.st_gid == nobody.pw_gid
    assert info.st_uid == nobody.pw_uid  # the workers' user owns its socket

    with Load(server.port, "/", threads=4, seconds=30, keepalive=True) as load:
        wait_for(lambda: len(load.bodies) >= 200, 30, lambda: f"200 responses; {load.failures[:3]}")
    assert load.failures == [], load.failures[:5]
    seen = {body for _, body in load.bodies}
    assert {(d["uid"], d["euid"], d["gid"]) for d in map(json.loads, seen)} == \
        {(nobody.pw_uid, nobody.pw_uid, nobody.pw_gid)}

    # Metrics: the workers (as nobody) write their files into the directory the arbiter made.
    def requests_counted() -> float:
        with urllib.request.urlopen(f"{server.status_url}/metrics", timeout=5) as response:
            text = response.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("forkserve_requests_total{"))
    wait_for(lambda: requests_counted() >= 200, 10, "the workers' requests in /metrics")

    # USR1 (logrotate): the workers may not open the access log's path as nobody; they say so
    # and go on writing to the file they have.
    lines_before = len(access.read_text().splitlines())
    server.signal(signal.SIGUSR1)
    server.wait_log("Worker cannot reopen its access log; writing on to the old file")
    assert set(worker_set(server, 2)) == set(server.workers())  # no worker was lost to it
    with Load(server.port, "/", threads=2, seconds=30, keepalive=True) as more:
        wait_for(lambda: len(more.bodies) >= 50, 30, "50 more responses")
    assert more.failures == []
    server.signal(signal.SIGTERM)
    assert server.wait_exit() == 0
    assert len(access.read_text().splitlines()) >= lines_before + 50


def test_a_unix_socket_lets_a_proxy_running_as_another_user_connect(server_factory: Any,
                                                                   ctl_dir: Path) -> None:
    """Without --bind-mode a unix socket is 666, whatever the inherited umask (022 would make
    it 755: connecting needs write permission, so nginx running as www-data got 502)."""
    nobody = pwd.getpwnam("nobody")
    os.chmod(ctl_dir, 0o755)  # (mkdtemp's 700 would stop nobody before the socket's mode)
    sock_path = ctl_dir / "app.sock"
    server = server_factory("-b", f"unix:{sock_path}").wait_ready()
    assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o666
    read_fd, write_fd = os.pipe()
    child = os.fork()
    if child == 0:  # a client as nobody
        code = 1
        try:
            os.close(read_fd)
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.settimeout(10)
            client.connect(str(sock_path))
            client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := client.recv(65536):
                answer += chunk
            os.write(write_fd, answer[:12])
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as answer:
        status_line = answer.read()
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and status_line == b"HTTP/1.1 200", status_line
    server.signal(signal.SIGTERM)
    assert server.wait_exit(10) == 0
