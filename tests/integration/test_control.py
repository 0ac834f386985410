"""The control socket (``--control-socket PATH``) and ``forkserve ctl``, against real servers.

One line ``COMMAND [ARG]`` in, one line of JSON out, then the server closes. The socket is
0600 and owned by the server's user; ``listeners`` passes the listening fds with SCM_RIGHTS.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.harness import worker_set, ROOT, Server, get, read_response, refused, send_get, wait_for

APP = "tests.apps.reload:app"
WORKER_FIELDS = {"pid", "worker_id", "generation", "age", "requests_served", "active_connections",
                 "in_flight_requests", "background_tasks", "booted"}
NOBODY = 65534


# -- helpers ------------------------------------------------------------------------------------

@pytest.fixture
def ctl_dir() -> Iterator[Path]:
    """A short directory for unix sockets (sun_path holds 107 bytes; pytest's tmp_path can be
    longer than that)."""
    path = Path(tempfile.mkdtemp(prefix="fsctl-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def raw_control(path: Path, line: str, timeout: float = 5.0) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        sock.sendall(line.encode() + b"\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


def ok(answer: dict[str, Any], **fields: Any) -> bool:
    """An answer with ok true and these fields (a reply may carry more, such as the state)."""
    return answer.get("ok") is True and all(answer.get(k) == v for k, v in fields.items())


def control(path: Path, line: str, timeout: float = 5.0) -> dict[str, Any]:
    """Send one command, return the answer: exactly one line of JSON, then EOF."""
    data = raw_control(path, line, timeout)
    assert data.endswith(b"\n") and data.count(b"\n") == 1, f"not one line: {data!r}"
    answer = json.loads(data)
    assert isinstance(answer, dict), answer
    return answer


def start(server_factory: Any, ctl_dir: Path, *args: str, workers: int = 2) -> tuple[Server, Path]:
    path = ctl_dir / "ctl.sock"
    server = server_factory("--control-socket", str(path), *args, app=APP, workers=workers)
    server.wait_ready()
    wait_for(path.exists, 5, f"the control socket {path}")
    return server, path



def errors(server: Server) -> list[dict[str, Any]]:
    return [r for r in server.records() if r.get("level") == "ERROR"]


def ctl(*args: str, timeout: float = 15.0) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "forkserve", "ctl", *args], cwd=str(ROOT), env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)


# -- the socket itself --------------------------------------------------------------------------

def test_socket_is_0600_and_owned_by_the_server_user(server_factory: Any, ctl_dir: Path) -> None:
    _, path = start(server_factory, ctl_dir)
    st = os.stat(path)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
    assert st.st_uid == os.getuid()


def _interpreter_for(uid: int) -> str | None:
    """A Python that ``uid`` can run (the venv may live in a directory only root can enter)."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            done = subprocess.run([candidate, "-c", "pass"], user=uid, capture_output=True, timeout=10)
        except OSError:
            continue
        if done.returncode == 0:
            return candidate
    return None


def _connect_as(uid: int, python: str, path: Path) -> str:
    code = ("import socket, sys\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
            "try:\n    s.connect(sys.argv[1])\nexcept OSError as exc:\n"
            "    print(type(exc).__name__)\nelse:\n    print('connected')\n")
    done = subprocess.run([python, "-c", code, str(path)], user=uid, capture_output=True, text=True,
                          timeout=10)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client as another user")
def test_other_users_cannot_connect(server_factory: Any, ctl_dir: Path) -> None:
    python = _interpreter_for(NOBODY)
    if python is None:
        pytest.skip("no Python interpreter the nobody user can run")
    ctl_dir.chmod(0o755)  # the directory lets anyone in: only the socket's own mode refuses
    _, path = start(server_factory, ctl_dir)
    # A control: a 0666 socket in the same directory is reachable by the other user.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as open_sock:
        open_path = ctl_dir / "open.sock"
        open_sock.bind(str(open_path))
        open_sock.listen(1)
        open_path.chmod(0o666)
        assert _connect_as(NOBODY, python, open_path) == "connected"
    assert _connect_as(NOBODY, python, path) == "PermissionError"
    assert control(path, "status")["ok"] is True  # the owner still gets in


# -- commands -----------------------------------------------------------------------------------

def test_status(server_factory: Any, ctl_dir: Path) -> None:
    server, path = start(server_factory, ctl_dir)
    for _ in range(3):
        assert get(server.port, "/").status == 200
    pids = worker_set(server, 2)
    # Each get() closes its kept-alive connection after the response: the worker counts it
    # until it reads that close (on a loaded machine, after the status asked once already).
    answer = wait_for(lambda: (a := control(path, "status")) and
                      sum(w["requests_served"] for w in a["workers"]) >= 3 and
                      not any(w["active_connections"] for w in a["workers"]) and a,
                      5, "the status to count the 3 requests, and their connections closed")
    assert answer["ok"] is True
    assert answer["state"] == "running"
    assert answer["generation"] == 1
    assert answer["pid"] == server.pid
    workers = answer["workers"]
    assert {w["pid"] for w in workers} == pids
    assert sorted(w["worker_id"] for w in workers) == [1, 2]
    for worker in workers:
        assert WORKER_FIELDS <= set(worker), worker
        assert worker["generation"] == 1
        assert worker["booted"] is True
        assert isinstance(worker["age"], (int, float)) and 0 <= worker["age"] < 60
        assert worker["active_connections"] == 0
        assert worker["in_flight_requests"] == 0
        assert worker["background_tasks"] == 0


def test_status_counts_a_request_in_flight(server_factory: Any, ctl_dir: Path, gates: Any) -> None:
    server, path = start(server_factory, ctl_dir, workers=1)
    gate = gates()
    with send_get(server.port, gate.route) as sock:
        gate.wait_entered()
        answer = wait_for(lambda: (a := control(path, "status")) and
                          a["workers"][0]["in_flight_requests"] == 1 and a, 5,
                          "the status to show the request in flight")
        assert answer["workers"][0]["active_connections"] == 1
        gate.release()
        assert read_response(sock).body == b"released"


def test_reload(server_factory: Any, ctl_dir: Path) -> None:
    server, path = start(server_factory, ctl_dir)
    old = worker_set(server, 2)
    assert ok(control(path, "reload"))
    server.wait_log("Reload complete")
    new = wait_for(lambda: (w := set(server.workers())) and len(w) == 2 and not w & old and w, 10,
                   "the new generation alone")
    answer = wait_for(lambda: (a := control(path, "status")) and len(a["workers"]) == 2 and a, 5,
                      "the status to show the new generation alone")
    assert answer["generation"] == 2
    assert {w["pid"] for w in answer["workers"]} == new
    assert {w["generation"] for w in answer["workers"]} == {2}
    assert get(server.port, "/").status == 200


def test_scale_up_and_down(server_factory: Any, ctl_dir: Path, gates: Any) -> None:
    server, path = start(server_factory, ctl_dir)
    two = worker_set(server, 2)
    assert ok(control(path, "scale 3"), workers=3)
    three = worker_set(server, 3)
    assert two < three  # more workers spawned; none replaced
    wait_for(lambda: (a := control(path, "status")) and len(a["workers"]) == 3 and
             all(w["booted"] for w in a["workers"]), 10, "3 booted workers in the status")
    # Scaling down retires the extra workers gracefully: a request in flight completes.
    gate = gates()
    with send_get(server.port, gate.route) as sock:
        gate.wait_entered()
        assert ok(control(path, "scale 1"), workers=1)
        gate.release()
        response = read_response(sock)
        assert response.status == 200 and response.body == b"released"
    (one,) = worker_set(server, 1)
    assert one in three
    answer = wait_for(lambda: (a := control(path, "status")) and len(a["workers"]) == 1 and a, 5,
                      "1 worker in the status")
    assert answer["workers"][0]["pid"] == one
    for _ in range(3):
        assert get(server.port, "/").status == 200
    assert errors(server) == [], server.log_text()


def test_scale_with_a_bad_count_is_refused(server_factory: Any, ctl_dir: Path) -> None:
    server, path = start(server_factory, ctl_dir)
    before = worker_set(server, 2)
    for line in ("scale", "scale many", "scale -1"):
        answer = control(path, line)
        assert answer["ok"] is False, (line, answer)
        assert isinstance(answer["error"], str) and answer["error"], answer
    assert worker_set(server, 2) == before


def test_pause_and_resume(server_factory: Any, ctl_dir: Path, gates: Any) -> None:
    server, path = start(server_factory, ctl_dir)
    port = server.port
    gate = gates()
    with send_get(port, gate.route) as sock:
        gate.wait_entered()
        assert ok(control(path, "pause"))
        server.wait_log("Paused: not listening")
        wait_for(lambda: refused(port), 5, "connections to be refused while paused")
        # Closed in every process: the port is free for anyone to listen on.
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("127.0.0.1", port))
            probe.listen(1)
        # What was in flight is still served.
        gate.release()
        response = read_response(sock)
        assert response.status == 200 and response.body == b"released"
    assert control(path, "status")["ok"] is True  # the control socket stays up while paused
    assert ok(control(path, "resume"))
    server.wait_log("Resumed: listening again")
    assert not refused(port)
    assert get(port, "/").status == 200
    assert server.proc.poll() is None
    assert errors(server) == [], server.log_text()


def test_listeners_passes_the_listening_fds(server_factory: Any, ctl_dir: Path) -> None:
    server, path = start(server_factory, ctl_dir)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(10)
        client.connect(str(path))
        client.sendall(b"listeners\n")
        message, fds, _, _ = socket.recv_fds(client, 65536, 16)
        rest = b""
        while chunk := client.recv(65536):
            rest += chunk
    received = [socket.socket(fileno=fd) for fd in fds]
    try:
        data = message + rest
        assert data.endswith(b"\n") and data.count(b"\n") == 1, data
        answer = json.loads(data)
        assert ok(answer, listeners=[f"127.0.0.1:{server.port}"]), answer
        assert message.strip(), "the JSON answer must travel with the fds, in the same sendmsg"
        assert len(received) == 1, f"{len(fds)} fds for one listener"
        (listener,) = received
        assert listener.family == socket.AF_INET and listener.type == socket.SOCK_STREAM
        assert listener.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
        assert listener.getsockname() == ("127.0.0.1", server.port)
    finally:
        for sock in received:
            sock.close()
    assert get(server.port, "/").status == 200  # the server still has its own


def test_upgrade_keeps_the_pid(server_factory: Any, ctl_dir: Path) -> None:
    server, path = start(server_factory, ctl_dir)
    old = worker_set(server, 2)
    assert ok(control(path, "upgrade"))
    server.wait_log("Upgrade complete", timeout=20)
    assert server.proc.poll() is None
    wait_for(lambda: not set(server.workers()) & old and len(server.workers()) == 2, 10,
             "the old workers to leave")
    # The new image serves the control socket on the same path, still 0600.
    answer = wait_for(lambda: path.exists() and control(path, "status"), 5, "the control socket")
    assert answer["pid"] == server.pid
    assert {w["pid"] for w in answer["workers"]} == set(server.workers())
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert get(server.port, "/").status == 200
    assert errors(server) == [], server.log_text()


def test_stop(server_factory: Any, ctl_dir: Path) -> None:
    server, path = start(server_factory, ctl_dir)
    assert ok(control(path, "stop"))
    assert server.wait_exit(10) == 0
    server.wait_log("Server stopped", timeout=5)


def test_unknown_command(server_factory: Any, ctl_dir: Path) -> None:
    server, path = start(server_factory, ctl_dir)
    for line in ("frobnicate", "", "reload-everything now"):
        answer = control(path, line)
        assert answer["ok"] is False, (line, answer)
        assert isinstance(answer["error"], str) and answer["error"]
    assert control(path, "status")["ok"] is True
    assert server.proc.poll() is None


def test_control_socket_removed_on_exit(server_factory: Any, ctl_dir: Path) -> None:
    """The arbiter removes its control socket when it stops (TERM by signal here)."""
    server, path = start(server_factory, ctl_dir)
    server.signal(signal.SIGTERM)
    assert server.wait_exit(10) == 0
    assert not path.exists()


# -- forkserve ctl ------------------------------------------------------------------------------

def test_ctl_cli(server_factory: Any, ctl_dir: Path) -> None:
    server, path = start(server_factory, ctl_dir)
    done = ctl(str(path), "status")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["ok"] is True and answer["pid"] == server.pid

    done = ctl(str(path), "scale", "3")
    assert done.returncode == 0, done.stderr
    assert ok(json.loads(done.stdout), workers=3)
    worker_set(server, 3)

    done = ctl(str(path), "frobnicate")
    assert done.returncode == 1, (done.stdout, done.stderr)
    answer = json.loads(done.stdout)
    assert answer["ok"] is False and answer["error"]


def test_ctl_cli_without_a_server(ctl_dir: Path) -> None:
    done = ctl(str(ctl_dir / "nobody-here.sock"), "status")
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip(), "a failure must say why"
