"""forkserve.logs through the logging module: the default formatters' bytes, the gunicorn
aliases, the lock-free handler and fork safety, --log-config reading, syslog addresses; the
access log's records, header fields and gunicorn atoms; the validation of access-log formats;
and the splitting of captured output."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from forkserve import logs
from forkserve.capture import LINE_MAX, OutputCapture
from forkserve.config import ConfigError, _access_log_format, read_log_config
from forkserve.logs import ACCESS_LOGGER, ERROR_LOGGER, Log, Setup
from forkserve.telemetry.accesslog import AccessLog, AccessRecord

STARTED = 1700000000.25  # 14/Nov/2023:22:13:20 +0000


@pytest.fixture
def clean_logging() -> Iterator[None]:
    """install() changes the process's loggers: put them back as they were."""
    manager = logging.Logger.manager
    saved = dict(manager.loggerDict)
    state = {name: (l.handlers[:], l.level, l.propagate, l.disabled)
             for name, l in saved.items() if isinstance(l, logging.Logger)}
    yield
    manager.loggerDict.clear()
    manager.loggerDict.update(saved)
    for name, (handlers, level, propagate, disabled) in state.items():
        logger = saved[name]
        assert isinstance(logger, logging.Logger)
        logger.handlers[:] = handlers
        logger.level, logger.propagate, logger.disabled = level, propagate, disabled
    manager._clear_cache()  # type: ignore[attr-defined]


def lines(path: Path) -> list[str]:
    return path.read_text().split("\n")[:-1]


# -- the default formats: the bytes of before -------------------------------------------------

def test_text_and_json_lines_are_todays_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logging.time, "time_ns", lambda: 1700000000_250000000)  # type: ignore[attr-defined]
    monkeypatch.setattr(logging.time, "time", lambda: 1700000000.25)  # type: ignore[attr-defined]
    pid = os.getpid()
    text, js = tmp_path / "t.log", tmp_path / "j.log"
    for path, fmt in ((text, "text"), (js, "json")):
        log = Log(str(path), "info", fmt)
        log.info("Spawned worker", worker=1, pid=4242, note="two words", empty="")
        log.debug("hidden")
        try:
            raise ValueError("bad")
        except ValueError as exc:
            log.exception("It failed", exc, worker=2)
        os.close(log.fd)
    got = lines(text)
    assert got[0] == (f'[2023-11-14T22:13:20.250Z] [{pid}] [INFO] Spawned worker worker=1 pid=4242 '
                      'note="two words" empty=""')
    assert got[1] == f"[2023-11-14T22:13:20.250Z] [{pid}] [ERROR] It failed"
    assert got[2] == "Traceback (most recent call last):" and got[-1] == "ValueError: bad worker=2"
    first, second = (json.loads(l) for l in lines(js))
    assert lines(js)[0] == ('{"time":"2023-11-14T22:13:20.250Z","level":"INFO","message":"Spawned '
                            'worker","pid":4242,"worker":1,"note":"two words","empty":""}')
    assert list(second) == ["time", "level", "message", "pid", "worker", "traceback"]
    assert second["traceback"].endswith("ValueError: bad") and second["pid"] == pid


def test_a_foreign_record_in_json_names_its_logger(tmp_path: Path) -> None:
    log = Log(str(tmp_path / "j.log"), "info", "json")
    record = logging.LogRecord("myapp", 20, __file__, 1, "hello %s", ("you",), None)
    log.handler.handle(record)
    os.close(log.fd)
    (line,) = lines(tmp_path / "j.log")
    assert json.loads(line)["logger"] == "myapp" and json.loads(line)["message"] == "hello you"


# -- the loggers and their gunicorn names ---------------------------------------------------------

def test_install_makes_gunicorn_names_the_same_loggers(tmp_path: Path, clean_logging: None) -> None:
    log = Log(str(tmp_path / "e.log"), "warning", "text")
    log.install(Setup())  # as the arbiter does (a worker's install() keeps what it finds)
    error = logging.getLogger("gunicorn.error")
    assert error is logging.getLogger(ERROR_LOGGER) is log.logger
    assert logging.getLogger("gunicorn.access") is logging.getLogger(ACCESS_LOGGER)
    assert error.handlers == [log.handler] and error.level == logging.WARNING
    assert not error.propagate
    # Flask's recipe: another logger takes the same handlers and level.
    app_logger = logging.getLogger("unit.app")
    app_logger.handlers = error.handlers
    app_logger.setLevel(error.level)
    app_logger.propagate = False
    app_logger.warning("from the app %d", 7)
    app_logger.info("below the level")
    log.configure("info", "json")  # HUP: the same handler object, now JSON, level info
    app_logger.setLevel(error.level)
    app_logger.info("now json")
    os.close(log.fd)
    first, second = lines(tmp_path / "e.log")
    assert first.endswith("[WARNING] from the app 7")
    assert json.loads(second)["message"] == "now json"


def test_log_config_names_win_and_the_rest_keep_ours(tmp_path: Path, clean_logging: None) -> None:
    config = {"version": 1, "handlers": {"f": {"class": "logging.FileHandler",
                                               "filename": str(tmp_path / "access.txt")}},
              "loggers": {"gunicorn.access": {"handlers": ["f"], "level": "INFO"}}}
    log = Log(str(tmp_path / "e.log"), "info", "text")
    log.install(Setup(config))
    access = logging.getLogger(ACCESS_LOGGER)
    assert [type(h) for h in access.handlers] == [logging.FileHandler]
    assert log.access_configured()
    error = logging.getLogger(ERROR_LOGGER)
    assert error.handlers == [log.handler] and not error.disabled  # (disable_existing_loggers)
    sink = AccessLog(None, "combined")
    sink.logger = log.attach_access(sink.handler)
    assert access.handlers[0] is not sink.handler  # the file's handler stays alone
    sink.request("10.0.0.1", "GET", "/x", "HTTP/1.1", 200, 3, None, None, STARTED, 0.5, "id")
    access.handlers[0].flush()
    assert (tmp_path / "access.txt").read_text() == (
        '10.0.0.1 - - [14/Nov/2023:22:13:20 +0000] "GET /x HTTP/1.1" 200 3 "-" "-" 0.500000 id\n')
    for handler in access.handlers:
        handler.close()
    os.close(log.fd)


def test_our_handler_writes_while_another_thread_holds_its_lock(tmp_path: Path) -> None:
    """No handler lock on the write path: a line from a signal handler, or while another
    thread sits in a handler, never waits. The lock still exists and is one logging re-inits
    in a forked child."""
    log = Log(str(tmp_path / "e.log"))
    assert log.handler.lock is not None
    assert log.handler in logging._at_fork_reinit_lock_weakset  # type: ignore[attr-defined]
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with log.handler.lock:  # type: ignore[union-attr]
            held.set()
            done.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    writer = threading.Thread(target=log.info, args=("written anyway",))
    writer.start()
    writer.join(10)
    finished = not writer.is_alive()
    done.set()
    holder.join(10)
    assert finished and lines(tmp_path / "e.log")[0].endswith("written anyway")
    os.close(log.fd)


def test_a_line_from_a_handler_waits_for_no_lock(tmp_path: Path, clean_logging: None) -> None:
    """Log.from_handler (an orphaned worker's last line, the timeout kill's stacks): another
    thread holds logging's module lock (with the level cache empty, whose miss takes it) and
    the lock of an app's handler on our logger. The line is written at once to our file and
    to the app's free handler; the held one misses it."""
    log = Log(str(tmp_path / "e.log"))
    held_handler = logging.StreamHandler(open(tmp_path / "held.log", "w"))
    free_handler = logging.StreamHandler(open(tmp_path / "free.log", "w"))
    for handler in (held_handler, free_handler):
        log.logger.addHandler(handler)
    log.logger._cache.clear()  # type: ignore[attr-defined]
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with logging._lock, held_handler.lock:  # type: ignore[attr-defined,union-attr]
            held.set()
            done.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    writer = threading.Thread(target=log.from_handler,
                              args=(30, "Arbiter is gone", {"worker": 3}))
    writer.start()
    writer.join(10)
    finished = not writer.is_alive()
    done.set()
    holder.join(10)
    assert finished, "from_handler waited for a lock"
    assert "Arbiter is gone" in lines(tmp_path / "e.log")[0]
    assert "worker=3" in lines(tmp_path / "e.log")[0]
    free_handler.stream.flush()
    assert (tmp_path / "free.log").read_text() == "Arbiter is gone\n"
    assert (tmp_path / "held.log").read_text() == ""
    # Below the logger's level: nothing.
    log.from_handler(10, "a debug line", {})
    assert len(lines(tmp_path / "e.log")) == 1
    for handler in (held_handler, free_handler):
        log.logger.removeHandler(handler)
        handler.stream.close()
    os.close(log.fd)


def test_a_held_lock_is_free_in_a_forked_child(tmp_path: Path) -> None:
    log = Log(str(tmp_path / "e.log"))
    app_handler = logging.StreamHandler(open(tmp_path / "app.log", "w"))
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with log.handler.lock, app_handler.lock:  # type: ignore[union-attr]
            held.set()
            done.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    pid = os.fork()
    if pid == 0:  # the child: both locks must be free
        ok = log.handler.lock.acquire(timeout=5) and app_handler.lock.acquire(timeout=5)  # type: ignore[union-attr]
        os._exit(0 if ok else 1)
    done.set()
    holder.join(10)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    app_handler.stream.close()
    os.close(log.fd)


# -- --log-config files, syslog addresses --------------------------------------------------------

@pytest.mark.parametrize("name, text", [
    ("a.yaml", "version: 1\nroot: {level: INFO}\n"),
    ("a.json", '{"version": 1, "root": {"level": "INFO"}}'),
    ("a.conf", '  {"version": 1, "root": {"level": "INFO"}}'),
    ("b.conf", "version: 1\nroot: {level: INFO}\n"),
])
def test_log_config_is_json_or_yaml(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    assert read_log_config(str(path)) == {"version": 1, "root": {"level": "INFO"}}


@pytest.mark.parametrize("text, said", [
    ("- a list\n", "expected a mapping"), ("{}", "needs version: 1"),
    ("version: [", "not valid YAML"), ('{"version": 1', "not valid JSON"),
])
def test_log_config_errors_are_one_sentence(tmp_path: Path, text: str, said: str) -> None:
    path = tmp_path / "x.conf"
    path.write_text(text)
    with pytest.raises(ValueError, match=said) as info:
        read_log_config(str(path))
    assert "\n" not in str(info.value)


def test_syslog_addresses() -> None:
    assert logs.syslog_address("unix:///dev/log") == ("/dev/log", None)
    assert logs.syslog_address("udp://127.0.0.1:514") == (("127.0.0.1", 514), socket.SOCK_DGRAM)
    assert logs.syslog_address("tcp://[::1]:601") == (("::1", 601), socket.SOCK_STREAM)
    for bad in ("localhost:514", "udp://host", "http://x:1"):
        with pytest.raises(ValueError):
            logs.syslog_address(bad)


# -- the access log: records, header fields, gunicorn's atoms -----------------------------------

ENVIRON = {"HTTP_X_FORWARDED_FOR": "203.0.113.9", "CONTENT_TYPE": "application/json",
           "HTTP_AUTHORIZATION": "Basic YWxpY2U6c2VjcmV0", "wsgi.url_scheme": "https",
           "REMOTE_USER": "ignored"}
RESPONSE = [("Content-Type", "text/html"), ("X-Cache", 'HIT "edge"')]


def one(fmt: str) -> str:
    log = AccessLog(None, fmt)
    out: list[str] = []
    log.emit = out.append  # type: ignore[method-assign]
    log.request("10.1.2.3", "GET", "/a/b?x=1", "HTTP/1.1", 200, 1234, "http://ref/", "ua/1",
                STARTED, 0.0123456, "req-1", ENVIRON, RESPONSE)
    (line,) = out
    assert line.endswith("\n")
    return line[:-1]


def test_header_fields_in_a_template() -> None:
    fmt = ('{req_x-forwarded-for} {req_X-Forwarded-For} {req_content-type} {resp_content-type} '
           '"{resp_x-cache}" {req_absent} {resp_absent} {status}')
    assert one(fmt) == r'203.0.113.9 203.0.113.9 application/json text/html "HIT \"edge\"" - - 200'


def test_header_fields_in_json() -> None:
    record = json.loads(one("json:req_x-forwarded-for,resp_X-Cache,req_absent"))
    assert (record["req_x-forwarded-for"], record["resp_X-Cache"], record["req_absent"]) == (
        "203.0.113.9", 'HIT "edge"', "-")
    assert record["status"] == 200 and record["duration"] == 0.012346


def test_gunicorn_default_and_every_atom() -> None:
    assert one('%(h)s %(l)s %(u)s %(t)s "%(r)s" %(s)s %(b)s "%(f)s" "%(a)s"') == (
        '10.1.2.3 - alice [14/Nov/2023:22:13:20 +0000] "GET /a/b?x=1 HTTP/1.1" 200 1234 '
        '"http://ref/" "ua/1"')
    assert one("%(m)s %(U)s %(q)s %(H)s %(B)d %(p)s %(T)s %(D)s %(M)s %(L)s") == (
        f"GET /a/b x=1 HTTP/1.1 1234 <{os.getpid()}> 0 12345 12 0.012346")
    assert one("%({X-Forwarded-For}i)s %({content-type}o)s %({x-cache}o)s %({nope}i)s "
               "%({wsgi.url_scheme}e)s %(zz)s") == r'203.0.113.9 text/html HIT \"edge\" - https -'


def test_a_user_handler_gets_the_line_and_the_attributes() -> None:
    log = AccessLog(None, "{method} {path} {status}")
    got: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record)

    logger = logging.getLogger("unit.access")
    logger.handlers[:] = [Keep()]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    log.logger = logger
    log.request("10.1.2.3", "POST", "/p?q", "HTTP/1.1", 201, 0, None, None, STARTED, 0.1, "id")
    (record,) = got
    assert isinstance(record, AccessRecord)
    formatted = logging.Formatter("%(name)s %(levelname)s %(process)d %(message)s").format(record)
    assert formatted == f"forkserve.access INFO {os.getpid()} POST /p 201"
    assert record.msg == "POST /p 201" and record.status == 201
    logger.setLevel(logging.WARNING)  # a level above INFO: no record at all
    log.request("10.1.2.3", "GET", "/", "HTTP/1.1", 200, 0, None, None, STARTED, 0.1, "id")
    assert len(got) == 1


@pytest.mark.parametrize("fmt", [
    "{req_x-forwarded-for} {resp_content-type}", "json:req_a,resp_b",
    '%(h)s %(l)s %(u)s %(t)s "%(r)s" %(s)s %(b)s "%(f)s" "%(a)s"', "%(D)d %({x}i)s %({y}o)s %({Z}e)s",
])
def test_access_log_formats_accepted(fmt: str) -> None:
    assert _access_log_format(fmt) == fmt


@pytest.mark.parametrize("fmt, said", [
    ("{req_} {status}", "unknown field"), ("{request_x-y}", "unknown field"),
    ("json:status", "header fields"), ("%(Q)s", "unknown atom"), ("%(s)d %(h)d", "bad access-log"),
])
def test_access_log_formats_refused(fmt: str, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        _access_log_format(fmt)
    assert ConfigError  # (the registry turns it into a one-line ConfigError)


# -- captured output ----------------------------------------------------------------------------

class FakeReactor:
    def __init__(self) -> None:
        self.fds: dict[int, Any] = {}

    def add(self, fd: int, events: int, callback: Any) -> None:
        self.fds[fd] = callback

    def remove(self, fd: int) -> None:
        del self.fds[fd]


class Told:
    def __init__(self) -> None:
        self.lines: list[tuple[str, int]] = []

    def output(self, line: str, pid: int) -> None:
        self.lines.append((line, pid))


def test_capture_splits_lines_bounds_them_and_tells_the_partial_one_at_eof() -> None:
    reactor, told = FakeReactor(), Told()
    capture = OutputCapture(reactor, told)
    r, w = capture.pipe()
    capture.watch(r, 77)
    os.write(w, b"one\ntw")
    reactor.fds[r](r, 1)
    os.write(w, b"o\r\n" + b"x" * (LINE_MAX * 2 + 5) + b"\nlast \xff")
    reactor.fds[r](r, 1)
    assert told.lines[:2] == [("one", 77), ("two", 77)]
    os.close(w)
    capture.gone(77)  # reaped: read to the end, the partial line told, the pipe closed
    assert [len(l) for l, _ in told.lines[2:5]] == [LINE_MAX, LINE_MAX, 5]
    assert told.lines[5] == ("last \\xff", 77)
    assert r not in reactor.fds and capture.read_fds() == []


def test_a_worker_install_keeps_app_handlers_and_makes_its_own_syslog_connection(
        tmp_path: Path, clean_logging: None) -> None:
    """A preloaded app added a handler to gunicorn.error in the arbiter: the worker's install
    after fork keeps it; the syslog handler is the worker's own, the arbiter's closed."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        log = Log(str(tmp_path / "e.log"))
        log.install(Setup(None, f"udp://127.0.0.1:{sock.getsockname()[1]}", "unit", "local0"))
        error = logging.getLogger("gunicorn.error")
        arbiter_syslog = log.syslog[0]
        app_handler = logging.NullHandler()
        error.addHandler(app_handler)
        log.install()  # as a worker does after fork
        assert error.handlers == [log.handler, log.syslog[0], app_handler]
        assert log.syslog[0] is not arbiter_syslog
        log.info("to syslog", n=1)
        sock.settimeout(10)
        assert sock.recv(4096).decode() == f"<134>unit[{os.getpid()}]: [INFO] to syslog n=1\x00"
        log.syslog[0].close()
        os.close(log.fd)


GUNICORN_INI = """\
[loggers]
keys=root, gunicorn.error

[handlers]
keys=file

[formatters]
keys=generic

[logger_root]
level=INFO
handlers=

[logger_gunicorn.error]
level=INFO
handlers=file
propagate=0
qualname=gunicorn.error

[handler_file]
class=logging.FileHandler
formatter=generic
args=(%(path)r,)

[formatter_generic]
format=%(levelname)s %(name)s %(message)s
"""


def test_gunicorns_ini_log_config_is_applied_with_fileconfig(tmp_path: Path,
                                                             clean_logging: None) -> None:
    out = tmp_path / "ini.log"
    path = tmp_path / "logging.conf"
    path.write_text(GUNICORN_INI.replace("%(path)r", repr(str(out))))
    config = read_log_config(str(path))
    assert config["ini_file"] == str(path) and set(config["loggers"]) == {"gunicorn.error"}
    log = Log(str(tmp_path / "e.log"))
    log.install(Setup(config))
    assert Setup(config).configured() == {ERROR_LOGGER}
    log.info("through the ini", n=1)
    for handler in logging.getLogger(ERROR_LOGGER).handlers:
        handler.close()
    assert out.read_text() == "INFO forkserve.error through the ini\n"
    assert (tmp_path / "e.log").read_text() == ""
    os.close(log.fd)


def test_a_handler_added_later_gets_records_and_ours_keeps_its_lines(
        tmp_path: Path, clean_logging: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """With our handler alone on forkserve.access no record is made (the line goes straight
    to the buffer); one more handler (an app's, at any time) and every request is a record."""
    log = Log(str(tmp_path / "e.log"))
    log.install(Setup())
    sink = AccessLog(str(tmp_path / "access.log"), "{method} {path} {status}")
    sink.logger = log.attach_access(sink.handler)
    made: list[int] = []
    real_init = AccessRecord.__init__

    def counting(self: AccessRecord, *args: Any) -> None:
        made.append(1)
        real_init(self, *args)

    monkeypatch.setattr(AccessRecord, "__init__", counting)
    sink.request("10.0.0.1", "GET", "/alone", "HTTP/1.1", 200, 1, None, None, STARTED, 0.1, "i")
    assert made == []
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logging.getLogger("gunicorn.access").addHandler(Keep())
    sink.request("10.0.0.1", "GET", "/shared", "HTTP/1.1", 200, 1, None, None, STARTED, 0.1, "i")
    sink.close()
    assert made == [1] and seen == ["GET /shared 200"]
    assert lines(tmp_path / "access.log") == ["GET /alone 200", "GET /shared 200"]
    os.close(log.fd)
