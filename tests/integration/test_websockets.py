"""WebSockets the way WSGI servers do it (issue 15): the app takes the client's socket from the
environ (``werkzeug.socket`` / ``gunicorn.socket``), as simple-websocket and flask-sock do, on
real ``python -m forkserve`` process groups, with simple-websocket's own client.

Both apps of tests.apps.websockets (a plain WSGI app on ``simple_websocket.Server(environ)``,
and flask-sock) on the thread and gevent workers: the two that serve WebSockets. The sync
worker refuses the upgrade (one connection at a time: a WebSocket would hold it, and beat no
heartbeat), and that is tested too. Waits are bounded and wait on events (an echo, a line in
the app's file, a /status count, a log line); the heartbeat test waits for a worker's age, the
one thing it is about.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import simple_websocket

from tests.harness import Server, get, read_json_file, read_response, wait_for, worker_set
from tests.integration.test_status import status_when
from tests.integration.test_tls import Certs
from tests.load import Load

APPS = {"wsgi": "tests.apps.websockets:app", "flask": "tests.apps.websockets:flask_app"}
WS_CLASSES = ["thread", "gevent"]  # the sync worker refuses: see test_the_sync_worker_refuses
by_app = pytest.mark.parametrize("app", sorted(APPS))
by_class = pytest.mark.parametrize("worker_class", WS_CLASSES)
DEADLINE = "Drain timeout reached, cancelling in-flight requests"
HANDSHAKE = ("GET /ws HTTP/1.1\r\nHost: t\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
             "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")


def start(factory: Callable[..., Server], worker_class: str, app: str, *args: str,
          workers: int = 1) -> Server:
    # --threads 4: fewer threads than WebSockets, which each hold one (a spare thread takes
    # its place in the pool: see Connection.take_over), so HTTP is still served beside them.
    extra = ("--threads", "4") if worker_class == "thread" else ()
    return factory("-k", worker_class, *extra, *args, app=APPS[app], workers=workers).wait_ready()


def connect(server: Server, out: Path | None = None, scheme: str = "ws",
            **kwargs: Any) -> simple_websocket.Client:
    query = f"?out={out}" if out is not None else ""
    return simple_websocket.Client.connect(f"{scheme}://127.0.0.1:{server.port}/ws{query}",
                                           **kwargs)


def echo(ws: simple_websocket.Client, message: str) -> None:
    ws.send(message)
    assert ws.receive(timeout=10) == message


def pid_of(ws: simple_websocket.Client) -> int:
    ws.send("pid")
    return int(ws.receive(timeout=10))


def finish(ws: simple_websocket.Client) -> None:
    """Close (if the server has not) and wait for the client's reader thread to end."""
    if ws.connected:
        ws.close()
    ws.thread.join(10)
    assert not ws.thread.is_alive(), "the client's reader thread did not end"


def ended_by_server(ws: simple_websocket.Client, timeout: float = 10.0) -> bool:
    """The server ended the connection: the client sees it closed, and receive() says so."""
    ws.thread.join(timeout)
    if ws.thread.is_alive():
        return False
    with pytest.raises(simple_websocket.ConnectionClosed):
        ws.receive(timeout=1)
    return True


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def all_at_once(clients: list[simple_websocket.Client], rounds: int) -> list[str]:
    """Every client echoes ``rounds`` messages, all in threads at once; the errors."""
    errors: list[str] = []

    def chat(n: int, ws: simple_websocket.Client) -> None:
        try:
            for i in range(rounds):
                echo(ws, f"client {n} message {i}")
        except Exception as exc:  # noqa: BLE001 - every failure is reported
            errors.append(f"client {n}: {exc!r}")

    threads = [threading.Thread(target=chat, args=(n, ws)) for n, ws in enumerate(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return errors + [f"{t.name} still running" for t in threads if t.is_alive()]


# -- serving -------------------------------------------------------------------------------------

@by_class
@by_app
def test_twenty_websockets_and_http_load_on_one_worker(server_factory: Any, tmp_path: Path,
                                                       worker_class: str, app: str) -> None:
    access = tmp_path / "access.log"
    server = start(server_factory, worker_class, app, "--access-log", str(access),
                   "--access-log-format", "json", "--status-bind", "127.0.0.1:0")
    clients: list[simple_websocket.Client] = []
    try:
        with Load(server.port, threads=4, seconds=60) as load:
            for _ in range(20):
                clients.append(connect(server))
            # Counted like a stream: each is a request in flight and a connection, on /status.
            status_when(server, lambda s: s["in_flight_requests"] >= 20
                        and s["active_connections"] >= 20, "20 WebSockets in flight")
            served_before = load.successes
            errors = all_at_once(clients, 10)
            assert errors == []
            load.wait_requests(20)  # HTTP goes on beside the 20 (the worker is not held)
            pids = {pid_of(ws) for ws in clients}
        assert load.failures == [], load.summary()
        assert load.successes > served_before
        assert pids == set(server.workers())  # all on the one worker, beside the load
    finally:
        for ws in clients:
            finish(ws)
    status_when(server, lambda s: s["in_flight_requests"] == 0 and s["active_connections"] == 0,
                "the WebSockets counted out once closed")

    # The access log: 101, and no bytes the server did not send itself.
    def upgrades() -> list[dict[str, Any]]:
        return [r for r in read_json_file(access) if r.get("path") == "/ws"]
    records = wait_for(lambda: len(upgrades()) == 20 and upgrades(), 10, "20 access-log lines")
    assert {(r["status"], r["bytes"]) for r in records} == {(101, 0)}
    assert server.count_log("Error handling request") == 0


@by_class
def test_over_tls_the_socket_is_the_tls_socket(server_factory: Any, tmp_path: Path,
                                               worker_class: str) -> None:
    """wss://, and the drain deadline's cut on TLS sockets too."""
    certs = Certs(tmp_path)
    server = start(server_factory, worker_class, "wsgi", "--certfile", str(certs.server_pem),
                   "--drain-timeout", "1", "--cancel-grace", "3")
    clients = [connect(server, scheme="wss", ssl_context=certs.client()) for _ in range(3)]
    try:
        assert all_at_once(clients, 5) == []
        server.signal(signal.SIGTERM)
        assert server.wait_exit(15) == 0
        assert all(ended_by_server(ws) for ws in clients)
        assert server.count_log("killed with SIGKILL") == 0
    finally:
        for ws in clients:
            finish(ws)


@by_class
def test_an_upgrade_the_app_does_not_take_is_an_ordinary_response(server_factory: Any,
                                                                   worker_class: str) -> None:
    """The basic app ignores the Upgrade header: it answers as always, and the connection
    closes after (the server does not switch protocols by itself)."""
    server = start(server_factory, worker_class, "wsgi")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(HANDSHAKE.replace("/ws", "/").encode())
        response = read_response(sock)
        assert response.status == 200 and response.headers.get("connection") == "close"
        assert sock.recv(1) == b""


@by_app
def test_the_sync_worker_refuses_the_upgrade_with_a_clear_error(server_factory: Any,
                                                                app: str) -> None:
    """A WebSocket would hold the sync worker's one connection for its whole life: the app's
    upgrade fails (a plain app's error becomes a 501, Flask makes its own 500), one line says
    why, and the worker serves on."""
    server = start(server_factory, "sync", app)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(HANDSHAKE.encode())
        response = read_response(sock)
    assert response.status == (501 if app == "wsgi" else 500)
    record = server.wait_log("Connection upgrade (WebSocket) refused")
    assert "-k thread, -k gevent" in record["reason"]
    assert get(server.port, "/").status == 200


# -- reload and stop -----------------------------------------------------------------------------

@pytest.mark.slow
@by_class
def test_hup_new_workers_take_new_websockets_old_ones_stay_until_closed(
        server_factory: Any, worker_class: str) -> None:
    server = start(server_factory, worker_class, "wsgi", "--drain-timeout", "60")
    old = [connect(server) for _ in range(3)]
    new: list[simple_websocket.Client] = []
    try:
        (old_pid,) = {pid_of(ws) for ws in old}
        server.signal(signal.SIGHUP)
        pids = worker_set(server, 2)  # the new worker, and the old one still draining
        (new_pid,) = pids - {old_pid}

        server.wait_log("Reload complete")

        def on_new_worker() -> bool:
            # (One accepted by the old worker just before its stop is one of the old ones.)
            ws = connect(server)
            landed = pid_of(ws)
            (new if landed == new_pid else old).append(ws)
            return landed == new_pid
        wait_for(on_new_worker, 15, "a new WebSocket on the new worker")
        assert {pid_of(ws) for ws in old} == {old_pid}
        assert all_at_once(old, 3) == []  # the old ones are served on, by the old worker
        assert old_pid in server.workers()
        for ws in old:
            finish(ws)
        wait_for(lambda: old_pid not in server.workers(), 15,
                 "the old worker to exit once its WebSockets closed")
        assert all_at_once(new, 3) == []
        assert server.count_log(DEADLINE) == 0
    finally:
        for ws in old + new:
            finish(ws)


@by_class
def test_hup_old_websockets_are_cut_at_the_drain_deadline_new_ones_stay(
        server_factory: Any, tmp_path: Path, worker_class: str) -> None:
    """An old generation's deadline is a hard stop (QUIT): its WebSockets are cut all the
    same, the app's cleanup runs, and the worker exits before the arbiter's SIGKILL."""
    server = start(server_factory, worker_class, "wsgi", "--drain-timeout", "1",
                   "--cancel-grace", "3")
    outs = [tmp_path / f"old{n}" for n in range(2)]
    old = [connect(server, out) for out in outs]
    new: list[simple_websocket.Client] = []
    try:
        (old_pid,) = {pid_of(ws) for ws in old}
        server.signal(signal.SIGHUP)
        server.wait_log("Reload complete")

        def on_new_worker() -> bool:
            ws = connect(server)
            (new if pid_of(ws) != old_pid else old).append(ws)
            return bool(new)
        wait_for(on_new_worker, 15, "a new WebSocket on the new worker")
        wait_for(lambda: old_pid not in server.workers(), 15,
                 "the old worker to exit at its drain deadline")
        assert all(ended_by_server(ws) for ws in old)
        assert all_at_once(new, 3) == []  # the new worker's are not touched
        assert server.count_log("killed with SIGKILL") == 0
    finally:
        for ws in old + new:
            finish(ws)
    for out in outs:
        opened, closed, shut = lines(out)
        assert (opened, shut) == ("opened", "shutdown") and closed.startswith("closed "), out


@by_class
@by_app
def test_term_drains_websockets_then_closes_them_at_the_deadline(
        server_factory: Any, tmp_path: Path, worker_class: str, app: str) -> None:
    drain, grace = 1.5, 3.0
    server = start(server_factory, worker_class, app, "--drain-timeout", str(drain),
                   "--cancel-grace", str(grace))
    outs = [tmp_path / f"ws{n}" for n in range(5)]
    clients = [connect(server, out) for out in outs]
    try:
        wait_for(lambda: all(lines(out) == ["opened"] for out in outs), 10, "5 WebSockets open")
        began = time.monotonic()
        server.signal(signal.SIGTERM)
        server.wait_log("Received shutdown signal")
        assert all_at_once(clients, 2) == []  # drained like a stream: served on meanwhile
        assert server.wait_exit(drain + grace + 10) == 0
        took = time.monotonic() - began
        assert all(ended_by_server(ws) for ws in clients)
    finally:
        for ws in clients:
            finish(ws)
    server.wait_log(DEADLINE)
    assert took < drain + grace, f"exit took {took:.2f}s"
    assert server.count_log("killed with SIGKILL") == 0
    for out in outs:
        # The app's receive() ended (ConnectionClosed, or RequestCancelled thrown into it),
        # its finally ran, and so did its shutdown function.
        opened, closed, shut = lines(out)
        assert (opened, shut) == ("opened", "shutdown") and closed.startswith("closed "), out
    assert server.count_log("Error handling request") == 0


@pytest.mark.slow
@by_class
def test_an_idle_websocket_does_not_stop_the_heartbeat(server_factory: Any,
                                                       worker_class: str) -> None:
    """--timeout 2: a worker that held a silent WebSocket for three times that is not killed."""
    server = start(server_factory, worker_class, "wsgi", "--timeout", "2",
                   "--status-bind", "127.0.0.1:0")
    ws = connect(server)
    try:
        pid = pid_of(ws)
        snapshot = status_when(server, lambda s: s["workers"][0]["age"] > 6
                               and s["workers"][0]["pid"] == pid, "the worker 6 s old", 20)
        assert snapshot["workers"][0]["seconds_since_heartbeat"] < 2
        echo(ws, "still here")
        assert server.workers() == [pid]
        assert server.count_log("timed out") == 0
    finally:
        finish(ws)


@by_class
def test_request_timeout_leaves_a_websocket_alone(server_factory: Any, worker_class: str) -> None:
    """--request-timeout cuts a request that runs too long, not a WebSocket (the app took the
    socket; it lasts as long as its client keeps it). An HTTP request begun after the
    WebSocket times out: by then the WebSocket's own deadline has passed and was looked at."""
    server = start(server_factory, worker_class, "wsgi", "--request-timeout", "0.5")
    ws = connect(server)
    try:
        echo(ws, "before")
        slow = get(server.port, "/sleep?ms=1500", timeout=20)
        assert slow.status == 504, slow.status
        server.wait_log("ran past --request-timeout")
        echo(ws, "after")
        assert server.count_log("ran past --request-timeout") == 1, server.log_text()
    finally:
        finish(ws)
