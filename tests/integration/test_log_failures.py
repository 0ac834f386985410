"""Logs on a broken disk, with real servers on every worker class: ``/dev/full`` fails every
write with ENOSPC.

- access and span logs: every request is still served; the loss is told at most once per
  interval per worker (the first at once) with the lines lost, and once when writes succeed
  again (the operator freed the disk and sent USR1);
- the error log: it cannot report to itself; the server serves, stops cleanly, never spins,
  and tells the lines it lost once it can write again.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from tests.harness import Server, get, parse_head, read_json_file, wait_file_record, wait_for

WORKER_CLASSES = ["sync", "thread", "gevent"]
REQUESTS = 600
INTERVAL = 10.0  # forkserve.telemetry.losses.REPORT_INTERVAL
WORKERS = 2


def reports(server: Server, text: str) -> list[str]:
    return [line for line in server.lines if text in line]


def serve_all(port: int, path: str, count: int) -> None:
    statuses = [get(port, path).status for _ in range(count)]
    assert statuses == [200] * count, {s: statuses.count(s) for s in set(statuses)}


def allowed_reports(elapsed: float) -> int:
    """Per worker: the first at once, then one per interval begun."""
    return WORKERS * (1 + int(elapsed // INTERVAL) + 1)


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
@pytest.mark.parametrize("flag, app, path, what", [
    ("--access-log", "tests.apps.basic:app", "/", "Cannot write the access log /dev/full"),
    ("--span-log", "tests.apps.drain:app", "/spans?n=2", "Cannot write the span log /dev/full"),
], ids=["access", "span"])
def test_a_full_disk_serves_every_request_and_reports_at_a_bounded_rate(
        server_factory: Any, worker_class: str, flag: str, app: str, path: str, what: str) -> None:
    server = server_factory("-k", worker_class, flag, "/dev/full", app=app).wait_ready()
    pids = set(server.workers())
    started = time.monotonic()
    serve_all(server.port, path, REQUESTS)
    wait_for(lambda: reports(server, what), 10, lambda: f"{what!r}\n{server.log_text()}")
    elapsed = time.monotonic() - started
    told = reports(server, what)
    assert 1 <= len(told) <= allowed_reports(elapsed), "\n".join(told)
    # Nothing else on stderr but the JSON records: no traceback, no line per failed write.
    # (The reports are plain lines, or JSON records once the worker hands the sinks its
    # error log.)
    plain = [line for line in server.lines if not line.startswith("{")]
    assert set(plain) <= set(told), "\n".join(plain)
    assert "lost_lines" in told[0] and "No space left on device" in told[0]
    assert set(server.workers()) == pids and server.count_log("crashed") == 0
    server.signal(signal.SIGTERM)
    assert server.wait_exit() == 0


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_the_access_log_tells_its_recovery_after_usr1(server_factory: Any, tmp_path: Path,
                                                      worker_class: str) -> None:
    access = tmp_path / "access.log"
    access.symlink_to("/dev/full")
    server = server_factory("-k", worker_class, "--access-log", str(access)).wait_ready()
    serve_all(server.port, "/?lost", 50)
    wait_for(lambda: reports(server, "Cannot write the access log"), 10, server.log_text)
    access.unlink()  # the disk is freed: the path will name a real file again
    server.signal(signal.SIGUSR1)

    def recovered() -> list[str]:
        # Each request after the workers' reopen is written; until one has reopened, the
        # request is lost like the others (a request per poll: no sleeping on the reopen).
        assert get(server.port, "/?kept").status == 200
        return reports(server, "is written again")

    told = wait_for(recovered, 10, lambda: f"the recovery line\n{server.log_text()}")
    assert "line(s) were lost while it could not be" in told[0] and "lost_total" in told[0]
    # Lines of /?lost a worker still held unwritten when the disk came back are written
    # now (not lost after all); what is there is whole lines, the kept request's among them.
    text = access.read_text()
    assert "GET /?kept" in text and text.endswith("\n")
    assert all(line.startswith("127.0.0.1 - - [") for line in text.splitlines()), text
    server.signal(signal.SIGTERM)
    assert server.wait_exit() == 0


# -- the error log ------------------------------------------------------------------------------

def unix_get(path: Path, target: str = "/") -> int:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        sock.sendall(f"GET {target} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"closed before a response head: {data!r}")
            data += chunk
        return parse_head(data)[0]


def serving(path: Path) -> bool:
    """The server answers on its unix socket (its log, on /dev/full, cannot say it is ready)."""
    try:
        return unix_get(path) == 200
    except (FileNotFoundError, ConnectionRefusedError):
        return False


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_an_error_log_on_a_full_disk_neither_crashes_nor_spins(server_factory: Any,
                                                               ctl_dir: Path,
                                                               worker_class: str) -> None:
    sock = ctl_dir / "app.sock"
    server = server_factory("-k", worker_class, "-b", f"unix:{sock}", "--error-log", "/dev/full",
                            "--log-level", "debug", bind=None)
    wait_for(lambda: serving(sock), 20, lambda: f"the server to answer\n{server.log_text()}")
    pids = set(server.workers())
    statuses = [unix_get(sock, f"/?n={n}") for n in range(200)]
    assert statuses == [200] * 200
    assert set(server.workers()) == pids  # no worker crashed over its log
    server.signal(signal.SIGTERM)
    assert server.wait_exit() == 0
    assert server.lines == [] and server.stdout_lines == []  # dropped, not sent elsewhere


def test_an_error_log_on_a_full_disk_stays_cheap(server_factory: Any, ctl_dir: Path) -> None:
    """Idle on a full disk, the arbiter does not spin retrying its log."""
    sock = ctl_dir / "app.sock"
    server = server_factory("-b", f"unix:{sock}", "--error-log", "/dev/full", bind=None)
    wait_for(lambda: serving(sock), 20, lambda: f"the server to answer\n{server.log_text()}")
    before = cpu_seconds(server.pid)
    # Requests, not a sleep, fill the time measured: the arbiter is awake for its heartbeats.
    for n in range(100):
        assert unix_get(sock, f"/?n={n}") == 200
    assert cpu_seconds(server.pid) - before < 1.0


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_the_error_log_tells_what_it_lost_once_it_can_write(server_factory: Any, ctl_dir: Path,
                                                            tmp_path: Path,
                                                            worker_class: str) -> None:
    sock = ctl_dir / "app.sock"
    error_log = tmp_path / "error.log"
    error_log.symlink_to("/dev/full")
    server = server_factory("-k", worker_class, "-b", f"unix:{sock}", "--error-log",
                            str(error_log), bind=None)
    wait_for(lambda: serving(sock), 20, lambda: f"the server to answer\n{server.log_text()}")
    error_log.unlink()
    server.signal(signal.SIGUSR1)  # the disk is freed; the logs reopen
    record = wait_file_record(error_log, "The error log could not be written")
    assert record["pid"] == server.pid and "No space left on device" in record["message"]
    # Starting and two spawns at least: the arbiter's lines that went nowhere.
    assert record["lost_lines"] >= 3, record
    wait_file_record(error_log, "Reopened log files")
    server.signal(signal.SIGTERM)
    assert server.wait_exit() == 0
    messages = [r["message"] for r in read_json_file(error_log)]
    assert "Server stopped" in messages[-1], messages
