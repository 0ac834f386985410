"""The access log: one line per request, as Apache's combined format (plus the duration), as
JSON, as a template of named fields, or as gunicorn's ``%(h)s`` atoms; any request or response
header is a field too (``{req_x-forwarded-for}``, ``{resp_content-type}``, ``%({x-forwarded-for}i)s``).

Each request is one record on the ``forkserve.access`` logger (gunicorn.access is the same
object), so --log-config can send it anywhere; the record formats its line only when a handler
asks (``getMessage``). forkserve's own handler (``AccessHandler``, the --access-log file) buffers
the lines in the worker and writes them in one ``write`` when the worker is about to wait for
work (so an idle server's log is current) or when the buffer passes 64 KiB (so a busy one does
one write per many requests). ``O_APPEND`` keeps lines from different workers whole. Nothing is
formatted, and no record made, when the access log is off: the worker does not create a sink.

USR1 reopens the file (logrotate): what is buffered goes to the old file first, then the new
file takes every later line; a lock keeps a request thread's flush from writing to a descriptor
being swapped, so no line is lost or written twice.

A write that fails (a full disk) drops its lines and serving goes on; the loss is counted and
told at a bounded rate (:mod:`forkserve.telemetry.losses`).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import sys
import threading
import time
from typing import Any, Iterable, Mapping

from forkserve.telemetry.losses import ErrorSink, LostLines, write_all

FLUSH_AT = 65536
REQUEST_ID_MAX = 200  # longer incoming X-Request-ID values are replaced, not logged
ACCESS_LOGGER = "forkserve.access"  # (forkserve.logs names it too; imports go one way)
# A header field of a template: {req_NAME} (request) or {resp_NAME} (response).
HEADER_FIELD = re.compile(r"(req|resp)_([A-Za-z0-9!#$%&'*+.^_`|~-]+)\Z")
# gunicorn's atoms: %(h)s and the like, %({name}i)s request header, {name}o response header,
# {name}e environ variable.
ATOM = re.compile(r"%\(([^)]*)\)")
ATOMS = frozenset("hlutrsmUqHbBfaTDMLp")
_now = time.time  # (bound once: the record's clock is not the formatting's)
_START = _now()


def header_key(name: str) -> str:
    """The WSGI environ key of request header ``name`` (Content-Type and Content-Length have
    no HTTP_ prefix)."""
    key = name.upper().replace("-", "_")
    return key if key in ("CONTENT_TYPE", "CONTENT_LENGTH") else "HTTP_" + key


# What every record of logging has: in each record's __dict__ (Formatter's %(name)s reads it).
_CONSTANT = {
    "name": ACCESS_LOGGER, "levelno": logging.INFO, "levelname": "INFO", "pathname": __file__,
    "filename": "accesslog.py", "module": "accesslog", "lineno": 0, "funcName": "request",
    "args": (), "exc_info": None, "exc_text": None, "stack_info": None,
    "processName": "MainProcess", "taskName": None,
}


class _Headers:
    environ: Mapping[str, Any] | None
    response_headers: Iterable[tuple[str, str]] | None

    def request_header(self, name: str) -> str:
        environ = self.environ
        value = environ.get(header_key(name)) if environ is not None else None
        return "-" if value is None else str(value)

    def response_header(self, name: str) -> str:
        headers = self.response_headers
        if headers:
            wanted = name.lower()
            for key, value in headers:
                if key.lower() == wanted:
                    return value
        return "-"


class Request(_Headers):
    """One request's values, for its line when nobody but forkserve's own handler would see
    a record (the usual case: then no record is made at all)."""

    __slots__ = ("remote", "method", "target", "protocol", "status", "size", "referer", "agent",
                 "started", "duration", "request_id", "environ", "response_headers")

    def __init__(self, remote: str, method: str, target: str, protocol: str, status: int,
                 size: int, referer: str | None, agent: str | None, started: float,
                 duration: float, request_id: str, environ: Mapping[str, Any] | None,
                 response_headers: Iterable[tuple[str, str]] | None) -> None:
        self.remote, self.method, self.target, self.protocol = remote, method, target, protocol
        self.status, self.size, self.referer, self.agent = status, size, referer, agent
        self.started, self.duration, self.request_id = started, duration, request_id
        self.environ = environ
        self.response_headers = response_headers


class AccessRecord(_Headers, logging.LogRecord):
    """One request's record, made without :class:`logging.LogRecord`'s constructor (no caller
    lookup, nothing formatted): the message is the access-log line, made when asked for."""

    def __init__(self, log: "AccessLog", remote: str, method: str, target: str, protocol: str,
                 status: int, size: int, referer: str | None, agent: str | None, started: float,
                 duration: float, request_id: str, environ: Mapping[str, Any] | None,
                 response_headers: Iterable[tuple[str, str]] | None) -> None:
        self.__dict__.update(_CONSTANT)
        self.log = log
        self.remote, self.method, self.target, self.protocol = remote, method, target, protocol
        self.status, self.size, self.referer, self.agent = status, size, referer, agent
        self.started, self.duration, self.request_id = started, duration, request_id
        self.environ = environ
        self.response_headers = response_headers
        now = _now()
        self.created = now
        self.msecs = int(now % 1 * 1000)
        self.relativeCreated = (now - _START) * 1000
        self.process = log.pid
        self.thread = threading.get_ident()
        self.threadName = "worker"
        self._line: str | None = None

    def getMessage(self) -> str:
        line = self._line
        if line is None:
            line = self._line = self.log.line(self)
        return line

    @property
    def msg(self) -> str:  # a handler reading record.msg gets the line too
        return self.getMessage()

    @msg.setter
    def msg(self, value: str) -> None:  # a filter that rewrites it
        self._line = value



class AccessHandler(logging.Handler):
    """forkserve's handler on ``forkserve.access``: the line into its AccessLog's buffer. No
    lock (``list.append``; the flush has its own), as the error log's handler."""

    forkserve_access = True  # (forkserve.logs tells ours from an app's by it)

    def __init__(self, log: "AccessLog") -> None:
        super().__init__()
        self.access_log = log

    def handle(self, record: logging.LogRecord) -> Any:
        if self.filters and not self.filter(record):
            return False
        self.emit(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        if self.formatter is not None:  # someone gave ours a formatter: theirs, then
            self.access_log.emit(self.format(record) + "\n")
        else:
            self.access_log.emit(record.getMessage() + "\n")


class AccessLog:
    """The access log of one worker. ``target`` None: no file of ours (--log-config gives
    forkserve.access its handlers); the records still go to ``logger``."""

    def __init__(self, target: str | None, fmt: str = "combined", errors: ErrorSink | None = None,
                 stdout_fd: int | None = None) -> None:
        self.target = target
        self.losses = LostLines(f"access log {target}", errors)
        self.fmt = fmt
        self.kind, self.template, self.json_headers = parse_format(fmt)
        self.stdout_fd = stdout_fd  # "-": this descriptor (a worker capturing its stdout)
        self.fd = -1
        self._owns_fd = False
        self._lines: list[str] = []
        self._size = 0
        self._stamp = (-1, "")  # (second, its text): one tuple, so request threads never mix them
        self._iso = (-1, "")  # the same for ISO 8601, without the milliseconds
        self._lock = threading.Lock()  # flush and reopen; emitting needs none (list.append)
        self.pid = os.getpid()
        self.handler = AccessHandler(self)
        # Where records go: set by the worker (forkserve.access); alone (a test), the handler.
        self.logger: logging.Logger | None = None
        if target is not None:
            self.open()

    def open(self) -> None:
        if self.target == "-":
            self.fd = self.stdout_fd if self.stdout_fd is not None else sys.stdout.fileno()
            self._owns_fd = False
        elif self.target is not None:
            # As forkserve.logs.open_append (the arbiter's check before forking opens it so).
            self.fd = os.open(self.target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            self._owns_fd = True

    def timestamp(self, when: float) -> str:
        second = int(when)
        cached = self._stamp
        if cached[0] == second:
            return cached[1]
        text = time.strftime("%d/%b/%Y:%H:%M:%S +0000", time.gmtime(when))
        self._stamp = (second, text)
        return text

    def iso(self, when: float) -> str:
        second = int(when)
        cached = self._iso
        if cached[0] != second:
            cached = self._iso = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(when)))
        return f"{cached[1]}.{int(when % 1 * 1000):03d}Z"

    def request(self, remote: str, method: str, target: str, protocol: str, status: int,
                size: int, referer: str | None, agent: str | None, started: float,
                duration: float, request_id: str, environ: Mapping[str, Any] | None = None,
                response_headers: Iterable[tuple[str, str]] | None = None) -> None:
        logger = self.logger
        if logger is None or self._alone(logger):
            # Only our own handler would see the record: the line without one (what the record
            # would carry to it, at a fraction of the cost).
            if self.kind == "combined":
                line = self.combined(remote, method, target, protocol, status, size, referer,
                                     agent, started, duration, request_id)
            else:
                line = self.line(Request(remote, method, target, protocol, status, size, referer,
                                         agent, started, duration, request_id, environ,
                                         response_headers))
            self.emit(line + "\n")
        elif logger.isEnabledFor(20):
            logger.handle(AccessRecord(self, remote, method, target, protocol, status, size,
                                       referer, agent, started, duration, request_id, environ,
                                       response_headers))

    def _alone(self, logger: logging.Logger) -> bool:
        """True when ``forkserve.access`` has our handler alone, unfiltered and unformatted,
        propagating nowhere: a record would reach nobody else. Checked per request (an app
        may add a handler to gunicorn.access at any time)."""
        handlers = logger.handlers
        handler = self.handler
        return (len(handlers) == 1 and handlers[0] is handler and not logger.propagate
                and not logger.filters and not handler.filters and handler.formatter is None
                and not logger.disabled and logger.isEnabledFor(20))

    def combined(self, remote: str, method: str, target: str, protocol: str, status: int,
                 size: int, referer: str | None, agent: str | None, started: float,
                 duration: float, request_id: str) -> str:
        return (f'{remote} - - [{self.timestamp(started)}] "{method} {_quote(target)} '
                f'{protocol}" {status} {size if size else "-"} "{_quote(referer or "-")}" '
                f'"{_quote(agent or "-")}" {duration:.6f} {_quote(request_id)}')

    def line(self, r: Request | AccessRecord) -> str:
        """The record's line, without its LF, in the configured format."""
        kind = self.kind
        if kind == "combined":
            return self.combined(r.remote, r.method, r.target, r.protocol, r.status, r.size,
                                 r.referer, r.agent, r.started, r.duration, r.request_id)
        if kind == "atoms":
            return self.template % Atoms(self, r)
        target, duration = r.target, r.duration
        # The names are forkserve.config.ACCESS_LOG_FIELDS (a test keeps them equal).
        path, _, query = target.partition("?")
        fields: dict[str, Any] = {
            "time": self.timestamp(r.started), "time_iso": self.iso(r.started),
            "remote_addr": r.remote, "method": r.method, "path": path, "query": query,
            "target": target, "protocol": r.protocol, "status": r.status, "bytes": r.size,
            "duration_us": int(duration * 1e6), "duration": f"{duration:.6f}",
            "referer": r.referer or "-", "user_agent": r.agent or "-",
            "request_id": r.request_id, "pid": self.pid,
        }
        if kind == "json":
            fields["duration"] = round(duration, 6)
            for name, side, header in self.json_headers:
                fields[name] = r.request_header(header) if side == "req" else r.response_header(header)
            return _JSON(fields)
        # The text fields, quoted.
        fields.update(path=_quote(path), query=_quote(query), target=_quote(target),
                      referer=_quote(r.referer or "-"), user_agent=_quote(r.agent or "-"),
                      request_id=_quote(r.request_id), method=_quote(r.method))
        for name, side, header in self.json_headers:  # (a template's header fields)
            fields[name] = _quote(r.request_header(header) if side == "req"
                                  else r.response_header(header))
        return self.template.format_map(fields)

    def emit(self, line: str) -> None:
        self._lines.append(line)
        self._size += len(line)
        if self._size >= FLUSH_AT:
            self.flush()

    def flush(self) -> None:
        if not self._lines:
            return
        with self._lock:
            self._write_out()

    def flush_from_handler(self) -> None:
        """``flush`` from a signal handler (a worker whose arbiter died): the thread it
        interrupted may be inside ``flush`` holding the lock, so it waits for the lock only
        briefly and leaves the lines unwritten rather than hang (a hung worker would keep the
        port)."""
        if self._lines and self._lock.acquire(timeout=0.2):
            try:
                self._write_out()
            finally:
                self._lock.release()

    def _write_out(self) -> None:
        # Swapped, not cleared: request threads may emit while this runs.
        lines, self._lines = self._lines, []
        self._size = 0
        if not lines:
            return
        data = "".join(lines).encode("utf-8", "backslashreplace")
        try:
            write_all(self.fd, data)
        except OSError as exc:
            # Serving goes on; the lines are gone (a partly written batch counts whole).
            self.losses.failed(len(lines), exc)
            return
        self.losses.succeeded()

    def reopen(self) -> None:
        with self._lock:
            self._write_out()  # what was logged before the rotation goes to the old file
            if self._owns_fd:
                old = self.fd
                self.open()
                os.close(old)

    def close(self) -> None:
        with self._lock:
            self._write_out()
            if self._owns_fd:
                os.close(self.fd)
            self.fd = -1


class RequestIds:
    """X-Request-ID: the client's (or its proxy's) when it is sane, else a new one.

    Generated ids are a random per-worker prefix plus a counter: unique across workers and
    restarts without a call to the random source per request.
    """

    def __init__(self) -> None:
        self.prefix = os.urandom(8).hex()
        self.counter = itertools.count(1)  # next() is atomic: request threads share it

    def take(self, incoming: str | None) -> str:
        if incoming and len(incoming) <= REQUEST_ID_MAX and incoming.isprintable() \
                and " " not in incoming and '"' not in incoming:
            return incoming
        return f"{self.prefix}-{next(self.counter):x}"


def _quote(text: str) -> str:
    """Escape what would break the line's format or a terminal (CVE-style log injection)."""
    if text.isprintable() and '"' not in text and "\\" not in text:
        return text
    return "".join(c if c.isprintable() and c not in '"\\' else repr(c)[1:-1] if c != '"' else '\\"'
                   for c in text)


# ASCII only: a client's C1 controls or U+2028 never split or colour a JSON line.
_JSON = json.JSONEncoder(separators=(",", ":")).encode

class Atoms(Mapping[str, Any]):
    """gunicorn's atoms of one record, for ``template % atoms`` (computed as named; an
    unknown one is ``-``, as gunicorn has it). Text is escaped as in the other formats."""

    def __init__(self, log: AccessLog, record: Request | AccessRecord) -> None:
        self.log = log
        self.r = record

    def __getitem__(self, key: str) -> Any:
        r = self.r
        if len(key) > 2 and key[0] == "{" and key[-2] == "}":
            name, kind = key[1:-2], key[-1]
            if kind == "i":
                return _quote(r.request_header(name))
            if kind == "o":
                return _quote(r.response_header(name))
            if kind == "e":
                environ = r.environ or {}
                value = environ.get(name, environ.get(name.upper()))
                return "-" if value is None else _quote(str(value))
            return "-"
        path, _, query = r.target.partition("?")
        duration = r.duration
        if key == "h":
            return r.remote
        if key == "l":
            return "-"
        if key == "u":
            return _quote(remote_user(r.environ))
        if key == "t":
            return f"[{self.log.timestamp(r.started)}]"
        if key == "r":
            return f"{_quote(r.method)} {_quote(r.target)} {r.protocol}"
        if key == "s":
            return r.status
        if key == "m":
            return _quote(r.method)
        if key == "U":
            return _quote(path)
        if key == "q":
            return _quote(query)
        if key == "H":
            return r.protocol
        if key == "b":
            return str(r.size) if r.size else "-"
        if key == "B":
            return r.size
        if key == "f":
            return _quote(r.referer or "-")
        if key == "a":
            return _quote(r.agent or "-")
        if key == "T":
            return int(duration)
        if key == "D":
            return int(duration * 1e6)
        if key == "M":
            return int(duration * 1e3)
        if key == "L":
            return f"{duration:.6f}"
        if key == "p":
            return f"<{self.log.pid}>"
        return "-"

    def __iter__(self) -> Any:
        return iter(ATOMS)

    def __len__(self) -> int:
        return len(ATOMS)


def remote_user(environ: Mapping[str, Any] | None) -> str:
    """The user name of a Basic Authorization header (gunicorn's %(u)s), else ``-``."""
    if environ is None:
        return "-"
    auth = environ.get("HTTP_AUTHORIZATION")
    if not auth or not auth[:6].lower() == "basic ":
        return environ.get("REMOTE_USER") or "-"
    import base64
    import binascii

    try:
        decoded = base64.b64decode(auth[6:].strip(), validate=True).decode("latin-1")
    except (binascii.Error, ValueError):
        return "-"
    return decoded.partition(":")[0] or "-"


def is_atoms(fmt: str) -> bool:
    return "%(" in fmt


def parse_format(fmt: str) -> tuple[str, str, list[tuple[str, str, str]]]:
    """(kind, template, header fields) of an access-log format (validated by
    forkserve.config first): combined; json, or json:req_x,resp_y (header keys added);
    gunicorn atoms; or a {field} template, whose {req_*}/{resp_*} fields are listed."""
    if fmt == "combined":
        return "combined", "", []
    if fmt == "json" or fmt.startswith("json:"):
        names = [n.strip() for n in fmt[5:].split(",") if n.strip()]
        return "json", "", [header_field(n) for n in names]
    if is_atoms(fmt):
        return "atoms", fmt, []
    import string

    named = {name for _, name, _, _ in string.Formatter().parse(fmt) if name}
    return "template", fmt, [header_field(n) for n in sorted(named) if HEADER_FIELD.match(n)]


def header_field(name: str) -> tuple[str, str, str]:
    match = HEADER_FIELD.match(name)
    if match is None:
        raise ValueError(f"not a header field: {name!r} (req_NAME or resp_NAME)")
    return name, match.group(1), match.group(2)


__all__ = ["AccessHandler", "AccessLog", "AccessRecord", "RequestIds"]
