"""Structured error/lifecycle log, shared by the arbiter and the workers, through the standard
:mod:`logging` module.

Owns: the one log line format (text for people, JSON for machines) as two
:class:`logging.Formatter` classes, the handler that writes each record as one line, the
loggers ``forkserve.error`` and ``forkserve.access`` (``gunicorn.error`` and ``gunicorn.access``
are the same two objects, so gunicorn recipes find their handlers and level), ``--log-config``
(a dictConfig in YAML or JSON), ``--log-syslog``, level filtering, reopening the file on USR1,
and how every log file of ours is opened (``open_append``: the arbiter checks the workers' files
with it before forking). Imports only the standard library (forkserve.config reads the
--log-config file; this module applies it).

The one-line guarantee: each record is one ``os.write`` of one line on an ``O_APPEND``
descriptor, so lines from the arbiter and every worker never interleave mid-line (up to
PIPE_BUF bytes, which every lifecycle line is). forkserve's own handler takes no lock for that
(``AppendHandler.handle``): a record logged from a signal handler (a worker whose arbiter died)
or while another thread holds a handler lock never waits for one. Its lock still exists and is
registered with :mod:`logging`'s at-fork re-initialisation (it is created by
``Handler.__init__``), like every handler's, so a lock held by another thread at fork is free in
the child. The arbiter never logs from a signal handler (see :mod:`forkserve.signals`).
"""

from __future__ import annotations

import copy
import errno
import json
import logging
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
ERROR_LOGGER = "forkserve.error"
ACCESS_LOGGER = "forkserve.access"
OURS = (ERROR_LOGGER, ACCESS_LOGGER)
# gunicorn's names, for recipes written for it (Flask's: app.logger.handlers =
# logging.getLogger("gunicorn.error").handlers): the same logger objects as ours.
ALIASES = {"gunicorn.error": ERROR_LOGGER, "gunicorn.access": ACCESS_LOGGER}
DEFAULT_SYSLOG = "unix:///dev/log"
# How every log file is opened, here and by the workers' sinks (forkserve.telemetry opens
# its files with the same flags and mode; a unit test keeps them equal).
APPEND_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
FILE_MODE = 0o644


def open_append(path: str) -> int:
    return os.open(path, APPEND_FLAGS, FILE_MODE)


def probe_append(path: str, keep: bool = True) -> None:
    """Open ``path`` as a worker will open it (append, create: as the arbiter's user, which
    is the worker's before it drops privileges) and close it; raises ``OSError``. So a log
    file that cannot be opened is one line before forking, not a traceback per worker per
    boot. ``keep`` False (--check): a file this call created is removed again."""
    try:
        fd = os.open(path, APPEND_FLAGS | os.O_EXCL, FILE_MODE)
        created = True
    except FileExistsError:  # (a symlink too, dangling or not: opened below, through it)
        fd = open_append(path)
        created = False
    os.close(fd)
    if created and not keep:
        os.unlink(path)


def open_error(path: str, exc: OSError) -> str:
    """Why ``path`` cannot be opened, for the one error line (a missing directory named)."""
    parent = os.path.dirname(os.path.abspath(path))
    if exc.errno == errno.ENOENT and not os.path.isdir(parent):
        return f"{exc.strerror} (no directory {parent})"
    if exc.errno == errno.EISDIR:
        return f"{exc.strerror} (give the path of a file in it)"
    return exc.strerror or str(exc)


class AppendHandler(logging.Handler):
    """Writes each record, formatted, as one line with one ``os.write`` to its :class:`Log`'s
    descriptor (lost-line accounting there). No handler lock: see the module docstring."""

    def __init__(self, sink: "Log") -> None:
        super().__init__()
        self.sink = sink

    def handle(self, record: logging.LogRecord) -> Any:
        rv = self.filter(record)
        if rv:
            if isinstance(rv, logging.LogRecord):  # (3.12: a filter may return a new record)
                record = rv
            self.emit(record)
        return rv

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:  # a bad %-format from an app's record: logging's own report
            self.handleError(record)
            return
        self.sink.write_line(line)

    def close(self) -> None:
        """Detaches from :mod:`logging`'s bookkeeping only: the descriptor is the Log's (a
        dictConfig applied in a worker closes every handler, and ours is attached again)."""
        super().close()


def _exc_text(record: logging.LogRecord) -> str:
    exc_info = record.exc_info
    if not exc_info or exc_info[1] is None:
        return ""
    exc = exc_info[1]
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()


def _body(record: logging.LogRecord) -> str:
    """The message, its traceback on the lines after it, then the ``key=value`` fields (the
    text and syslog formats alike)."""
    message = record.getMessage()
    tb = _exc_text(record)
    if tb:
        message = message + "\n" + tb
    fields = getattr(record, "fields", None)
    extra = "".join(f" {k}={_text_value(v)}" for k, v in fields.items()) if fields else ""
    return message + extra


class TextFormatter(logging.Formatter):
    """``[2024-01-01T12:00:00.000Z] [pid] [LEVEL] message key=value ...``: the default format
    (``--log-format text``). A record's ``fields`` (a dict) become the ``key=value`` pairs; a
    traceback follows the message on its own lines."""

    def format(self, record: logging.LogRecord) -> str:
        return f"[{_iso(record.created)}] [{record.process}] [{record.levelname}] {_body(record)}"


class JSONFormatter(logging.Formatter):
    """One JSON object a line (``--log-format json``): time, level, message, pid, then the
    record's ``fields``; ``traceback`` with one; ``logger`` for a record that is not
    forkserve's own (an application's, through gunicorn.error's handlers)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": _iso(record.created),
            "level": record.levelname,
            "message": record.getMessage(),
            "pid": record.process,
        }
        if record.name not in OURS:
            out["logger"] = record.name
        fields = getattr(record, "fields", None)
        if fields:
            out.update(fields)
        tb = _exc_text(record)
        if tb:
            out["traceback"] = tb
        return json.dumps(out, default=str, separators=(",", ":"))


class SyslogFormatter(logging.Formatter):
    """``PREFIX[pid]: [LEVEL] message key=value``: the syslog tag convention (the handler puts
    the priority in front; the daemon adds the time and host)."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        return f"{self.prefix}[{record.process}]: [{record.levelname}] {_body(record)}"


def formatter(fmt: str) -> logging.Formatter:
    return JSONFormatter() if fmt == "json" else TextFormatter()


def named_logger(name: str) -> logging.Logger:
    """``forkserve.error`` or ``forkserve.access``; their gunicorn names are made the same
    objects (in the logging manager's table), so ``logging.getLogger("gunicorn.error")`` in an
    app, or a dictConfig naming it, is forkserve's logger itself."""
    real = logging.getLogger(name)
    manager = logging.Logger.manager
    for alias, target in ALIASES.items():
        if target == name and manager.loggerDict.get(alias) is not real:
            manager.loggerDict[alias] = real
            manager._clear_cache()  # type: ignore[attr-defined]
    return real


@dataclass(frozen=True)
class Setup:
    """How forkserve's loggers are put together, in the arbiter and again in each worker
    after fork: the --log-config dictionary (parsed once, in the arbiter), --log-syslog."""

    log_config: dict[str, Any] | None = None
    syslog_to: str | None = None  # None: no syslog
    syslog_prefix: str = "forkserve"
    syslog_facility: str = "user"

    def configured(self) -> set[str]:
        """forkserve's logger names the --log-config file configures (gunicorn's spelling
        counted as ours)."""
        if self.log_config is None:
            return set()
        names = set((self.log_config.get("loggers") or {}).keys())
        return {ALIASES.get(n, n) for n in names} & set(OURS)


class Log:
    """forkserve's error log: the ``forkserve.error`` logger (once ``install``ed; a private
    one before, so a Log in a test writes only to its own target), fed with a message and
    fields, and the descriptor its default handler writes to."""

    def __init__(self, target: str = "-", level: str = "info", fmt: str = "text") -> None:
        self.target = target
        self.fd = -1
        self._owns_fd = False
        # Lines a failing write dropped (a full disk): there is nowhere to report that but
        # this log, so they are counted, and told once a write succeeds again.
        self.lost = 0
        self.lost_error = ""
        self.level = level
        self.fmt = fmt
        self.setup = Setup()
        self.handler = AppendHandler(self)
        self.handler.setFormatter(formatter(fmt))
        self.syslog: list[logging.Handler] = []  # ours, to close and build anew after fork
        # Not in logging's table until install(): tests make many Logs.
        self.logger = logging.Logger(ERROR_LOGGER, LEVELS[level])
        self.logger.addHandler(self.handler)
        self.logger.propagate = False
        self.open()

    # -- logging set-up ----------------------------------------------------------------
    def install(self, setup: Setup | None = None) -> None:
        """Wire the process's ``forkserve.error``/``forkserve.access`` (and gunicorn's names):
        the arbiter at start with its ``setup``, each worker right after fork with none (the
        same again: --log-config applied anew, a syslog connection of its own; handlers a
        preloaded app added in the arbiter stay). Raises what dictConfig or the syslog
        connection raises."""
        fresh = setup is not None
        if setup is not None:
            self.setup = setup
        setup = self.setup
        old = self.syslog
        for handler in old:
            handler.close()  # (a worker: the arbiter's connection, inherited)
        self.syslog = []
        # The aliases first: a dictConfig naming gunicorn.error must configure our logger.
        error = named_logger(ERROR_LOGGER)
        access = named_logger(ACCESS_LOGGER)
        if setup.log_config is not None:
            # Only with --log-config: 2 MiB of modules (socketserver, pickle…) otherwise.
            import logging.config as logging_config

            ini = setup.log_config.get("ini_file")
            if ini is not None:  # gunicorn's INI --log-config
                logging_config.fileConfig(ini, disable_existing_loggers=False)
            else:
                logging_config.dictConfig(copy.deepcopy(setup.log_config))
        mine = set(OURS) - setup.configured()
        if setup.syslog_to is not None:
            self.syslog = [syslog_handler(setup)]
        for logger, ours in ((error, [self.handler]), (access, [])):
            if logger.name not in mine:
                continue
            if fresh:
                kept: list[logging.Handler] = []
            else:
                kept = [h for h in logger.handlers if h not in old and h not in ours]
            # In place: an app (Flask's recipe) may hold this very list.
            logger.handlers[:] = [*ours, *self.syslog, *kept]
            logger.setLevel(LEVELS[self.level] if logger is error else logging.INFO)
            logger.propagate = False
        # dictConfig disables the loggers it does not name (disable_existing_loggers), and
        # naming gunicorn.error leaves forkserve.error "unnamed": ours stay on.
        error.disabled = access.disabled = False
        self.logger = error

    def attach_access(self, handler: logging.Handler) -> logging.Logger:
        """A worker's access log: its handler first on ``forkserve.access`` unless
        --log-config gave that logger handlers of its own."""
        access = named_logger(ACCESS_LOGGER)
        if ACCESS_LOGGER not in self.setup.configured():
            # One access log a process: an earlier one's handler (``forkserve_access``) goes.
            others = [h for h in access.handlers if not getattr(h, "forkserve_access", False)]
            access.handlers[:] = [handler, *others]
        return access

    def fds(self) -> list[int]:
        """The descriptors the error log's handlers write to: ours, the syslog connection,
        --log-config's files and sockets (a child that closes everything else, the status
        stand-in, keeps these)."""
        fds = {self.fd}
        logger: logging.Logger | None = self.logger
        while logger is not None:
            for handler in logger.handlers:
                for name in ("stream", "socket"):
                    try:
                        fds.add(getattr(handler, name).fileno())
                    except (AttributeError, OSError, ValueError):
                        continue  # none, closed, or not a real descriptor (io.StringIO)
            logger = logger.parent if logger.propagate else None
        return sorted(fd for fd in fds if fd >= 0)

    def access_configured(self) -> bool:
        return ACCESS_LOGGER in self.setup.configured()

    # -- file handling ---------------------------------------------------------------
    def open(self) -> None:
        if self.target in ("-", ""):
            self.fd = sys.stderr.fileno()
            self._owns_fd = False
        else:
            self.fd = open_append(self.target)
            self._owns_fd = True

    def reopen(self) -> None:
        """USR1: logrotate moved the file away; open the path anew, then drop the old fd.
        Also the moment an operator who freed a full disk expects the losses told."""
        if not self._owns_fd:
            return
        old = self.fd
        self.open()
        os.close(old)
        self.report_lost()

    def configure(self, level: str, fmt: str) -> None:
        """HUP: the new --log-level and --log-format (a logger --log-config configures keeps
        the file's level)."""
        self.level, self.fmt = level, fmt
        self.handler.setFormatter(formatter(fmt))
        if ERROR_LOGGER not in self.setup.configured():
            self.logger.setLevel(LEVELS[level])

    @property
    def json(self) -> bool:
        return self.fmt == "json"

    # -- records -----------------------------------------------------------------------
    def enabled(self, level: int) -> bool:
        return self.logger.isEnabledFor(level)

    def log(self, level: int, message: str, fields: dict[str, Any],
            exc: BaseException | None = None) -> None:
        logger = self.logger
        if not logger.isEnabledFor(level):
            return
        record = logger.makeRecord(logger.name, level, __file__, 0, message, (),
                                   (type(exc), exc, exc.__traceback__) if exc is not None else None,
                                   extra={"fields": fields})
        logger.handle(record)

    def write_line(self, line: str) -> None:
        if self._write(line) and self.lost:
            self.report_lost()

    def _write(self, line: str) -> bool:
        if self.fd < 0:
            return False
        data = (line + "\n").encode("utf-8", "backslashreplace")
        try:
            while data:
                written = os.write(self.fd, data)
                if written <= 0:  # never spin on a descriptor that takes nothing
                    raise OSError(errno.EIO, "the log took no bytes")
                data = data[written:]
        except OSError as exc:
            # A log that cannot be written must never take the server down (EPIPE on a
            # closed stderr, ENOSPC): the line is dropped, and counted.
            self.lost += 1
            self.lost_error = exc.strerror or str(exc)
            return False
        return True

    def report_lost(self) -> None:
        """Tell, in this log (its own file, whatever other handlers the logger has), how many
        lines it lost since the last time it could write (nothing when none were, or when it
        still cannot)."""
        if not self.lost:
            return
        lost, error = self.lost, self.lost_error
        self.lost = 0
        record = logging.LogRecord(ERROR_LOGGER, 40, __file__, 0,
                                   f"The error log could not be written ({error}); {lost} "
                                   "line(s) lost", None, None)
        record.fields = {"lost_lines": lost}
        self.handler.emit(record)
        if self.lost:  # this line failed too: the count stands, for the next write to tell
            self.lost = lost

    def from_handler(self, level: int, message: str, fields: dict[str, Any]) -> None:
        """``log`` from a signal handler that may have interrupted anything, even a thread or
        greenlet half-way into one of :mod:`logging`'s locks (under gevent those are Python
        locks owned by a greenlet: taking one there waits forever, or raises in the hub).
        No lock is waited for: the level is read without the logger's cache (whose miss
        takes the module lock); our handler takes none; any other handler of the logger
        (syslog, --log-config's, an app's) writes only if its lock is free this instant."""
        logger: logging.Logger | None = self.logger
        assert logger is not None
        if logger.disabled or level < logger.getEffectiveLevel():
            return
        record = logger.makeRecord(logger.name, level, __file__, 0, message, (), None,
                                   extra={"fields": fields})
        while logger is not None:
            for handler in logger.handlers:
                if level < handler.level:
                    continue
                lock = None if handler is self.handler else handler.lock
                if lock is not None and not lock.acquire(blocking=False):
                    continue  # held: this handler misses the line
                try:
                    if handler.filter(record):
                        handler.emit(record)
                except Exception:  # (a broken handler must not stop the exit)
                    pass
                finally:
                    if lock is not None:
                        lock.release()
            logger = logger.parent if logger.propagate else None

    def debug(self, message: str, **fields: Any) -> None:
        if self.logger.isEnabledFor(10):
            self.log(10, message, fields)

    def info(self, message: str, **fields: Any) -> None:
        if self.logger.isEnabledFor(20):
            self.log(20, message, fields)

    def warning(self, message: str, **fields: Any) -> None:
        self.log(30, message, fields)

    def error(self, message: str, **fields: Any) -> None:
        self.log(40, message, fields)

    def exception(self, message: str, exc: BaseException, **fields: Any) -> None:
        """An error line with the traceback: folded into one JSON field, or indented text."""
        self.log(40, message, fields, exc)

    def output(self, line: str, pid: int) -> None:
        """A line a worker wrote to its stdout or stderr (--capture-output), as its record."""
        logger = self.logger
        if not logger.isEnabledFor(20):
            return
        record = logger.makeRecord(logger.name, 20, __file__, 0, line, (), None)
        record.process = pid
        logger.handle(record)


def syslog_handler(setup: Setup) -> logging.Handler:
    """--log-syslog: a SysLogHandler to --log-syslog-to; raises OSError when it cannot
    connect (a unix socket that is not there)."""
    address, socktype = syslog_address(setup.syslog_to or DEFAULT_SYSLOG)
    if isinstance(address, str):
        _probe_unix(address)  # SysLogHandler ignores a socket that is not there
    import logging.handlers as logging_handlers  # only with --log-syslog

    facility = logging_handlers.SysLogHandler.facility_names[setup.syslog_facility]
    handler = logging_handlers.SysLogHandler(address, facility, socktype)
    handler.setFormatter(SyslogFormatter(setup.syslog_prefix))
    return handler


def _probe_unix(path: str) -> None:
    """Raise OSError unless a syslog daemon listens at ``path`` (datagram or stream)."""
    error: OSError | None = None
    for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
        with socket.socket(socket.AF_UNIX, kind) as probe:
            try:
                probe.connect(path)
                return
            except OSError as exc:
                error = error or exc
    assert error is not None
    raise error


def syslog_address(text: str) -> tuple[str | tuple[str, int], socket.SocketKind | None]:
    """unix:///dev/log, udp://host:port or tcp://host:port (gunicorn's --log-syslog-to)."""
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in ("unix", "udp", "tcp") or not rest:
        raise ValueError(f"expected unix://PATH, udp://HOST:PORT or tcp://HOST:PORT; got {text!r}")
    if scheme == "unix":
        return rest, None  # SysLogHandler tries a datagram socket, then a stream one
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected {scheme}://HOST:PORT; got {text!r}")
    return ((host.strip("[]"), int(port)),
            socket.SOCK_DGRAM if scheme == "udp" else socket.SOCK_STREAM)


def setup_error(exc: BaseException) -> str:
    """What dictConfig or the syslog connection raised, as one line (dictConfig chains the
    real cause: "Unable to configure handler 'x'" from "No such file ...")."""
    cause = exc.__cause__
    text = str(exc)
    if cause is not None and str(cause) not in text:
        text = f"{text}: {cause}"
    return " ".join(text.split()) or type(exc).__name__


def _iso(now: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"


def _text_value(value: Any) -> str:
    text = str(value)
    return json.dumps(text) if (" " in text or not text) else text
