"""Response framing: the head builder, header validation, chunk framing, the Date header.

Pure functions over bytes; no sockets, no WSGI. ``status_and_headers`` is the one place a
status line and headers are serialised: ``response_head`` (the server's own small responses,
the arbiter's status server) adds the server's fields to it, and the WSGI exchange keeps it
per status and headers list (``wsgi.CheckedHeads``) and adds its fields in the same one join.
The body writers are in :mod:`forkserve.http.writers`.
"""

from __future__ import annotations

import re
import time
from time import gmtime
from http import HTTPStatus
from typing import Iterable

SERVER = b"forkserve"

# RFC 9110 §5.1 token characters for field names; values may not hold CR, LF or NUL.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
# RFC 9110 §5.5: a field value is visible characters, obs-text, SP and HTAB: no other control
# character (CR and LF would split the head; NUL, ESC or DEL are refused by strict clients,
# and some proxies cut the field there). Latin-1 only, as PEP 3333 says.
_BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]|[^\x00-\xff]")
_STATUS = re.compile(r"[1-9][0-9]{2} [^\r\n\x00]*\Z")

# Hop-by-hop headers (RFC 9110 §7.6.1) belong to the server, not to a WSGI app (PEP 3333).
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "transfer-encoding", "upgrade"})

# Statuses that never carry a body (RFC 9110 §6.4.1).
NO_BODY_STATUS = frozenset({204, 304})


def reason_phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


class DateCache:
    """The ``Date`` header value, formatted at most once a second."""

    __slots__ = ("_second", "_value")

    def __init__(self) -> None:
        self._second = -1
        self._value = b""

    def get(self) -> bytes:
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second = second
            self._value = http_date(second)
        return self._value


_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def http_date(seconds: float) -> bytes:
    """RFC 9110 §5.6.7 IMF-fixdate (``Sun, 06 Nov 1994 08:49:37 GMT``): what
    ``email.utils.formatdate(usegmt=True)`` writes, without importing the email package into
    every worker (about 1 MiB of modules for one line)."""
    t = gmtime(seconds)
    return (f"{_DAYS[t.tm_wday]}, {t.tm_mday:02d} {_MONTHS[t.tm_mon - 1]} {t.tm_year:04d} "
            f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d} GMT").encode("ascii")


def check_header(name: object, value: object) -> None:
    """Raise ValueError for a header a WSGI app must not send (PEP 3333, no injection)."""
    if type(name) is not str or type(value) is not str:
        raise TypeError(f"header name and value must be str, got {name!r}: {value!r}")
    if not _TOKEN.match(name):
        raise ValueError(f"invalid header name {name!r}")
    if _BAD_VALUE.search(value):
        raise ValueError(f"invalid header value for {name!r}: control characters (but HTAB) "
                         "and text that is not latin-1 are not allowed")


def parse_status(status: object) -> int:
    """'200 OK' -> 200; ValueError for anything PEP 3333 does not allow."""
    if type(status) is not str:
        raise TypeError(f"status must be str, got {status!r}")
    if not _STATUS.match(status) or _BAD_VALUE.search(status):
        raise ValueError(f"invalid status {status!r}: expected e.g. '200 OK' (latin-1 text)")
    return int(status[:3])


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
CONNECTION_CLOSE = b"Connection: close\r\n"
CONNECTION_KEEP_ALIVE = b"Connection: keep-alive\r\n"


def response_head(status: str, headers: Iterable[tuple[str, str]], fields: Iterable[bytes] = (),
                  body: bytes = b"") -> bytes:
    """``HTTP/1.1 <status>``, each header as ``name: value``, then ``fields`` (what the server
    adds, already serialised, each line ending in CRLF), the blank line and ``body``: one join,
    so a small response is built and sent whole.

    The caller has validated ``status`` and ``headers`` (``parse_status``, ``check_header``);
    text is encoded latin-1, as PEP 3333 says. ``body`` is the framed body, if any.
    """
    return b"".join((status_and_headers(status, headers), *fields, b"\r\n", body))


def status_and_headers(status: str, headers: Iterable[tuple[str, str]]) -> bytes:
    """The start of a response head: the status line and the application's headers, each
    line ending in CRLF. The part of a head that does not change from one response to the
    next (no Date, no framing), so a worker may keep it (``wsgi.CheckedHeads``)."""
    lines = ["HTTP/1.1 ", status, "\r\n"]
    for name, value in headers:
        lines += (name, ": ", value, "\r\n")
    return "".join(lines).encode("latin-1")


def simple_response(status: int, reason: str, dates: DateCache, body: bytes | None = None,
                    close: bool = True, extra: bytes = b"", head: bool = False) -> bytes:
    """A complete small response the server writes itself (errors: 400, 500, 503 ...);
    ``head``: the answer to a HEAD request, which has the same fields and no body (RFC 9110
    §9.3.2: a client would read the body as the next response)."""
    if body is None:
        body = f"{status} {reason}\n".encode("latin-1")
    return response_head("%d %s" % (status, reason), (), (
        b"Date: ", dates.get(), b"\r\nServer: ", SERVER,
        b"\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\n" % len(body),
        CONNECTION_CLOSE if close else b"",
        extra), b"" if head else body)
