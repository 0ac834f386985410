"""The access log (json and template formats, X-Request-ID), USR1 rotation under load, and the
error log's lifecycle lines (json and text), against real ``python -m forkserve`` processes.

Port 0, real signals, no sleeps: every wait is a deadline-bounded ``wait_for`` or log wait on
an event (a log line, a file's content, a response). Requests are held in flight on a FIFO.
"""

from __future__ import annotations

import calendar
import collections
import json
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.harness import (Response, Server, get, read_response, send_get, wait_for,
                           worker_set)

GENERATED_ID = re.compile(r"[0-9a-f]{16}-[0-9a-f]+")
APACHE_TIME = "%d/%b/%Y:%H:%M:%S +0000"
COUNTERS = ("active_connections", "in_flight_requests", "background_tasks")


# -- helpers ------------------------------------------------------------------------------------

def request(port: int, method: str, target: str, headers: tuple[tuple[str, str], ...] = (),
            body: bytes = b"", timeout: float = 10.0) -> Response:
    """One request on its own connection, headers sent byte for byte (latin-1)."""
    head = f"{method} {target} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in headers)
    if body:
        head += f"Content-Length: {len(body)}\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head.encode("latin-1") + b"\r\n" + body)
        return read_response(sock, timeout)


def file_lines(path: Path, writer_done: bool = True) -> list[str]:
    """Whole lines (split at LF only); a line is written in one write, so once the writer is
    done none is partial. A read beside a write may see part of it (Linux does not make a
    read atomic with a write to the same file): while the server runs, pass
    ``writer_done=False`` and the unfinished last line is left out."""
    if not path.exists():
        return []
    text = path.read_bytes().decode("utf-8", "replace")
    if not writer_done:
        return text.split("\n")[:-1]
    assert text == "" or text.endswith("\n"), f"partial line at the end of {path}: {text[-300:]!r}"
    return text.split("\n")[:-1]


def wait_lines(path: Path, count: int, timeout: float = 10.0) -> list[str]:
    return wait_for(lambda: len(file_lines(path, False)) >= count and file_lines(path, False),  # type: ignore[no-any-return]
                    timeout, lambda: f"{count} lines in {path}, have {file_lines(path, False)}")


def read_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in file_lines(path)]


def wait_file_record(path: Path, message: str, timeout: float = 10.0,
                     **fields: Any) -> dict[str, Any]:
    def find() -> dict[str, Any] | None:
        return next((r for r in read_records(path) if message in r.get("message", "")
                     and all(r.get(k) == v for k, v in fields.items())), None)
    return wait_for(find, timeout, f"{message!r} {fields or ''} in {path}")  # type: ignore[no-any-return]


def environ_of(response: Response) -> dict[str, Any]:
    assert response.status == 200, response.body
    return json.loads(response.body)  # type: ignore[no-any-return]


# -- 1. json and template access logs -------------------------------------------------------------

def test_json_access_log_end_to_end(server_factory: Any, tmp_path: Path) -> None:
    log = tmp_path / "access.log"
    server = server_factory("--access-log", str(log), "--access-log-format", "json").wait_ready()
    workers = worker_set(server, 2)
    before = time.time()
    assert request(server.port, "GET", "/?a=1&b=two%20x", headers=(
        ("User-Agent", "forkserve-tests/1.0"), ("Referer", "http://ref.example/page"),
        ("X-Request-ID", "req-get-1"))).body == b"hello\n"
    assert request(server.port, "POST", "/echo", body=b"x" * 1234).body == b"x" * 1234
    assert request(server.port, "GET", "/missing").status == 404
    records = {r["target"]: r for r in read_records_when(log, 3)}
    after = time.time()

    first, post, missing = records["/?a=1&b=two%20x"], records["/echo"], records["/missing"]
    assert set(first) == {"time", "time_iso", "remote_addr", "method", "path", "query", "target",
                          "protocol", "status", "bytes", "duration_us", "duration", "referer",
                          "user_agent", "request_id", "pid"}
    assert {k: first[k] for k in ("remote_addr", "method", "path", "query", "protocol", "status",
                                  "bytes", "referer", "user_agent", "request_id")} == {
        "remote_addr": "127.0.0.1", "method": "GET", "path": "/", "query": "a=1&b=two%20x",
        "protocol": "HTTP/1.1", "status": 200, "bytes": 6, "referer": "http://ref.example/page",
        "user_agent": "forkserve-tests/1.0", "request_id": "req-get-1"}
    assert (post["method"], post["path"], post["query"], post["status"], post["bytes"]) == (
        "POST", "/echo", "", 200, 1234)
    assert (post["referer"], post["user_agent"]) == ("-", "-")
    assert (missing["method"], missing["path"], missing["status"], missing["bytes"]) == (
        "GET", "/missing", 404, len(b"not found\n"))
    ids = [r["request_id"] for r in (post, missing)]
    assert all(GENERATED_ID.fullmatch(i) for i in ids) and ids[0] != ids[1], ids
    for record in records.values():
        assert record["pid"] in workers, (record["pid"], workers)
        assert type(record["duration_us"]) is int and 0 <= record["duration_us"] < 10_000_000
        # The same duration: truncated to microseconds, and rounded to 6 decimals.
        assert abs(float(record["duration"]) * 1e6 - record["duration_us"]) < 1.5, record
        start = calendar.timegm(time.strptime(record["time"], APACHE_TIME))
        assert int(before) - 1 <= start <= after + 1, record["time"]
        iso = calendar.timegm(time.strptime(record["time_iso"][:19], "%Y-%m-%dT%H:%M:%S"))
        assert iso == start and re.fullmatch(r".{19}\.\d{3}Z", record["time_iso"]), record


def read_records_when(path: Path, count: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in wait_lines(path, count)]


def test_template_access_log_end_to_end(server_factory: Any, tmp_path: Path) -> None:
    log = tmp_path / "access.log"
    server = server_factory(
        "--access-log", str(log), "--access-log-format",
        '{remote_addr} {method} {path} {status} {duration_us} {request_id} "{user_agent}" {bytes}',
    ).wait_ready()
    assert request(server.port, "GET", "/?q=1", headers=(("X-Request-ID", "tmpl-1"),)).status == 200
    assert request(server.port, "POST", "/echo", body=b"abc",
                   headers=(("User-Agent", 'evil" agent\\ "x'),)).status == 200
    lines = sorted(wait_lines(log, 2))
    line = re.compile(r'127\.0\.0\.1 (GET|POST) (\S+) (\d{3}) (\d+) (\S+) "((?:[^"\\]|\\.)*)" (\d+)')
    matches = [line.fullmatch(text) for text in lines]
    assert all(matches), lines
    get_line, post_line = matches
    assert get_line.group(1, 2, 3, 5, 6, 7) == ("GET", "/", "200", "tmpl-1", "-", "6")
    assert post_line.group(1, 2, 3, 6, 7) == ("POST", "/echo", "200", 'evil\\" agent\\\\ \\"x', "3")
    assert GENERATED_ID.fullmatch(post_line[5]), post_line[5]


@pytest.mark.parametrize("template, named", [
    ("{remote_addr} {nope}", "nope"),
    ("{path} {bogus} {also_bad}", "also_bad, bogus"),
    ("{path.__class__}", "path.__class__"),
    ("{user_agent[0]}", "user_agent[0]"),
    ("{}", "(none given)"),
    ("just text", "just text"),
    ("{path", "{path"),
    # Known names, but a format spec or a conversion that fails on every request.
    ("{path:d}", "path"),
    ("{status} {method!z}", "method"),
])
def test_invalid_template_exits_2_with_one_line(server_factory: Any, tmp_path: Path,
                                                template: str, named: str) -> None:
    access_log = tmp_path / "access.log"
    server = server_factory("--access-log", str(access_log), "--access-log-format", template)
    # A config error is one plain line and exit 2; any JSON record means the server started.
    wait_for(lambda: server.proc.poll() is not None or server.records(), 10,
             "the server to exit or to start")
    assert not server.records(), f"the server started with {template!r}:\n{server.log_text()}"
    assert server.wait_exit(5) == 2
    server.close()  # reads its output to the end
    assert len(server.lines) == 1, server.lines
    assert "--access-log-format" in server.lines[0] and named in server.lines[0], server.lines[0]
    assert server.stdout_lines == []
    assert not access_log.exists()


def test_json_access_log_escapes_c1_controls_from_clients(server_factory: Any,
                                                          tmp_path: Path) -> None:
    """Header bytes 0x80-0x9f are accepted (obs-text) and decoded as latin-1 C1 controls:
    NEL (0x85) breaks the line for Unicode-aware readers, CSI (0x9b) is a terminal escape.
    The combined format escapes them; the json one must too."""
    log = tmp_path / "access.log"
    server = server_factory("--access-log", str(log), "--access-log-format", "json").wait_ready()
    agent = "ua\x85nel\x9bcsi\"quote\\"
    assert request(server.port, "GET", "/", headers=(("User-Agent", agent),)).status == 200
    [line] = wait_lines(log, 1)
    assert json.loads(line)["user_agent"] == agent
    assert len(line.splitlines()) == 1 and line.isprintable(), f"raw controls in {line!r}"


# -- 2. X-Request-ID ------------------------------------------------------------------------------

def test_request_id_taken_generated_or_replaced(server_factory: Any, tmp_path: Path) -> None:
    log = tmp_path / "access.log"
    server = server_factory("--access-log", str(log), "--access-log-format", "json").wait_ready()
    port = server.port
    seen = {}  # target -> the id the app saw
    seen["/environ?case=given"] = environ_of(request(
        port, "GET", "/environ?case=given", headers=(("X-Request-ID", "abc-123"),)))["HTTP_X_REQUEST_ID"]
    for n in range(3):
        seen[f"/environ?case=none{n}"] = environ_of(request(
            port, "GET", f"/environ?case=none{n}"))["HTTP_X_REQUEST_ID"]
    hostile = {"space": "abc 123", "quote": 'abc"123', "long": "a" * 300}
    for name, value in hostile.items():
        seen[f"/environ?case={name}"] = environ_of(request(
            port, "GET", f"/environ?case={name}", headers=(("X-Request-ID", value),)))["HTTP_X_REQUEST_ID"]
    at_limit = "b" * 200
    seen["/environ?case=limit"] = environ_of(request(
        port, "GET", "/environ?case=limit", headers=(("X-Request-ID", at_limit),)))["HTTP_X_REQUEST_ID"]

    assert seen["/environ?case=given"] == "abc-123"
    assert seen["/environ?case=limit"] == at_limit
    generated = [seen[f"/environ?case={c}"] for c in ("none0", "none1", "none2", *hostile)]
    assert all(GENERATED_ID.fullmatch(g) for g in generated), generated
    assert len(set(generated)) == len(generated), generated
    logged = {r["target"]: r["request_id"] for r in read_records_when(log, len(seen))}
    assert logged == seen, "the access log records the id the app saw"


def test_no_request_id_without_the_access_log(server: Server) -> None:
    environ = environ_of(get(server.port, "/environ"))
    assert "HTTP_X_REQUEST_ID" not in environ
    passed = environ_of(request(server.port, "GET", "/environ",
                                headers=(("X-Request-ID", "a b"),)))
    assert passed["HTTP_X_REQUEST_ID"] == "a b"  # an ordinary header, untouched


# -- 3. USR1 rotation under load ------------------------------------------------------------------

ROTATION_LINE = re.compile(r"(\d+) (\d{3}) /\?m=(\S+) (\S+)")


@pytest.mark.parametrize("worker_class", ["sync", "thread"])
def test_usr1_rotation_under_load_loses_and_duplicates_nothing(server_factory: Any, tmp_path: Path,
                                                               worker_class: str) -> None:
    error_log, access_log = tmp_path / "error.log", tmp_path / "access.log"
    threads = ["--threads", "4"] if worker_class == "thread" else []
    server = server_factory("-k", worker_class, *threads, "--error-log", str(error_log),
                            "--access-log", str(access_log), "--access-log-format",
                            "{pid} {status} {target} {request_id}", "--log-level", "debug",
                            workers=2)
    started = wait_file_record(error_log, "Starting forkserve")
    port = int(str(started["listening"]).rsplit(":", 1)[1])
    wait_file_record(error_log, "Server ready")
    workers = worker_set(server, 2)

    sent: list[str] = []
    failures: list[BaseException] = []
    stop = threading.Event()

    def client(c: int) -> None:
        n = 0
        try:
            while not stop.is_set():
                marker = f"{c}-{n}"
                response = get(port, f"/?m={marker}")
                assert response.status == 200, response.status
                sent.append(marker)  # list.append: atomic
                n += 1
        except BaseException as exc:  # reported below
            failures.append(exc)

    clients = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(4)]
    for thread in clients:
        thread.start()
    rotations = 3
    try:
        wait_for(lambda: len(sent) >= 100 or failures, 15, "100 requests before the rotation")
        for n in range(1, rotations + 1):
            # logrotate: rename both logs under load, then USR1.
            access_log.rename(tmp_path / f"access.log.{n}")
            error_log.rename(tmp_path / f"error.log.{n}")
            server.signal(signal.SIGUSR1)
            wait_file_record(error_log, "Reopened log files")
            for worker_id in (1, 2):
                wait_file_record(error_log, "Worker reopened its log files", worker=worker_id)

            def both_workers_in_new_file() -> bool:
                pids = {int(line.split()[0]) for line in file_lines(access_log, writer_done=False)}
                return pids == workers or bool(failures)
            wait_for(both_workers_in_new_file, 15, "lines from both workers in the new access log")
            reopened = len(sent)  # each of these is logged after the reopen: in the new file
            wait_for(lambda: len(sent) >= reopened + 200 or failures, 15, "200 more requests")
    finally:
        stop.set()
        for thread in clients:
            thread.join(15)
    assert not failures, failures
    assert not any(thread.is_alive() for thread in clients)

    server.signal(signal.SIGTERM)
    assert server.wait_exit(15) == 0
    wait_file_record(error_log, "Server stopped", exit_code=0)

    files = [tmp_path / f"access.log.{n}" for n in range(1, rotations + 1)] + [access_log]
    per_file = [file_lines(path) for path in files]
    every = [line for lines in per_file for line in lines]
    matches = [ROTATION_LINE.fullmatch(line) for line in every]
    assert all(matches), [line for line, m in zip(every, matches) if not m][:5]
    assert all(m[2] == "200" and int(m[1]) in workers for m in matches)  # type: ignore[index]
    logged = collections.Counter(m[3] for m in matches)  # type: ignore[index]
    lost = set(sent) - set(logged)
    doubled = {k: v for k, v in logged.items() if v > 1}
    unknown = set(logged) - set(sent)
    assert not lost and not doubled and not unknown, (
        f"{len(sent)} sent; {len(lost)} lost e.g. {sorted(lost)[:5]}; {len(doubled)} logged "
        f"twice e.g. {sorted(doubled)[:5]}; {len(unknown)} never sent e.g. {sorted(unknown)[:5]}")
    assert all(len(lines) >= 100 for lines in per_file), [len(lines) for lines in per_file]
    for n in range(1, rotations + 1):
        old_records = read_records(tmp_path / f"error.log.{n}")
        # The arbiter logs each reopen in the new file: error.log.N holds rotation N-1's.
        assert sum("Reopened log files" in r["message"] for r in old_records) == (n > 1), n
        assert [r for r in old_records if r["level"] == "ERROR"] == []
    current = read_records(error_log)
    assert sum("Reopened log files" in r["message"] for r in current) == 1
    assert [r for r in current if r["level"] == "ERROR"] == []


# -- 4. --log-format json lifecycle ---------------------------------------------------------------

def test_json_lifecycle_log(server_factory: Any, gates: Any) -> None:
    server = server_factory("--lameduck", "0.3").wait_ready()
    starting = server.wait_log("Starting forkserve")
    assert starting["workers"] == 2 and starting["listening"] == f"127.0.0.1:{server.port}"
    spawned = [r for r in server.records() if r["message"] == "Spawned worker"]
    assert sorted(r["worker"] for r in spawned) == [1, 2]
    assert {r["generation"] for r in spawned} == {1}
    assert {r["pid"] for r in spawned} == worker_set(server, 2)
    ready = server.wait_log("Server ready")
    assert ready["generation"] == 1 and all(type(ready[k]) is int for k in COUNTERS)

    # A crash: SIGKILL to a worker.
    victim = spawned[0]
    os.kill(victim["pid"], signal.SIGKILL)
    crash = server.wait_log("unexpectedly", pid=victim["pid"])
    assert crash["level"] == "ERROR" and crash["reason"] == "crashed"
    assert (crash["worker"], crash["generation"]) == (victim["worker"], 1)
    assert "SIGKILL" in crash["exit"] and f"pid {victim['pid']}" in crash["message"]

    def spawned_now() -> list[dict[str, Any]]:
        return [r for r in server.records() if r["message"] == "Spawned worker"]
    replacement = wait_for(lambda: len(spawned_now()) == 3 and spawned_now()[2], 10,
                           "a replacement worker")
    assert (replacement["worker"], replacement["generation"]) == (victim["worker"], 1)
    assert replacement["pid"] != victim["pid"]
    old_pids = ({r["pid"] for r in spawned} - {victim["pid"]}) | {replacement["pid"]}
    assert worker_set(server, 2) == old_pids

    # A reload: HUP.
    server.signal(signal.SIGHUP)
    reloading = server.wait_log("Reloading: starting a new generation", generation=2)
    assert reloading["workers"] == 2 and reloading["level"] == "INFO"
    complete = server.wait_log("Reload complete", generation=2)
    assert complete["old_workers"] == 2
    for pid in old_pids:
        stopped = server.wait_log("exited", pid=pid)
        assert stopped["reason"] == "stopped" and stopped["generation"] == 1, stopped
        assert stopped["exit"] == "exited with code 0"
    new_pids = worker_set(server, 2)
    assert not new_pids & old_pids

    # A drain with a request in flight: every step logged with the counters.
    gate = gates()
    held = send_get(server.port, gate.route)
    try:
        gate.wait_entered()
        server.signal(signal.SIGTERM)
        received = server.wait_log("Received shutdown signal, draining connections")
        assert received["lameduck"] == 0.3
        server.wait_log("Stopped accepting; draining in-flight work")
        draining = server.wait_log("Draining in-flight connections")
        assert draining["in_flight_requests"] == 1 and draining["active_connections"] >= 1
        gate.release()
        assert read_response(held).body == b"released"
    finally:
        held.close()
    drained = server.wait_log("All connections drained")
    assert [drained[k] for k in COUNTERS] == [0, 0, 0]
    server.wait_log("All workers stopped")
    assert server.wait_log("Server stopped")["exit_code"] == 0
    assert server.wait_exit(10) == 0
    for message in ("Received shutdown signal", "Stopped accepting", "Draining in-flight",
                    "All connections drained", "All workers stopped"):
        record = server.wait_log(message)
        assert all(type(record[k]) is int for k in COUNTERS), record

    # Every line of the error log ("Server stopped" is the last) is one JSON object.
    assert server.lines and len(server.records()) == len(server.lines), server.log_text()
    for record in server.records():
        assert {"level", "message", "time", "pid"} <= set(record), record
        assert record["level"] in ("INFO", "WARNING", "ERROR", "DEBUG")
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", record["time"]), record
    assert [r["message"] for r in server.records() if r["level"] == "ERROR"] == [crash["message"]]


# -- 5. --log-format text -------------------------------------------------------------------------

TEXT_LINE = re.compile(r"\[(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z)\] \[(\d+)\] "
                       r"\[(DEBUG|INFO|WARNING|ERROR|CRITICAL)\] (.+)")
FIELD = re.compile(r' (\w+)=("(?:[^"\\]|\\.)*"|[^ "]\S*)')


def text_fields(message: str) -> tuple[str, dict[str, str]]:
    """Split 'Message words key=value key="quoted value"' into the message and its fields."""
    first = FIELD.search(message)
    head = message[:first.start()] if first else message
    tail = message[len(head):]
    pairs = FIELD.findall(tail)
    assert "".join(f" {k}={v}" for k, v in pairs) == tail, f"not key=value pairs: {tail!r}"
    return head, {k: json.loads(v) if v.startswith('"') else v for k, v in pairs}


def test_text_format_one_human_line_per_event(server_factory: Any) -> None:
    server = server_factory("--log-format", "text", json_logs=False)
    text = server.wait_text("Server ready")
    port = int(re.search(r"listening=127\.0\.0\.1:(\d+)", text)[1])  # type: ignore[index]
    assert get(port, "/").body == b"hello\n"
    victim = min(worker_set(server, 2))
    os.kill(victim, signal.SIGKILL)
    server.wait_text(f"(pid {victim}) was killed by signal 9")
    wait_for(lambda: server.log_text().count("Spawned worker") == 3, 10, "a replacement worker")
    server.signal(signal.SIGTERM)
    assert server.wait_exit(10) == 0
    server.wait_text("Server stopped")  # the last line: every line is read

    events = []
    for line in server.lines:
        match = TEXT_LINE.fullmatch(line)
        assert match, f"not a text log line: {line!r}"
        assert not line.lstrip().startswith("{")
        message, fields = text_fields(match[4])
        events.append((int(match[2]), match[3], message, fields))
    by_message = {message: (pid, level, fields) for pid, level, message, fields in events}
    pid, level, fields = by_message["Starting forkserve"]
    assert (pid, level) == (server.pid, "INFO")
    assert fields["listening"] == f"127.0.0.1:{port}" and fields["workers"] == "2"
    assert fields["app"] == "tests.apps.basic:app"
    spawned = [f for _, _, m, f in events if m == "Spawned worker"]
    assert len(spawned) == 3 and {f["generation"] for f in spawned} == {"1"}
    assert int(spawned[0]["pid"]) > 0
    crash = next((level, m, f) for _, level, m, f in events if f.get("reason") == "crashed")
    assert crash[0] == "ERROR" and f"(pid {victim})" in crash[1]
    assert crash[2]["pid"] == str(victim) and crash[2]["exit"] == "was killed by signal 9 (SIGKILL)"
    for message in ("Server ready", "Received shutdown signal, draining connections",
                    "All connections drained", "All workers stopped", "Server stopped"):
        assert message in by_message, (message, server.lines)
    assert all(k in by_message["All connections drained"][2] for k in COUNTERS)
    assert by_message["Server stopped"][2]["exit_code"] == "0"
