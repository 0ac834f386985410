"""forkserve's lines through the logging module, end to end: Flask's gunicorn recipe writing
into forkserve's error log (text and JSON), --log-config (YAML and JSON, applied in the arbiter
and in every worker, refused in one line before forking), --log-syslog over UDP and a unix
datagram socket, --capture-output on every worker class, access-log header fields and
gunicorn's atom format through a real server, and handler locks held across the fork.

Port 0, real signals, no sleeps: every wait is a bounded wait on a log line, a file or a
datagram.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness import ROOT, get, wait_for, worker_set

WORKER_CLASSES = ["sync", "thread", "gevent"]
FLASK = "tests.apps.logging_app:flask_app"
PRINTING = "tests.apps.logging_app:printing"
TEXT_LINE = re.compile(r"\[(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z)\] \[(\d+)\] \[([A-Z]+)\] (.*)")


def request(port: int, target: str, headers: tuple[tuple[str, str], ...] = ()) -> bytes:
    head = f"GET {target} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head.encode("latin-1") + b"\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 2"), data
    return data


def file_lines(path: Path) -> list[str]:
    return path.read_text().split("\n")[:-1] if path.exists() else []


def wait_file_text(path: Path, text: str, timeout: float = 10.0) -> list[str]:
    return wait_for(lambda: [l for l in file_lines(path) if text in l],  # type: ignore[no-any-return]
                    timeout, lambda: f"{text!r} in {path}: {file_lines(path)[-20:]}")


def run_check(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "forkserve", "-b", "127.0.0.1:0", *args],
                          cwd=str(tmp), env=env, capture_output=True, text=True, timeout=60)


# -- 1. Flask's recipe: app.logger takes gunicorn.error's handlers and level ------------------

@pytest.mark.parametrize("preload", [False, True], ids=["import-in-worker", "preload"])
def test_flask_recipe_writes_json_records_into_the_error_log(server_factory: Any,
                                                             preload: bool) -> None:
    """(--preload: the recipe ran in the arbiter; each worker's logging set-up after fork
    changes the handler list in place, so the app's logger still shares it.)"""
    server = server_factory(*(["--preload"] if preload else []), app=FLASK).wait_ready()
    workers = worker_set(server, 2)
    request(server.port, "/log?msg=through%20the%20recipe")
    request(server.port, "/debug?msg=hidden")  # the recipe copies the level: info
    request(server.port, "/fail")
    line = server.wait_log("app says through the recipe")
    assert line["level"] == "INFO" and line["pid"] in workers and line["logger"] == "logging_app"
    failed = server.wait_log("app caught it", level="ERROR")
    assert failed["pid"] in workers
    assert failed["traceback"].startswith("Traceback") and "RuntimeError: app trouble" in failed["traceback"]
    assert "app debug" not in server.log_text()
    # forkserve's own lines are unchanged: no logger key, the same fields as ever.
    spawned = server.wait_log("Spawned worker")
    assert "logger" not in spawned and set(spawned) == {"time", "level", "message", "pid",
                                                        "worker", "generation"}


def test_flask_recipe_writes_text_lines_and_follows_the_level(server_factory: Any) -> None:
    server = server_factory("--log-level", "debug", app=FLASK, json_logs=False, workers=1)
    server.wait_text("Server ready")
    port = int(re.search(r"listening=127\.0\.0\.1:(\d+)", server.log_text()).group(1))  # type: ignore[union-attr]
    request(port, "/log?msg=text%20please")
    request(port, "/debug?msg=shown")
    request(port, "/fail")
    server.wait_text("app caught it")
    lines = server.log_text().split("\n")
    said = next(l for l in lines if "app says text please" in l)
    match = TEXT_LINE.fullmatch(said)
    assert match and match.group(3) == "INFO" and match.group(4) == "app says text please", said
    assert int(match.group(2)) in server.workers()
    assert any(TEXT_LINE.fullmatch(l) and l.endswith("[DEBUG] app debug shown") for l in lines)
    at = next(i for i, l in enumerate(lines) if l.endswith("[ERROR] app caught it"))
    assert lines[at + 1] == "Traceback (most recent call last):"
    assert "RuntimeError: app trouble" in lines[at + 2:at + 8]


# -- 2. --log-config -------------------------------------------------------------------------

YAML_CONFIG = """\
version: 1
disable_existing_loggers: true
formatters:
  plain: {{format: "%(name)s|%(levelname)s|%(process)d|%(message)s"}}
  forkserve-json: {{"()": forkserve.logs.JSONFormatter}}
handlers:
  stderr: {{class: logging.StreamHandler, stream: "ext://sys.stderr", formatter: forkserve-json}}
  errors: {{class: logging.FileHandler, filename: "{dir}/error.log", formatter: plain}}
  access: {{class: logging.FileHandler, filename: "{dir}/access.log", formatter: plain}}
  each: {{"()": tests.apps.log_handlers.PerProcessHandler, directory: "{dir}", formatter: plain}}
loggers:
  gunicorn.error: {{handlers: [errors, each, stderr], level: INFO, propagate: false}}
  forkserve.access: {{handlers: [access], level: INFO, propagate: false}}
"""


@pytest.mark.parametrize("kind", ["yaml", "json"])
def test_log_config_handlers_in_the_arbiter_and_each_worker(server_factory: Any, tmp_path: Path,
                                                            kind: str) -> None:
    text = YAML_CONFIG.format(dir=tmp_path)
    if kind == "json":
        import yaml

        path = tmp_path / "logging.conf"  # no extension: JSON told by its content
        path.write_text(json.dumps(yaml.safe_load(text)))
    else:
        path = tmp_path / "logging.yaml"
        path.write_text(text)
    default = tmp_path / "default-error.log"
    server = server_factory("--log-config", str(path), "--error-log", str(default), app=FLASK)
    server.wait_ready()  # (its lines on stderr: the file's handler, with forkserve's formatter)
    errors = tmp_path / "error.log"
    wait_file_text(errors, "Server ready")
    workers = worker_set(server, 2)
    # Each worker built the handler again after fork: a file per process, arbiter included.
    wait_for(lambda: {p.name for p in tmp_path.glob("lines.*")} ==
             {f"lines.{pid}" for pid in (*workers, server.pid)}, 10,
             lambda: f"a file per process, have {sorted(p.name for p in tmp_path.glob('lines.*'))}")
    starting = wait_file_text(errors, "Starting forkserve")[0]
    assert starting.startswith(f"forkserve.error|INFO|{server.pid}|Starting forkserve")
    request(server.port, "/log?msg=configured")
    said = wait_file_text(errors, "app says configured")[0]
    name, level, pid, message = said.split("|")
    assert (name, level, message) == ("logging_app", "INFO", "app says configured")
    assert int(pid) in workers
    wait_file_text(tmp_path / f"lines.{pid}", "app says configured")
    assert server.wait_log("app says configured")["pid"] == int(pid)
    # The access log is on because the file configures its logger (no --access-log).
    access = wait_file_text(tmp_path / "access.log", "GET /log?msg=configured")[0]
    assert access.startswith("forkserve.access|INFO|") and '" 200 7 ' in access
    # The file's loggers replaced --error-log's handler: nothing of forkserve's went there.
    assert default.read_text() == ""


BAD_CONFIGS = {
    "missing": (None, "No such file"),
    "yaml": ("version: 1\nhandlers: [unclosed\n", "not valid YAML"),
    "json.json": ('{"version": 1,', "not valid JSON"),
    "version": ("handlers: {}\n", "needs version: 1"),
    "class": ("version: 1\nhandlers:\n  h: {class: no.such.Handler}\n", "Unable to configure handler 'h'"),
    "file": ("version: 1\nhandlers:\n  h: {class: logging.FileHandler, filename: /nonexistent/dir/x.log}\n"
             "loggers:\n  forkserve.error: {handlers: [h]}\n", "No such file or directory"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
@pytest.mark.parametrize("check", [False, True], ids=["serve", "check"])
def test_bad_log_config_is_one_line_and_exit_2(tmp_path: Path, case: str, check: bool) -> None:
    content, said = BAD_CONFIGS[case]
    path = tmp_path / (case if "." in case else case + ".yaml")
    if content is not None:
        path.write_text(content)
    result = run_check("--log-config", str(path), *(["--check"] if check else []),
                       "tests.apps.basic:app", tmp=tmp_path)
    assert result.returncode == 2, result
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"forkserve: error: --log-config {path}: "), lines
    assert said in lines[0], lines
    assert "Spawned worker" not in result.stderr + result.stdout


# -- 3. --log-syslog ---------------------------------------------------------------------------

def receive_until(sock: socket.socket, text: str, got: list[str], timeout: float = 10.0) -> str:
    def find() -> str | None:
        for line in got:
            if text in line:
                return line
        sock.settimeout(0.2)
        try:
            got.append(sock.recv(65536).decode())
        except TimeoutError:
            return None
        return next((line for line in got if text in line), None)
    return wait_for(find, timeout, lambda: f"{text!r} by syslog, have {got[-10:]}")  # type: ignore[no-any-return]


def test_syslog_over_udp_with_prefix_and_facility(server_factory: Any, tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = server_factory("--log-syslog", "--log-syslog-to", f"udp://127.0.0.1:{port}",
                                "--log-syslog-prefix", "shop", "--log-syslog-facility", "local3",
                                "--access-log", str(tmp_path / "access.log"), app=FLASK)
        server.wait_ready()
        got: list[str] = []
        ready = receive_until(sock, "Server ready", got)
        # local3 (19) * 8 + info (6): the priority; then the tag with the arbiter's pid.
        assert ready.startswith(f"<158>shop[{server.pid}]: [INFO] Server ready state=running"), ready
        request(server.port, "/log?msg=to%20syslog")
        said = receive_until(sock, "app says to syslog", got)
        assert re.fullmatch(r"<158>shop\[(\d+)\]: \[INFO\] app says to syslog\x00?", said), said
        assert int(re.search(r"\[(\d+)\]", said).group(1)) in server.workers()  # type: ignore[union-attr]
        access = receive_until(sock, "GET /log?msg=to%20syslog", got)  # the access log is on
        assert access.startswith("<158>shop[") and '" 200 7 ' in access
        # ...and the error log still has it all (syslog is an extra).
        server.wait_log("app says to syslog")


def test_syslog_over_a_unix_datagram_socket(server_factory: Any, tmp_path: Path) -> None:
    path = tmp_path / "dev-log"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        server = server_factory("--log-syslog", "--log-syslog-to", f"unix://{path}")
        server.wait_ready()
        got: list[str] = []
        line = receive_until(sock, "Starting forkserve", got)
        assert line.startswith(f"<14>forkserve[{server.pid}]: [INFO] Starting forkserve"), line  # user.info
        workers = worker_set(server, 2)
        server.signal(signal.SIGTERM)
        assert server.wait_exit() == 0
        stopped = receive_until(sock, "Server stopped", got)
        assert stopped.startswith(f"<14>forkserve[{server.pid}]:")
        assert workers  # (two workers served on the same socket meanwhile)


def test_syslog_keeps_working_through_an_upgrade_and_its_status_stand_in(
        server_factory: Any) -> None:
    """USR2: the status stand-in (a child that closes every descriptor it does not need)
    keeps the syslog connection, and the new image opens its own."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        server = server_factory("--log-syslog", "--log-syslog-to",
                                f"udp://127.0.0.1:{sock.getsockname()[1]}",
                                "--status-bind", "127.0.0.1:0").wait_ready()
        server.signal(signal.SIGUSR2)
        stand_in = server.wait_log("Upgrade: a status stand-in answers", timeout=30)["pid"]
        server.wait_log("Upgrade: the status stand-in stopped", timeout=30)
        got: list[str] = []
        line = receive_until(sock, "Upgrade: the status stand-in stopped", got)
        assert line.startswith(f"<14>forkserve[{stand_in}]: [INFO] "), line
        server.wait_log("Upgrade complete", timeout=30)
        receive_until(sock, "Upgrade complete", got)
        assert "Logging error" not in server.log_text()


def test_syslog_socket_missing_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = run_check("--log-syslog", "--log-syslog-to", f"unix://{tmp_path}/nothing",
                       "tests.apps.basic:app", tmp=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"forkserve: error: --log-syslog-to unix://{tmp_path}/nothing: "), lines


# -- 4. --capture-output -----------------------------------------------------------------------

@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_capture_output_of_every_worker_class(server_factory: Any, tmp_path: Path,
                                             worker_class: str) -> None:
    access = tmp_path / "access.log"
    server = server_factory("-k", worker_class, "--capture-output", "--access-log", "-",
                            app=PRINTING, workers=1).wait_ready()
    (pid,) = worker_set(server, 1)
    assert server.wait_log("printed at import")["pid"] == pid
    get(server.port, "/print?alpha")
    get(server.port, "/oswrite?beta")
    get(server.port, "/partial?gamma")
    for message in ("printed alpha", "to stderr alpha", "fd one beta", "fd one again beta",
                    "fd two beta"):
        record = server.wait_log(message)
        assert (record["pid"], record["level"], record["message"]) == (pid, "INFO", message)
    server.signal(signal.SIGTERM)
    assert server.wait_exit() == 0
    messages = [r["message"] for r in server.records()]
    # The line without its newline: told when the worker's pipe closed, before its exit line.
    assert messages.index("partial gamma") < next(i for i, m in enumerate(messages) if "exited" in m)
    assert [r for r in server.records() if r["message"] == "partial gamma"][0]["pid"] == pid
    # The access log stays on stdout, not in the captured output; nothing is doubled.
    assert any("GET /print?alpha HTTP/1.1" in line for line in server.stdout_lines)
    assert not any("GET /print" in m for m in messages)
    assert messages.count("printed alpha") == 1 and not access.exists()


def test_capture_output_splits_long_lines_and_keeps_every_line(server_factory: Any) -> None:
    server = server_factory("--capture-output", app=PRINTING, workers=1).wait_ready()
    (pid,) = worker_set(server, 1)
    get(server.port, "/long?40000")
    get(server.port, "/many?3000")
    server.wait_log("many 2999")
    records = [r for r in server.records() if r["pid"] == pid]
    longs = [r["message"] for r in records if r["message"].startswith("L")]
    assert [len(m) for m in longs] == [16384, 16384, 40000 - 2 * 16384]
    many = [r["message"] for r in records if r["message"].startswith("many ")]
    assert many == [f"many {n}" for n in range(3000)]


def test_capture_output_does_not_block_a_worker_while_the_arbiter_is_stopped(
        server_factory: Any) -> None:
    """The bound: a worker writes up to the pipe's 1 MiB without its reader. With the arbiter
    stopped (SIGSTOP), a request that prints ~230 KB (more than a default 64 KiB pipe) is
    answered; once the arbiter runs again every line reaches the log."""
    server = server_factory("--capture-output", app=PRINTING, workers=1).wait_ready()
    (pid,) = worker_set(server, 1)
    os.kill(server.pid, signal.SIGSTOP)
    try:
        assert get(server.port, "/many?20000", timeout=20).status == 200
    finally:
        os.kill(server.pid, signal.SIGCONT)
    server.wait_log("many 19999", timeout=20)
    many = [r["message"] for r in server.records() if r["pid"] == pid and r["message"].startswith("many ")]
    assert many == [f"many {n}" for n in range(20000)]


@pytest.mark.parametrize("capture", [False, True], ids=["plain", "capture"])
def test_a_preloaded_apps_print_is_written_once(server_factory: Any, capture: bool) -> None:
    """The arbiter flushes its buffered stdout before forking: workers that flush theirs at
    exit have no copy of what the preloaded app printed at import."""
    server = server_factory("--preload", *(["--capture-output"] if capture else []),
                            app=PRINTING, workers=2).wait_ready()
    worker_set(server, 2)
    server.signal(signal.SIGTERM)
    assert server.wait_exit() == 0
    assert server.stdout_lines.count("printed at import") == 1, server.stdout_lines
    assert server.count_log("printed at import") == 0


def test_without_capture_output_prints_stay_on_the_streams(server_factory: Any) -> None:
    server = server_factory(app=PRINTING, workers=1).wait_ready()
    get(server.port, "/print?plain")
    wait_for(lambda: "printed plain" in server.stdout_lines, 10, "the print on stdout")
    assert server.count_log("printed plain") == 0


# -- 5. access-log fields: headers, gunicorn's atoms -------------------------------------------

GUNICORN_FORMAT = ('%(h)s %(l)s %(u)s %(t)s "%(r)s" %(s)s %(b)s "%(f)s" "%(a)s" '
                   '%(m)s %(U)s %(q)s %(H)s %(B)s %(p)s %(D)s %(M)s %(T)s %(L)s '
                   '"%({x-forwarded-for}i)s" "%({Content-Type}o)s" %({x-absent}i)s %({wsgi.url_scheme}e)s')


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_gunicorn_atom_format_through_a_server(server_factory: Any, tmp_path: Path,
                                               worker_class: str) -> None:
    log = tmp_path / "access.log"
    server = server_factory("-k", worker_class, "--access-log", str(log),
                            "--access-log-format", GUNICORN_FORMAT, app=FLASK).wait_ready()
    request(server.port, "/headers?x=1", headers=(
        ("X-Forwarded-For", "203.0.113.7"), ("Referer", "http://ref/"), ("User-Agent", "ua/1"),
        ("Authorization", "Basic dXNlcjpwdw==")))  # user:pw
    (line,) = wait_for(lambda: file_lines(log), 10, f"a line in {log}")
    pid = next(iter(server.workers()))
    pattern = (r'127\.0\.0\.1 - user \[\d\d/\w{3}/\d{4}:\d\d:\d\d:\d\d \+0000\] '
               r'"GET /headers\?x=1 HTTP/1\.1" 201 3 "http://ref/" "ua/1" GET /headers x=1 '
               r'HTTP/1\.1 3 <(\d+)> (\d+) (\d+) (\d+) (\d+\.\d{6}) "203\.0\.113\.7" '
               r'"text/plain; charset=x" - http')
    match = re.fullmatch(pattern, line)
    assert match, line
    assert int(match.group(1)) in server.workers() or int(match.group(1)) == pid
    assert int(match.group(2)) // 1000 == int(match.group(3))  # D in us, M in ms


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_header_fields_in_a_template(server_factory: Any, tmp_path: Path, worker_class: str) -> None:
    log = tmp_path / "access.log"
    server = server_factory(
        "-k", worker_class, "--access-log", str(log), "--access-log-format",
        '{status} "{req_x-forwarded-for}" "{resp_content-type}" {resp_X-Custom} {req_absent}',
        app=FLASK).wait_ready()
    request(server.port, "/headers", headers=(("x-forwarded-for", 'a "quoted" \\ value'),))
    (line,) = wait_for(lambda: file_lines(log), 10, f"a line in {log}")
    assert line == r'201 "a \"quoted\" \\ value" "text/plain; charset=x" custom value -', line


def test_header_fields_in_json(server_factory: Any, tmp_path: Path) -> None:
    log = tmp_path / "access.log"
    server = server_factory("--access-log", str(log), "--access-log-format",
                            "json:req_x-forwarded-for,resp_x-custom,req_absent", app=FLASK).wait_ready()
    request(server.port, "/headers", headers=(("X-Forwarded-For", "198.51.100.1"),))
    (line,) = wait_for(lambda: file_lines(log), 10, f"a line in {log}")
    record = json.loads(line)
    assert (record["req_x-forwarded-for"], record["resp_x-custom"], record["req_absent"]) == (
        "198.51.100.1", "custom value", "-")
    assert record["status"] == 201 and record["path"] == "/headers"


# -- 6. fork safety: handler locks held by another thread at fork -------------------------------

def test_handler_locks_held_at_fork_block_no_worker(server_factory: Any, tmp_path: Path) -> None:
    """A preloaded app's thread holds forkserve's handler lock and its own handler's lock
    while the arbiter forks: each worker's copies are free (logging re-initialises every
    handler's lock at fork; ours takes none to write), and the arbiter goes on logging."""
    release = tmp_path / "release"
    server = server_factory("--preload", app="tests.apps.logging_app:held_lock",
                            env={"HOLD_RELEASE": str(release)}).wait_ready()
    workers = worker_set(server, 2)
    for _ in range(4):
        get(server.port, "/")
    record = server.wait_log("worker logs while the arbiter's thread held the handler locks")
    assert record["pid"] in workers and record["level"] == "WARNING"
    # The app's own handler (a StreamHandler on stderr, its lock held in the arbiter) wrote
    # in the worker too: a plain line beside the JSON one.
    wait_for(lambda: any(l == "worker logs while the arbiter's thread held the handler locks "
                         "at fork" for l in server.lines), 10, "the app handler's line")
    server.signal(signal.SIGHUP)  # new forks, the locks still held; the arbiter logs on
    server.wait_log("Reload complete")
    release.touch()
    server.signal(signal.SIGTERM)
    assert server.wait_exit() == 0
