"""The arbiter's life cycle against real ``python -m forkserve`` process groups.

Real signals, port 0, no sleeps: requests are held in flight on a FIFO (``/block?fifo=``) and
every wait is a deadline-bounded ``wait_for`` or log wait.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.harness import (worker_set, Server, closed_without_response, get, process_group,
                           read_json_file, read_response, refused, send_get, wait_file_record,
                           wait_for)

APP_LOAD_ERROR = 4
WORKER_BOOT_ERROR = 3


# -- helpers ------------------------------------------------------------------------------------

def errors(server: Server) -> list[dict[str, Any]]:
    return [r for r in server.records() if r.get("level") == "ERROR"]



def exit_code(server: Server, timeout: float) -> int:
    """Wait for the server to exit, then for its last log line: the log reader is a thread, so
    the process can be gone before its final lines have been read."""
    code = server.wait_exit(timeout)
    server.wait_log("Server stopped", timeout=5)
    return code


def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        return fh.read().replace(b"\0", b" ").decode().strip()


# -- 1. start, serve, stop ----------------------------------------------------------------------

@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_graceful_stop_exits_zero(server: Server, signum: int) -> None:
    assert get(server.port, "/").body == b"hello\n"
    server.signal(signum)
    assert exit_code(server, 10) == 0
    server.wait_log("Received shutdown signal, draining connections")
    assert server.wait_log("Server stopped")["exit_code"] == 0
    assert errors(server) == []


def test_request_in_flight_at_term_completes(server_factory: Any, gates: Any) -> None:
    server = server_factory().wait_ready()
    gate = gates()
    # No "Connection: close" from the client: the server must add it while draining.
    with send_get(server.port, gate.route, close=False) as sock:
        gate.wait_entered()
        server.signal(signal.SIGTERM)
        server.wait_log("Received shutdown signal")
        assert server.proc.poll() is None, "the server exited with a request in flight"
        gate.release()
        response = read_response(sock)
        assert response.status == 200
        assert response.body == b"released"
        assert response.headers.get("connection") == "close"
        assert closed_without_response(sock, 5), "the connection stayed open after the drain"
    assert exit_code(server, 10) == 0
    assert server.wait_log("Server stopped")["exit_code"] == 0


def test_new_connections_refused_promptly_after_term(server: Server) -> None:
    port = server.port
    assert not refused(port)
    server.signal(signal.SIGTERM)
    # Promptly: with nothing in flight, long before the drain timeout (25 s) could end it;
    # the bound leaves room for a loaded machine's scheduling, not for a drain.
    wait_for(lambda: refused(port), 10, "connections to be refused after TERM")
    assert exit_code(server, 10) == 0


def test_connection_queued_at_term_is_served(server_factory: Any, gates: Any) -> None:
    """ARCHITECTURE.md, draining: "accept queue drained, then closed". A client already in the
    listen queue when TERM arrives (the only worker busy) must be served, not reset."""
    server = server_factory(workers=1).wait_ready()
    gate = gates()
    with send_get(server.port, gate.route) as busy:
        gate.wait_entered()
        queued = send_get(server.port, "/")  # accepted by the kernel, waiting in the backlog
        server.signal(signal.SIGTERM)
        server.wait_log("Received shutdown signal")
        gate.release()
        assert read_response(busy).body == b"released"
    with queued:
        try:
            response = read_response(queued, 5)
        except (ConnectionError, OSError) as exc:
            pytest.fail(f"a client queued before TERM was dropped: {exc!r}\n{server.log_text()}")
        assert response.status == 200 and response.body == b"hello\n"
    assert exit_code(server, 10) == 0


def test_quit_is_a_hard_stop(server_factory: Any, gates: Any) -> None:
    server = server_factory(workers=1).wait_ready()
    gate = gates()
    with send_get(server.port, gate.route) as sock:
        gate.wait_entered()
        started = time.monotonic()
        server.signal(signal.SIGQUIT)
        assert exit_code(server, 5) == 0
        assert time.monotonic() - started < 5
        server.wait_log("Hard stop")
        assert closed_without_response(sock, 5)


def test_second_int_during_drain_is_a_hard_stop(server_factory: Any, gates: Any) -> None:
    # The default drain timeout (25 s) would keep the first INT waiting on the blocked request.
    server = server_factory(workers=1).wait_ready()
    gate = gates()
    with send_get(server.port, gate.route):
        gate.wait_entered()
        server.signal(signal.SIGINT)
        server.wait_log("Received shutdown signal")
        assert server.proc.poll() is None
        started = time.monotonic()
        server.signal(signal.SIGINT)
        assert exit_code(server, 5) == 0
        assert time.monotonic() - started < 5
        server.wait_log("Hard stop")


def test_drain_timeout_stops_a_stuck_request(server_factory: Any, gates: Any) -> None:
    server = server_factory("--drain-timeout", "1", workers=1).wait_ready()
    gate = gates()
    with send_get(server.port, gate.route):
        gate.wait_entered()
        started = time.monotonic()
        server.signal(signal.SIGTERM)
        assert exit_code(server, 8) == 0
        assert 0.9 <= time.monotonic() - started < 8
        server.wait_log("Drain timeout reached")


def test_long_timeouts_do_not_crash_the_arbiter(server_factory: Any) -> None:
    """A timeout longer than poll() can express (~24.8 days in ms) means "practically never",
    not a crash: the arbiter must boot, serve and drain with it."""
    server = server_factory("--timeout", "1e7", "--drain-timeout", "1e7", workers=1)
    wait_for(lambda: server.proc.poll() is not None or server.count_log("Server ready"), 10,
             "the server to be ready or to die")
    assert server.proc.poll() is None, server.log_text()
    assert get(server.port, "/").body == b"hello\n"
    server.signal(signal.SIGTERM)
    assert exit_code(server, 10) == 0, server.log_text()


# -- 2. worker replacement ----------------------------------------------------------------------

def test_killed_worker_is_replaced(server: Server) -> None:
    before = worker_set(server, 2)
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    record = server.wait_log(f"(pid {victim}) was killed by signal 9")
    assert record["level"] == "ERROR"
    after = wait_for(lambda: (w := set(server.workers())) and len(w) == 2 and victim not in w and w,
                     10, "a replacement worker")
    assert len(after - before) == 1
    for _ in range(4):
        assert get(server.port, "/").body == b"hello\n"


def test_worker_that_exits_in_a_request_is_replaced(server_factory: Any) -> None:
    server = server_factory(workers=1).wait_ready()
    first = int(get(server.port, "/pid").body)
    with send_get(server.port, "/exit") as sock:
        assert closed_without_response(sock)
    server.wait_log(f"(pid {first}) exited with code 3")
    second = int(get(server.port, "/pid").body)
    assert second != first
    assert worker_set(server, 1) == {second}


# -- 3. boot failures ---------------------------------------------------------------------------

BOOT_FAILURES = {
    "import-error": ("tests.apps.basic:app", {"TESTAPP_FAIL_IMPORT": "1"},
                     ["tests.apps.basic", "ImportError: failing on purpose (TESTAPP_FAIL_IMPORT)"]),
    "no-module": ("no_such_module_here:app", {},
                  ["no_such_module_here", "ModuleNotFoundError: No module named 'no_such_module_here'"]),
    "no-attribute": ("tests.apps.basic:no_such_app", {}, ["tests.apps.basic", "no_such_app"]),
    "syntax-error": ("syntax_broken:app", {}, ["syntax_broken", "SyntaxError: invalid syntax"]),
    "factory-raises": ("tests.apps.lifecycle:failing_factory()", {},
                       ["failing_factory", "ValueError: the factory refused on purpose"]),
    "not-callable": ("tests.apps.basic:not_callable", {},
                     ["tests.apps.basic:not_callable", "not callable"]),
}


@pytest.mark.parametrize("case", list(BOOT_FAILURES))
def test_app_that_cannot_load_exits_4(server_factory: Any, tmp_path: Path, case: str) -> None:
    app, env, expected = BOOT_FAILURES[case]
    (tmp_path / "syntax_broken.py").write_text("app = 1 +\n")
    server = server_factory(app=app, env=env, cwd=tmp_path)
    # Bounded for a hang only: a start-up beside a loaded suite takes seconds. That it gives
    # up at once rather than retrying is test_boot_failure_is_not_a_fork_loop's (a count).
    assert exit_code(server, 30) == APP_LOAD_ERROR, server.log_text()
    lines = errors(server)
    assert len(lines) == 1, server.log_text()
    for text in expected:
        assert text in lines[0]["message"], server.log_text()
    assert server.count_log("Server ready") == 0


def test_boot_failure_is_not_a_fork_loop(server_factory: Any) -> None:
    server = server_factory("--log-level", "debug", env={"TESTAPP_FAIL_IMPORT": "1"})
    assert exit_code(server, 30) == APP_LOAD_ERROR, server.log_text()
    assert server.count_log("Spawned worker") == 2, server.log_text()


def test_app_load_error_exit_code_is_reliable(server_factory: Any) -> None:
    """The exit code is what a supervisor acts on: it must be 4 every time, not usually."""
    codes = []
    for _ in range(20):
        server = server_factory(env={"TESTAPP_FAIL_IMPORT": "1"})
        # What is tested is the code, not the speed: the bound only keeps a hang finite (20
        # start-ups beside a loaded suite take seconds each).
        codes.append(server.wait_exit(30))
        if codes[-1] != APP_LOAD_ERROR:
            pytest.fail(f"run {len(codes)}: exit code {codes[-1]}, not 4\n{server.log_text()}")
        server.close()


def test_worker_exiting_while_importing_exits_4(server_factory: Any) -> None:
    # os._exit(7) at import: no BOOT_ERROR record, an exit code; the import ended the worker.
    server = server_factory(app="tests.apps.lifecycle:app", env={"LIFECYCLE_EXIT_ON_IMPORT": "7"})
    assert exit_code(server, 30) == APP_LOAD_ERROR, server.log_text()
    lines = errors(server)
    assert len(lines) == 1, server.log_text()
    assert "exited with code 7 while importing the application (os._exit?)" in lines[0]["message"]


def test_worker_hanging_while_booting_times_out(server_factory: Any, tmp_path: Path) -> None:
    fifo = tmp_path / "boot"
    os.mkfifo(fifo)
    server = server_factory("--timeout", "1", app="tests.apps.slow_boot:app", workers=1,
                            env={"SLOW_BOOT_FIFO": str(fifo)})
    server.wait_log("timed out (no boot for 1s)")
    assert exit_code(server, 8) == WORKER_BOOT_ERROR, server.log_text()


# -- 4. worker timeout --------------------------------------------------------------------------

def test_stuck_request_gets_its_worker_killed_and_replaced(server_factory: Any, gates: Any) -> None:
    server = server_factory("--timeout", "2", workers=1).wait_ready()
    first = int(get(server.port, "/pid").body)
    gate = gates()
    with send_get(server.port, gate.route) as sock:
        gate.wait_entered()
        record = server.wait_log(f"(pid {first}) timed out", timeout=10)
        assert "heartbeat" in record["message"]
        assert closed_without_response(sock)
    server.wait_log(f"(pid {first}) exited with code 1 after a timeout")
    second = int(get(server.port, "/pid").body)
    assert second != first
    server.signal(signal.SIGTERM)
    assert exit_code(server, 10) == 0
    assert server.count_log("timed out") == 1, server.log_text()


# -- 5. arbiter death ---------------------------------------------------------------------------

def test_workers_exit_when_the_arbiter_is_killed(server: Server) -> None:
    workers = worker_set(server, 2)
    os.kill(server.pid, signal.SIGKILL)
    assert server.wait_exit(5) == -signal.SIGKILL
    started = time.monotonic()
    wait_for(lambda: not process_group(server.pid), 2.5,
             f"workers {workers} to notice the arbiter's death")
    assert time.monotonic() - started < 2.5


# -- 6. HUP reload ------------------------------------------------------------------------------

class Client(threading.Thread):
    """Requests in a loop on fresh connections until stopped (bounded by count and time)."""

    def __init__(self, port: int, limit: int = 5000, seconds: float = 30.0) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.limit = limit
        self.seconds = seconds
        self.stop = threading.Event()
        self.pids: list[int] = []
        self.failures: list[str] = []

    def run(self) -> None:
        deadline = time.monotonic() + self.seconds
        while not self.stop.is_set() and len(self.pids) < self.limit and time.monotonic() < deadline:
            try:
                response = get(self.port, "/pid", timeout=5)
            except OSError as exc:
                self.failures.append(repr(exc))
                continue
            if response.status != 200:
                self.failures.append(f"status {response.status}")
                continue
            self.pids.append(int(response.body))

    def finish(self) -> None:
        self.stop.set()
        self.join(10)


def test_hup_reloads_without_failed_requests(server: Server) -> None:
    client = Client(server.port)
    client.start()
    try:
        wait_for(lambda: len(client.pids) >= 5, 10, "the client to get going")
        for reload in range(1, 4):
            old = worker_set(server, 2)
            served_before = len(client.pids)
            server.signal(signal.SIGHUP)
            wait_for(lambda: server.count_log("Reload complete") >= reload, 10, f"reload {reload}")
            new = wait_for(lambda: (w := set(server.workers())) and len(w) == 2 and not (w & old) and w,
                           10, f"the old workers {old} to exit")
            assert not new & old
            # The old workers left only after the new generation had booted.
            for pid in old:
                server.wait_log(f"(pid {pid}) exited with code 0")
            records = server.records()
            complete = [i for i, r in enumerate(records) if "Reload complete" in r["message"]][reload - 1]
            for pid in old:
                gone = [i for i, r in enumerate(records)
                        if f"(pid {pid})" in r["message"] and "exited" in r["message"]]
                assert gone[0] > complete, server.log_text()
            wait_for(lambda: any(p in new for p in client.pids[served_before:]), 10,
                     "a request served by the new generation")
    finally:
        client.finish()
    assert client.failures == [], client.failures
    assert errors(server) == []
    server.signal(signal.SIGTERM)
    assert exit_code(server, 10) == 0


def test_hup_applies_a_changed_worker_count(server_factory: Any, tmp_path: Path) -> None:
    config = tmp_path / "forkserve.yaml"
    config.write_text("workers: 1\n")
    server = server_factory("-c", str(config), workers=0).wait_ready()
    worker_set(server, 1)
    config.write_text("workers: 3\n")
    server.signal(signal.SIGHUP)
    server.wait_log("Reload complete")
    three = worker_set(server, 3)
    config.write_text("workers: 2\n")
    server.signal(signal.SIGHUP)
    wait_for(lambda: server.count_log("Reload complete") >= 2, 10, "the second reload")
    two = worker_set(server, 2)
    assert not two & three
    assert get(server.port, "/").status == 200


def test_hup_with_a_broken_app_keeps_the_old_workers(server_factory: Any, tmp_path: Path) -> None:
    flag = tmp_path / "break-the-app"
    server = server_factory(app="tests.apps.lifecycle:app",
                            env={"LIFECYCLE_BREAK_IF_EXISTS": str(flag)}).wait_ready()
    old = worker_set(server, 2)
    flag.touch()
    server.signal(signal.SIGHUP)
    record = server.wait_log("Reload failed")
    assert "broken deploy on purpose" in record["message"], server.log_text()
    assert worker_set(server, 2) == old
    for _ in range(4):
        response = get(server.port, "/pid")
        assert response.status == 200 and int(response.body) in old
    assert server.proc.poll() is None
    # The deploy is fixed: the next HUP goes through.
    flag.unlink()
    server.signal(signal.SIGHUP)
    server.wait_log("Reload complete")
    new = wait_for(lambda: (w := set(server.workers())) and len(w) == 2 and not (w & old) and w,
                   10, "the new generation")
    assert int(get(server.port, "/pid").body) in new
    server.signal(signal.SIGTERM)
    assert exit_code(server, 10) == 0


def test_failed_reload_keeps_the_old_configuration(server_factory: Any, tmp_path: Path) -> None:
    """After "Reload failed" the old generation keeps serving *with its configuration*: a worker
    of it that dies later is replaced by one that boots, not by one running the broken app."""
    config = tmp_path / "forkserve.yaml"
    config.write_text("workers: 1\napp: tests.apps.basic:app\n")
    server = server_factory("-c", str(config), app="", workers=0).wait_ready()
    (old,) = worker_set(server, 1)
    config.write_text("workers: 1\napp: tests.apps.basic:no_such_app\n")
    server.signal(signal.SIGHUP)
    server.wait_log("Reload failed")
    assert int(get(server.port, "/pid").body) == old
    os.kill(old, signal.SIGKILL)
    server.wait_log(f"(pid {old}) was killed by signal 9")
    try:
        replacement = int(get(server.port, "/pid", timeout=5).body)
    except OSError as exc:
        pytest.fail(f"no worker serves after the failed reload: {exc!r}\n{server.log_text()}")
    assert replacement != old
    assert server.count_log("failed to boot") == 0, server.log_text()


def test_hup_applies_a_changed_error_log(server_factory: Any, tmp_path: Path) -> None:
    """error_log is declared reloadable (config.py): after a HUP the arbiter must write to the
    new path, or at the least warn that the change needs a restart, never ignore it silently."""
    first, second = tmp_path / "first.log", tmp_path / "second.log"
    config = tmp_path / "forkserve.yaml"
    config.write_text(f"workers: 1\nerror_log: {first}\n")
    server = server_factory("-c", str(config), workers=0)
    wait_file_record(first, "Server ready")
    config.write_text(f"workers: 1\nerror_log: {second}\n")
    server.signal(signal.SIGHUP)
    wait_file_record(first, "Reloading")

    def moved_or_warned() -> bool:
        warned = any("error_log" in str(r.get("settings", "")) for r in read_json_file(first))
        return warned or any("Reload complete" in r.get("message", "") for r in read_json_file(second))
    wait_for(moved_or_warned, 5, f"the error log to move to {second}\n{first.read_text()}")


# -- 7. USR1 reopens the logs -------------------------------------------------------------------

def test_usr1_reopens_error_and_access_logs(server_factory: Any, tmp_path: Path) -> None:
    error_log = tmp_path / "error.log"
    access_log = tmp_path / "access.log"
    server = server_factory("--error-log", str(error_log), "--access-log", str(access_log),
                            "--log-level", "debug", workers=1)
    started = wait_file_record(error_log, "Starting forkserve")
    port = int(str(started["listening"]).rsplit(":", 1)[1])
    wait_file_record(error_log, "Server ready")

    sent: list[str] = []

    def request(n: int) -> None:
        marker = f"/?line={n}"
        assert get(port, marker).status == 200
        sent.append(marker)

    request(1)
    wait_for(lambda: access_log.exists() and "line=1 " in access_log.read_text(), 10, "line 1")
    rotated_error, rotated_access = tmp_path / "error.log.1", tmp_path / "access.log.1"
    error_log.rename(rotated_error)
    access_log.rename(rotated_access)
    request(2)  # before USR1: still written to the renamed file
    server.signal(signal.SIGUSR1)
    wait_file_record(error_log, "Reopened log files")

    def new_access_line() -> bool:
        request(len(sent) + 1)
        return access_log.exists() and f"line={len(sent)} " in access_log.read_text()
    wait_for(new_access_line, 10, "the worker to write to the new access log", interval=0.05)
    with send_get(port, "/raise") as sock:
        assert read_response(sock).status == 500
    wait_file_record(error_log, "Error handling request GET /raise")

    server.signal(signal.SIGTERM)
    assert server.wait_exit(10) == 0
    wait_file_record(error_log, "Server stopped")
    old_lines = rotated_access.read_text().splitlines()
    new_lines = access_log.read_text().splitlines()
    assert "line=2 " in "\n".join(old_lines)
    # Every request is logged exactly once, in one file or the other.
    logged = [m for m in sent for line in old_lines + new_lines if f'"GET {m} HTTP/1.1"' in line]
    assert sorted(logged) == sorted(sent), (old_lines, new_lines)
    assert not any("Reopened" in r.get("message", "") for r in read_json_file(rotated_error))


# -- 8. max-requests ----------------------------------------------------------------------------

def test_max_requests_retires_the_worker(server_factory: Any) -> None:
    server = server_factory("--max-requests", "5", workers=1).wait_ready()
    pids = [int(get(server.port, "/pid").body) for _ in range(12)]
    assert pids[:5] == [pids[0]] * 5
    assert pids[5] != pids[0]
    assert len(set(pids)) == 3, pids
    record = server.wait_log(f"(pid {pids[0]}) retired", timeout=5)
    assert "max-requests" in record["message"]
    assert errors(server) == []


# -- 9. pidfile ---------------------------------------------------------------------------------

def test_pidfile_written_and_removed(server_factory: Any, tmp_path: Path) -> None:
    pidfile = tmp_path / "forkserve.pid"
    server = server_factory("--pidfile", str(pidfile)).wait_ready()
    assert pidfile.read_text().strip() == str(server.pid)
    server.signal(signal.SIGTERM)
    assert exit_code(server, 10) == 0
    assert not pidfile.exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no temporary file left behind


# -- 10. process titles -------------------------------------------------------------------------

def test_process_titles(server: Server) -> None:
    assert cmdline(server.pid) == "forkserve: arbiter [tests.apps.basic:app]"
    titles = sorted(cmdline(pid) for pid in worker_set(server, 2))
    assert titles == ["forkserve: worker 1 [tests.apps.basic:app]",
                      "forkserve: worker 2 [tests.apps.basic:app]"]



def test_ctrl_c_to_the_whole_process_group_is_graceful(server_factory: Any, gates: Any) -> None:
    """A terminal's Ctrl-C sends SIGINT to every process of the group, workers included: the
    in-flight request must still complete (workers leave the decision to the arbiter)."""
    server = server_factory().wait_ready()
    gate = gates()
    with send_get(server.port, gate.route) as sock:
        gate.wait_entered()
        os.killpg(server.pid, signal.SIGINT)
        server.wait_log("Received shutdown signal")
        gate.release()
        response = read_response(sock)
        assert response.status == 200 and response.body == b"released"
    assert exit_code(server, 10) == 0
